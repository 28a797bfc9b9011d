"""Benchmark for bamboo-schedule (run directly; not collected by pytest).

    .venv/bin/python tests/benchmarks/bench_schedule.py [--stages 32] [--microbatches 256] [--repeat 3]
    .venv/bin/python tests/benchmarks/bench_schedule.py --overhead [--json]

1. Speed: generating, failing over, validating and simulating a P x M 1F1B/eflb schedule, phase by
   phase, with its ratio against the baseline measured in the same run: the same steps for the
   plain schedule (generate, validate, simulate; no redundancy, no failover). Every run is one cold
   end-to-end pass (the package's caches are cleared first, each step runs once); the fastest of
   --repeat runs is shown, for the job and for the baseline.
2. Figure 10 (paper): with a BERT-like cost profile on 8 stages, the bubble at stage i (no
   redundancy) against the FRC that node i runs for stage i+1, and the share of it hidden.
3. The modes' time overhead per iteration against the same schedule without redundancy.
4. With --overhead only: lflb's and eflb's overhead against its lower bound (`overhead_bound_pct`) over a grid
   of P and M, with the built-in and the BERT-like costs, beside the overhead of the placement the runtime builds
   today (no cost model, no search; `runtime_overhead_pct`).
"""

from __future__ import annotations

import argparse
import json
import os
import time
from collections.abc import Callable
from typing import Any

from bamboo.schedule import generate
from bamboo.schedule.failover import failover_schedule, progress_at, validate_failover
from bamboo.schedule.ir import clear_caches
from bamboo.schedule.simulate import Costs, simulate
from bamboo.schedule.validate import validate

PHASES = [
    ("gen", "generate eflb"),
    ("cut", "failure cut (progress_at)"),
    ("fail", "failover_schedule: remainder (critical path)"),
    ("steady", "failover: steady schedule (next iteration)"),
    ("val", "validate schedule"),
    ("valf", "validate_failover (remainder + steady)"),
    ("sim", "simulate (incl. no-redundancy baseline)"),
]
BASELINE = [("bgen", "generate plain"), ("bval", "validate plain"), ("bsim", "simulate plain")]


def cold() -> None:
    """Forget every cache the package keeps (interned instructions), so each run starts cold."""
    clear_caches()


def timed(times: dict[str, tuple[float, float]], key: str, work: Callable[[], Any]) -> Any:
    """Run ``work`` once; record its (wall, CPU) seconds under ``key``."""
    start, start_cpu = time.perf_counter(), time.process_time()
    result = work()
    times[key] = (time.perf_counter() - start, time.process_time() - start_cpu)
    return result


def end_to_end(stages: int, microbatches: int) -> tuple[dict[str, tuple[float, float]], Any, Any, list[int], int]:
    """One cold run of the whole job, phase by phase: generate, fail over, validate, simulate."""
    times: dict[str, tuple[float, float]] = {}
    cold()
    schedule = timed(times, "gen", lambda: generate("1f1b", stages, microbatches, "eflb"))
    victims = sorted({stages // 3, (2 * stages) // 3})
    index = len(schedule.streams[victims[0]]) // 2
    progress = timed(times, "cut", lambda: progress_at(schedule, dict.fromkeys(victims, index)))
    plan = timed(times, "fail", lambda: failover_schedule(schedule, victims, progress))
    timed(times, "steady", lambda: plan.steady)  # built on first use; validate_failover validates it
    timed(times, "val", lambda: validate(schedule))
    timed(times, "valf", lambda: validate_failover(plan))
    result = timed(times, "sim", lambda: simulate(schedule))
    return times, schedule, result, victims, index


def plain_run(stages: int, microbatches: int) -> tuple[dict[str, tuple[float, float]], Any]:
    """The baseline, cold, in the same process: the plain schedule generated, validated, simulated."""
    times: dict[str, tuple[float, float]] = {}
    cold()
    plain = timed(times, "bgen", lambda: generate("1f1b", stages, microbatches, "none"))
    timed(times, "bval", lambda: validate(plain))
    timed(times, "bsim", lambda: simulate(plain))
    return times, plain


def speed(stages: int, microbatches: int, repeat: int) -> None:
    print(f"== speed: 1f1b P={stages} M={microbatches} (best of {repeat} cold end-to-end runs) ==")
    best: dict[str, tuple[float, float]] | None = None
    best_base: dict[str, tuple[float, float]] | None = None
    for _ in range(repeat):
        times, schedule, result, victims, index = end_to_end(stages, microbatches)
        if best is None or sum(w for w, _ in times.values()) < sum(w for w, _ in best.values()):
            best = times
        base, plain = plain_run(stages, microbatches)
        if best_base is None or sum(w for w, _ in base.values()) < sum(w for w, _ in best_base.values()):
            best_base = base
    assert best is not None and best_base is not None
    total = sum(w for w, _ in best.values())
    cpu_total = sum(c for _, c in best.values())
    baseline = sum(w for w, _ in best_base.values())
    cpu_baseline = sum(c for _, c in best_base.values())
    print(f"  instructions: {len(schedule)} (eflb), {len(plain)} (plain); victims {victims} at index {index}")
    print(f"  {'phase':44} {'wall ms':>9} {'cpu ms':>9}")
    for key, label in PHASES:
        print(f"  {label:44} {best[key][0] * 1000:9.1f} {best[key][1] * 1000:9.1f}")
    print(f"  {'TOTAL generate+failover+validate+simulate':44} {total * 1000:9.1f} {cpu_total * 1000:9.1f}")
    for key, label in BASELINE:
        print(f"  {'  baseline: ' + label:44} {best_base[key][0] * 1000:9.1f} {best_base[key][1] * 1000:9.1f}")
    print(f"  {'baseline: plain generate+validate+simulate':44} {baseline * 1000:9.1f} {cpu_baseline * 1000:9.1f}")
    print(f"  ratio total / baseline: {total / baseline:.2f}x (cpu {cpu_total / cpu_baseline:.2f}x); "
          f"total under 1 s: {total < 1.0}; load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} cpus")
    print(f"  (simulated makespan {result.makespan:.1f} ms, overhead {result.overhead_pct:.1f}%)")


def figure_10(microbatches: int = 32) -> None:
    costs = Costs.bert_like(8)
    result = simulate(generate("1f1b", 8, microbatches, "eflb", costs.linearizer_cost()), costs)
    assert result.baseline_bubble is not None
    print(f"== Figure 10: BERT-like profile, 8 stages, M={microbatches}, eflb ==")
    print("  node  forward(ms)  bubble w/o RC(ms)  FRC for stage+1(ms)  hidden")
    for n in range(8):
        hidden = result.frc_hidden(n)
        print(f"  {n:4}  {costs.stage(n).forward_ms:11.1f}  {result.baseline_bubble[n]:17.1f}  "
              f"{result.frc[n]:19.1f}  {'-' if hidden is None else f'{100 * hidden:5.1f}%'}")
    print(f"  frc_hidden_pct {result.frc_hidden_pct:.1f}%, overhead {result.overhead_pct:.1f}% "
          f"(makespan {result.makespan:.1f} ms vs {result.baseline_makespan:.1f} ms without RC)")


def modes(microbatches: int = 32) -> None:
    costs = Costs.bert_like(8)
    print(f"== time overhead per iteration, BERT-like profile, 8 stages, M={microbatches} ==")
    for rc in ("lflb", "eflb", "efeb"):
        result = simulate(generate("1f1b", 8, microbatches, rc, costs.linearizer_cost()), costs)
        assert result.baseline_makespan is not None
        ratio = result.makespan / result.baseline_makespan
        print(f"  {rc}: {result.makespan:8.1f} ms vs {result.baseline_makespan:8.1f} ms without redundancy "
              f"-> ratio {ratio:.3f} (+{result.overhead_pct:.1f}%)")


def overhead_against_bound() -> list[dict[str, Any]]:
    """The placement's overhead and the least overhead any placement can have (`overhead_bound_pct`), for P in
    {2, 4, 8, 16}, M in {P, 2P, 4P, 8P}, lflb and eflb, with the built-in and the BERT-like costs; and the overhead
    of the placement the runtime builds today (`runtime_overhead_pct`: without a cost model, as
    `bamboo.rc.executor` calls `one_f_one_b`), simulated with the same costs."""
    rows: list[dict[str, Any]] = []
    for profile in ("built-in", "bert_like"):
        for stages in (2, 4, 8, 16):
            costs = Costs() if profile == "built-in" else Costs.bert_like(stages)
            for factor in (1, 2, 4, 8):
                for rc in ("lflb", "eflb"):
                    microbatches = stages * factor
                    result = simulate(generate("1f1b", stages, microbatches, rc, costs.linearizer_cost(), refine=True),
                                      costs)
                    runtime = simulate(generate("1f1b", stages, microbatches, rc), costs)
                    assert result.overhead_pct is not None and result.overhead_bound_pct is not None
                    assert runtime.overhead_pct is not None
                    rows.append({"costs": profile, "stages": stages, "microbatches": microbatches, "rc": rc,
                                 "overhead_pct": round(result.overhead_pct, 2),
                                 "overhead_bound_pct": round(result.overhead_bound_pct, 2),
                                 "points_above_bound": round(result.overhead_pct - result.overhead_bound_pct, 2),
                                 "runtime_overhead_pct": round(runtime.overhead_pct, 2)})
    return rows


def print_overheads(rows: list[dict[str, Any]]) -> None:
    print("== overhead against the bound (simulated, 1f1b): overhead% / bound% (the runtime's placement%) ==")
    for profile in ("built-in", "bert_like"):
        for rc in ("lflb", "eflb"):
            mine = [r for r in rows if r["costs"] == profile and r["rc"] == rc]
            print(f"  {profile} {rc}:")
            for stages in sorted({r["stages"] for r in mine}):
                cells = [f"M={r['microbatches']:<3} {r['overhead_pct']:5.1f} / {r['overhead_bound_pct']:5.1f} "
                         f"({r['runtime_overhead_pct']:5.1f})" for r in mine if r["stages"] == stages]
                print(f"    P={stages:<2} " + "   ".join(cells))
            worst = max(mine, key=lambda r: r["points_above_bound"])
            print(f"    most above the bound: {worst['points_above_bound']:.2f} points "
                  f"(P={worst['stages']}, M={worst['microbatches']})")
            runtime = max(mine, key=lambda r: r["runtime_overhead_pct"] - r["overhead_pct"])
            print(f"    the runtime's placement, most above this one: "
                  f"{runtime['runtime_overhead_pct'] - runtime['overhead_pct']:.2f} points "
                  f"(P={runtime['stages']}, M={runtime['microbatches']})")


def main() -> None:
    parser = argparse.ArgumentParser(description="bamboo-schedule benchmark (speed, Figure 10, mode overheads)")
    parser.add_argument("--stages", type=int, default=32, help="pipeline depth for the speed test (default 32)")
    parser.add_argument("--microbatches", type=int, default=256, help="microbatches for the speed test (default 256)")
    parser.add_argument("--repeat", type=int, default=3, help="cold end-to-end runs, fastest kept (default 3)")
    parser.add_argument("--overhead", action="store_true",
                        help="only the overhead of lflb and eflb against its lower bound over a grid of P and M")
    parser.add_argument("--json", action="store_true", help="with --overhead: print the rows as JSON")
    args = parser.parse_args()
    if args.overhead:
        rows = overhead_against_bound()
        if args.json:
            print(json.dumps(rows))
        else:
            print_overheads(rows)
        return
    speed(args.stages, args.microbatches, args.repeat)
    figure_10()
    modes()


if __name__ == "__main__":
    main()
