"""Benchmark: the full Table 6 sweep (five probabilities x 1,000 runs, bert-table6) must finish in under 60 s.

Run: ``.venv/bin/python tests/benchmarks/bench_simulator.py [--runs 1000] [--workers 2]``.

Baseline, measured in the same run on the same worker pool: generating the same synthetic spot
event streams (same seeds, each row for its mean run length) without simulating anything. The
ratio sweep / baseline is the simulator's cost on top of producing its input. Exit status 1 if
the sweep takes longer than the budget.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import sys
import time

from bamboo.bench.profile import load_profile
from bamboo.bench.sweep import sweep
from bamboo.bench.synthetic import SyntheticSpec, SyntheticTraceGenerator

PROBABILITIES = (0.01, 0.05, 0.1, 0.25, 0.5)
BUDGET_S = 60.0


def _generate_only(job: tuple[SyntheticSpec, tuple[int, ...], float]) -> int:
    spec, seeds, hours = job
    count = 0
    for seed in seeds:
        for _ in SyntheticTraceGenerator(spec, seed).events(until_s=hours * 3600.0):
            count += 1
    return count


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=1000, help="runs per probability (default 1000)")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument("--json", action="store_true", help="print only the JSON report: the sweep's time, the "
                        "baseline's, their ratio and each probability's row")
    args = parser.parse_args()
    profile = load_profile("bert-table6")

    start = time.perf_counter()
    rows = sweep(profile, PROBABILITIES, args.runs, workers=args.workers)
    sweep_s = time.perf_counter() - start

    jobs = []
    for row in rows:
        spec = SyntheticSpec(preemption_probability=row.probability, desired_nodes=profile.desired_nodes,
                             zones=3, bulk_mean=2.0)
        for first in range(0, args.runs, 50):
            jobs.append((spec, tuple(range(first, min(first + 50, args.runs))), row.result.duration_h))
    start = time.perf_counter()
    with multiprocessing.get_context("fork").Pool(args.workers) as pool:
        events = sum(pool.map(_generate_only, jobs))
    baseline_s = time.perf_counter() - start

    runs = args.runs * len(PROBABILITIES)
    ok = sweep_s < BUDGET_S
    if args.json:
        print(json.dumps({
            "runs": runs, "workers": args.workers, "sweep_s": round(sweep_s, 2), "budget_s": BUDGET_S,
            "ms_per_run": round(sweep_s / runs * 1000, 3), "baseline_s": round(baseline_s, 2), "events": events,
            "sweep_over_baseline": round(sweep_s / baseline_s, 2), "within_budget": ok,
            "rows": [{"probability": row.probability, "value": round(row.result.value, 4),
                      "nodes": round(row.result.nodes, 3), "fatal_failures": round(row.result.fatal_failures, 4),
                      "preemptions": round(row.result.preemptions, 2)} for row in rows]}))
        return 0 if ok else 1
    for row in rows:
        r = row.result
        print(f"p={row.probability:<5g} value={r.value:.3f} nodes={r.nodes:.2f} fatal={r.fatal_failures:.3f} "
              f"preemptions={r.preemptions:.1f}")
    print(f"sweep: {runs} runs in {sweep_s:.1f} s on {args.workers} workers "
          f"({sweep_s / runs * 1000:.2f} ms per run); budget {BUDGET_S:.0f} s")
    print(f"baseline (event streams only, {events} events): {baseline_s:.1f} s; "
          f"sweep / baseline = {sweep_s / baseline_s:.2f}x")
    print("PASS" if ok else f"FAIL: {sweep_s:.1f} s >= {BUDGET_S:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
