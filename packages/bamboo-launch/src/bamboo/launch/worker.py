"""One training worker of ``bamboo-launch run``: the bamboo-rc engine for one (stage, pipeline).

Its node's agent spawns it as ``python -m bamboo.launch.worker --spec RUN.json --rank R --agent
HOST:PORT``, in the agent's process group (a market kill takes both). The worker

- reaches the shared c10d store over etcd (`bamboo.membership.EtcdStore` under
  ``/bamboo/<job>/c10d/rc/``), so groups form and re-form with no store host to lose;
- learns of confirmed failures through :class:`bamboo.launch.authority.MembershipFailureNotices`
  (suspicions go to its agent's failure detector);
- trains a :class:`bamboo.launch.script.Program` (the built-in example, the tiny GPT of bamboo-rc,
  or a user script's model, loss and data through :func:`bamboo.launch.train_worker`) with exact
  arithmetic for the run's steps, appending ``step`` records (from the host of the last stage of pipeline 0) and
  ``failover`` records (from the shadow that took a victim's stage) to the run's event log;
- at a reconfiguration, starts the next layout as an attempt (:mod:`bamboo.launch.attempt`) that is
  abandoned and decided again if a node it needs dies meanwhile;
- writes its final state to ``<run>/out/rank<R>.pt`` and ends with a flush and ``os._exit``.

Exit status: 0 done; 3 a consecutive failure stopped its pipeline (reconfiguration is the
launcher's business; see the package README for what is supported); 1 any other error.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from bamboo.launch.script import Program

__all__ = ["STANDBY_EXIT", "RunSpec", "example_program", "main", "train"]


@attrs.frozen
class RunSpec:
    """What every worker of a run shares (written once by the launcher as ``RUN.json``)."""

    job: str
    etcd: tuple[str, ...] = attrs.field(converter=tuple)
    stages: int
    pipelines: int
    steps: int
    node_of_rank: dict[int, str] = attrs.field(converter=lambda m: {int(k): str(v) for k, v in m.items()})
    out_dir: str
    events: str
    run_start: float
    redundancy: str = "eflb"
    size: dict[str, int] = attrs.field(factory=dict)
    config: dict[str, Any] = attrs.field(factory=dict)
    seed: int = 0
    etcd_user: str | None = None
    etcd_password: str | None = attrs.field(default=None, repr=False)
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    confirm_timeout_s: float = 60.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = 10
    group_timeout_s: float = 60.0
    reconfigure_timeout_s: float = 120.0
    """How long a reconfiguration attempt may take to start every node before it is abandoned and redone."""
    script: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """``SCRIPT ARGS`` of a user script (agents spawn ``python SCRIPT ARGS``); empty: the built-in example."""

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), indent=1)

    @classmethod
    def from_json(cls, text: str) -> RunSpec:
        return cls(**json.loads(text))


def _failover_records(executor: Any, seen: int) -> list[dict[str, Any]]:
    """The failovers this node took a victim's stage in, among those recorded since ``seen``."""
    records = []
    stages = executor.layout.stages
    for failover in executor.failovers[seen:]:
        for victim in failover["victims"].get(executor.pipeline, []):
            if (victim - 1) % stages == executor.stage:
                records.append({"victim": victim, "pause_s": _pause_s(failover)})
    return records


def _pause_s(failover: dict[str, Any]) -> float:
    """Seconds from the moment the runtime caught the failure to the moment it resumed.

    bamboo-rc records ``caught_at``/``resumed_at`` (wall clock); older records carried
    ``detect_s`` and ``reroute_s``.
    """
    if "caught_at" in failover and "resumed_at" in failover:
        return max(0.0, float(failover["resumed_at"]) - float(failover["caught_at"]))
    return float(failover.get("detect_s", 0.0)) + float(failover.get("reroute_s", 0.0))


TRANSFER_PAUSE_ENV = "BAMBOO_LAUNCH_TEST_TRANSFER_PAUSE_S"
"""Test hook: seconds every member of a reconfiguration's transfer group waits once the group is formed,
after publishing decision ``g<G>-transfer-group-<node>`` (so that a test can kill a node mid-transfer)."""

STANDBY_EXIT = 4
"""Exit status of a worker whose node has no role in the next layout (its agent waits on standby)."""
_UNTIL_EXIT: list[Any] = []  # objects that must not be freed before ``os._exit`` (see train's standby return)


class _Generation:
    """One worker's view of the run across layouts (see :mod:`bamboo.launch.reconfigure`)."""

    def __init__(self, spec: RunSpec, node: str, agent_address: str | None, program: Program) -> None:
        from bamboo.launch.authority import PatientKV
        from bamboo.launch.events import EventLog
        from bamboo.membership import (
            AgentClient,
            EtcdKV,
            EtcdOptions,
            EtcdStore,
            MembershipStore,
            c10d_prefix,
        )
        from bamboo.rc import CommTimeouts

        self.spec = spec
        self.node = node
        self.program = program
        self.kv = EtcdKV(EtcdOptions(endpoints=spec.etcd, user=spec.etcd_user, password=spec.etcd_password,
                                     ca_cert=spec.etcd_ca, cert_cert=spec.etcd_cert, cert_key=spec.etcd_key))
        patient = PatientKV(self.kv)  # an etcd restart pauses this worker instead of failing it
        self.membership = MembershipStore(patient, spec.job)  # type: ignore[arg-type]
        self.timeouts = CommTimeouts(group=spec.group_timeout_s, confirm=spec.confirm_timeout_s)
        self.store = EtcdStore(patient, c10d_prefix(spec.job, "rc"),  # type: ignore[arg-type]
                               timeout=datetime.timedelta(seconds=self.timeouts.build))
        self.agent = AgentClient(agent_address, name=f"worker-{node}") if agent_address else None
        self.log = EventLog(spec.events, start=spec.run_start)
        self.retired: list[Any] = []  # old executors stay referenced: their gloo groups must not be destroyed

    @staticmethod
    def layers(layout: dict[str, Any]) -> list[Any]:
        """bamboo-reconfig's view of the model's layers: those the launcher planned the first layout with."""
        from bamboo.reconfig import Layout

        return list(Layout.from_dict(layout["plan"]).layers)

    def wait_layout(self, after: int) -> dict[str, Any]:
        """The first layout of generation > ``after`` (the first layout for ``after=-1``)."""
        deadline = time.monotonic() + self.timeouts.build
        while True:
            try:
                current = self.membership.get_layout()
            except Exception:  # etcd restarting
                current = None
            if current is not None and current.value.get("generation", 0) > after:
                return current.value
            if time.monotonic() > deadline:
                raise RuntimeError(f"no layout after generation {after} within {self.timeouts.build:g} s")
            time.sleep(0.05)

    def wait_decision(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                found = self.membership.get_decision(name)
            except Exception:
                found = None
            if found is not None:
                return found.value
            if time.monotonic() > deadline:
                raise RuntimeError(f"decision {name} not taken within {timeout:g} s")
            time.sleep(0.02)


def example_program(size: dict[str, int], config: dict[str, Any], seed: int) -> Program:
    """The built-in example: the tiny GPT of bamboo-rc on the standard library's source bytes."""
    from bamboo.launch.script import Program
    from bamboo.rc import load_config
    from bamboo.rc.data import GlobalBatchSampler
    from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss

    gpt = GPTSize(**size)
    sampler = GlobalBatchSampler(load_config(config).micro_batch_size, gpt.sequence, seed=seed)

    def microbatch(step: int, index: int) -> tuple[Any, Any]:
        batch = sampler.microbatch(step, index)
        return batch.tokens, batch.labels

    return Program(layers=gpt_layer_specs(gpt), loss_fn=lm_loss, microbatch=microbatch, config=config)


def pipeline_batches(microbatch: Any, pipeline: int, micro_batches: int, first_step: int) -> Iterator[Any]:
    """DeepSpeed-style ``(inputs, labels)`` iterator of pipeline ``pipeline``: global microbatches
    ``pipeline*M .. pipeline*M+M-1`` of every step from ``first_step`` on."""
    step = first_step
    while True:
        for k in range(micro_batches):
            yield microbatch(step, pipeline * micro_batches + k)
        step += 1


def train(spec: RunSpec, node: str, agent_address: str | None, program: Program | None = None) -> dict[str, Any]:
    """Train ``program`` (default: the built-in example) as node ``node`` through every layout it has a
    role in; returns the final report."""
    import torch
    from bamboo.launch.events import Failover, Reconfiguration, Step
    from bamboo.launch.reconfigure import log_restore
    from bamboo.rc import ConsecutiveFailure
    from bamboo.rc.worker import exact_mode

    exact_mode()
    program = program or example_program(spec.size, spec.config, spec.seed)
    run = _Generation(spec, node, agent_address, program)
    log = run.log
    layout = run.wait_layout(-1)
    if len(program.layers) != len(run.layers(layout)):
        raise RuntimeError(f"this worker's model has {len(program.layers)} layers, the launcher planned "
                           f"{len(run.layers(layout))}: every process of the script must build the same model")
    old: Any = None  # the executor of the previous generation (the state this node holds)
    base: dict[str, Any] = layout  # the layout whose barrier this node's state is from (holders only)
    ready_record: dict[str, Any] | None = None  # what this node published at that barrier (None: holds nothing)
    started = time.perf_counter()
    checkpointers: dict[int, Any] = {}
    losses: list[float] = []
    failovers: list[dict[str, Any]] = []
    while True:
        generation = int(layout["generation"])
        ranks: dict[str, int] = dict(layout["ranks"])
        if node not in ranks and ready_record is None:
            return {"standby": True, "generation": generation}
        pipelines, micro_batches = int(layout["pipelines"]), int(layout["micro_batches"])
        node_of_rank = {r: n for n, r in ranks.items()}
        if generation == 0:
            engine = _start_engine(run, layout, None, run.store)
        else:
            engine = _attempt(run, layout, old)
            if engine is _ABANDONED:
                if ready_record is None:  # a joiner: it holds nothing, it follows the next attempt's layout
                    layout = _next_attempt_layout(run, layout)
                    continue
                attempt = int(layout.get("attempt", 0)) + 1
                run.membership.decide(f"{_prefix(int(base['generation']), attempt)}ready-{node}", ready_record)
                survivors = list(layout["survivors"])
                layout = _next_layout(run, base, lambda records, s=survivors: [n for n in s if n in records],
                                      attempt, str(layout["reason"]))
                continue
            if node not in ranks:  # a source that leaves for standby: its transfers are done
                # Freeing the groups here would block until their pending work times out (gloo's destructor
                # waits; 60 s after a kill), so the agent would see this exit late and miss the next layout.
                _UNTIL_EXIT.append((run, old))
                return {"standby": True, "generation": generation}
        rank = ranks[node]
        executor = engine.executor
        if generation > 0 and rank == min(ranks.values()):  # one record per reconfiguration, once all are up
            log.write(Reconfiguration(t=log.now(), reason=layout["reason"], pipelines=pipelines,
                                      stages=spec.stages, standby=len(layout["standby"]),
                                      bytes_moved=_bytes_moved(run, layout),
                                      duration_s=max(0.0, time.time() - float(layout["barrier_unix"])),
                                      attempts=int(layout.get("attempt", 0)) + 1))
            log_restore(log, layout)
        if old is not None:
            run.retired.append(old)
        ready_record = None
        old = None
        data = pipeline_batches(program.microbatch, executor.pipeline, micro_batches, executor.step)
        samples = executor.config.micro_batch_size * micro_batches * pipelines
        seen_failovers = 0
        stop_step: int | None = None
        stop_reason = "step boundary"
        consecutive = False
        evaluator = min(ranks.values())
        while executor.step < spec.steps:
            if stop_step is not None and executor.step >= stop_step:
                break
            step_started = time.perf_counter()
            try:
                loss = float(engine.train_batch(data))
            except ConsecutiveFailure as failure:
                print(f"node {node}: {failure}", file=sys.stderr, flush=True)
                executor.apply_replica_updates()
                consecutive = True
                break
            duration = time.perf_counter() - step_started
            losses.append(loss)
            for record in _failover_records(executor, seen_failovers):
                victim_rank = executor.layout.rank(record["victim"], executor.pipeline)
                log.write(Failover(t=log.now(), victim=node_of_rank.get(victim_rank, str(victim_rank)),
                                   shadow=node, stage=record["victim"], pause_s=record["pause_s"]))
            failovers.extend(executor.failovers[seen_failovers:])
            seen_failovers = len(executor.failovers)
            if executor.pipeline == 0 and spec.stages - 1 in executor.hosted:
                log.write(Step(t=log.now(), step=executor.step, samples=samples, loss=loss,
                               nodes_active=spec.stages * pipelines - len(executor.dead), duration_s=duration))
            if spec.checkpoint_dir is not None and executor.pipeline == 0:
                _checkpoint(spec, executor, checkpointers, log, torch)
            if stop_step is None:
                stop_step, stop_reason = _stop_step(run, generation, executor, ranks, evaluator, layout)
        if executor.step >= spec.steps and not consecutive:
            engine.finish()
            break
        # ---- the barrier: this generation ends at executor.step ----------------------------------
        executor.apply_replica_updates()
        holds = sorted(s for s, piece in executor.slices.items() if piece.steps == executor.step)
        ready_record = {"step": executor.step, "holds": holds, "at": time.time()}
        run.membership.decide(f"g{generation}-ready-{node}", ready_record)
        print(f"node {node}: at the barrier of generation {generation}: step {executor.step}, holds stages {holds}",
              flush=True)
        dead = set(executor.dead)
        base, old = layout, executor
        layout = _next_layout(run, base, lambda records, dead=dead, ranks=ranks: [
            n for n, r in ranks.items() if r not in dead and n in records],
            0, "consecutive failure" if consecutive else stop_reason)
    for writer in checkpointers.values():
        writer.close()
    report = {
        "rank": rank,
        "node": node,
        "generation": generation,
        "history": layout.get("history", [[0, int(layout["pipelines"])]]),
        "stage": executor.stage,
        "pipeline": executor.pipeline,
        "hosted": list(executor.hosted),
        "slices": {stage: [layer.state_dict() for layer in piece.layers] for stage, piece in executor.slices.items()},
        "replica_stage": executor.replica_stage,
        "losses": losses,
        "steps_done": executor.step,
        "failovers": failovers,
        "consecutive": None,
        "seconds": time.perf_counter() - started,
    }
    path = Path(spec.out_dir) / f"rank{rank}.pt"
    torch.save(report, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)  # the launcher reads this file: never a partial one
    log.close()
    return report


def _bytes_moved(run: _Generation, layout: dict[str, Any]) -> int:
    """Bytes the sources of this reconfiguration sent (each records its own; waits up to 10 s for them)."""
    sources = sorted({src for src, _, _ in layout["transfers"]})
    total = 0
    for src in sources:
        try:
            total += int(run.wait_decision(f"g{layout['generation']}-sent-{src}", 10.0)["bytes"])
        except RuntimeError:
            print(f"node {run.node}: source {src} did not record what it sent", file=sys.stderr, flush=True)
    return total


def _checkpoint(spec: RunSpec, executor: Any, checkpointers: dict[int, Any], log: Any, torch: Any) -> None:
    """Pipeline 0 writes one shard per stage it hosts (a shadow that took over a stage writes it too)."""
    from bamboo.launch.checkpoint import AsyncCheckpointer
    from bamboo.launch.events import Checkpoint

    def committed(info: Any) -> None:
        log.write(Checkpoint(t=log.now(), step=info.step, path=str(info.path), bytes=info.bytes,
                             duration_s=info.duration_s))

    for stage in executor.hosted:
        if stage not in checkpointers:
            checkpointers[stage] = AsyncCheckpointer(spec.checkpoint_dir, shard=f"stage-{stage}",
                                                     every_steps=spec.checkpoint_every, on_commit=committed)
        checkpointers[stage].maybe_save(executor.step, lambda stage=stage: {
            "state": torch.frombuffer(bytearray(executor.slices[stage].state_bytes()), dtype=torch.uint8)})


def _stop_step(run: _Generation, generation: int, executor: Any, ranks: dict[str, int], evaluator: int,
               layout: dict[str, Any]) -> tuple[int | None, str]:
    """The step this generation stops at and why, once decided (first writer wins); the evaluator proposes it."""
    name = f"g{generation}-stop"
    evaluator = min((r for r in ranks.values() if r not in executor.dead), default=evaluator)  # the lowest live rank
    if executor.rank == evaluator and executor.step + 2 <= run.spec.steps:
        from bamboo.reconfig import When, decide

        view = _view(run, layout, executor, ranks)
        if view is not None:
            decision = decide(view)
            reason = ", ".join(r.value for r in decision.reasons)
            if decision.when is When.CARRY_ON and executor.dead:
                # After a failover the taken-over stage and its successor have no shadow, so one more
                # failure next to them would be consecutive. bamboo-rc survives a second non-adjacent
                # failure on the merged schedule, but full redundancy is restored at the next boundary.
                reason = "rebuild redundancy after a failover"
            if decision.when is not When.CARRY_ON or executor.dead:
                try:
                    run.membership.decide(name, {"step": executor.step + 2, "reason": reason})
                except Exception as error:  # etcd restarting: propose again after the next step
                    print(f"node {run.node}: could not propose a reconfiguration: {error}", file=sys.stderr)
                    return None, ""
    try:
        found = run.membership.get_decision(name)
    except Exception:
        return None, ""
    if found is None:
        return None, ""
    return int(found.value["step"]), str(found.value["reason"])


def _view(run: _Generation, layout: dict[str, Any], executor: Any, ranks: dict[str, int]) -> Any:
    from bamboo.launch.reconfigure import build_view

    try:
        records = run.membership.list_nodes(skip_malformed=True)
    except Exception:
        return None
    dead = [n for n, r in ranks.items() if r in executor.dead]
    zones = {n: record.zone for n, record in records.items()}
    zones.update(layout.get("zones", {}))
    layers = run.layers(layout)
    global_batch = int(layout["micro_batches"]) * int(layout["pipelines"])
    return build_view(layout, zones, sorted(records), dead, layers, global_batch, run.spec.stages,
                      run.spec.pipelines)


_ABANDONED: Any = object()
"""What :func:`_attempt` returns when the attempt's outcome was ``abort``."""


def _prefix(generation: int, attempt: int) -> str:
    """Decision names of the barrier of ``generation``: ``g<g>-`` for its first attempt, ``g<g>-a<k>-`` after."""
    return f"g{generation}-" if attempt == 0 else f"g{generation}-a{attempt}-"


def _start_engine(run: _Generation, layout: dict[str, Any], old: Any, store: Any) -> Any:
    """This node's engine for ``layout``, with its stage state (from ``old``, peers or a checkpoint) in place."""
    from bamboo.launch.authority import MembershipFailureNotices
    from bamboo.rc import initialize

    spec, ranks = run.spec, dict(layout["ranks"])
    pipelines, micro_batches = int(layout["pipelines"]), int(layout["micro_batches"])
    job = f"{spec.job}-g{int(layout['generation'])}"
    notices = MembershipFailureNotices(store, job, run.agent, {r: n for n, r in ranks.items()})
    engine = initialize(
        list(run.program.layers), {**spec.config, "gradient_accumulation_steps": micro_batches}, spec.redundancy,
        loss_fn=run.program.loss_fn, stages=spec.stages, rank=ranks[run.node], world_size=spec.stages * pipelines,
        store=store, seed=spec.seed, job=job, timeouts=run.timeouts,
        notices=notices if spec.redundancy != "none" else None,
    )
    if int(layout["generation"]) > 0:
        _receive_state(run, layout, old, engine.executor, store)
        engine.executor.step = int(layout["start_step"])
    return engine


def _attempt(run: _Generation, layout: dict[str, Any], old: Any) -> Any:
    """Start ``layout`` as one attempt (:mod:`bamboo.launch.attempt`): this node's engine on ``go``,
    :data:`_ABANDONED` on ``abort``; a node that is not in the layout (a source leaving for standby, or a
    holder kept for a possible retry) does its transfers and returns None on ``go``."""
    from bamboo.launch.attempt import AbandonableStore, StartThread, await_outcome

    generation = int(layout["generation"])
    owners = set(layout["ranks"])
    sources = {src for src, _, _ in layout["transfers"]}
    store = AbandonableStore(run.store)
    if run.node in owners:
        part = StartThread(lambda: _start_engine(run, layout, old, store), name=f"bamboo-start-g{generation}")
    else:
        part = StartThread(lambda: _serve_as_source(run, layout, old, store), name=f"bamboo-serve-g{generation}")
    outcome = await_outcome(run.membership, generation, run.node, owners, owners | sources, part.progress,
                            run.spec.reconfigure_timeout_s, say=lambda line: print(f"node {run.node}: {line}",
                                                                                    flush=True))
    if outcome.go:
        part.join(run.timeouts.group)  # every owner is up, so every transfer of this node is done
        done, error = part.progress()
        if not done or error is not None:
            raise RuntimeError(f"generation {generation} went ahead without this node's part: {error}")
        return part.result
    print(f"node {run.node}: generation {generation} abandoned: {outcome.reason}", flush=True)
    store.abandon()
    part.join(2.0)  # a thread blocked in gloo on a dead peer stays blocked: its objects are never freed
    run.retired.append((store, part))
    return _ABANDONED


def _publish_layout(run: _Generation, value: dict[str, Any]) -> None:
    """Make ``value`` the layout in etcd unless a later one is there (any node may do it: its writer may be dead)."""
    current = run.membership.get_layout()
    if current is not None and int(current.value.get("generation", 0)) < int(value["generation"]):
        run.membership.put_layout(value, current.revision)


def _next_attempt_layout(run: _Generation, layout: dict[str, Any]) -> dict[str, Any]:
    """For a joiner whose attempt was abandoned: the layout the holders decide next."""
    name = f"{_prefix(int(layout['base_generation']), int(layout['attempt']) + 1)}next"
    value = run.wait_decision(name, run.timeouts.build)
    _publish_layout(run, value)
    return value


def _next_layout(run: _Generation, base: dict[str, Any], expected: Any, attempt: int, reason: str) -> dict[str, Any]:
    """Wait for every expected holder at the barrier of ``base``, then the next layout (first writer wins).

    ``expected(records)`` lists the nodes that must publish what they hold, given the registered nodes;
    ``attempt`` counts the abandoned starts of this barrier so far (each retry has its own decision names).
    """
    generation = int(base["generation"])
    prefix = _prefix(generation, attempt)
    name = f"{prefix}next"
    # A survivor may reach the barrier only after its own confirmation wait or group timeout.
    deadline = time.monotonic() + run.timeouts.build
    ready: dict[str, dict[str, Any]] = {}
    value: dict[str, Any] | None = None
    while value is None:
        existing = run.membership.get_decision(name)
        if existing is not None:
            value = existing.value
            break
        records = run.membership.list_nodes(skip_malformed=True)
        waiting_for = expected(records)
        for other in waiting_for:
            if other not in ready:
                found = run.membership.get_decision(f"{prefix}ready-{other}")
                if found is not None:
                    ready[other] = found.value
        if all(other in ready for other in waiting_for):
            value = _plan_next(run, base, ready, attempt, reason)
            value = run.membership.decide(name, value).value
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"survivors {sorted(set(waiting_for) - set(ready))} did not reach the barrier of "
                               f"generation {generation}")
        time.sleep(0.02)
    _publish_layout(run, value)
    print(f"node {run.node}: generation {value['generation']} starts at step {value['start_step']} "
          f"({value['mode']}, attempt {attempt + 1}): ranks {value['ranks']}, transfers {value['transfers']}",
          flush=True)
    return value


def _plan_next(run: _Generation, base: dict[str, Any], ready: dict[str, dict[str, Any]], attempt: int,
               reason: str) -> dict[str, Any]:
    """The next layout from the holders' ``ready`` records at the barrier of ``base``."""
    from bamboo.launch.reconfigure import build_view, next_history, restore_point, transfer_plan
    from bamboo.reconfig import plan_layout

    generation = int(base["generation"])
    ranks: dict[str, int] = dict(base["ranks"])
    records = run.membership.list_nodes(skip_malformed=True)
    # a holder whose lease expired since it published what it holds is dead: no transfer from it
    ready = {node: record for node, record in ready.items() if node in records} or ready
    # A consecutive failure can leave one pipeline committed at step k+1 while the broken one's
    # survivors abandoned step k: the committed state already holds the whole global batch of k,
    # so the next generation starts from the newest step, held by the nodes that reached it.
    step = max(int(record["step"]) for record in ready.values())
    holdings = {other: [int(s) for s in record["holds"]] for other, record in ready.items()
                if int(record["step"]) == step}
    dead = [n for n in ranks if n not in ready]
    zones = {n: record.zone for n, record in records.items()}
    usable = sorted(set(ready) | {n for n in records if n not in ranks})
    global_batch = int(base["micro_batches"]) * int(base["pipelines"])
    view = build_view(base, zones, usable, dead, run.layers(base), global_batch, run.spec.stages,
                      run.spec.pipelines)
    plan = plan_layout(view)
    pipelines = len(plan.owners)
    if pipelines == 0 or global_batch % pipelines:
        raise RuntimeError(f"cannot keep the global batch of {global_batch} microbatches over {pipelines} pipelines")
    new_ranks = {owner: d * run.spec.stages + s for d, row in enumerate(plan.owners) for s, owner in enumerate(row)}
    transfers, _local, missing = transfer_plan(new_ranks, run.spec.stages, holdings)
    mode, start, restore = "peers", step, None
    if missing:  # no survivor holds these stages: every node restarts from the last good checkpoint
        mode, transfers = "checkpoint", []
        start, restore = restore_point(run.spec.checkpoint_dir, run.spec.stages, missing)
    return {
        "state": "running", "generation": generation + 1 + attempt, "stages": run.spec.stages,
        "pipelines": pipelines, "micro_batches": global_batch // pipelines, "ranks": new_ranks,
        "standby": list(plan.standby), "owners": [list(row) for row in plan.owners], "plan": plan.to_dict(),
        "start_step": start, "mode": mode, "missing": missing,
        "transfers": [[a, b, stages] for a, b, stages in transfers], "reason": reason, "barrier_step": step,
        "checkpoint": restore,
        # when the first holder reached the barrier (wall clock): the reconfiguration's duration counts from
        # it, whichever node writes the record (the lowest rank may be a joiner that started later)
        "barrier_unix": min(float(record.get("at", time.time())) for record in ready.values()),
        # the barrier this layout comes from, which start of it this is, and who held state there
        "base_generation": generation, "attempt": attempt, "survivors": sorted(ready),
        # (first step, pipelines) of every generation so far: the reference follows the same grouping
        "history": next_history(base.get("history", [[0, int(base["pipelines"])]]), start, pipelines),
    }


def _receive_state(run: _Generation, layout: dict[str, Any], old: Any, executor: Any, store: Any) -> None:
    """Fill the new executor's slices: local copies, transfers by the plan, or the last checkpoint."""
    if layout["mode"] == "checkpoint":  # every node loads the checkpoint the layout names (reconfigure.py)
        from bamboo.launch.reconfigure import restore_slices

        restore_slices(layout, executor.slices)
        return
    if old is not None:
        for stage, piece in executor.slices.items():
            if stage in old.slices and old.slices[stage].steps == int(layout["start_step"]):
                piece.load_state_bytes(old.slices[stage].state_bytes())
    _run_transfers(run, layout, old, executor, store)


def _transfer_group(run: _Generation, layout: dict[str, Any], store: Any) -> tuple[Any, list[str]]:
    from bamboo.launch.reconfigure import transfer_participants
    from bamboo.rc.comm import build_gloo_group

    transfers = [(a, b, list(stages)) for a, b, stages in layout["transfers"]]
    members = transfer_participants(transfers)
    group = build_gloo_group(store, f"bamboo/{run.spec.job}/g{layout['generation']}/transfer/",
                             members.index(run.node), len(members), run.timeouts.group)
    run.retired.append(group)
    pause_s = float(os.environ.get(TRANSFER_PAUSE_ENV, "0") or 0)
    if pause_s > 0:  # test hook: the group is formed, no byte has moved yet
        run.membership.decide(f"g{layout['generation']}-transfer-group-{run.node}", {"pause_s": pause_s})
        time.sleep(pause_s)
    return group, members


def _run_transfers(run: _Generation, layout: dict[str, Any], old: Any, executor: Any | None, store: Any) -> None:
    """This node's part of the layout's transfers: send what ``old`` holds by the plan and, with an
    ``executor`` (a node with a role in the layout), receive into its slices."""
    from bamboo.rc.transfer import export_stage_state, import_stage_state

    transfers = [(a, b, list(stages)) for a, b, stages in layout["transfers"]]
    if not any(run.node in (a, b) for a, b, _ in transfers):
        return
    group, members = _transfer_group(run, layout, store)
    sent = 0
    for src, dst, stages in transfers:  # every member walks the same order: no cycle can block
        if src == run.node:
            sent += export_stage_state({s: old.slices[s] for s in stages}, group, members.index(dst))
        elif dst == run.node:
            assert executor is not None, "a node without a role in the layout receives nothing"
            import_stage_state(executor.slices, group, members.index(src))
    if any(src == run.node for src, _, _ in transfers):  # every source reports, for the reconfiguration record
        run.membership.decide(f"g{layout['generation']}-sent-{run.node}", {"bytes": sent})


def _serve_as_source(run: _Generation, layout: dict[str, Any], old: Any, store: Any) -> None:
    """A node with no role in the next layout still sends the stages it holds by the plan."""
    _run_transfers(run, layout, old, None, store)


def main(argv: list[str] | None = None) -> None:
    """Entry point (never returns: ends with ``os._exit``, see the module docstring)."""
    parser = argparse.ArgumentParser(prog="python -m bamboo.launch.worker",
                                     description="One bamboo-launch worker (started by its node's agent).")
    parser.add_argument("--spec", required=True, help="the run's RUN.json, written by bamboo-launch run")
    parser.add_argument("--node", required=True, help="this worker's node id (its rank comes from the layout in etcd)")
    parser.add_argument("--agent", default=None, help="HOST:PORT of this node's agent (failure reports)")
    args = parser.parse_args(argv)
    code = 0
    try:
        report = train(RunSpec.from_json(Path(args.spec).read_text()), args.node, args.agent)
        code = STANDBY_EXIT if report.get("standby") else 0
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":  # pragma: no cover
    main()
