"""The fault-free step of each system, one core per stage: the setting a GPU per node gives.

The emulated runs of ``compare`` put eight nodes, their agents, standby workers and etcd on the same few cores, so
the step time each run measures says as much about how many processes shared the cores with it as about the
system. This module measures the systems' steps where that does not happen: one pipeline (D = 1) of ``stages``
forked workers, one intra-op thread each, each pinned to its own core, training the same model with the same
config and data, fault-free, for ``steps`` iterations (the first is warm-up). The variants are:

- ``deepspeed``: DeepSpeed's ``PipelineEngine`` (what the checkpoint/restart baseline trains);
- ``none``, ``lflb``, ``eflb``, ``efeb``: bamboo-rc's engine with that redundancy mode.

They run interleaved, ``repeats`` times; each repeat's figure is the median over its iterations of the slowest
worker's time, and a variant's figure is the median over its repeats.

``compare --long-run`` scales its full-scale profiles by these ratios (:func:`steady_step_ms` through
``python -m bamboo.bench.measured.steady``, a process of its own, since it forks); ``tests/benchmarks/bench_rc.py``
runs the same workers for its per-instruction breakdown (:func:`run_variant`).
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from bamboo.bench import timeouts
from bamboo.bench.measured.options import CompareError

if TYPE_CHECKING:
    from bamboo.rc.model import GPTSize

__all__ = [
    "REPEATS",
    "STEPS",
    "VARIANTS",
    "SteadySteps",
    "VariantFailed",
    "deepspeed_config",
    "iteration_s",
    "main",
    "run_variant",
    "steady_step_ms",
]

VARIANTS = ("deepspeed", "none", "lflb", "eflb", "efeb")
"""What :func:`run_variant` trains: DeepSpeed's ``PipelineEngine``, or bamboo-rc with that redundancy mode."""

STEPS = 30
"""Iterations per run of a variant (the first is warm-up)."""

REPEATS = 3
"""Interleaved runs of every variant; a variant's figure is the median over them."""

PARTITIONS = ("uniform", "parameters")
"""How the layers are cut into stages (DeepSpeed's ``partition_method``; bamboo is given the same bounds)."""

Report = dict[str, Any]
"""One worker's JSON report: ``times`` (seconds per iteration) and what its variant measured besides."""

Worker = Callable[[int, int], Report]
"""A worker of a custom variant: ``(rank, store port) -> report``."""


class VariantFailed(RuntimeError):
    """A variant's workers failed (its first error line says why)."""


def deepspeed_config(micro_batches: int, micro_batch_size: int, torch_adam: bool = False) -> dict[str, Any]:
    """A DeepSpeed config for ``micro_batches`` of ``micro_batch_size`` per iteration. ``torch_adam``: DeepSpeed's
    engine steps with torch's fused AdamW (the kernel bamboo's optimizer uses) instead of its FusedAdam, a
    JIT-compiled op that the first run on a CPU machine spends about a minute building; bamboo's engine reads the
    keys and uses its own AdamW either way."""
    params: dict[str, Any] = {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}
    if torch_adam:
        params.update(torch_adam=True, fused=True)
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "AdamW", "params": params},
        "gradient_clipping": 1.0,
    }


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _bounds(specs: Sequence[Any], stages: int, partition: str) -> tuple[tuple[int, int], ...]:
    """The stage bounds DeepSpeed's ``partition`` method cuts, so both engines run the very same layers per stage
    (``parameters`` is bamboo-rc's own ``stage_bounds``, which the checkpoint/restart baseline checks it equals)."""
    if partition == "uniform":
        from deepspeed.runtime.utils import partition_uniform

        return tuple(itertools.pairwise(partition_uniform(len(specs), stages)))
    from bamboo.rc.model import stage_bounds

    return tuple(stage_bounds(specs, stages))


def _pin(rank: int) -> None:
    """This worker on its own core (rank modulo the cores), as a GPU per node would give it its own device."""
    cores = sorted(os.sched_getaffinity(0))
    os.sched_setaffinity(0, {cores[rank % len(cores)]})


def _deepspeed_worker(rank: int, port: int, stages: int, size: GPTSize, config: dict[str, Any], steps: int,
                      device: str, partition: str) -> Report:
    if device != "cpu":  # DeepSpeed picks its accelerator at import: a GPU one here (never in the parent)
        os.environ["DS_ACCELERATOR"] = "cuda"
    import deepspeed
    import torch
    from bamboo.bench.measured.baseline import init_deepspeed_gloo
    from bamboo.rc.data import GlobalBatchSampler, pipeline_data_iter
    from bamboo.rc.model import gpt_layer_specs, lm_loss
    from deepspeed.pipe import LayerSpec, PipelineModule
    from torch.distributed import TCPStore

    local_rank = rank % max(1, torch.cuda.device_count()) if device != "cpu" else rank
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(stages), "LOCAL_RANK": str(local_rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # The parent's store, as for every variant: DeepSpeed takes the default group that exists
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=stages)
    init_deepspeed_gloo()
    specs = gpt_layer_specs(size, LayerSpec)  # DeepSpeed's PipelineModule wants its own
    module = PipelineModule(layers=specs, num_stages=stages, loss_fn=lm_loss, partition_method=partition)
    ds_config = {**config, "steps_per_print": 10**9, "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=module, config=ds_config, model_parameters=module.parameters())
    sampler = GlobalBatchSampler(config["train_micro_batch_size_per_gpu"], size.sequence)
    data = pipeline_data_iter(sampler, 0, config["gradient_accumulation_steps"])
    times = []
    for _ in range(steps):
        started = time.perf_counter()
        engine.train_batch(data_iter=data)
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated() if device != "cpu" else 0
    return {"times": times, "stash": 0, "rss": _peak_rss_mib(), "kinds": {}, "device_peak": peak}


def _bamboo_worker(rank: int, port: int, stages: int, size: GPTSize, config: dict[str, Any], steps: int, mode: str,
                   device: str, partition: str, schedule_costs: dict[str, Any] | None = None) -> Report:
    from bamboo.rc.data import GlobalBatchSampler, pipeline_data_iter
    from bamboo.rc.device import peak_memory_bytes, resolve_device
    from bamboo.rc.engine import initialize
    from bamboo.rc.model import gpt_layer_specs, lm_loss
    from bamboo.schedule import Costs
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    specs = gpt_layer_specs(size)
    engine = initialize(specs, config, mode, loss_fn=lm_loss, stages=stages, rank=rank, world_size=stages,
                        store=store, job=f"steady-{mode}", stage_bounds=_bounds(specs, stages, partition),
                        device=resolve_device(device, local_rank=rank),
                        schedule_costs=None if schedule_costs is None else Costs.from_dict(schedule_costs))
    sampler = GlobalBatchSampler(config["train_micro_batch_size_per_gpu"], size.sequence)
    data = pipeline_data_iter(sampler, 0, config["gradient_accumulation_steps"])
    times = []
    for step in range(steps):
        if step == 1:
            engine.executor.kind_seconds.clear()  # the first step is warm-up
        started = time.perf_counter()
        engine.train_batch(data)
        times.append(time.perf_counter() - started)
    engine.finish()
    kinds = {kind: seconds / max(1, steps - 1) for kind, seconds in engine.executor.kind_seconds.items()}
    counts: dict[str, int] = {}
    for instruction in engine.executor.schedule.streams[engine.executor.node]:
        counts[instruction.kind.value] = counts.get(instruction.kind.value, 0) + 1
    stash = engine.executor.stash
    return {"times": times, "stash": stash.peak_bytes, "rss": _peak_rss_mib(), "kinds": kinds,
            "counts": counts, "sync_bytes": engine.executor.sync_bytes / steps,
            "device_peak": peak_memory_bytes(engine.executor.device) or 0,
            "swapped_per_step": stash.swapped_bytes_total / steps, "stash_device_peak": stash.device_peak_bytes}


def _child(variant: str, rank: int, port: int, stages: int, size: GPTSize, config: dict[str, Any], steps: int,
           device: str, partition: str, worker: Worker | None, schedule_costs: dict[str, Any] | None) -> Report:
    if worker is not None:
        return worker(rank, port)
    if variant == "deepspeed":
        return _deepspeed_worker(rank, port, stages, size, config, steps, device, partition)
    return _bamboo_worker(rank, port, stages, size, config, steps, variant, device, partition, schedule_costs)


def run_variant(variant: str, size: GPTSize, config: dict[str, Any], steps: int, pin: bool = True, device: str = "cpu",
                *, stages: int = 2, partition: str = "uniform", worker: Worker | None = None,
                schedule_costs: dict[str, Any] | None = None) -> list[Report]:
    """Fork the ``stages`` workers of one variant (``worker``, when given, runs in each instead, with its own
    name); returns their reports, rank by rank (:class:`VariantFailed` when one fails). ``schedule_costs`` (a
    ``bamboo.schedule.Costs`` as a dict) gives a bamboo variant the placement searched for those costs. ``size`` is a
    :class:`bamboo.rc.model.GPTSize`. The caller has imported torch (and, on the CPU, DeepSpeed) and called
    :func:`bamboo.rc.worker.exact_mode`'s imports already: the workers inherit them."""
    from bamboo.rc.worker import exact_mode
    from torch.distributed import TCPStore

    with tempfile.TemporaryDirectory(prefix="bamboo-steady-") as out:
        # Fork before the store (and its thread) exists; the workers read the port from a pipe.
        port_reader, port_writer = os.pipe()
        pids = []
        for rank in range(stages):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    os.close(port_writer)
                    port = int.from_bytes(os.read(port_reader, 8), "little")
                    exact_mode()
                    if pin:
                        _pin(rank)
                    report = _child(variant, rank, port, stages, size, config, steps, device, partition, worker,
                                    schedule_costs)
                    Path(out, f"{rank}.json").write_text(json.dumps(report))
                except BaseException as exc:  # report and die without running destructors
                    print(f"{variant} rank {rank}: {exc!r}", file=sys.stderr)
                    Path(out, f"{rank}.error").write_text(f"{type(exc).__name__}: {exc}".splitlines()[0])
                    code = 1
                finally:
                    sys.stdout.flush()
                    sys.stderr.flush()
                    os._exit(code)
            pids.append(pid)
        os.close(port_reader)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                         timeout=datetime.timedelta(seconds=120))
        port = store.port
        os.write(port_writer, port.to_bytes(8, "little") * stages)
        os.close(port_writer)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        del store
        if any(codes):
            errors = sorted(path.read_text() for path in Path(out).glob("*.error"))
            raise VariantFailed(errors[0] if errors else f"exit statuses {codes}")
        return [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(stages)]


def iteration_s(workers: Sequence[Report]) -> float:
    """A run's time per iteration: the median over its iterations after the first (warm-up) of the slowest
    worker's time."""
    per_iteration = [max(times) for times in zip(*(w["times"][1:] for w in workers), strict=True)]
    return statistics.median(per_iteration)


def _measure(variants: Sequence[str], size: GPTSize, config: dict[str, Any], *, stages: int, steps: int, repeats: int,
             pin: bool, partition: str, say: Callable[[str], None]) -> dict[str, list[float]]:
    samples: dict[str, list[float]] = {v: [] for v in variants}
    for repeat in range(repeats):
        for variant in variants:
            workers = run_variant(variant, size, config, steps, pin, stages=stages, partition=partition)
            samples[variant].append(iteration_s(workers))
            say(f"repeat {repeat + 1}/{repeats} {variant}: {samples[variant][-1] * 1e3:.1f} ms")
    return samples


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m bamboo.bench.measured.steady", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--variants", default="deepspeed,none",
                        help=f"comma-separated, from {', '.join(VARIANTS)} (default deepspeed,none)")
    parser.add_argument("--layers", type=int, default=4, help="the example GPT's decoder blocks (default 4)")
    parser.add_argument("--stages", type=int, default=2,
                        help="pipeline stages, one worker and one core each (default 2)")
    parser.add_argument("--config", type=Path, default=None,
                        help="a DeepSpeed config JSON (default: bamboo-launch's built-in example's)")
    parser.add_argument("--steps", type=int, default=STEPS,
                        help="iterations per run; the first is warm-up (default %(default)s)")
    parser.add_argument("--repeats", type=int, default=REPEATS,
                        help="interleaved repeats of every variant (default %(default)s)")
    parser.add_argument("--partition", choices=PARTITIONS, default="parameters",
                        help="how the layers are cut into stages (default parameters, as the runs cut them)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="pin each worker to its own core (default on)")
    parser.add_argument("--json", type=Path, default=None, help="write {variant: ms per iteration} here too")
    return parser


def main(argv: list[str] | None = None) -> int:
    """``python -m bamboo.bench.measured.steady``: print each variant's fault-free time per iteration."""
    parser = _parser()
    args = parser.parse_args(argv)
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown or not variants:
        parser.error(f"--variants takes some of {', '.join(VARIANTS)}, got {args.variants!r}")
    if args.steps < 2 or args.repeats < 1 or args.stages < 1 or args.layers < 1:
        parser.error(f"--steps must be >= 2, --repeats, --stages and --layers >= 1; got {args.steps}, "
                     f"{args.repeats}, {args.stages} and {args.layers}")
    if "deepspeed" in variants:
        import deepspeed  # noqa: F401  (imported once here, inherited by the forked workers)
    from bamboo.bench.measured.baseline import with_torch_adam
    from bamboo.launch.example import EXAMPLE_CONFIG
    from bamboo.rc.model import GPTSize
    from bamboo.rc.worker import exact_mode

    exact_mode()  # its imports, before the fork
    # the example's config as the checkpoint/restart baseline trains it (torch's AdamW, not DeepSpeed's FusedAdam)
    config = json.loads(args.config.read_text()) if args.config else with_torch_adam(EXAMPLE_CONFIG)
    size = GPTSize(layers=args.layers)
    print(f"steady: {', '.join(variants)}, P={args.stages} D=1, {args.steps} steps x {args.repeats} repeats, "
          f"{'each worker pinned to its own core' if args.pin else 'unpinned'}", flush=True)
    samples = _measure(variants, size, config, stages=args.stages, steps=args.steps, repeats=args.repeats,
                       pin=args.pin, partition=args.partition, say=lambda line: print(f"steady: {line}", flush=True))
    result = {v: statistics.median(s) * 1e3 for v, s in samples.items()}
    for variant, ms in result.items():
        print(f"{variant:<10} {ms:8.2f} ms per iteration")
    if args.json:
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


@attrs.frozen
class SteadySteps:
    """Each variant's fault-free time per iteration (``ms``), one core per stage, from :func:`steady_step_ms`: the
    setting it was measured in (``stages`` of them on a machine of ``cores``) and the command that measures it
    again."""

    ms: dict[str, float]
    stages: int
    cores: int
    command: tuple[str, ...]

    def ratio(self, variant: str, against: str) -> float:
        """``variant``'s time per iteration over ``against``'s."""
        return self.ms[variant] / self.ms[against]


def steady_step_ms(variants: Sequence[str], layers: int, stages: int, out: Path, *, steps: int = STEPS,
                   repeats: int = REPEATS, timeout_s: float = timeouts.STEADY_TIMEOUT_S) -> SteadySteps:
    """Run ``python -m bamboo.bench.measured.steady`` for ``variants`` with ``min(stages, cores)`` stages (one core
    each) and return what it measured; its output goes to ``out/steady.log``. Raises :class:`CompareError` when it
    fails or times out."""
    cores = len(os.sched_getaffinity(0))
    used = max(1, min(stages, cores))
    target = out / "steady.json"
    command = [sys.executable, "-m", "bamboo.bench.measured.steady", "--variants", ",".join(variants),
               "--layers", str(layers), "--stages", str(used), "--steps", str(steps), "--repeats", str(repeats),
               "--json", str(target)]
    log = out / "steady.log"
    with log.open("w") as stream:
        try:
            code = subprocess.run(command, stdout=stream, stderr=subprocess.STDOUT, timeout=timeout_s).returncode
        except subprocess.TimeoutExpired as exc:
            raise CompareError(f"the steady-state measurement did not finish in {timeout_s:.0f} s (log: {log})") from exc
    if code != 0 or not target.exists():
        raise CompareError(f"the steady-state measurement failed with exit status {code} (log: {log})")
    return SteadySteps(ms=json.loads(target.read_text()), stages=used, cores=cores, command=tuple(command[1:]))


if __name__ == "__main__":
    raise SystemExit(main())
