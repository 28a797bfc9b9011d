"""End to end: a bulk preemption across every zone at once, which no placement can dodge, survived exactly.

6 nodes in three zones (two each) train P=3, D=2, placed zone-aware. The test kills one node in each zone
within milliseconds, the worst pick: in each zone the node that holds the stage the others' kills have
left with the fewest live copies. Whatever the three kills break (failovers, a consecutive failure in a
pipeline, stages left only on shadows), the job goes on: the survivors fail over or meet at the barrier and
re-form from the copies left (peers, shadows, in-memory copies) on the three survivors and the three nodes
the trace adds after the kills. The final parameters equal a fault-free run of the same steps, and the job
ends without an error.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.bench.emulated.run import RunHandles, RunOptions, compare_with_reference, run_cluster
from bamboo.launch.events import Preemption, Reconfiguration, read_events

pytestmark = pytest.mark.timeout(300)

TOLERANCE = 1e-6


def _one_per_zone(layout: object) -> list[str]:
    """One node per zone: stage 0's owner in the first zone, then the holders of the stages it shares copies
    with, so that the three kills take as many copies of one stage as they can."""
    zones = layout.zones  # type: ignore[attr-defined]
    stages = layout.stages  # type: ignore[attr-defined]
    ranks = layout.ranks  # type: ignore[attr-defined]
    chosen: dict[str, str] = {}
    # holders of stage 1: its owners (stage 1) and its shadows (stage 0), in pipeline order
    for node in sorted(ranks, key=lambda n: (ranks[n] % stages not in (0, 1), ranks[n])):
        chosen.setdefault(zones[node], node)
    return list(chosen.values())


def test_one_node_of_every_zone_killed_at_once_is_survived_exactly(
    tmp_path: Path, write_trace: Callable[..., str], finish_when: Callable[..., None],
    until_step: Callable[..., None],
) -> None:
    trace = write_trace(6, [(25_000, "add", "node7"), (25_000, "add", "node8"), (25_000, "add", "node9")])
    options = RunOptions(redundancy="eflb", nodes=6, stages=3, pipelines=2, steps=400, zones=("a", "b", "c"), time_scale=1.0,
                         preemptions=trace, run_dir=str(tmp_path / "run"), confirm_timeout_s=30.0, timeout_s=240.0,
                         group_timeout_s=20.0, size={"layers": 2})
    killed: list[str] = []

    def bulk(handles: RunHandles) -> None:
        from bamboo.launch.coordinator import read_layout

        until_step(handles, 8)
        victims = _one_per_zone(read_layout(handles.membership))
        for node in victims:  # within milliseconds: one SIGKILL after the other
            handles.preempt(node)
        killed.extend(victims)
        finish_when(handles, lambda events: any(isinstance(e, Reconfiguration) for e in events), steps_after=10)

    result = run_cluster(options, during=bulk)
    events = read_events(result.events)
    assert not result.timed_out and result.job_error is None, result.job_error
    bulk_kills = [e for e in events if isinstance(e, Preemption) and e.node in killed]
    assert len(killed) == 3 and {e.zone for e in bulk_kills} == {"a", "b", "c"}
    assert max(e.t for e in bulk_kills) - min(e.t for e in bulk_kills) < 5.0  # confirmed together
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == result.steps_done
    assert comparison["max_relative_diff"] <= TOLERANCE
