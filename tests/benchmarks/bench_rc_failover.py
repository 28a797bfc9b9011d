"""Benchmark: the pause of a failover, for lflb, eflb and efeb, against the fault-free iteration.

Run: `.venv/bin/python tests/benchmarks/bench_rc_failover.py` (`--help` for the flags). Not
collected by pytest.

For each mode it runs `verify` (P=4, D=1) with the example model, kills stage 1 with SIGKILL at a
forward-phase and at a backward-phase instruction of step 2, and measures on the victim's shadow:
- detection: from the kill (the victim records the time just before it kills itself) to the
  confirmed failure on the shadow;
- re-routing: from the confirmation to the first instruction of the merged schedule (progress
  agreement, failover plan, groups of the new epoch);
- BRC: time the shadow spent in the recovery's FR, SI and BR instructions;
- the rest of the failed iteration.
The pauses (kill -> first merged instruction, kill -> end of the iteration) are printed against
the median fault-free iteration time measured in the same run (the shadow's other iterations).
"lost" is what the failure cost: the failed iteration's duration minus that fault-free iteration
(kill -> end counts the iteration's remaining ordinary work too, which a fault-free run also does).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics

os.environ.setdefault("DS_ACCELERATOR", "cpu")

from bamboo.rc.faults import KillPoint
from bamboo.rc.model import GPTSize
from bamboo.rc.timeouts import CommTimeouts
from bamboo.rc.verify import DEFAULT_CONFIG, run_verify


def measure(mode: str, where: str, size: GPTSize, micro_batches: int, steps: int) -> dict[str, float]:
    config = {**DEFAULT_CONFIG, "gradient_accumulation_steps": micro_batches}
    kill_step = steps - 2
    result = run_verify(4, 1, steps, mode, size=size, config=config, kills=(KillPoint(1, 0, where, kill_step),),
                        timeouts=CommTimeouts(group=60, build=60, confirm=30), deadline_s=600)
    if not result.passed:
        raise SystemExit(f"bench_rc_failover: {mode} kill at {where} did not match the reference: {result}")
    killed_at = result.kill_times[1]
    shadow = result.timings[0]
    failover = next(f for f in shadow["failovers"] if f.own_pipeline)
    normal = [end - start for i, (start, end) in enumerate(shadow["iteration_times"]) if i not in (0, kill_step)]
    iteration = statistics.median(normal)
    kinds = failover.recovery_kinds
    brc = sum(kinds.get(k, 0.0) for k in ("FR", "SI", "BR"))
    detection = failover.confirmed_at - killed_at
    rerouting = failover.resumed_at - failover.confirmed_at
    to_end = failover.iteration_end - killed_at
    failed_start, failed_end = shadow["iteration_times"][kill_step]
    return {
        "iteration_s": iteration, "to_merged_s": failover.resumed_at - killed_at, "to_end_s": to_end,
        "detection_s": detection, "rerouting_s": rerouting, "brc_s": brc,
        "rest_s": to_end - detection - rerouting - brc,
        "lost_s": (failed_end - failed_start) - iteration,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=3, help="runs per mode and kill point (default 3)")
    parser.add_argument("--micro-batches", type=int, default=8, help="microbatches per step, M (default 8)")
    parser.add_argument("--steps", type=int, default=5, help="steps per run; the kill is in step steps-2 (default 5)")
    parser.add_argument("--width", type=int, default=128, help="model width (default 128)")
    parser.add_argument("--layers", type=int, default=6, help="decoder blocks (default 6)")
    parser.add_argument("--sequence", type=int, default=64, help="bytes per sample (default 64)")
    parser.add_argument("--json", action="store_true", help="print only the JSON report: one object per mode and "
                        "kill point, the medians in ms and their ratios to the fault-free iteration")
    args = parser.parse_args()
    if args.steps < 4:
        parser.error(f"--steps must be at least 4, got {args.steps}")
    size = GPTSize(layers=args.layers, width=args.width, heads=4, sequence=args.sequence)
    points = {"forward phase (1F3)": "1F3", "backward phase (1B2)": "1B2"}
    say = (lambda line: None) if args.json else (lambda line: print(line, flush=True))
    say(f"P=4 D=1 M={args.micro_batches}, model {size}, victim stage 1, {args.repeats} runs each (medians)")
    say(f"{'mode':<6} {'kill':<22} {'iter ms':>8} {'->merged ms':>12} {'/iter':>6} {'->end ms':>9} {'/iter':>6} "
        f"{'detect':>7} {'reroute':>8} {'BRC':>7} {'rest':>7} {'lost ms':>8} {'/iter':>6}")
    rows = []
    for mode in ("lflb", "eflb", "efeb"):
        for label, where in points.items():
            runs = [measure(mode, where, size, args.micro_batches, args.steps) for _ in range(args.repeats)]
            m = {key: statistics.median(r[key] for r in runs) * 1e3 for key in runs[0]}
            say(f"{mode:<6} {label:<22} {m['iteration_s']:>8.1f} {m['to_merged_s']:>12.1f} "
                f"{m['to_merged_s'] / m['iteration_s']:>6.2f} {m['to_end_s']:>9.1f} {m['to_end_s'] / m['iteration_s']:>6.2f} "
                f"{m['detection_s']:>7.1f} {m['rerouting_s']:>8.1f} {m['brc_s']:>7.1f} {m['rest_s']:>7.1f} "
                f"{m['lost_s']:>8.1f} {m['lost_s'] / m['iteration_s']:>6.2f}")
            rows.append({"mode": mode, "kill": where, **{key.removesuffix("_s") + "_ms": round(value, 2)
                                                         for key, value in m.items()},
                         "to_merged_per_iteration": round(m["to_merged_s"] / m["iteration_s"], 3),
                         "to_end_per_iteration": round(m["to_end_s"] / m["iteration_s"], 3),
                         "lost_per_iteration": round(m["lost_s"] / m["iteration_s"], 3)})
    if args.json:
        print(json.dumps(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
