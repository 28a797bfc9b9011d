"""Benchmark: bamboo-rc's redundancy modes against DeepSpeed's own PipelineEngine, same run.

Run: `.venv/bin/python tests/benchmarks/bench_rc.py` (add `--help` for the flags). Not collected
by pytest.

It trains the example GPT decoder (bamboo.rc.model) under one DeepSpeed config with P=2, D=1,
for M of 4 and 8, as:
1. DeepSpeed's `PipelineEngine` (the baseline; gloo on CPU);
2. bamboo `none`, 3. `lflb`, 4. `eflb`, 5. `efeb`.

Every variant is two forked worker processes (one per stage, one intra-op thread each, so each
stage owns a core of this 2-core machine and the bubbles are real idle time). The variants run
interleaved, `--repeats` times, and each prints the median time per iteration, its overhead
against (1) and against bamboo `none` measured in the same run, the FRC stash bytes, the peak RSS of
its workers, and, for bamboo, where the time went per instruction kind (FRC compute, stash copies, sync).

`--device cuda` runs both workers of every variant on the GPU (sharing it when there is one), and each
prints its peak GPU memory and the stash's bytes swapped per step and held on the GPU at most. A variant
that cannot run there (DeepSpeed's PipelineEngine with two ranks on one GPU) is reported as such, its
first error line printed, and the others still run.
"""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2] / ".cache" / "torch_extensions"))

import torch
from bamboo.rc.data import GlobalBatchSampler, pipeline_data_iter, stdlib_corpus
from bamboo.rc.device import peak_memory_bytes, resolve_device
from bamboo.rc.engine import initialize
from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss
from bamboo.rc.worker import exact_mode
from torch.distributed import TCPStore

VARIANTS = ("deepspeed", "none", "lflb", "eflb", "efeb")


def _peak_rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def _config(micro_batches: int, micro_batch_size: int) -> dict[str, Any]:
    return {
        "train_micro_batch_size_per_gpu": micro_batch_size,
        "gradient_accumulation_steps": micro_batches,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "gradient_clipping": 1.0,
    }


def _deepspeed_worker(rank: int, port: int, size: GPTSize, config: dict[str, Any], steps: int,
                      device: str) -> dict[str, Any]:
    if device != "cpu":  # DeepSpeed picks its accelerator at import: a GPU one here (never in the parent)
        os.environ["DS_ACCELERATOR"] = "cuda"
    import deepspeed
    from deepspeed.pipe import PipelineModule

    local_rank = rank % max(1, torch.cuda.device_count()) if device != "cpu" else rank
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(local_rank),
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)
    specs = gpt_layer_specs(size)
    # "uniform" splits the layer count evenly; the bamboo variants are given the same stage bounds.
    module = PipelineModule(layers=specs, num_stages=2, loss_fn=lm_loss, partition_method="uniform")
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


def _uniform_bounds(layer_count: int, stages: int) -> tuple[tuple[int, int], ...]:
    """DeepSpeed's "uniform" partition as stage bounds, so both engines run the very same layers per stage."""
    from deepspeed.runtime.utils import partition_uniform

    parts = partition_uniform(layer_count, stages)
    return tuple(itertools.pairwise(parts))


def _bamboo_worker(rank: int, port: int, size: GPTSize, config: dict[str, Any], steps: int, mode: str,
                   device: str) -> dict[str, Any]:
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    specs = gpt_layer_specs(size)
    engine = initialize(specs, config, mode, loss_fn=lm_loss, stages=2, rank=rank, world_size=2, store=store,
                        job=f"bench-{mode}", stage_bounds=_uniform_bounds(len(specs), 2),
                        device=resolve_device(device, local_rank=rank))
    sampler = GlobalBatchSampler(config["train_micro_batch_size_per_gpu"], size.sequence)
    data = pipeline_data_iter(sampler, 0, config["gradient_accumulation_steps"])
    engine.executor.kind_seconds.clear()
    times = []
    for step in range(steps):
        if step == 1:
            engine.executor.kind_seconds.clear()  # the first step is warm-up
        started = time.perf_counter()
        engine.train_batch(data)
        times.append(time.perf_counter() - started)
    engine.finish()
    kinds = {kind: seconds / max(1, steps - 1) for kind, seconds in engine.executor.kind_seconds.items()}
    stash = engine.executor.stash
    return {"times": times, "stash": stash.peak_bytes, "rss": _peak_rss_mib(), "kinds": kinds,
            "sync_bytes": engine.executor.sync_bytes / steps,
            "device_peak": peak_memory_bytes(engine.executor.device) or 0,
            "swapped_per_step": stash.swapped_bytes_total / steps, "stash_device_peak": stash.device_peak_bytes}


class VariantFailed(RuntimeError):
    """A variant's workers failed (its first error line says why)."""


def run_variant(variant: str, size: GPTSize, config: dict[str, Any], steps: int,
                device: str = "cpu") -> list[dict[str, Any]]:
    """Fork the two workers of one variant; returns their reports (VariantFailed if one fails)."""
    with tempfile.TemporaryDirectory(prefix="bamboo-bench-") as out:
        # Fork before the store (and its thread) exists; the workers read the port from a pipe.
        port_reader, port_writer = os.pipe()
        pids = []
        for rank in range(2):
            pid = os.fork()
            if pid == 0:
                code = 0
                try:
                    os.close(port_writer)
                    port = int.from_bytes(os.read(port_reader, 8), "little")
                    exact_mode()
                    if variant == "deepspeed":
                        report = _deepspeed_worker(rank, port, size, config, steps, device)
                    else:
                        report = _bamboo_worker(rank, port, size, config, steps, variant, device)
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
        store = None
        if variant == "deepspeed":  # DeepSpeed's own init: its rank 0 hosts the store on a free port
            with socket.socket() as probe:
                probe.bind(("127.0.0.1", 0))
                port = probe.getsockname()[1]
        else:
            store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                             timeout=datetime.timedelta(seconds=120))
            port = store.port
        os.write(port_writer, port.to_bytes(8, "little") * 2)
        os.close(port_writer)
        codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
        del store
        if any(codes):
            errors = sorted(path.read_text() for path in Path(out).glob("*.error"))
            raise VariantFailed(errors[0] if errors else f"exit statuses {codes}")
        return [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(2)]


def _measure(args: argparse.Namespace, size: GPTSize, m: int) -> tuple[dict[str, list[float]], dict[str, Any]]:
    """Run every variant `--repeats` times, interleaved; returns each one's median times per iteration and its
    last workers' reports (or the error that stopped it)."""
    config = _config(m, args.micro_batch_size)
    samples: dict[str, list[float]] = {v: [] for v in args.variants}
    last: dict[str, Any] = {}
    for repeat in range(args.repeats):
        for variant in args.variants:
            if isinstance(last.get(variant), str):
                continue  # it cannot run here: once is enough to say so
            try:
                workers = run_variant(variant, size, config, args.steps, args.device)
            except VariantFailed as failed:
                last[variant] = str(failed)
                print(f"  M={m} {variant}: cannot run: {failed}", flush=True)
                continue
            per_iteration = [max(a, b) for a, b in zip(workers[0]["times"][1:], workers[1]["times"][1:], strict=True)]
            samples[variant].append(statistics.median(per_iteration))
            last[variant] = workers
            print(f"  M={m} repeat {repeat + 1}/{args.repeats} {variant}: {samples[variant][-1] * 1e3:.1f} ms",
                  flush=True)
    return samples, last


def _row(variant: str, ms: float, workers: list[dict[str, Any]], base: float | None, none: float | None) -> dict[str, Any]:
    kinds: dict[str, float] = {}
    for worker in workers:
        for kind, seconds in worker["kinds"].items():
            kinds[kind] = max(kinds.get(kind, 0.0), seconds * 1e3)
    return {"ms_per_iteration": ms,
            "overhead_vs_deepspeed": ms / base - 1 if base else None, "overhead_vs_none": ms / none - 1 if none else None,
            "stash_bytes": max(w["stash"] for w in workers), "peak_rss_mib": max(w["rss"] for w in workers),
            "device_peak_bytes": max(w.get("device_peak", 0) for w in workers),
            "swapped_bytes_per_step": max(w.get("swapped_per_step", 0) for w in workers),
            "stash_device_peak_bytes": max(w.get("stash_device_peak", 0) for w in workers), "kind_ms": kinds}


def _print_table(m: int, rows: dict[str, dict[str, Any]], device: str) -> None:
    print(f"\nM={m}: time per iteration (median of repeats), overhead vs DeepSpeed PipelineEngine and vs bamboo none")
    print(f"{'variant':<10} {'ms/iter':>9} {'vs DS':>8} {'vs none':>8} {'stash MiB':>10} {'peak RSS MiB':>13} "
          f"{'FR ms':>7} {'SO+SI ms':>9} {'BR ms':>7} {'sync ms':>8}" + (
              f" {'GPU peak MiB':>13} {'swap MiB/step':>14} {'stash on GPU MiB':>17}" if device != "cpu" else ""))
    for variant, row in rows.items():
        if "error" in row:
            print(f"{variant:<10} cannot run here: {row['error']}")
            continue
        kinds = row["kind_ms"]
        ratio = {key: "n/a" if row[key] is None else f"{row[key] * 100:+.1f}%"
                 for key in ("overhead_vs_deepspeed", "overhead_vs_none")}
        sync = kinds.get("SY", 0.0) + kinds.get("RY", 0.0) + kinds.get("replica_step", 0.0)
        line = (f"{variant:<10} {row['ms_per_iteration']:>9.1f} {ratio['overhead_vs_deepspeed']:>8} "
                f"{ratio['overhead_vs_none']:>8} {row['stash_bytes'] / 2**20:>10.2f} {row['peak_rss_mib']:>13.0f} "
                f"{kinds.get('FR', 0.0):>7.1f} {kinds.get('SO', 0.0) + kinds.get('SI', 0.0):>9.1f} "
                f"{kinds.get('BR', 0.0):>7.1f} {sync:>8.1f}")
        if device != "cpu":
            line += (f" {row['device_peak_bytes'] / 2**20:>13.1f} {row['swapped_bytes_per_step'] / 2**20:>14.2f} "
                     f"{row['stash_device_peak_bytes'] / 2**20:>17.2f}")
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--micro-batches", type=int, nargs="+", default=[4, 8], help="values of M (default 4 8)")
    parser.add_argument("--steps", type=int, default=8, help="iterations per run; the first is warm-up (default 8)")
    parser.add_argument("--repeats", type=int, default=3, help="interleaved repeats of every variant (default 3)")
    parser.add_argument("--layers", type=int, default=6, help="decoder blocks (default 6)")
    parser.add_argument("--width", type=int, default=256, help="model width (default 256)")
    parser.add_argument("--heads", type=int, default=8, help="attention heads (default 8)")
    parser.add_argument("--sequence", type=int, default=128, help="bytes per sample (default 128)")
    parser.add_argument("--micro-batch-size", type=int, default=4, help="samples per microbatch (default 4)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS,
                        help="variants to run; deepspeed must be among them for the ratios (default all)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda: the workers of every variant on the GPU (sharing one)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        parser.error(f"--steps must be >= 2 and --repeats >= 1, got {args.steps} and {args.repeats}")
    try:
        kind = resolve_device(args.device).type  # counts GPUs without starting CUDA: the workers fork after
    except ValueError as exc:
        parser.error(str(exc))
    size = GPTSize(layers=args.layers, width=args.width, heads=args.heads, sequence=args.sequence)
    stdlib_corpus()
    if kind == "cpu":
        import deepspeed  # noqa: F401  (imported once here, inherited by the forked workers)

    print(f"model {size}, micro batch {args.micro_batch_size}, P=2 D=1, {args.steps} steps "
          f"(first is warm-up) x {args.repeats} repeats, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"device {args.device}")
    results: dict[str, Any] = {}
    for m in args.micro_batches:
        samples, last = _measure(args, size, m)
        medians = {v: statistics.median(samples[v]) * 1e3 for v in args.variants if samples[v]}
        rows: dict[str, dict[str, Any]] = {}
        for variant in args.variants:
            if variant not in medians:
                rows[variant] = {"error": last[variant]}
                continue
            rows[variant] = _row(variant, medians[variant], last[variant], medians.get("deepspeed"), medians.get("none"))
            rows[variant]["samples_ms"] = [sample * 1e3 for sample in samples[variant]]
        _print_table(m, rows, kind)
        results[str(m)] = rows
        print()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
