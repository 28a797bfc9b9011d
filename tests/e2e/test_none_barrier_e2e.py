"""End to end: under ``--redundancy none`` a failure is a barrier, and a stage no survivor holds comes back from a
keeper's memory, in the survivors' warm workers.

4 nodes in three zones, P=2 stages, D=1 pipeline, 2 nodes on standby, no redundancy: no node holds its
successor's replica, so nothing fails over. Every step the host of each stage sends a copy of it to keepers in
other zones, standby nodes first (``bamboo.launch.memcopy``). The test kills the node of stage 1 at step 8. The
node of stage 0 stops on the lost peer and goes to the barrier with its stage at the step it was training, in the
same worker process (before, the worker ended and its agent registered the node afresh, whose new worker spent
its imports before the restart could use it). The next layout finds stage 1 missing, and every stage restarts
from the newest step that live nodes keep in memory. The final parameters equal a fault-free single-process run
of the same steps (bound 1e-6 relative).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.bench.emulated.run import RunHandles, RunOptions, compare_with_reference, run_cluster
from bamboo.launch.events import Failover, Join, Reconfiguration, Restore, read_events
from bamboo.launch.memcopy import read_indexes

pytestmark = pytest.mark.timeout(240)

TOLERANCE = 1e-6


def a_recent_step_is_kept_for_both_stages(handles: RunHandles, deadline_s: float = 60.0) -> None:
    """Wait until a node other than stage 1's host keeps stage 1 at a step that stage 0's host keeps too, and will
    still keep after one more step (within one step of its newest copy): the step the restore should find."""
    host0, host1, job = handles.node_of_rank[0], handles.node_of_rank[1], handles.membership.keys.job
    deadline = time.monotonic() + deadline_s
    while True:
        indexes = read_indexes(handles.membership.kv, job)
        kept = {k for node, index in indexes.items() if node != host1 for k in index.copies.get(1, {})}
        own = indexes[host0].copies.get(0, {}) if host0 in indexes else {}
        common = kept & set(own)
        if common and max(common) >= max(own) - 1:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"no recent step of stage 1 kept by another node within {deadline_s} s: "
                                 f"stage 1 kept elsewhere at {sorted(kept)}, stage 0 at {sorted(own)} on its host")
        time.sleep(0.02)


def test_a_stage_lost_without_redundancy_restores_from_memory_at_the_barrier_in_warm_workers(
    tmp_path: Path, finish_when: Callable[..., None], until_step: Callable[..., None]
) -> None:
    options = RunOptions(
        nodes=4, stages=2, pipelines=1, steps=300, zones=("a", "b", "c"), time_scale=1.0,
        run_dir=str(tmp_path / "run"), checkpoint_every=50, memory_copy_every=1, confirm_timeout_s=30.0,
        timeout_s=200.0, group_timeout_s=20.0, size={"layers": 2}, redundancy="none",
    )
    killed: list[str] = []

    def kill_stage_1_at_step_8(handles: RunHandles) -> None:
        until_step(handles, 8)
        # The scenario's premise: another node keeps stage 1 at a step that stage 0's host keeps too. Copies go out
        # in the background and a host keeps its 3 newest steps: under a loaded make test the keepers' copies lagged
        # by more than that twice, and the restore found no step kept for every stage (it restarted from step 0).
        a_recent_step_is_kept_for_both_stages(handles)
        killed.append(handles.node_of_rank[1])
        handles.preempt(killed[0])
        finish_when(handles, lambda events: any(isinstance(e, Restore) for e in events))

    result = run_cluster(options, during=kill_stage_1_at_step_8)
    assert not result.timed_out and result.job_error is None
    events = read_events(result.events)
    assert not any(isinstance(e, Failover) for e in events)
    assert not any(isinstance(e, Join) and e.returns for e in events)  # the survivor kept its worker
    [reconfiguration] = [e for e in events if isinstance(e, Reconfiguration)]
    assert reconfiguration.reason == "failure without redundancy", reconfiguration
    [restore] = [e for e in events if isinstance(e, Restore)]
    assert restore.source == "memory" and restore.lost_stages == "1", restore
    assert restore.duration_s == reconfiguration.duration_s
    comparison = compare_with_reference(result, options)
    assert comparison["history"] == [[0, 1], [restore.step, 1]]
    assert comparison["steps"] == result.steps_done
    assert comparison["max_relative_diff"] <= TOLERANCE
