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
against (1) measured in the same run, the FRC stash bytes, the peak RSS of its workers, and, for
bamboo, where the time went per instruction kind (FRC compute, stash copies, sync).
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


def _deepspeed_worker(rank: int, port: int, size: GPTSize, config: dict[str, Any], steps: int) -> dict[str, Any]:
    import deepspeed
    from deepspeed.pipe import PipelineModule

    os.environ.update({"RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank),
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
    return {"times": times, "stash": 0, "rss": _peak_rss_mib(), "kinds": {}}


def _uniform_bounds(layer_count: int, stages: int) -> tuple[tuple[int, int], ...]:
    """DeepSpeed's "uniform" partition as stage bounds, so both engines run the very same layers per stage."""
    from deepspeed.runtime.utils import partition_uniform

    parts = partition_uniform(layer_count, stages)
    return tuple(itertools.pairwise(parts))


def _bamboo_worker(rank: int, port: int, size: GPTSize, config: dict[str, Any], steps: int, mode: str) -> dict[str, Any]:
    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    specs = gpt_layer_specs(size)
    engine = initialize(specs, config, mode, loss_fn=lm_loss, stages=2, rank=rank, world_size=2, store=store,
                        job=f"bench-{mode}", stage_bounds=_uniform_bounds(len(specs), 2))
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
    return {"times": times, "stash": engine.executor.stash.peak_bytes, "rss": _peak_rss_mib(), "kinds": kinds,
            "sync_bytes": engine.executor.sync_bytes / steps}


def run_variant(variant: str, size: GPTSize, config: dict[str, Any], steps: int) -> list[dict[str, Any]]:
    """Fork the two workers of one variant; returns their reports."""
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
                        report = _deepspeed_worker(rank, port, size, config, steps)
                    else:
                        report = _bamboo_worker(rank, port, size, config, steps, variant)
                    Path(out, f"{rank}.json").write_text(json.dumps(report))
                except BaseException as exc:  # report and die without running destructors
                    print(f"{variant} rank {rank}: {exc!r}", file=sys.stderr)
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
        for pid in pids:
            _, status = os.waitpid(pid, 0)
            if os.waitstatus_to_exitcode(status) != 0:
                raise SystemExit(f"bench_rc: the {variant} workers failed")
        del store
        return [json.loads(Path(out, f"{rank}.json").read_text()) for rank in range(2)]


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
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        parser.error(f"--steps must be >= 2 and --repeats >= 1, got {args.steps} and {args.repeats}")
    size = GPTSize(layers=args.layers, width=args.width, heads=args.heads, sequence=args.sequence)
    stdlib_corpus()
    import deepspeed  # noqa: F401  (imported once here, inherited by the forked workers)

    print(f"model {size}, micro batch {args.micro_batch_size}, P=2 D=1, {args.steps} steps "
          f"(first is warm-up) x {args.repeats} repeats, torch {torch.__version__}, {os.cpu_count()} CPUs")
    results: dict[str, Any] = {}
    for m in args.micro_batches:
        config = _config(m, args.micro_batch_size)
        samples: dict[str, list[float]] = {v: [] for v in args.variants}
        reports: dict[str, list[dict[str, Any]]] = {v: [] for v in args.variants}
        for repeat in range(args.repeats):
            for variant in args.variants:
                workers = run_variant(variant, size, config, args.steps)
                per_iteration = [max(a, b) for a, b in zip(workers[0]["times"][1:], workers[1]["times"][1:], strict=True)]
                samples[variant].append(statistics.median(per_iteration))
                reports[variant].append(workers)
                print(f"  M={m} repeat {repeat + 1}/{args.repeats} {variant}: {samples[variant][-1] * 1e3:.1f} ms",
                      flush=True)
        base = statistics.median(samples["deepspeed"]) if "deepspeed" in samples else None
        print(f"\nM={m}: time per iteration (median of repeats), overhead vs DeepSpeed PipelineEngine")
        print(f"{'variant':<10} {'ms/iter':>9} {'overhead':>9} {'stash MiB':>10} {'peak RSS MiB':>13} "
              f"{'FR ms':>7} {'SO+SI ms':>9} {'BR ms':>7} {'sync ms':>8}")
        results[str(m)] = {}
        for variant in args.variants:
            ms = statistics.median(samples[variant]) * 1e3
            overhead = f"{(ms / (base * 1e3) - 1) * 100:+.1f}%" if base else "n/a"
            last = reports[variant][-1]
            stash = max(w["stash"] for w in last) / 2**20
            rss = max(w["rss"] for w in last)
            kinds: dict[str, float] = {}
            for worker in last:
                for kind, seconds in worker["kinds"].items():
                    kinds[kind] = max(kinds.get(kind, 0.0), seconds * 1e3)
            sync = kinds.get("SY", 0.0) + kinds.get("RY", 0.0) + kinds.get("replica_step", 0.0)
            print(f"{variant:<10} {ms:>9.1f} {overhead:>9} {stash:>10.2f} {rss:>13.0f} {kinds.get('FR', 0.0):>7.1f} "
                  f"{kinds.get('SO', 0.0) + kinds.get('SI', 0.0):>9.1f} {kinds.get('BR', 0.0):>7.1f} {sync:>8.1f}")
            results[str(m)][variant] = {"ms_per_iteration": ms, "samples_ms": [s * 1e3 for s in samples[variant]],
                                        "stash_bytes": max(w["stash"] for w in last), "peak_rss_mib": rss,
                                        "kind_ms": kinds}
        print()
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
