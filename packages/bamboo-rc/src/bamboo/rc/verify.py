"""The self-check: train P×D forked workers and a single-process reference, and compare.

The parent process hosts the TCPStore (a store must not live in a worker), forks one worker per
node, waits for them, trains the reference on the same global batches and compares:
- every stage's parameters against the reference (max relative difference, per tensor
  `max|a-b| / max|b|`), which must be at most 1e-6;
- every replica against the original it shadows, which must be bit-equal (`torch.equal`).

Every worker builds exactly the stage bounds of :func:`bamboo.rc.model.stage_bounds` (or those
given), and the reference's layers are compared by those bounds. With kill points, the parent is
the failure authority (it sees each death through `waitpid`), and every kill point must fire:
one that never does is reported by name and fails the run (the soak's random kill points may
not fire, and do not have to).
"""

from __future__ import annotations

import copy
import datetime
import json
import os
import signal
import tempfile
import time
import traceback
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import torch
from bamboo.rc.config import TrainingConfig
from bamboo.rc.data import stdlib_corpus
from bamboo.rc.device import resolve_device
from bamboo.rc.executor import REDUNDANCY_MODES
from bamboo.rc.failures import StoreFailureNotices
from bamboo.rc.faults import KillPoint, KillRecord, NoticePoint, killed_key, reached_key
from bamboo.rc.layout import Layout
from bamboo.rc.model import GPTSize, check_stage_bounds, stage_bounds
from bamboo.rc.records import FailoverRecord
from bamboo.rc.reference import ReferenceResult, train_reference
from bamboo.rc.timeouts import (
    VERIFY_BATCH_WINDOW_S,
    VERIFY_DEADLINE_S,
    VERIFY_HOLD_LIMIT_S,
    VERIFY_STORE_S,
    VERIFY_WAIT_POLL_S,
    CommTimeouts,
)
from bamboo.rc.worker import (
    VerifyModel,
    WorkerSpec,
    exact_mode,
    example_model,
    heap_frozen_for_forks,
    run_config,
    worker_main,
)
from bamboo.schedule import Costs
from torch.distributed import TCPStore

__all__ = ["DEFAULT_CONFIG", "RELATIVE_TOLERANCE", "VerifyResult", "run_verify"]

RELATIVE_TOLERANCE = 1e-6

DEFAULT_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3}},
    "gradient_clipping": 1.0,
}

REFERENCES_KEPT = 16
"""How many fault-free references of the example model this process keeps (least recently used first out): the
reference of a model, config, seed, pipeline count, device and step is the same whatever the stages, mode and
kill points, so the runs of a soak, or of a test suite's failover matrix, train each one once."""

_KEPT_REFERENCES: OrderedDict[tuple[object, ...], ReferenceResult] = OrderedDict()


@attrs.frozen
class VerifyResult:
    """What `verify` measured."""

    max_relative_diff: float
    max_abs_diff: float
    max_replica_diff: float
    replicas_bit_equal: bool
    replicas_compared: int
    losses: list[float]
    reference_losses: list[float]
    worker_exit_codes: dict[int, int]
    stash_peak_bytes: int
    seconds: float
    killed: tuple[int, ...] = ()
    consecutive: str | None = None
    failovers: tuple[FailoverRecord, ...] = ()
    compared_at_step: int = 0
    kill_times: dict[int, float] = attrs.field(factory=dict)
    left: tuple[int, ...] = ()
    """Ranks that handed their role over after a preemption notice and left."""
    withdrawn: tuple[int, ...] = ()
    """Ranks that announced a hand-over and withdrew it (a failure in their pipeline came first) and stayed."""
    timings: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    """Per rank: ``iteration_times`` ((start, end) of every step), ``kind_seconds`` (seconds spent in each
    instruction kind, summed over the run, by the kind's code), ``hosted``, ``stage``, ``pipeline`` and
    ``failovers``."""
    stage_bounds: tuple[tuple[int, int], ...] = ()
    """The layer range of every stage, as every worker built it."""
    unfired_kills: tuple[str, ...] = ()
    """The kill points (as `--kill` writes them) whose node never reached them."""
    kills_must_fire: bool = True
    device: str = "cpu"
    """The device the workers and the reference trained on (``cuda`` for any GPU)."""
    memory: dict[int, dict[str, Any]] = attrs.field(factory=dict)
    """Per rank: ``device`` (the worker's), ``device_peak_bytes`` (the most it allocated on its GPU; 0 on the
    CPU), ``stash_swapped_bytes`` (bytes the FRC stash swapped to host memory, in all), ``stash_device_peak_bytes``
    (the most the stash held on the GPU at once) and ``staged_bytes`` (message bytes copied between the GPU and
    host buffers)."""

    @property
    def refused_exactly(self) -> bool:
        """A consecutive failure (or a lost contribution) stopped the run, and the survivors equal the reference at
        the start of the failed step: the refusal the failure model documents (the job restores), not a wrong
        result or a hang."""
        return self.consecutive is not None and self.max_relative_diff <= RELATIVE_TOLERANCE

    def pause_seconds(self, failover: FailoverRecord) -> tuple[float, float | None] | None:
        """The failover's pause as the survivors of its pipeline saw it: seconds from the kill to the last of them
        resuming, and to the last of them ending the failed step (None when unknown); None when the kill time is
        not known."""
        stages = len(self.stage_bounds)
        victims = [pipeline * stages + node for pipeline, nodes in failover.victims.items() for node in nodes]
        killed = [self.kill_times[rank] for rank in victims if rank in self.kill_times]
        same = [f for f in self.failovers if f.epoch == failover.epoch and f.own_pipeline]
        if not killed or not same:
            return None
        ended = [f.iteration_end for f in same if f.iteration_end is not None]
        return max(f.resumed_at for f in same) - min(killed), (max(ended) - min(killed)) if ended else None
    loss_scales_match: bool = True
    """fp16: every stage's and every replica's loss-scale state equals the reference's (trivially true without)."""
    loss_scale: dict[str, Any] | None = None
    """fp16: the reference's loss-scale state after its last step."""

    @property
    def passed(self) -> bool:
        """Survivors exited cleanly, parameters match within 1e-6 relative, replicas bit-equal, loss
        scales equal, no consecutive failure stopped the run, and every kill point fired (when they must)."""
        return (
            self.loss_scales_match
            and self.consecutive is None
            and all(code == 0 for rank, code in self.worker_exit_codes.items() if rank not in self.killed)
            and self.max_relative_diff <= RELATIVE_TOLERANCE
            and self.replicas_bit_equal
            and not (self.kills_must_fire and self.unfired_kills)
        )


def _relative(a: torch.Tensor, b: torch.Tensor) -> tuple[float, float]:
    diff = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    scale = b.double().abs().max().item() if b.numel() else 0.0
    return diff / scale if scale > 0 else diff, diff


def run_verify(
    stages: int,
    pipelines: int,
    steps: int,
    redundancy: str = "eflb",
    size: GPTSize | None = None,
    config: dict[str, Any] | None = None,
    seed: int = 0,
    timeouts: CommTimeouts | None = None,
    deadline_s: float = VERIFY_DEADLINE_S,
    kills: tuple[KillPoint, ...] = (),
    notice_points: tuple[NoticePoint, ...] = (),
    bounds: tuple[tuple[int, int], ...] | None = None,
    kills_must_fire: bool = True,
    device: str | None = None,
    model: VerifyModel | None = None,
    references: dict[int, ReferenceResult] | None = None,
    global_microbatches: int | None = None,
    schedule_costs: Costs | None = None,
) -> VerifyResult:
    """Run the self-check and return what it measured (see the module docstring).

    ``model`` trains a model of your own (layers, loss, ``microbatch(step, index)``; see
    :class:`~bamboo.rc.worker.VerifyModel`) instead of the example GPT of ``size``.

    With `kills`, the chosen workers SIGKILL themselves at the chosen instructions. This parent
    process is then the failure authority: it sees each death through `waitpid` and publishes
    the confirmed failure with the next membership epoch in the store. A kill point that never
    fires fails the run unless `kills_must_fire` is False. `bounds` are the stage bounds
    (default: :func:`bamboo.rc.model.stage_bounds` of the model).

    `device` is the workers' (:func:`bamboo.rc.device.resolve_device`; ``cuda`` spreads them over the GPUs
    by rank, several to a GPU when there are fewer GPUs than workers); the reference trains on the same kind
    of device, in a child process on a GPU (this process never starts CUDA, so it can fork again).

    ``references`` is a cache of reference runs by the step they were compared at, that a caller shares
    between runs of one model, config, seed, pipeline count and device (chaos runs many kill plans of one):
    a reference found there is not trained again.

    ``global_microbatches`` splits a global batch of that many microbatches over the pipelines unevenly where
    they do not divide it (the first ``G mod D`` one microbatch longer, as bamboo-launch does after a loss);
    each worker then runs its pipeline's share in place of ``config``'s gradient accumulation steps.
    ``schedule_costs`` gives every worker the placement searched for those costs (``initialize``'s).
    """
    _check_plan(stages, pipelines, steps, redundancy, kills)
    size = size or GPTSize()
    config, training = run_config(dict(config or DEFAULT_CONFIG), pipelines, global_microbatches)
    layout = Layout(stages, pipelines)
    program = model or example_model(size, training.micro_batch_size, seed)
    specs = list(program.layers)
    bounds = check_stage_bounds(stage_bounds(specs, stages) if bounds is None else bounds, len(specs), stages)
    kind = resolve_device(device).type  # a bad device is one line here, before anything forks
    exact_mode()
    stdlib_corpus()  # read once here; the forked workers inherit it
    started = time.perf_counter()

    def spec_for(stage: int, pipeline: int, out_dir: str) -> WorkerSpec:
        return WorkerSpec(layout=layout, stage=stage, pipeline=pipeline, store_host="127.0.0.1", store_port=0,
                          steps=steps, redundancy=redundancy, size=size, config=config, out_dir=out_dir,
                          stage_bounds=bounds, seed=seed, timeouts=timeouts or CommTimeouts(), kills=tuple(kills),
                          notice_points=tuple(notice_points), device=device, model=model,
                          global_microbatches=global_microbatches,
                          schedule_costs=None if schedule_costs is None else schedule_costs.to_dict())

    outcome = _run_workers(layout, spec_for, kills, deadline_s)
    reports = outcome.reports
    # A consecutive failure leaves survivors at the start of an iteration: compare with that step.
    compared_at = min((r["steps_done"] for r in reports.values() if not r["left"]), default=steps)
    cache = {} if references is None else references
    if compared_at not in cache:
        key = None if model is not None else (size, json.dumps(config, sort_keys=True), seed, pipelines, kind, device,
                                               compared_at, global_microbatches)
        cache[compared_at] = _kept_reference(key, lambda: _reference(
            kind, device, specs, program.loss_fn, training, program.microbatch, compared_at, pipelines, seed))
    reference = cache[compared_at]
    consecutive = next((r["consecutive"] for r in reports.values() if r["consecutive"]), None)
    comparison = _compare(reports, reference, stages, bounds, consecutive)
    return _verify_result(outcome, comparison, reference, layout.world, kills, kills_must_fire=kills_must_fire,
                          bounds=bounds, device=kind, compared_at=compared_at, consecutive=consecutive,
                          seconds=time.perf_counter() - started)


def _verify_result(outcome: _Outcome, comparison: _Comparison, reference: ReferenceResult, world: int,
                   kills: tuple[KillPoint, ...], *, kills_must_fire: bool, bounds: tuple[tuple[int, int], ...],
                   device: str, compared_at: int, consecutive: str | None, seconds: float) -> VerifyResult:
    reports, codes = outcome.reports, outcome.codes
    killed = tuple(sorted(rank for rank, code in codes.items() if code < 0))
    missing = {rank: 1 for rank in range(world) if rank not in reports and rank not in killed}
    fired = {record.point for record in outcome.kill_records.values()}
    return VerifyResult(
        max_relative_diff=comparison.max_rel if reports else float("inf"),
        max_abs_diff=comparison.max_abs,
        max_replica_diff=comparison.max_replica,
        replicas_bit_equal=comparison.equal,
        replicas_compared=comparison.compared,
        losses=comparison.losses,
        reference_losses=list(reference.losses),  # a copy: the reference may be kept for the next run
        worker_exit_codes={**codes, **missing},
        stash_peak_bytes=max((r["stash_peak_bytes"] for r in reports.values()), default=0),
        seconds=seconds,
        killed=killed,
        consecutive=consecutive,
        failovers=tuple(FailoverRecord.from_dict(f) for r in reports.values() for f in r["failovers"]),
        compared_at_step=compared_at,
        kill_times={rank: record.at for rank, record in outcome.kill_records.items()},
        left=tuple(sorted(rank for rank, r in reports.items() if r["left"])),
        withdrawn=tuple(sorted(rank for rank, r in reports.items() if r.get("withdrew"))),
        timings={rank: _timing(r) for rank, r in reports.items()},
        stage_bounds=bounds,
        unfired_kills=tuple(str(kill) for kill in kills if str(kill) not in fired),
        kills_must_fire=kills_must_fire,
        device=device,
        memory={rank: r["memory"] for rank, r in reports.items()},
        loss_scales_match=comparison.scales_match,
        loss_scale=copy.deepcopy(reference.loss_scale),
    )


def _check_plan(stages: int, pipelines: int, steps: int, redundancy: str, kills: tuple[KillPoint, ...]) -> None:
    for kill in kills:
        if not (0 <= kill.stage < stages and 0 <= kill.pipeline < pipelines and 0 <= kill.step < steps):
            raise ValueError(f"kill point {kill} is outside P={stages} D={pipelines} steps={steps}")
    if redundancy not in REDUNDANCY_MODES:
        raise ValueError(f"redundancy must be one of {', '.join(REDUNDANCY_MODES)}, got {redundancy!r}")


@attrs.frozen
class _Outcome:
    """What the workers left: exit codes by rank (negative: the signal), the records of the kills that fired, and
    the final report of every worker that wrote one."""

    codes: dict[int, int]
    kill_records: dict[int, KillRecord]
    reports: dict[int, dict[str, Any]]


def _run_workers(layout: Layout, spec_for: Callable[[int, int, str], WorkerSpec], kills: tuple[KillPoint, ...],
                 deadline_s: float) -> _Outcome:
    """Fork one worker per rank, host their store, confirm their deaths, and read what they left."""
    with tempfile.TemporaryDirectory(prefix="bamboo-verify-") as out_dir:
        # Fork before the store exists: a process that forks while a store thread holds a libc
        # lock (resolver, malloc) can leave the child deadlocked. The children read the port
        # from a pipe once the store is up.
        port_reader, port_writer = os.pipe()
        children: dict[int, int] = {}
        with heap_frozen_for_forks():
            for rank in range(layout.world):
                spec = spec_for(*layout.position(rank), out_dir)
                pid = os.fork()
                if pid == 0:
                    os.close(port_writer)
                    port = int.from_bytes(os.read(port_reader, 8), "little")
                    os.close(port_reader)
                    worker_main(attrs.evolve(spec, store_port=port))
                children[pid] = rank
        os.close(port_reader)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=VERIFY_STORE_S))
        os.write(port_writer, store.port.to_bytes(8, "little") * layout.world)
        os.close(port_writer)
        codes = _wait_children(children, deadline_s, StoreFailureNotices(store, "verify"), _hold_keys(layout, kills))
        kill_records = {
            rank: KillRecord.from_json(store.get(killed_key("verify", rank)))
            for rank in range(layout.world)
            if codes.get(rank, 0) < 0 and store.check([killed_key("verify", rank)])
        }
        del store  # stops the store's server thread before anything forks again
        paths = {rank: Path(out_dir) / f"rank{rank}.pt" for rank in range(layout.world)}
        reports = {rank: torch.load(path, weights_only=False) for rank, path in paths.items() if path.exists()}
    return _Outcome(codes=codes, kill_records=kill_records, reports=reports)


def _hold_keys(layout: Layout, kills: tuple[KillPoint, ...]) -> dict[int, str]:
    """Victim rank -> the store key its death's confirmation waits for (``KillPoint.hold_confirmation_until``)."""
    keys: dict[int, str] = {}
    for kill in kills:
        if kill.hold_confirmation_until is not None:
            hold_stage, hold_pipeline, hold_instruction, hold_step = kill.hold_confirmation_until
            holder = layout.rank(hold_stage, hold_pipeline)
            keys[layout.rank(kill.stage, kill.pipeline)] = reached_key("verify", holder, hold_step, hold_instruction)
    return keys


@attrs.define
class _Comparison:
    """The workers' state against the reference's, and every replica against its original."""

    max_rel: float = 0.0
    max_abs: float = 0.0
    max_replica: float = 0.0
    equal: bool = True
    scales_match: bool = True
    compared: int = 0
    losses: list[float] = attrs.field(factory=list)


def _compare(reports: dict[int, dict[str, Any]], reference: ReferenceResult, stages: int,
             bounds: tuple[tuple[int, int], ...], consecutive: str | None) -> _Comparison:
    found = _Comparison()
    hosts = {(report["pipeline"], stage): report for report in reports.values() for stage in report["hosted"]}
    for report in reports.values():
        pipeline = report["pipeline"]
        if stages - 1 in report["hosted"] and (pipeline == 0 or (stages == 1 and not found.losses)):
            found.losses = report["losses"]  # P = 1: pipeline 0's, or a survivor's (every node has them all)
        for stage, layers in report["slices"].items():
            if stage not in report["hosted"] and consecutive is None:
                continue  # a replica: compared with its original below
            found.scales_match = found.scales_match and report["loss_scales"].get(stage) == reference.loss_scale
            for offset, layer_state in enumerate(layers):
                for name, tensor in layer_state.items():
                    rel, absolute = _relative(tensor, reference.layer_states[bounds[stage][0] + offset][name])
                    found.max_rel, found.max_abs = max(found.max_rel, rel), max(found.max_abs, absolute)
        replica_stage = report["replica_stage"]
        if replica_stage is None or replica_stage in report["hosted"]:
            continue
        owner = hosts.get((pipeline, replica_stage))
        if owner is None:
            if consecutive is None:
                found.equal = False  # the original is missing: nothing proves the replica exact
            continue
        _compare_replica(found, report, owner, replica_stage)
    return found


def _compare_replica(found: _Comparison, report: dict[str, Any], owner: dict[str, Any], stage: int) -> None:
    """A replica of ``stage`` (in ``report``) against its original (in ``owner``): bit for bit."""
    found.scales_match = found.scales_match and report["loss_scales"].get(stage) == owner["loss_scales"].get(stage)
    for replica_layer, original_layer in zip(report["slices"][stage], owner["slices"][stage], strict=True):
        for name, tensor in replica_layer.items():
            found.compared += 1
            if not torch.equal(tensor, original_layer[name]):
                found.equal = False
                found.max_replica = max(found.max_replica, (tensor - original_layer[name]).abs().max().item())


def _timing(report: dict[str, Any]) -> dict[str, Any]:
    return {"iteration_times": report["iteration_times"], "kind_seconds": report["kind_seconds"],
            "hosted": report["hosted"], "stage": report["stage"], "pipeline": report["pipeline"],
            "failovers": [FailoverRecord.from_dict(f) for f in report["failovers"]]}


def _kept_reference(key: tuple[object, ...] | None, train: Callable[[], ReferenceResult]) -> ReferenceResult:
    """The reference under ``key`` that this process already trained (`REFERENCES_KEPT`), or ``train()``'s, kept
    under it; a model of the caller's own (``key`` None) is trained every time."""
    if key is None:
        return train()
    if key in _KEPT_REFERENCES:
        _KEPT_REFERENCES.move_to_end(key)
        return _KEPT_REFERENCES[key]
    reference = _KEPT_REFERENCES[key] = train()
    while len(_KEPT_REFERENCES) > REFERENCES_KEPT:
        _KEPT_REFERENCES.popitem(last=False)
    return reference


def _reference(kind: str, device: str | None, specs: list[Any], loss_fn: Callable[[Any, Any], torch.Tensor],
               training: TrainingConfig, microbatch: Callable[[int, int], tuple[Any, Any]], steps: int,
               pipelines: int, seed: int) -> ReferenceResult:
    """The single-process reference, on the workers' kind of device: here on the CPU; on a GPU in a forked child
    (this process must not start CUDA: it forks the workers of the next run), which hands its result back
    through a file."""
    if kind != "cuda":
        return train_reference(specs, loss_fn, training, microbatch, steps, pipelines, seed)
    with tempfile.TemporaryDirectory(prefix="bamboo-reference-") as folder:
        path = Path(folder) / "reference.pt"
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                result = train_reference(specs, loss_fn, training, microbatch, steps, pipelines, seed,
                                         device=resolve_device(device, local_rank=0))
                torch.save(attrs.asdict(result), path)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                os._exit(code)
        _, status = os.waitpid(pid, 0)
        if os.waitstatus_to_exitcode(status) != 0 or not path.exists():
            raise RuntimeError(f"the reference on {device or 'the GPU'} failed (exit status {os.waitstatus_to_exitcode(status)})")
        return ReferenceResult(**torch.load(path, weights_only=False))


def _wait_children(
    children: dict[int, int], deadline_s: float, notices: StoreFailureNotices, hold_keys: dict[int, str] | None = None
) -> dict[int, int]:
    """Wait for every child; returns rank -> exit code (negative: killed by that signal).

    A child killed by a signal is a confirmed failure: deaths seen within
    :data:`~bamboo.rc.timeouts.VERIFY_BATCH_WINDOW_S` of each other are published together as the
    next epoch's event. `hold_keys` (fault injection, from `KillPoint.hold_confirmation_until`)
    maps a victim to a store key: its death is confirmed only once that key exists (or after
    :data:`~bamboo.rc.timeouts.VERIFY_HOLD_LIMIT_S`).
    """
    codes: dict[int, int] = {}
    epoch = 0
    deadline = time.monotonic() + deadline_s
    while len(codes) < len(children):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            if time.monotonic() > deadline:
                for other, rank in children.items():
                    if rank not in codes:
                        os.kill(other, signal.SIGKILL)
                        os.waitpid(other, 0)
                        codes[rank] = -signal.SIGKILL
                break
            time.sleep(VERIFY_WAIT_POLL_S)
            continue
        if pid not in children:
            continue
        codes[children[pid]] = os.waitstatus_to_exitcode(status)
        # A child that left after a preemption notice published its own hand-over event (first writer wins).
        if codes[children[pid]] < 0:
            dead = [children[pid]]
            batch_end = time.monotonic() + VERIFY_BATCH_WINDOW_S
            while time.monotonic() < batch_end:
                other, other_status = os.waitpid(-1, os.WNOHANG)
                if other in children:
                    codes[children[other]] = os.waitstatus_to_exitcode(other_status)
                    if codes[children[other]] < 0:
                        dead.append(children[other])
                else:
                    time.sleep(VERIFY_WAIT_POLL_S)
            for victim in dead:
                key = (hold_keys or {}).get(victim)
                hold_end = time.monotonic() + VERIFY_HOLD_LIMIT_S
                while key is not None and not notices.store.check([key]) and time.monotonic() < hold_end:
                    time.sleep(VERIFY_WAIT_POLL_S)
            epoch = notices.publish_next(dead, after=epoch).epoch
    return codes
