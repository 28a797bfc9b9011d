"""Benchmark: the fault-free step of pure data parallelism (P = 1) with exact redundancy, against no redundancy
(`--redundancy none`), same run.

Run: `flock /tmp/bamboo-heavy.lock .venv/bin/python tests/benchmarks/bench_dp_step.py` (`--help` for the flags).
Not collected by pytest. Ratios are printed, not asserted.

For each D in `--replicas`, `bamboo.rc.verify.run_verify` trains the example decoder with P = 1 and D
replicas (one process each, `--steps` steps, one microbatch per replica and step, SGD) as:
1. `none` (the baseline): no redundancy, so the step ends with one all-reduce of the gradients: gloo's, as
   DDP's, with D = 2; with D >= 3 the exact sum in replica order in two phases (`bamboo.rc.two_phase_sum`: an
   all-to-all, each node adds its piece's shares in order, an all-gather), moving about what gloo's ring moves;
2. `lflb`: the shadow ring, lazy. Its step ends with the exact reduction (`bamboo.rc.ring`: an all-to-all of
   gradient chunks, each node adds its chunk's shares in share order, a second all-to-all of the sums), which
   adds the shares in one fixed order whichever node computed them;
3. `eflb`: the same, plus the eager copy of the neighbour's share every step (overbatching).

The variants run interleaved, `--repeats` times. Each prints the median step time (the steps after the
first two of every run, pooled over the repeats) and its ratio against (1) in the same run. Every run is
checked bit-equal (0.0) against the single-process reference.

Where the time goes: rank 0's mean seconds per step in the compute instructions (`L`, `F`, `B`, and the
eager copies' `FR`, `BR`), from `verify`'s per-kind timings, and the mean step time less that (the
reduction, waiting for the peers, and the optimizer step), both over every step of every run.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent))

from _bench_common import Log
from bamboo.rc.model import GPTSize
from bamboo.rc.verify import run_verify

MODES = ("none", "lflb", "eflb")
COMPUTE_KINDS = ("L", "F", "B", "FR", "BR")
CONFIG = {
    "train_micro_batch_size_per_gpu": 1,
    "gradient_accumulation_steps": 1,
    "optimizer": {"type": "SGD", "params": {"lr": 0.01}},
}


def _replicas(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--replicas takes comma-separated integers, got {text!r}") from None
    if not values or any(v < 2 for v in values):
        raise argparse.ArgumentTypeError(f"every replica count must be at least 2, got {text!r}")
    return values


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {text!r}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--replicas", type=_replicas, default=[2, 3, 4],
                        help="data-parallel replicas D, comma separated (default 2,3,4)")
    parser.add_argument("--width", type=_positive, default=512,
                        help="model width (default 512: 4 blocks, about 13 M parameters)")
    parser.add_argument("--steps", type=_positive, default=12, help="steps per run (default 12; the first 2 are "
                        "left out of the median)")
    parser.add_argument("--repeats", type=_positive, default=2, help="interleaved runs per variant (default 2)")
    parser.add_argument("--json", action="store_true", help="print only the JSON report: one object per D and mode "
                        "(median step, its ratio to none, max rel diff, compute and other ms per step)")
    args = parser.parse_args(argv)
    if args.steps < 3:
        parser.error(f"--steps must be at least 3 (the first 2 are left out), got {args.steps}")
    log = Log()
    size = GPTSize(layers=4, width=args.width, heads=4, sequence=16)
    times: dict[tuple[int, str], list[float]] = {}
    diffs: dict[tuple[int, str], list[float]] = {}
    split: dict[tuple[int, str], list[tuple[float, float]]] = {}  # (compute, whole) seconds of each run
    failed: list[str] = []
    for replicas in args.replicas:
        for repeat in range(args.repeats):
            for mode in MODES:
                result = run_verify(1, replicas, args.steps, mode, size=size, config=CONFIG)
                rank0 = result.timings[0]
                steps = sorted(end - start for start, end in rank0["iteration_times"][2:])
                compute = sum(rank0["kind_seconds"].get(kind, 0.0) for kind in COMPUTE_KINDS)
                whole = sum(end - start for start, end in rank0["iteration_times"])
                split.setdefault((replicas, mode), []).append((compute, whole))
                times.setdefault((replicas, mode), []).extend(steps)
                diffs.setdefault((replicas, mode), []).append(result.max_relative_diff)
                if not (result.passed and result.max_relative_diff == 0.0):
                    failed.append(f"D={replicas} {mode} repeat {repeat + 1}: max rel diff {result.max_relative_diff}")
                log(f"D={replicas} {mode:5} repeat {repeat + 1}/{args.repeats}: median step "
                    f"{statistics.median(steps) * 1e3:.1f} ms, max rel diff {result.max_relative_diff:.1e}")
    say = (lambda line: None) if args.json else print
    say(f"\nP = 1, the example decoder at width {args.width} (4 blocks), one microbatch per replica and step, "
        f"SGD; median step time over {args.repeats} interleaved runs of {args.steps} steps (the first 2 left out)")
    say(f"{'D':>3} {'mode':6} {'median ms':>10} {'vs none':>8} {'max rel diff':>13} {'compute ms':>11} "
        f"{'other ms':>9}")
    rows = []
    for replicas in args.replicas:
        base = statistics.median(times[(replicas, "none")])
        for mode in MODES:
            median = statistics.median(times[(replicas, mode)])
            runs = split[(replicas, mode)]
            compute = sum(c for c, _ in runs) / (args.steps * len(runs))
            other = sum(w for _, w in runs) / (args.steps * len(runs)) - compute
            say(f"{replicas:>3} {mode:6} {median * 1e3:>10.1f} {median / base:>7.2f}x "
                f"{max(diffs[(replicas, mode)]):>13.1e} {compute * 1e3:>11.1f} {other * 1e3:>9.1f}")
            rows.append({"replicas": replicas, "mode": mode, "median_step_ms": round(median * 1e3, 2),
                         "vs_none": round(median / base, 3), "max_relative_diff": max(diffs[(replicas, mode)]),
                         "compute_ms": round(compute * 1e3, 2), "other_ms": round(other * 1e3, 2)})
    for line in failed:
        say(f"NOT EXACT: {line}")
    if args.json:
        print(json.dumps({"width": args.width, "steps": args.steps, "repeats": args.repeats, "rows": rows,
                          "not_exact": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
