"""Benchmark: bamboo-rc's redundancy modes against DeepSpeed's own PipelineEngine, same run.

Run: `.venv/bin/python tests/benchmarks/bench_rc.py` (add `--help` for the flags). Not collected
by pytest.

It trains the example GPT decoder (bamboo.rc.model) under one DeepSpeed config with P=2, D=1,
for M of 4 and 8, as:
1. DeepSpeed's `PipelineEngine` (the baseline; gloo on CPU);
2. bamboo `none`, 3. `lflb`, 4. `eflb`, 5. `efeb`.

Every variant is two forked worker processes (one per stage, one intra-op thread each, each pinned to its own
core with `--pin`, the default: what a GPU per node gives, and the bubbles are real idle time). The variants run
interleaved, `--repeats` times, and each prints the median time per iteration, its overhead against (1) measured
in the same run, the FRC stash bytes, the peak RSS of its workers, and, for bamboo, where the time went per
instruction kind (FRC compute, stash copies, sync, the commit) and what the step spent outside every instruction
(the interpreter's own time: the loop, the data, the hooks), and its overhead against bamboo `none`.

`--device cuda` runs both workers of every variant on the GPU (sharing it when there is one), and each prints
its peak GPU memory and the stash's bytes swapped per step and held on the GPU at most. A variant that cannot
run there (DeepSpeed's PipelineEngine with two ranks on one GPU) is reported with its first error line, and the
others still run.

Then the simulator's prediction: the per-instruction costs measured in this run (each stage's forward, backward
and FRC per microbatch, a message, the replica sync, the commit) become a `bamboo.schedule.Costs`, and each mode's
schedule (the one the runtime ran) is simulated with them: the predicted time per iteration against the measured
one, and `overhead_bound_pct`, the least overhead any placement of that mode's redundant work could have had.

`--costed` adds `lflb+costs` and `eflb+costs`: the same modes with their schedules searched for the costs measured
in the same repeat (`bamboo.rc.initialize(..., schedule_costs=...)`) instead of the placement for unit costs
that the runtime builds by default, interleaved with the others.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import json
import os
import statistics
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(__file__).resolve().parents[2] / ".cache" / "torch_extensions"))

import torch
from bamboo.bench.measured.steady import VARIANTS, VariantFailed, deepspeed_config, iteration_s, run_variant
from bamboo.rc.data import stdlib_corpus
from bamboo.rc.device import resolve_device
from bamboo.rc.model import GPTSize
from bamboo.schedule import Costs, StageCost, one_f_one_b, simulate
from torch.distributed import TCPStore


def _link_worker(rank: int, port: int, size: GPTSize, config: dict[str, Any], steps: int) -> dict[str, Any]:
    """The link between the two pinned workers: the round trip of an empty message and of one activation."""
    from bamboo.rc.comm import build_gloo_group

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=120))
    group = build_gloo_group(store, "probe", rank, 2, 60.0)
    activation = torch.ones(config["train_micro_batch_size_per_gpu"], size.sequence, size.width)
    empty = torch.ones(1)
    result = {}
    for name, tensor in (("latency_ms", empty), ("activation_ms", activation)):
        rounds = []
        for _ in range(steps * 4 + 2):
            started = time.perf_counter()
            if rank == 0:
                group.send([tensor], 1, 0).wait()
                group.recv([tensor], 1, 0).wait()
            else:
                group.recv([tensor], 0, 0).wait()
                group.send([tensor], 0, 0).wait()
            rounds.append((time.perf_counter() - started) / 2)
        result[name] = statistics.median(rounds[2:]) * 1e3
    result["activation_mb"] = activation.numel() * activation.element_size() / 2**20
    return {"times": [0.0], "stash": 0, "kinds": {}, "link": result}


def _per_instruction_ms(worker: dict[str, Any], kind: str) -> float:
    """The mean time (ms) of one `kind` instruction of a step on this worker."""
    count = worker["counts"].get(kind, 0)
    return worker["kinds"].get(kind, 0.0) * 1e3 / count if count else 0.0


def measured_costs(reports: dict[str, list[dict[str, Any]]], link: dict[str, float]) -> Costs:
    """The cost model of this run: each stage's forward, backward and commit from `none`'s workers (stage s runs on
    rank s), each stage's FRC from `eflb`'s shadow of it, the messages from the link probe, the replica sync's
    transfer from its bytes at the probe's bandwidth. D = 1: the all-reduce takes nothing."""
    none = reports["none"]
    eflb = reports.get("eflb")
    link_mb_per_ms = link["activation_mb"] / max(link["activation_ms"] - link["latency_ms"], 1e-6)
    stages = []
    for s in (0, 1):
        frc = _per_instruction_ms(eflb[(s - 1) % 2], "FR") if eflb else None
        sync_mb = (eflb or none)[s].get("sync_bytes", 0.0) / 2**20
        stages.append(StageCost(
            forward_ms=_per_instruction_ms(none[s], "F"), backward_ms=_per_instruction_ms(none[s], "B"),
            frc_ms=frc or None, optimizer_ms=none[s]["kinds"].get("commit", 0.0) * 1e3,
            activation_mb=link["activation_mb"], stash_mb=0.0, grad_mb=sync_mb, allreduce_ms=0.0,
        ))
    return Costs(default=stages[0], stages=tuple(stages), latency_ms=link["latency_ms"],
                 link_gb_per_s=link_mb_per_ms)


COSTED = "+costs"
"""The suffix of a variant run with its schedule searched for the costs measured in the same repeat (``--costed``)."""


def predictions(costs: Costs, microbatches: int, variants: list[str]) -> dict[str, dict[str, float]]:
    """Each bamboo variant's simulated time per iteration (the schedule the runtime ran: the unit-cost placement,
    or for a ``+costs`` variant the placement searched for the costs) and the least overhead its redundancy could
    have (`overhead_bound_pct`), for the measured costs."""
    out = {}
    for variant in variants:
        if variant in ("deepspeed", "link"):
            continue
        mode = variant.removesuffix(COSTED)
        schedule = (one_f_one_b(2, microbatches, mode, costs.linearizer_cost(), refine=True) if variant.endswith(COSTED)
                    else one_f_one_b(2, microbatches, mode))
        result = simulate(schedule, costs)
        out[variant] = {"ms_per_iteration": result.makespan, "overhead_bound_pct": result.overhead_bound_pct or 0.0}
    return out


def median_repeat(samples: list[float]) -> int:
    """The index of the repeat whose time is the median (the lower one of an even count): its workers' reports
    give the costs and the breakdown, so that one slow repeat (this machine's speed moves by tens of percent
    between runs) does not stand for the variant."""
    return samples.index(statistics.median_low(samples))


def _report_variant(variant: str, workers_by_repeat: list[list[dict[str, Any]]], samples: list[float],
                    base_ms: float | None, predicted: dict[str, float] | None, none_ms: float | None) -> dict[str, Any]:
    """One row: measured, predicted, overhead; where the time went (the slower worker per kind, in the median
    repeat)."""
    ms = statistics.median(samples) * 1e3
    median_workers = workers_by_repeat[median_repeat(samples)]
    kinds: dict[str, float] = {}
    for worker in median_workers:
        for kind, seconds in worker["kinds"].items():
            kinds[kind] = max(kinds.get(kind, 0.0), seconds * 1e3)
    instructions = sum(v for k, v in kinds.items() if k not in ("commit", "replica_step"))
    own = max(0.0, ms - instructions - kinds.get("commit", 0.0))
    sync = kinds.get("SY", 0.0) + kinds.get("RY", 0.0) + kinds.get("replica_step", 0.0)
    row = {"ms_per_iteration": ms, "samples_ms": [x * 1e3 for x in samples],
           "overhead_vs_deepspeed_pct": (ms / base_ms - 1) * 100 if base_ms else None,
           "overhead_vs_none_pct": (ms / none_ms - 1) * 100 if none_ms else None,
           "device_peak_bytes": max(w.get("device_peak", 0) for w in median_workers),
           "swapped_bytes_per_step": max(w.get("swapped_per_step", 0) for w in median_workers),
           "stash_device_peak_bytes": max(w.get("stash_device_peak", 0) for w in median_workers),
           "stash_bytes": max(w["stash"] for w in median_workers),
           "peak_rss_mib": max(w["rss"] for w in median_workers),
           "frc_ms": kinds.get("FR", 0.0), "swap_ms": kinds.get("SO", 0.0) + kinds.get("SI", 0.0),
           "brc_ms": kinds.get("BR", 0.0), "sync_ms": sync, "commit_ms": kinds.get("commit", 0.0),
           "interpreter_own_ms": own, "kind_ms": kinds,
           "kind_ms_per_worker": [{kind: seconds * 1e3 for kind, seconds in worker["kinds"].items()}
                                  for worker in median_workers]}
    if predicted is not None:
        row["predicted_ms"] = predicted["ms_per_iteration"]
        row["prediction_error_pct"] = (predicted["ms_per_iteration"] / ms - 1) * 100
        row["overhead_bound_pct"] = predicted["overhead_bound_pct"]
    return row


def _print_table(m: int, rows: dict[str, dict[str, Any]], device: str) -> None:
    gpu = device != "cpu"
    print(f"\nM={m}: time per iteration (median of repeats), overhead vs DeepSpeed PipelineEngine and vs none, "
          f"simulator")
    print(f"{'variant':<10} {'ms/iter':>8} {'vs DS':>7} {'vs none':>8} {'sim ms':>7} {'sim err':>8} {'bound':>6} "
          f"{'stash MiB':>9} {'FR':>6} {'SO+SI':>6} {'BR':>6} {'sync':>6} {'commit':>7} {'own':>6}"
          + (f" {'GPU peak MiB':>12} {'swap MiB/step':>13} {'stash on GPU MiB':>16}" if gpu else ""))
    for variant, row in rows.items():
        if "error" in row:
            print(f"{variant:<10} cannot run here: {row['error']}")
            continue
        cells = [f"{row['ms_per_iteration']:>8.1f}"]
        for key, width in (("overhead_vs_deepspeed_pct", 7), ("overhead_vs_none_pct", 8)):
            cells.append(f"{row[key]:>+{width - 1}.1f}%" if row[key] is not None else f"{'n/a':>{width}}")
        if "predicted_ms" in row:
            cells += [f"{row['predicted_ms']:>7.1f}", f"{row['prediction_error_pct']:>+7.1f}%",
                      f"{row['overhead_bound_pct']:>5.1f}%"]
        else:
            cells += [f"{'-':>7}", f"{'-':>8}", f"{'-':>6}"]
        memory = (f" {row['device_peak_bytes'] / 2**20:>12.1f} {row['swapped_bytes_per_step'] / 2**20:>13.2f} "
                  f"{row['stash_device_peak_bytes'] / 2**20:>16.2f}") if gpu else ""
        print(f"{variant:<10} {' '.join(cells)} {row['stash_bytes'] / 2**20:>9.2f} {row['frc_ms']:>6.1f} "
              f"{row['swap_ms']:>6.1f} {row['brc_ms']:>6.1f} {row['sync_ms']:>6.1f} {row['commit_ms']:>7.1f} "
              f"{row['interpreter_own_ms']:>6.1f}{memory}")
    print("(ms per iteration; FR..commit: the slower worker's time in those instructions; own: the step's time "
          "outside every instruction and the commit; bound: the least overhead that mode's redundancy could add "
          "over `none` for the costs measured here)")


def _measure(args: argparse.Namespace, size: GPTSize, config: dict[str, Any], m: int,
             link: dict[str, float]) -> tuple[dict[str, list[float]], dict[str, list[list[dict[str, Any]]]],
                                             dict[str, str]]:
    """Every variant `--repeats` times, interleaved: each one's median time per iteration per repeat, its workers'
    reports per repeat, and the first error of each variant that cannot run here (tried once). With ``--costed``,
    each repeat then runs lflb and eflb again (``lflb+costs``, ``eflb+costs``) with their schedules searched for
    the costs measured in that repeat (none's and eflb's instructions, ``link``)."""
    variants = list(args.variants) + ([f"{v}{COSTED}" for v in args.variants if v in ("lflb", "eflb")]
                                      if args.costed else [])
    samples: dict[str, list[float]] = {v: [] for v in variants}
    reports: dict[str, list[list[dict[str, Any]]]] = {v: [] for v in variants}
    failed: dict[str, str] = {}
    for repeat in range(args.repeats):
        for variant in [v for v in variants if v not in failed]:
            costs = None
            if variant.endswith(COSTED):
                measured = {v: reports[v][-1] for v in args.variants if v != "deepspeed" and reports[v]}
                costs = measured_costs(measured, link).to_dict()
            try:
                workers = run_variant(variant.removesuffix(COSTED), size, config, args.steps, args.pin, args.device,
                                      schedule_costs=costs)
            except VariantFailed as exc:
                failed[variant] = str(exc)
                print(f"  M={m} {variant}: cannot run here: {exc}", flush=True)
                continue
            samples[variant].append(iteration_s(workers))
            reports[variant].append(workers)
            print(f"  M={m} repeat {repeat + 1}/{args.repeats} {variant}: {samples[variant][-1] * 1e3:.1f} ms",
                  flush=True)
    return samples, reports, failed


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
                        help="variants to run; deepspeed must be among them for the ratios, none (and eflb) for "
                        "the simulator's costs (default all)")
    parser.add_argument("--pin", action=argparse.BooleanOptionalAction, default=True,
                        help="pin each worker to its own core (default on)")
    parser.add_argument("--device", default="cpu",
                        help="cpu (default) or cuda: the workers of every variant on the GPU (sharing one)")
    parser.add_argument("--torch-adam", action="store_true",
                        help="DeepSpeed's engine steps with torch's AdamW instead of its FusedAdam, which on the CPU "
                        "is a JIT-compiled op built on first use (scripts/gpu-check.sh --dry-run sets it)")
    parser.add_argument("--costed", action="store_true",
                        help="also run lflb and eflb with their schedules searched for the costs measured in the same "
                        "repeat (bamboo.rc.initialize's schedule_costs), as lflb+costs and eflb+costs; needs none "
                        "(and eflb, for the FRC's cost) among the variants")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.steps < 2 or args.repeats < 1:
        parser.error(f"--steps must be >= 2 and --repeats >= 1, got {args.steps} and {args.repeats}")
    if args.costed and "none" not in args.variants:
        parser.error("--costed needs none among the variants: the costs come from its instructions")
    try:
        kind = resolve_device(args.device).type  # counts GPUs without starting CUDA: the workers fork after
    except ValueError as exc:
        parser.error(str(exc))
    size = GPTSize(layers=args.layers, width=args.width, heads=args.heads, sequence=args.sequence)
    stdlib_corpus()
    if kind == "cpu":  # on a GPU each DeepSpeed worker imports it with the GPU accelerator itself
        import deepspeed  # noqa: F401  (imported once here, inherited by the forked workers)

    print(f"model {size}, micro batch {args.micro_batch_size}, P=2 D=1, {args.steps} steps "
          f"(first is warm-up) x {args.repeats} repeats, torch {torch.__version__}, {os.cpu_count()} CPUs, "
          f"{'each worker pinned to its own core' if args.pin else 'unpinned'}, "
          f"load average {os.getloadavg()[0]:.1f}, device {args.device}")
    results: dict[str, Any] = {"load_average": os.getloadavg()[0], "pinned": args.pin, "device": args.device}
    for m in args.micro_batches:
        config = deepspeed_config(m, args.micro_batch_size, args.torch_adam)
        link = run_variant("link", size, config, args.steps, args.pin,
                           worker=functools.partial(_link_worker, size=size, config=config, steps=args.steps))[0]["link"]
        samples, reports, failed = _measure(args, size, config, m, link)
        ran = [v for v in samples if v not in failed]
        predicted: dict[str, dict[str, float]] = {}
        costs = None
        if "none" in ran:
            costs = measured_costs({v: reports[v][median_repeat(samples[v])] for v in ran
                                    if v != "deepspeed" and not v.endswith(COSTED)}, link)
            predicted = predictions(costs, m, ran)
        base = statistics.median(samples["deepspeed"]) * 1e3 if "deepspeed" in ran else None
        none = statistics.median(samples["none"]) * 1e3 if "none" in ran else None
        rows = {v: {"error": failed[v]} if v in failed else
                _report_variant(v, reports[v], samples[v], base, predicted.get(v), none) for v in samples}
        _print_table(m, rows, kind)
        results[str(m)] = {"link": link, "costs": costs.to_dict() if costs else None, "variants": rows}
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
