"""Benchmark of bamboo-reconfig: planning time at 1,024 nodes, and a replay of the paper's EC2 p3 trace.

Run: ``.venv/bin/python tests/benchmarks/bench_reconfig.py`` (not collected by pytest).

Part 1 plans clusters of 1,024 nodes in several shapes: a first layout, then the re-plan after a whole
zone and 5% of the rest are preempted. It times ``decide``, ``plan_layout`` and ``plan_transfers``
(median of repeats) and prints, measured in the same run:

- the planning time against a 1 s budget, and against a naive planner (fill the slots with the usable
  nodes in id order, split the layers evenly by count, no zone or reuse awareness) timed alongside;
- the same-zone neighbours of our layout against the naive planner's;
- the bytes our transfer plan moves against the naive transfer plan (every new owner fetches all).

Part 2 replays ``/work/shared/traces/bamboo/p3-trace.csv`` (add/remove events of up to 32 EC2 p3 spot
instances over ~11 h) with P = 4, D = 8, zones assigned round-robin by node number (the trace has no
zones), and reports the decisions, the reconfigurations, checkpoint restores and bytes moved.
"""

from __future__ import annotations

import argparse
import itertools
import json
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from bamboo.reconfig import (
    ClusterView,
    LayerSpec,
    Layout,
    Node,
    NodeState,
    When,
    decide,
    plan_layout,
    plan_transfers,
    same_zone_pairs,
)
from bamboo.reconfig.layout_plan import microbatch_shares, pipeline_count

TRACE = Path("/work/shared/traces/bamboo/p3-trace.csv")
BUDGET_S = 1.0
#: A GPT-like model: 48 layers, 50 M parameters each (fp32), Adam state 2x, slightly uneven compute.
LAYERS = tuple(LayerSpec(200_000_000, 400_000_000, 1.0 + 0.25 * (i % 4 == 3)) for i in range(48))


def median_time(function: Callable[[], Any], repeats: int) -> tuple[float, Any]:
    times = []
    result = None
    for _ in range(repeats):
        start = time.perf_counter()
        result = function()
        times.append(time.perf_counter() - start)
    return statistics.median(times), result


def naive_fill(view: ClusterView) -> Layout:
    """The baseline planner: usable nodes in id order fill the slots; layers split evenly by count."""
    usable = [node.id for node in view.usable_nodes]
    stages = view.target_stages
    rings = pipeline_count(len(usable), stages, view.target_pipelines, view.global_batch)
    count = len(view.layers)
    edges = [round(s * count / stages) for s in range(stages + 1)]
    zones = {node.id: node.zone for node in view.nodes}
    owners = [usable[d * stages:(d + 1) * stages] for d in range(rings)]
    return Layout(
        stages=stages,
        layers=view.layers,
        stage_layers=list(itertools.pairwise(edges)),
        owners=owners,
        microbatches=microbatch_shares(view.global_batch, rings),
        standby=usable[rings * stages:],
        same_zone_neighbours=sum(same_zone_pairs([zones[n] for n in row]) for row in owners),
    )


def bench_planning(repeats: int, say: Callable[[str], None] = print) -> tuple[bool, list[dict[str, Any]]]:
    """Plan each shape of 1,024 nodes; whether every re-plan is within the budget, and one row per shape."""
    say(f"== planning 1,024 nodes (median of {repeats}; budget {BUDGET_S:.1f} s) ==")
    say(f"{'P x D':>9} {'zones':>5} | {'decide':>8} {'layout':>8} {'re-plan':>8} {'transfer':>8} "
        f"{'total':>8} {'naive':>8} {'x naive':>7} {'x budget':>8} | {'same-zone':>13} | {'bytes moved':>17}")
    ok = True
    rows: list[dict[str, Any]] = []
    rng = random.Random(2023)
    for stages, pipelines, zone_weights in [
        (8, 128, {"a": 4, "b": 3, "c": 2, "d": 1}),
        (16, 64, {"a": 1, "b": 1, "c": 1}),
        (32, 32, {"a": 3, "b": 2, "c": 2, "d": 1, "e": 1, "f": 1}),
        (4, 256, {"a": 2, "b": 1}),
    ]:
        names = sorted(zone_weights)
        zones = rng.choices(names, weights=[zone_weights[z] for z in names], k=1024)
        nodes = [Node(f"node{i:04d}", zones[i], "active") for i in range(1024)]
        first = ClusterView(nodes=nodes, target_stages=stages, target_pipelines=pipelines, global_batch=1024,
                            layers=LAYERS)
        layout = plan_layout(first)
        lost_zone = names[-1]
        victims = {n.id for n in nodes if n.zone == lost_zone}
        others = sorted({n.id for n in nodes} - victims)
        victims |= set(rng.sample(others, len(others) // 20))
        after_nodes = [attrs.evolve(n, state=NodeState.PREEMPTED) if n.id in victims else n for n in nodes]
        after = ClusterView(nodes=after_nodes, target_stages=stages, target_pipelines=pipelines, global_batch=1024,
                            layers=LAYERS, layout=layout)
        survivors = [n.id for n in after.usable_nodes]

        t_decide, decision = median_time(lambda after=after: decide(after), repeats)
        t_first, _ = median_time(lambda first=first: plan_layout(first), repeats)
        t_replan, new = median_time(lambda after=after: plan_layout(after), repeats)
        t_transfer, plan = median_time(
            lambda layout=layout, new=new, survivors=survivors: plan_transfers(layout, new, survivors), repeats)
        t_naive, naive = median_time(lambda after=after: naive_fill(after), repeats)
        total = t_decide + t_replan + t_transfer
        ok &= total < BUDGET_S and decision.when is not When.CARRY_ON
        moved = "restore" if plan.restore_from_checkpoint else f"{plan.bytes_moved / plan.naive_bytes:6.1%} of naive"
        say(f"{stages:>3} x {pipelines:<3} {len(zone_weights):>5} | {t_decide * 1e3:6.1f}ms {t_first * 1e3:6.1f}ms "
            f"{t_replan * 1e3:6.1f}ms {t_transfer * 1e3:6.1f}ms {total * 1e3:6.1f}ms {t_naive * 1e3:6.1f}ms "
            f"{total / t_naive:6.1f}x {total / BUDGET_S:7.1%} | {new.same_zone_neighbours:>5} vs "
            f"{naive.same_zone_neighbours:>5} | {moved:>17}")
        rows.append({"stages": stages, "pipelines": pipelines, "zones": len(zone_weights),
                     "decide_ms": round(t_decide * 1e3, 2), "first_layout_ms": round(t_first * 1e3, 2),
                     "replan_ms": round(t_replan * 1e3, 2), "transfers_ms": round(t_transfer * 1e3, 2),
                     "total_ms": round(total * 1e3, 2), "naive_ms": round(t_naive * 1e3, 2),
                     "total_over_naive": round(total / t_naive, 2), "total_over_budget": round(total / BUDGET_S, 4),
                     "same_zone_neighbours": new.same_zone_neighbours,
                     "naive_same_zone_neighbours": naive.same_zone_neighbours,
                     "bytes_over_naive": None if plan.restore_from_checkpoint
                     else round(plan.bytes_moved / plan.naive_bytes, 4)})
    say("(total = decide + re-plan + transfers after the loss; 'x naive' = total / naive fill time;"
        " same-zone = ours vs naive fill)")
    return ok, rows


def read_trace(path: Path) -> list[tuple[int, str, str]]:
    events = []
    for line in path.read_text().splitlines():
        if line.strip():
            ms, event, name = line.split(",")
            events.append((int(ms), event, name))
    return events


def replay_trace(path: Path, stages: int, pipelines: int, zones: str,
                 say: Callable[[str], None] = print) -> dict[str, Any]:
    """Replay the trace through decide, plan_layout and plan_transfers; what it decided and moved."""
    say(f"\n== replay of {path.name}: P={stages}, D={pipelines}, zones {', '.join(zones)} (round-robin) ==")
    events = read_trace(path)
    by_time: dict[int, list[tuple[str, str]]] = {}
    for ms, event, name in events:
        by_time.setdefault(ms, []).append((event, name))
    nodes: dict[str, Node] = {}
    layout: Layout | None = None
    reasons: Counter[str] = Counter()
    whens: Counter[str] = Counter()
    restores = moved = naive = 0
    plan_times: list[float] = []
    for ms in sorted(by_time):
        for event, name in by_time[ms]:
            if event == "add":
                zone = zones[int(name.removeprefix("node")) % len(zones)]
                nodes[name] = Node(name, zone, "joining")
            elif name in nodes:
                nodes[name] = attrs.evolve(nodes[name], state=NodeState.PREEMPTED)
        view = ClusterView(nodes=list(nodes.values()), target_stages=stages, target_pipelines=pipelines,
                           global_batch=8 * pipelines, layers=LAYERS, layout=layout)
        start = time.perf_counter()
        decision = decide(view)
        whens[decision.when.value] += 1
        if decision.when is When.CARRY_ON:
            plan_times.append(time.perf_counter() - start)
            continue
        reasons[decision.reason.value] += 1
        new = plan_layout(view)
        if layout is not None:
            plan = plan_transfers(layout, new, [n.id for n in view.usable_nodes])
            if plan.restore_from_checkpoint:
                restores += 1
            else:
                moved += plan.bytes_moved
                naive += plan.naive_bytes
        plan_times.append(time.perf_counter() - start)
        placed = {node for row in new.owners for node in row}
        nodes = {
            n.id: attrs.evolve(n, state=NodeState.ACTIVE if n.id in placed else NodeState.STANDBY)
            for n in nodes.values() if n.state.alive
        }
        layout = new if new.num_pipelines else None
    say(f"{len(events)} events at {len(by_time)} instants; decisions: "
        + ", ".join(f"{k} {v}" for k, v in sorted(whens.items())))
    say("reconfigurations by reason: " + ", ".join(f"{k} {v}" for k, v in sorted(reasons.items())))
    ratio = f"{moved / naive:.1%}" if naive else "n/a"
    say(f"checkpoint restores: {restores}; bytes moved {moved / 2**30:.1f} GiB vs naive {naive / 2**30:.1f} GiB "
        f"({ratio}); planning per instant: median {statistics.median(plan_times) * 1e3:.2f} ms, "
        f"max {max(plan_times) * 1e3:.2f} ms")
    return {"trace": path.name, "stages": stages, "pipelines": pipelines, "events": len(events),
            "instants": len(by_time), "decisions": dict(sorted(whens.items())),
            "reconfigurations_by_reason": dict(sorted(reasons.items())), "checkpoint_restores": restores,
            "bytes_moved_gib": round(moved / 2**30, 2), "naive_bytes_gib": round(naive / 2**30, 2),
            "bytes_over_naive": round(moved / naive, 4) if naive else None,
            "plan_p50_ms": round(statistics.median(plan_times) * 1e3, 3),
            "plan_max_ms": round(max(plan_times) * 1e3, 3)}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Benchmark bamboo-reconfig planning (1,024 nodes) and replay "
                                     "the EC2 p3 spot trace.")
    parser.add_argument("--repeats", type=int, default=5, help="timed repeats per measurement (median is printed)")
    parser.add_argument("--trace", type=Path, default=TRACE, help="the add/remove event trace to replay")
    parser.add_argument("--json", action="store_true", help="print only the JSON report: the planning rows, the "
                        "replay's figures and whether every re-plan was within the budget")
    args = parser.parse_args(argv)
    say: Callable[[str], None] = (lambda line: None) if args.json else print
    ok, rows = bench_planning(args.repeats, say)
    replay = None
    if args.trace.exists():
        replay = replay_trace(args.trace, stages=4, pipelines=8, zones="abc", say=say)
    else:
        say(f"\n(trace {args.trace} not found; replay skipped)")
    say(f"\nresult: {'PASS' if ok else 'FAIL'}: every 1,024-node re-plan within {BUDGET_S:.1f} s")
    if args.json:
        print(json.dumps({"budget_s": BUDGET_S, "within_budget": ok, "planning": rows, "replay": replay}))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
