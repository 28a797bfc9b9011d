"""End to end: ``--redundancy auto`` changes the mode at a reconfiguration boundary, and the run stays exact.

3 nodes, P=2, D=1 (one warm on standby), ``--preemption-rate 0``: with no preemption expected nothing pays for
redundancy, so the coordinator's first layout names ``none``. The test kills the node of stage 1 at step 5.
Without a shadow nothing fails over: the survivor stops on the lost peer and meets the others at the barrier in
its warm process (none registers afresh). No other pipeline holds stage 1, and the run keeps no copy (no in-memory
copies, a checkpoint every 4,000 steps), so the next layout starts over from the seeded initial state and trains
the first steps again. That layout counts the job's own ``preemption`` record (one in a few node-seconds, weighed
against the prior's node-hour at 0: about one an hour), at which a redundant mode pays: without one, a loss in a
layout of one pipeline would redo half of the job. The new generation trains with it, its owners building their
successor's replica. The final parameters equal a fault-free single-process run of the same steps. (With D = 2
the lost stage's data-parallel peer holds it, and a loss without redundancy costs a barrier: ``auto`` then keeps
``none`` at this rate.)
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.bench.emulated.run import RunHandles, RunOptions, compare_with_reference, run_cluster
from bamboo.bench.value import compute_report
from bamboo.launch.events import Failover, Join, Reconfiguration, RedundancyChoice, Restore, Step, read_events

pytestmark = pytest.mark.timeout(240)

TOLERANCE = 1e-6


def test_auto_starts_without_redundancy_and_takes_it_up_after_a_kill_exactly(
    tmp_path: Path, write_trace: Callable[..., str], finish_when: Callable[..., None],
    until_step: Callable[..., None],
) -> None:
    options = RunOptions(nodes=3, stages=2, pipelines=1, steps=4000, zones=("a", "b", "c"), time_scale=1.0,
                         preemptions=write_trace(3, []), run_dir=str(tmp_path / "run"), confirm_timeout_s=30.0,
                         timeout_s=200.0, group_timeout_s=20.0, size={"layers": 2}, redundancy="auto",
                         preemption_rate=0.0, checkpoint_every=4000, memory_copy_every=0)

    def kill_at_step_5(handles: RunHandles) -> None:
        until_step(handles, 5)
        handles.preempt(handles.node_of_rank[1])
        finish_when(handles, lambda events: any(isinstance(e, RedundancyChoice) and e.generation > 0 for e in events))

    result = run_cluster(options, during=kill_at_step_5)
    assert not result.timed_out and result.job_error is None
    events = read_events(result.events)
    choices = {e.generation: e for e in events if isinstance(e, RedundancyChoice)}
    assert choices[0].mode == "none" and choices[0].preemptions_per_node_hour == 0.0, choices[0]
    later = choices[max(choices)]
    assert later.generation > 0 and later.mode != "none", later
    assert later.preemptions_per_node_hour > 0.5  # the job's own preemption, seen from its records
    assert not any(isinstance(e, Failover) for e in events)  # no shadow under none: a barrier, not a failover
    [restore] = [e for e in events if isinstance(e, Restore)]  # no copy of stage 1 anywhere: from the start
    assert restore.source == "initial" and restore.lost_stages == "1" and restore.step == 0, restore
    assert not any(isinstance(e, Join) and e.returns for e in events)  # every survivor kept its worker
    barriers = [e for e in events if isinstance(e, Reconfiguration)]
    assert [e.reason for e in barriers] == ["failure without redundancy"], barriers
    assert barriers[0].generation == later.generation
    trained = {e.generation for e in events if isinstance(e, Step)}
    assert {0, later.generation} <= trained
    report = compute_report(events)
    assert report.redundancy_mode == later.mode and report.redundancy_reason.startswith(f"{later.mode} (auto")
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == result.steps_done
    assert comparison["max_relative_diff"] <= TOLERANCE
