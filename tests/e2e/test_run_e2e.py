"""End to end: `bamboo-launch run`'s engine on an emulated cluster, with real kills, a real etcd and real gloo.

Each test runs `run_cluster` (an embedded etcd, one agent process per node that spawns a bamboo-rc
worker, the spot market replaying a scripted trace) and checks the final parameters against a
fault-free single-process run of the same steps (`compare_with_reference`, 1e-6 relative).

The layout is bamboo-reconfig's zone-aware placement, deterministic for a given set of nodes and
zones: with 8 nodes in zones a,b,c (node i in zone i mod 3), P=4, D=2, pipeline 0 is
node0 node1 node3 node2 and pipeline 1 is node4 node6 node7 node5. Trace node K (from 1) is the
launcher's node K-1.

Two nodes of different pipelines killed at the same instant: `test_same_instant_e2e.py`.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bamboo.bench.emulated.run import RunHandles, RunOptions, compare_with_reference, run_cluster
from bamboo.bench.emulated.run_results import market_billing
from bamboo.launch.events import Failover, Join, Preemption, Reconfiguration, read_events
from bamboo.rc.model import GPTSize, gpt_layer_specs, stage_bounds
from bamboo.reconfig import JobLayout

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-6


def _options(tmp_path: Path, **changes: object) -> RunOptions:
    base: dict[str, object] = {
        "nodes": 4, "stages": 2, "pipelines": 2, "steps": 30, "zones": ("a", "b", "c"), "time_scale": 1.0,
        "redundancy": "eflb",
        "run_dir": str(tmp_path / "run"), "confirm_timeout_s": 30.0, "timeout_s": 240.0,
        "group_timeout_s": 20.0,  # a survivor stuck on a dead peer's transfer gives up after 20 s
        "size": {"layers": 2},  # 4 layers: the smallest model that P=4 can split, and the cheapest step
    }
    base.update(changes)
    return RunOptions(**base)  # type: ignore[arg-type]


def _failovers(events: Path) -> list[Failover]:
    return [event for event in read_events(events) if isinstance(event, Failover)]


def test_an_etcd_restart_and_an_agent_stopped_shorter_than_the_grace_period_fail_nothing_over(tmp_path: Path) -> None:
    """Two outages that must cost no failover, one after the other in one run: the embedded etcd SIGKILLed
    and restarted 1 s later, then a node's agent SIGSTOPped for 1 s (below the 2 s grace period and lease)."""
    outages: dict[str, float] = {}

    def restart_etcd_then_pause_an_agent(handles: RunHandles) -> None:
        time.sleep(0.3)
        handles.etcd.kill()
        outages["etcd killed"] = time.monotonic()
        time.sleep(1.0)
        handles.etcd.restart()
        outages["etcd restarted"] = time.monotonic()
        time.sleep(0.5)
        agent = handles.cluster.processes[handles.node_of_rank[1]].pid  # the node's agent (its group leader)
        os.kill(agent, signal.SIGSTOP)
        outages["agent stopped"] = time.monotonic()
        time.sleep(1.0)
        os.kill(agent, signal.SIGCONT)
        outages["agent resumed"] = time.monotonic()

    options = _options(tmp_path, steps=60)
    result = run_cluster(options, during=restart_etcd_then_pause_an_agent)
    assert "agent resumed" in outages, f"the run ended before both outages were over: {outages}"
    assert result.failed_ranks == () and not result.timed_out
    # the plan is what runs: the stage bounds of the layout in etcd are the layers every executor built
    layout = JobLayout.from_json((result.run_dir / "layout.json").read_text())
    assert layout.stage_bounds == stage_bounds(gpt_layer_specs(GPTSize(layers=2)), 2)
    for report in result.reports.values():
        built = {int(stage): list(indices) for stage, indices in report["slice_layers"].items()}
        assert built == {stage: list(range(*layout.stage_bounds[stage])) for stage in built}, report["node"]
    assert all(code == 0 for code in result.exit_codes.values()), result.exit_codes
    assert _failovers(result.events) == []
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == 60
    assert comparison["max_relative_diff"] <= TOLERANCE


def test_kills_consecutive_pair_join_and_reconfigurations_match_a_fault_free_run(
    tmp_path: Path, write_trace: Callable[[int, list[tuple[int, str, str]]], str],
    wait_for_layout: Callable[..., Any], finish_when: Callable[..., None],
    assert_preempted: Callable[..., None],
) -> None:
    """The acceptance run: 3 real kills (one a consecutive pair), a join, reconfigurations, exact result.

    1. trace: node8 joins (standby: its worker starts warm and waits for a role); once it is warm, the
       test kills node1 (stage 1 of pipeline 0); its shadow fails over;
    2. at a step boundary `decide` sees a degraded pipeline and a waiting warm node: generation 1 puts the
       joiner in, moving layers over gloo;
    3. the test kills stages 2 and 3 of pipeline 1 of generation 1 together (a consecutive pair):
       the survivors reconfigure from the surviving copies into one pipeline of 8 microbatches
       (the global batch unchanged), the surplus on standby; no checkpoint is restored;
    4. five steps later the test asks the job to finish (`bamboo-launch finish`).
    """
    trace = write_trace(8, [(600, "add", "node9")])
    killed_pair: list[str] = []

    def kill_node1_then_a_consecutive_pair(handles: RunHandles) -> None:
        deadline = time.monotonic() + 120.0
        while handles.membership.get_decision("warm-node8") is None:
            assert time.monotonic() < deadline, "the joiner's worker never got warm"
            time.sleep(0.05)
        handles.preempt("node1")
        layout = wait_for_layout(handles, 1, 120.0)
        ranks = layout.node_of_rank
        while not any(isinstance(e, Reconfiguration) for e in read_events(handles.events)):
            assert time.monotonic() < deadline, "generation 1 never finished its transfers"
            time.sleep(0.05)
        time.sleep(1.0)  # let generation 1 train a few steps
        pair = [ranks[6], ranks[7]]  # stages 2 and 3 of pipeline 1
        killed_pair.extend(pair)
        for node in pair:
            handles.preempt(node)
        finish_when(handles, lambda events: any(isinstance(e, Reconfiguration) and e.reason == "consecutive failure"
                                                for e in events))

    options = _options(tmp_path, nodes=8, stages=4, steps=600, preemptions=trace)
    result = run_cluster(options, during=kill_node1_then_a_consecutive_pair)
    events = read_events(result.events)
    assert len(killed_pair) == 2
    assert set(result.failed_nodes) == {"node1", *killed_pair}
    assert_preempted(events, {"node1", *killed_pair})
    assert "node8" in {e.node for e in events if isinstance(e, Join)}
    billed = market_billing(result.run_dir, events)  # the report bills each machine from its start to its kill
    assert billed is not None
    assert {e.node for e in billed if isinstance(e, Preemption)} == {"node1", *killed_pair}
    assert {e.node for e in billed if isinstance(e, Join)} == {f"node{k}" for k in range(9)}
    reconfigurations = [e for e in events if isinstance(e, Reconfiguration)]
    assert len(reconfigurations) >= 2, reconfigurations
    assert reconfigurations[0].pipelines == 2 and reconfigurations[0].bytes_moved > 0
    assert any(e.reason == "consecutive failure" and e.pipelines == 1 and e.standby == 2 for e in reconfigurations)
    assert [f.victim for f in _failovers(result.events)] == ["node1"]
    assert not result.timed_out
    assert result.steps_done < 600 and sorted(result.reports) == [0, 1, 2, 3]  # finished once it played out
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == result.steps_done
    assert comparison["max_relative_diff"] <= TOLERANCE
