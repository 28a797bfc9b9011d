"""Benchmark: restore points chosen by Young's rule (`--checkpoint-every auto`, the default) against a fixed
interval of 10 steps, the former default, in the same run.

Run: ``.venv/bin/python tests/benchmarks/bench_restore_points.py [--pairs N] [--steps N] [--churn] [--json OUT.json]``
(not collected by pytest; about 45 s a run on 2 cores, two runs a pair).

Each pair is two ``bamboo-launch run --verify --json`` of the same job (6 nodes, P = 3, D = 2, the example GPT,
exec'd workers), one after the other: ``auto`` (the defaults) and ``fixed`` (``--checkpoint-every 10
--memory-copy-every 10``). Without ``--churn`` nothing fails, so what the restore points cost is all there is
to see; with it the runs replay bench_churn.py's heavy-synthetic trace (``--preemptions synthetic:0.5 --hours 24
--seed 2 --time-scale 240``), where a longer interval also redoes more steps at a restore. For each run it prints
the throughput over the training window, the steps' share of the window, the intervals the layouts chose (their
``restore_every``, from the ``redundancy_choice`` records' reasons), what a restore point cost (the step interval
that held one less the median of the others, from the ``step`` records) and the steps redone at restores, and,
for each pair, ``auto``'s throughput over ``fixed``'s; then the median ratio.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

NODES, STAGES, PIPELINES = 6, 3, 2
FIXED = ["--checkpoint-every", "10", "--memory-copy-every", "10"]
CHURN = ["--preemptions", "synthetic:0.5", "--hours", "24", "--seed", "2", "--time-scale", "240"]


def launch(run_dir: Path, flags: list[str], steps: int, timeout_s: float) -> dict[str, Any]:
    """One ``bamboo-launch run`` of the job; its JSON report (``error`` when it printed none)."""
    command = [sys.executable, "-m", "bamboo.launch", "run", "--nodes", str(NODES), "--stages", str(STAGES),
               "--pipelines", str(PIPELINES), "--steps", str(steps), "--run-dir", str(run_dir), "--no-live", "--json",
               "--verify", "--no-fork-server", "--timeout", str(timeout_s), *flags]
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        return {"error": f"status {done.returncode}: {(done.stderr.strip().splitlines() or ['no output'])[-1]}"}
    return json.loads(lines[-1])


def restore_points(run_dir: Path) -> dict[str, Any]:
    """What the run's event log says of its restore points: the intervals chosen, a point's measured cost, the
    steps redone at restores."""
    from bamboo.launch.events import RedundancyChoice, Restore, Step, read_events
    from bamboo.launch.restore_interval import measured_boundary

    events = read_events(run_dir / "events.jsonl")
    chosen = sorted({int(found.group(1)) for e in events if isinstance(e, RedundancyChoice)
                     for found in [re.search(r"restore points every (\d+) steps", e.reason)] if found})
    cost = measured_boundary(events)
    taken = sorted({e.step for e in events if isinstance(e, Step) and e.restore_point})
    return {"intervals": chosen, "points_taken": len(taken),
            "point_cost_s": None if cost is None else cost.cost_s,
            "step_interval_s": None if cost is None else cost.step_s,
            "redone_steps": sum(e.discarded_steps for e in events if isinstance(e, Restore))}


def measure(kind: str, run_dir: Path, steps: int, churn: bool, timeout_s: float) -> dict[str, Any]:
    started = time.monotonic()
    report = launch(run_dir, (FIXED if kind == "fixed" else []) + (CHURN if churn else []), steps, timeout_s)
    result: dict[str, Any] = {"kind": kind, "wall_s": time.monotonic() - started}
    if "window_throughput" not in report:
        return {**result, "error": report.get("error") or report.get("job_error") or "no report"}
    return {**result, "throughput": report["window_throughput"], "step_share": report["step_share"],
            "preemptions": report.get("preemptions", 0), "verify": report.get("verify"),
            **restore_points(run_dir)}


def line(result: dict[str, Any]) -> str:
    if "error" in result:
        return f"  {result['kind']:<6} FAILED: {result['error']}"
    cost = "-" if result["point_cost_s"] is None else f"{1000 * result['point_cost_s']:.0f} ms"
    return (f"  {result['kind']:<6} {result['throughput']:7.1f} samples/s  steps' share {100 * result['step_share']:.1f}%"
            f"  intervals {result['intervals'] or '-'}  {result['points_taken']} points, each {cost}"
            f"  {result['preemptions']} preemptions, {result['redone_steps']} steps redone  verify {result['verify']}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--pairs", type=int, default=2, help="pairs of runs, auto then fixed (default 2)")
    parser.add_argument("--steps", type=int, default=400, help="steps of each run (default 400)")
    parser.add_argument("--churn", action="store_true", help="replay bench_churn.py's heavy-synthetic trace "
                        "(default: no preemptions)")
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds each run may take (default 900)")
    parser.add_argument("--work-dir", default=None, help="where the runs go (default: a new temp dir)")
    parser.add_argument("--json", default=None, metavar="OUT.json", help="also write the results as JSON here")
    args = parser.parse_args()
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-restore-points-"))
    print(f"bench_restore_points: runs in {work}; {'heavy-synthetic churn' if args.churn else 'no preemptions'}, "
          f"{args.steps} steps, {args.pairs} pair(s)", flush=True)
    pairs = []
    for index in range(args.pairs):
        pair = {kind: measure(kind, work / f"{kind}{index}", args.steps, args.churn, args.timeout)
                for kind in ("auto", "fixed")}
        ok = all("error" not in r for r in pair.values())
        ratio = pair["auto"]["throughput"] / pair["fixed"]["throughput"] if ok else None
        pairs.append({**pair, "ratio": ratio})
        print(f"pair {index + 1}:" + (f" auto / fixed = {ratio:.3f}" if ratio is not None else " failed"))
        for result in pair.values():
            print(line(result), flush=True)
    ratios = [p["ratio"] for p in pairs if p["ratio"] is not None]
    summary = {"median_ratio": statistics.median(ratios) if ratios else None, "ratios": ratios,
               "exact": all(r.get("verify") == "PASSED" for p in pairs for r in (p["auto"], p["fixed"]))}
    print(f"\nauto's throughput over fixed's: median {summary['median_ratio']:.3f} over {len(ratios)} pair(s) "
          f"({', '.join(f'{r:.3f}' for r in ratios)}); every run exact: {summary['exact']}"
          if ratios else "\nno pair completed")
    if args.json:
        Path(args.json).write_text(json.dumps({"pairs": pairs, "summary": summary, "churn": args.churn}, indent=1))


if __name__ == "__main__":
    main()
