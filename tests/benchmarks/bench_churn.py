"""Benchmark: the time lost to churn, on heavy synthetic churn and on real multi-zone spot traces.

Run: ``.venv/bin/python tests/benchmarks/bench_churn.py [--runs NAME,...] [--steps N] [--json OUT.json]``
(not collected by pytest; about 5 minutes per run on 2 cores, more under load).

Each run is one ``bamboo-launch run --verify --json`` (P = 3, D = 2, the example GPT) on a preemption trace
replayed against real processes, and one run of the same job on P x D on-demand nodes without preemptions is
measured in the same invocation, for the value comparison. The runs:

- ``heavy-synthetic``: the paper's synthetic model at a preemption probability of 0.5 per node-hour over 24
  hours, at x240 (``--preemptions synthetic:0.5 --hours 24 --seed 2 --time-scale 240``), 6 nodes;
- ``synthetic-bulk``: the same model (seed 0) with a bulk preemption across every zone every 2 trace hours
  (one node in each zone, 10 ms apart, as real traces show: no placement can dodge it), 6 nodes, x240;
- ``skypilot-aws``: SkyPilot's 3-zone AWS V100 preemption trace (``../shared/traces/skypilot-spot-traces/
  preemption/4-node/aws-08-03-2023``, up to 4 nodes per zone), capped at 8 nodes, x240;
- ``ec2-p3``: the Bamboo paper's EC2 p3 trace (``../shared/traces/bamboo/p3-trace.csv``), capped at 8
  nodes, its nodes spread round-robin over 3 zones, x240;
- ``gcp-pair``: the Bamboo paper's two GCP count logs (``../shared/traces/bamboo/v100x1-east1c.txt`` and
  ``a100x1-east1b.txt``, 30 to 80 and 17 to 64 instances, drops of up to 40 at once), one zone each, each from
  its own first row, their counts scaled to at most 4 nodes a zone (a drop of 40 of 80 takes 2 of 4 at once:
  GCP's bulk preemptions within a zone), x240.

A capped trace asks for N machines: it keeps an addition while fewer than N of its machines live, and the
removals of the machines it kept. Traces are converted into the generic CSV format in the benchmark's work
folder (never into the repository).

For each run it prints the steps' share of the training window (first step to last), the start-up, each
reconfiguration's pause with its parts (waiting for nodes, decide, barrier, transfers, group builds, first step;
``prepared`` when it was built while the old layout trained), each restore's pause and source (a peer's memory, or
disk), the value (samples/s per $/h over the training window, at $0.918/h spot and $3.06/h on demand) against the
on-demand run's, and whether the final parameters equal the fault-free run's (``--verify``). Then one
reconfiguration (7 nodes, one on standby; the node of stage 1 of pipeline 0 killed at step 10, the standby node
put in), before make before break (``BAMBOO_LAUNCH_BREAK_BEFORE_MAKE=1``: decided and built at the barrier)
and after (prepared while training goes on), with each pause broken down. The goals of issue 34 close the
table: reconfiguration pause p50 <= 0.5 s and max <= 2 s, a restore after every live copy
of a stage is lost from a peer's memory in <= 1 s, and >= 85% of the window in steps.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SHARED = Path("/work/shared/traces")
SKYPILOT = SHARED / "skypilot-spot-traces" / "preemption" / "4-node" / "aws-08-03-2023"
EC2_P3 = SHARED / "bamboo" / "p3-trace.csv"
GCP_LOGS = (SHARED / "bamboo" / "v100x1-east1c.txt", SHARED / "bamboo" / "a100x1-east1b.txt")
GCP_NODES_PER_ZONE = 4
STAGES, PIPELINES = 3, 2
SPOT_PRICE, ON_DEMAND_PRICE = 0.918, 3.06
RUNS = ("heavy-synthetic", "synthetic-bulk", "skypilot-aws", "ec2-p3", "gcp-pair")
ONE_NODES = STAGES * PIPELINES + 1
GOAL_PAUSE_P50_S, GOAL_PAUSE_MAX_S, GOAL_RESTORE_S, GOAL_SHARE = 0.5, 2.0, 1.0, 0.85


def capped(events: list[Any], cap: int) -> list[tuple[float, str, str, str]]:
    """``(time_s, add|remove, node, zone)`` of a trace that asks for ``cap`` machines (see the module docstring)."""
    kept: set[str] = set()
    out = []
    for event in sorted(events, key=lambda e: (e.time_s, e.kind.value != "remove")):
        kind = event.kind.value
        if kind == "add" and len(kept) < cap:
            kept.add(event.node)
            out.append((event.time_s, kind, event.node, event.zone))
        elif kind == "remove" and event.node in kept:
            kept.discard(event.node)
            out.append((event.time_s, kind, event.node, event.zone))
    return out


def with_bulk(events: list[Any], every_s: float, back_after_s: float) -> list[tuple[float, str, str, str]]:
    """The synthetic trace plus a bulk preemption across every zone every ``every_s`` seconds (one live node of
    each zone, 10 ms apart), each victim replaced in its zone ``back_after_s`` later."""
    rows = sorted(((e.time_s, e.kind.value, e.node, e.zone) for e in events), key=lambda r: (r[0], r[1] != "remove"))
    zones = sorted({row[3] for row in rows})
    horizon = max(row[0] for row in rows)
    bulks = [every_s * k for k in range(1, int(horizon // every_s) + 1)]
    alive: dict[str, str] = {}
    out: list[tuple[float, str, str, str]] = []
    removed: set[str] = set()
    spare = 0
    for time_s, kind, node, zone in rows:
        while bulks and bulks[0] <= time_s:
            at = bulks.pop(0)
            for index, victim_zone in enumerate(zones):
                victims = sorted(n for n, z in alive.items() if z == victim_zone)
                if victims:
                    del alive[victims[0]]
                    removed.add(victims[0])
                    out.append((at + 0.01 * index, "remove", victims[0], victim_zone))
                    spare += 1
                    out.append((at + back_after_s, "add", f"bulk{spare}", victim_zone))
        if kind == "add":
            alive[node] = zone
            out.append((time_s, kind, node, zone))
        elif node not in removed:
            alive.pop(node, None)
            out.append((time_s, kind, node, zone))
    return sorted(out, key=lambda r: (r[0], r[1] != "remove"))


def scaled_counts(trace: Any, cap: int, zone: str, work: Path) -> list[tuple[float, str, str, str]]:
    """The events of a one-zone count trace whose counts are scaled to at most ``cap`` nodes (rounded), read back
    through bamboo-bench's loader as an ``x,y`` count curve (a rise adds nodes ``<zone>-<i>``, a drop removes the
    newest)."""
    from bamboo.bench.loaders import load_count_curve

    times, counts = trace.alive_series()
    peak = max(int(counts.max()), 1)
    curve = work / f"{zone}-scaled-counts.csv"
    curve.write_text("".join(f"{t!r},{round(c * cap / peak)}\n" for t, c in zip(times.tolist(), counts.tolist(),
                                                                               strict=True)))
    return [(e.time_s, e.kind.value, e.node, e.zone) for e in load_count_curve(curve, time_unit_s=1.0, zone=zone)]


def write_csv(rows: list[tuple[float, str, str, str]], path: Path) -> str:
    lines = ["time_s,event,node,zone"] + [f"{t!r},{kind},{node},{zone}" for t, kind, node, zone in rows]
    path.write_text("\n".join(lines) + "\n")
    return str(path)


def trace_of(name: str, work: Path) -> tuple[str, list[str]]:
    """The ``--preemptions`` value of run ``name`` and the run's other trace flags."""
    from bamboo.bench.loaders import load_gcp_counts, load_skypilot_counts, load_trace
    from bamboo.bench.synthetic import SyntheticSpec, generate_trace

    if name == "heavy-synthetic":
        return "synthetic:0.5", ["--hours", "24", "--seed", "2", "--time-scale", "240", "--nodes", "6"]
    if name == "synthetic-bulk":
        trace = generate_trace(SyntheticSpec(preemption_probability=0.5, desired_nodes=6, zones=3), 24.0, 0)
        rows = with_bulk(list(trace.events()), every_s=2 * 3600.0, back_after_s=0.25 * 3600.0)
        return write_csv(rows, work / "synthetic-bulk.csv"), ["--time-scale", "240", "--nodes", "6"]
    if name == "skypilot-aws":
        trace = load_skypilot_counts(sorted(SKYPILOT.glob("*.json")))
        return write_csv(capped(list(trace.events()), 8), work / "skypilot-aws.csv"), ["--time-scale", "240",
                                                                                       "--nodes", "8"]
    if name == "ec2-p3":
        events = capped(list(load_trace(EC2_P3).events()), 8)
        zones: dict[str, str] = {}
        rows = [(t, kind, node, zones.setdefault(node, "abc"[len(zones) % 3])) for t, kind, node, _ in events]
        return write_csv(rows, work / "ec2-p3.csv"), ["--time-scale", "240", "--nodes", "8"]
    if name == "gcp-pair":
        rows = [row for path in GCP_LOGS
                for row in scaled_counts(load_gcp_counts(path), GCP_NODES_PER_ZONE, path.stem.split("-")[1], work)]
        return write_csv(sorted(rows, key=lambda r: (r[0], r[1] != "remove")), work / "gcp-pair.csv"), [
            "--time-scale", "240", "--nodes", str(2 * GCP_NODES_PER_ZONE)]
    raise ValueError(f"unknown run {name!r}; the runs are {', '.join(RUNS)}")


def launch(name: str, flags: list[str], work: Path, timeout_s: float) -> tuple[dict[str, Any], Path, float]:
    """One ``bamboo-launch run`` (its JSON report, its run dir, its wall time)."""
    run_dir = work / name
    command = [sys.executable, "-m", "bamboo.launch", "run", "--stages", str(STAGES), "--pipelines", str(PIPELINES),
               "--run-dir", str(run_dir), "--no-live", "--json", "--timeout", str(timeout_s), "--no-fork-server", *flags]
    started = time.monotonic()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.monotonic() - started
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    if not lines:
        tail = (done.stderr.strip().splitlines() or ["no output"])[-1]
        return {"error": f"status {done.returncode}: {tail}"}, run_dir, wall
    return json.loads(lines[-1]), run_dir, wall


def pauses_of(run_dir: Path) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Each reconfiguration (pause and parts) and each restore (pause, source, steps redone) of a run."""
    from bamboo.launch.events import Reconfiguration, Restore, read_events

    reconfigurations: list[dict[str, Any]] = []
    restores: list[dict[str, Any]] = []
    for event in read_events(run_dir / "events.jsonl"):
        if isinstance(event, Reconfiguration):
            reconfigurations.append({"reason": event.reason, "pause_s": event.duration_s, "prepared": event.prepared,
                                     "restore": False, "nodes_s": event.nodes_s,
                                     "decide_s": event.decide_s, "barrier_s": event.barrier_s,
                                     "transfers_s": event.transfers_s, "group_builds_s": event.group_builds_s,
                                     "first_step_s": event.first_step_s, "attempts": event.attempts})
        elif isinstance(event, Restore):  # written right after the reconfiguration that restored
            if reconfigurations:
                reconfigurations[-1]["restore"] = True
            restores.append({"pause_s": event.duration_s, "source": event.source or "disk", "step": event.step,
                             "redone_steps": event.discarded_steps, "lost_stages": event.lost_stages})
    return reconfigurations, restores


def measure(name: str, steps: int, work: Path, timeout_s: float, on_demand_value: float) -> dict[str, Any]:
    preemptions, flags = trace_of(name, work)
    report, run_dir, wall = launch(name, ["--preemptions", preemptions, "--steps", str(steps), "--verify", *flags],
                                   work, timeout_s)
    result: dict[str, Any] = {"run": name, "wall_s": wall}
    if "error" in report or "window_throughput" not in report:
        return {**result, "error": report.get("error") or report.get("job_error") or "no report"}
    reconfigurations, restores = pauses_of(run_dir)
    value = (report["window_throughput"] or 0.0) / (report["avg_nodes"] * SPOT_PRICE)
    return {**result, "steps": report["steps"], "preemptions": report["preemptions"],
            "failovers": report["failovers"], "step_share": report["step_share"], "startup_s": report["startup_s"],
            "reconfigurations": reconfigurations, "restores": restores, "value": value,
            "on_demand_value": on_demand_value, "value_vs_on_demand": value / on_demand_value,
            "verify": report.get("verify"), "max_relative_diff": report.get("max_relative_diff"),
            "job_error": report.get("job_error")}


def on_demand(steps: int, work: Path, timeout_s: float) -> dict[str, Any]:
    """The same job on P x D on-demand nodes, no preemptions: its window throughput and value."""
    report, _, wall = launch("on-demand", ["--nodes", str(STAGES * PIPELINES), "--steps", str(steps)], work, timeout_s)
    if "window_throughput" not in report:
        raise SystemExit(f"bench_churn: the on-demand run failed: {report.get('error') or report}")
    value = report["window_throughput"] / (STAGES * PIPELINES * ON_DEMAND_PRICE)
    return {"steps": report["steps"], "wall_s": wall, "window_throughput": report["window_throughput"],
            "step_share": report["step_share"], "startup_s": report["startup_s"], "value": value}


def one_reconfiguration(work: Path, before: bool, timeout_s: float) -> dict[str, Any]:
    """One reconfiguration, on 7 nodes (one on standby, warm): the node of stage 1 of pipeline 0 is killed at step
    10, its shadow fails over, and the next layout puts the standby node in. ``before``: as before make before
    break (the nodes stop at the barrier and decide and build there); else prepared while training goes on.
    Returns its ``reconfiguration`` record and whether the run was exact."""
    from bamboo.bench.emulated.run import RunOptions, compare_with_reference, run_cluster
    from bamboo.launch.events import Reconfiguration, read_events
    from bamboo.launch.prepare import BREAK_BEFORE_MAKE_ENV

    name = f"one-reconfiguration-{'before' if before else 'after'}"
    work.mkdir(parents=True, exist_ok=True)
    trace = work / f"{name}.csv"
    trace.write_text("".join(f"0,add,node{k}\n" for k in range(1, ONE_NODES + 1)))
    options = RunOptions(redundancy="eflb", nodes=ONE_NODES, stages=STAGES, pipelines=PIPELINES, steps=400, zones=("a", "b", "c"),
                         time_scale=1.0, preemptions=str(trace), run_dir=str(work / name), timeout_s=timeout_s,
                         fork_server=False)  # exec'd, as on real machines: start-ups pay their imports

    def scenario(handles: Any) -> None:
        while handles.step() < 10 or handles.membership.get_decision(f"warm-node{ONE_NODES - 1}") is None:
            time.sleep(0.05)
        handles.preempt(handles.node_of_rank[1])
        while not any(isinstance(e, Reconfiguration) for e in read_events(handles.events)):
            time.sleep(0.05)
        target = handles.step() + 5
        while handles.step() < target:
            time.sleep(0.05)
        handles.finish()

    os.environ[BREAK_BEFORE_MAKE_ENV] = "1" if before else "0"  # the agents' workers inherit it
    try:
        result = run_cluster(options, during=scenario)
    finally:
        os.environ.pop(BREAK_BEFORE_MAKE_ENV, None)
    [record] = [e for e in read_events(result.events) if isinstance(e, Reconfiguration)][:1]
    diff = compare_with_reference(result, options)["max_relative_diff"]
    return {"mode": "before (barrier)" if before else "after (prepared)", "pause_s": record.duration_s,
            "prepared": record.prepared, "nodes_s": record.nodes_s, "decide_s": record.decide_s,
            "barrier_s": record.barrier_s, "transfers_s": record.transfers_s, "group_builds_s": record.group_builds_s,
            "first_step_s": record.first_step_s, "bytes_moved": record.bytes_moved, "max_relative_diff": diff}


def print_one(items: list[dict[str, Any]]) -> None:
    print("\none reconfiguration (P=3, D=2, a failover then a standby node put in), before and after:")
    print("| mode | pause | decide | barrier | transfers | group builds | first step | exact |\n|---|---|---|---|---|---|---|---|")
    for item in items:
        print(f"| {item['mode']} | {item['pause_s']:.2f} s | {item['decide_s'] or 0:.2f} | {item['barrier_s'] or 0:.2f} | "
              f"{item['transfers_s'] or 0:.2f} | {item['group_builds_s'] or 0:.2f} | {item['first_step_s'] or 0:.2f} | "
              f"{'yes' if item['max_relative_diff'] <= 1e-6 else 'NO'} |")


def _seconds(values: list[float]) -> str:
    return ", ".join(f"{v:.2f}" for v in values) or "-"


def print_run(result: dict[str, Any]) -> None:
    if "error" in result:
        print(f"\n{result['run']}: FAILED: {result['error']}")
        return
    print(f"\n{result['run']}: {result['steps']} steps in {result['wall_s']:.0f} s, {result['preemptions']} "
          f"preemptions, {result['failovers']} failovers; verify {result['verify']} "
          f"(max relative diff {result['max_relative_diff']})")
    print(f"  steps' share of the window  {100 * result['step_share']:.1f}%   start-up {result['startup_s']:.1f} s")
    print(f"  value                       {result['value']:.3f} samples/s per $/h, on-demand "
          f"{result['on_demand_value']:.3f}: {result['value_vs_on_demand']:.2f}x")
    print("  reconfiguration pauses (s)  total  nodes  decide barrier transfers groups first-step")
    for item in result["reconfigurations"]:
        kind = "restore" if item["restore"] else "prepared" if item["prepared"] else "barrier"
        print(f"    {kind:<26}{item['pause_s']:6.2f} {item['nodes_s'] or 0:6.2f} "
              f"{item['decide_s'] or 0:7.2f} {item['barrier_s'] or 0:7.2f} {item['transfers_s'] or 0:9.2f} "
              f"{item['group_builds_s'] or 0:6.2f} {item['first_step_s'] or 0:10.2f}  {item['reason'][:40]}")
    for item in result["restores"]:
        print(f"  restore                     {item['pause_s'] or 0:.2f} s from {item['source']} (step {item['step']}, "
              f"stage(s) {item['lost_stages']} lost, {item['redone_steps']} steps redone)")


def goals(results: list[dict[str, Any]]) -> dict[str, Any]:
    done = [r for r in results if "error" not in r]
    pauses = [p["pause_s"] for r in done for p in r["reconfigurations"] if not p["restore"]]
    memory = [q["pause_s"] for r in done for q in r["restores"] if q["source"] == "memory"]
    return {
        "reconfiguration_pause_p50_s": statistics.median(pauses) if pauses else None,
        "reconfiguration_pause_max_s": max(pauses) if pauses else None,
        "restores_from_memory_s": memory,
        "restores_from_disk": sum(q["source"] == "disk" for r in done for q in r["restores"]),
        "step_share": {r["run"]: r["step_share"] for r in done},
        "exact": {r["run"]: r["verify"] == "PASSED" for r in results if "error" not in r},
        "failed": [r["run"] for r in results if "error" in r],
    }


def print_goals(summary: dict[str, Any]) -> None:
    p50, most = summary["reconfiguration_pause_p50_s"], summary["reconfiguration_pause_max_s"]
    print("\n| measure | measured | goal |\n|---|---|---|")
    print(f"| reconfiguration pause, p50 / max (restores apart) | {p50 if p50 is None else f'{p50:.2f}'} / "
          f"{most if most is None else f'{most:.2f}'} s | <= {GOAL_PAUSE_P50_S} / <= {GOAL_PAUSE_MAX_S} s |")
    print(f"| restore after every live copy of a stage is lost | from memory: {_seconds(summary['restores_from_memory_s'])} s;"
          f" {summary['restores_from_disk']} from disk | from a peer's memory, <= {GOAL_RESTORE_S} s |")
    shares = "; ".join(f"{run} {100 * share:.1f}%" for run, share in summary["step_share"].items())
    print(f"| steps' share of the window under heavy churn | {shares} | >= {100 * GOAL_SHARE:.0f}% |")
    exact = ", ".join(f"{run} {'exact' if ok else 'NOT exact'}" for run, ok in summary["exact"].items())
    print(f"| final parameters against the fault-free run | {exact} | exact |")
    if summary["failed"]:
        print(f"| runs that failed | {', '.join(summary['failed'])} | none |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", default=",".join(RUNS), help=f"comma-separated runs (default: {','.join(RUNS)})")
    parser.add_argument("--steps", type=int, default=400, help="steps of each churn run (default 400)")
    parser.add_argument("--on-demand-steps", type=int, default=150, help="steps of the on-demand run (default 150)")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds each run may take (default 1800)")
    parser.add_argument("--work-dir", default=None, help="where the runs and traces go (default: a new temp dir)")
    parser.add_argument("--one", type=int, default=1, help="repeats of the one-reconfiguration comparison, before "
                        "and after make before break (0: none; default 1)")
    parser.add_argument("--json", default=None, metavar="OUT.json", help="also write the results as JSON here")
    args = parser.parse_args()
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    work = Path(args.work_dir or tempfile.mkdtemp(prefix="bench-churn-"))
    work.mkdir(parents=True, exist_ok=True)
    print(f"bench_churn: runs in {work}; the on-demand run first ({args.on_demand_steps} steps)", flush=True)
    reference = on_demand(args.on_demand_steps, work, args.timeout)
    print(f"on-demand: {reference['window_throughput']:.2f} samples/s over the window, value {reference['value']:.3f}",
          flush=True)
    results = []
    for name in [item for item in args.runs.split(",") if item]:
        print(f"bench_churn: {name} ...", flush=True)
        results.append(measure(name, args.steps, work, args.timeout, reference["value"]))
        print_run(results[-1])
    one = []
    for repeat in range(args.one):
        print(f"bench_churn: one reconfiguration, before and after ({repeat + 1} of {args.one}) ...", flush=True)
        one += [one_reconfiguration(work / f"one-{repeat}", before, args.timeout) for before in (True, False)]
    if one:
        print_one(one)
    summary = goals(results)
    print_goals(summary)
    if args.json:
        Path(args.json).write_text(json.dumps({"on_demand": reference, "runs": results, "one_reconfiguration": one,
                                               "goals": summary}, indent=1))


if __name__ == "__main__":
    main()
