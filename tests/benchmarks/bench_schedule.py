"""Benchmark for bamboo-schedule (run directly; not collected by pytest).

    .venv/bin/python tests/benchmarks/bench_schedule.py [--stages 32] [--microbatches 256] [--repeat 3]

1. Speed: generating, failing over, validating and simulating a P x M 1F1B/eflb schedule, phase by
   phase (best of --repeat), with its ratio against the baseline measured in the same run: the
   same steps for the plain schedule (generate, validate, simulate; no redundancy, no failover).
2. Figure 10 (paper): with a BERT-like cost profile on 8 stages, the bubble at stage i (no
   redundancy) against the FRC that node i runs for stage i+1, and the share of it hidden.
3. The modes' time overhead per iteration against the same schedule without redundancy.
"""

from __future__ import annotations

import argparse
import os
import time
from collections.abc import Callable
from typing import Any

from bamboo.schedule import generate
from bamboo.schedule.failover import failover_schedule, progress_at, validate_failover
from bamboo.schedule.simulate import Costs, simulate
from bamboo.schedule.validate import validate

CPU: dict[str, float] = {}


def best_of(repeat: int, work: Callable[[], Any], label: str = "") -> tuple[float, Any]:
    """Best wall-clock time of ``repeat`` runs (and the best CPU time, kept in CPU[label])."""
    best, best_cpu, result = float("inf"), float("inf"), None
    for _ in range(repeat):
        start, start_cpu = time.perf_counter(), time.process_time()
        result = work()
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    CPU[label] = best_cpu
    return best, result


def speed(stages: int, microbatches: int, repeat: int) -> None:
    print(f"== speed: 1f1b P={stages} M={microbatches} (best of {repeat}, wall clock) ==")
    t_gen, schedule = best_of(repeat, lambda: generate("1f1b", stages, microbatches, "eflb"), "gen")
    victims = sorted({stages // 3, (2 * stages) // 3})
    index = len(schedule.streams[victims[0]]) // 2
    t_cut, progress = best_of(repeat, lambda: progress_at(schedule, dict.fromkeys(victims, index)), "cut")
    t_fail, plan = best_of(repeat, lambda: failover_schedule(schedule, victims, progress), "fail")
    t_steady, _ = best_of(repeat, lambda: failover_schedule(schedule, victims, progress).steady, "steady+fail")
    t_steady -= t_fail
    CPU["steady"] = CPU["steady+fail"] - CPU["fail"]
    t_val, _ = best_of(repeat, lambda: validate(schedule), "val")
    _ = plan.steady  # built (and timed) above; validate_failover validates it
    t_valf, _ = best_of(repeat, lambda: validate_failover(plan), "valf")
    t_sim, result = best_of(repeat, lambda: simulate(schedule), "sim")
    total = t_gen + t_cut + t_fail + t_steady + t_val + t_valf + t_sim
    cpu_total = sum(CPU[k] for k in ("gen", "cut", "fail", "steady", "val", "valf", "sim"))
    b_gen, plain = best_of(repeat, lambda: generate("1f1b", stages, microbatches, "none"), "bgen")
    b_val, _ = best_of(repeat, lambda: validate(plain), "bval")
    b_sim, _ = best_of(repeat, lambda: simulate(plain), "bsim")
    baseline = b_gen + b_val + b_sim
    cpu_baseline = CPU["bgen"] + CPU["bval"] + CPU["bsim"]
    print(f"  instructions: {len(schedule)} (eflb), {len(plain)} (plain); victims {victims} at index {index}")
    print(f"  {'phase':42} {'wall ms':>9} {'cpu ms':>9}")
    for label, key, value in [
        ("generate eflb", "gen", t_gen),
        ("failure cut (progress_at)", "cut", t_cut),
        ("failover_schedule: remainder (critical path)", "fail", t_fail),
        ("failover: steady schedule (next iteration)", "steady", t_steady),
        ("validate schedule", "val", t_val),
        ("validate_failover (remainder + steady)", "valf", t_valf),
        ("simulate (incl. no-redundancy baseline)", "sim", t_sim),
    ]:
        print(f"  {label:42} {value * 1000:9.1f} {CPU[key] * 1000:9.1f}")
    print(f"  {'TOTAL generate+failover+validate+simulate':42} {total * 1000:9.1f} {cpu_total * 1000:9.1f}")
    print(f"  {'baseline: plain generate+validate+simulate':42} {baseline * 1000:9.1f} {cpu_baseline * 1000:9.1f}")
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


def main() -> None:
    parser = argparse.ArgumentParser(description="bamboo-schedule benchmark (speed, Figure 10, mode overheads)")
    parser.add_argument("--stages", type=int, default=32, help="pipeline depth for the speed test (default 32)")
    parser.add_argument("--microbatches", type=int, default=256, help="microbatches for the speed test (default 256)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions per phase, best kept (default 3)")
    args = parser.parse_args()
    speed(args.stages, args.microbatches, args.repeat)
    figure_10()
    modes()


if __name__ == "__main__":
    main()
