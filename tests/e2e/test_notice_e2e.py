"""End to end: a preemption notice in `bamboo-launch run` is a hand-over at a step boundary, not a failover.

4 nodes (P=2, D=2). The trace removes node1 (stage 1 of pipeline 0) with 3 s of notice (`--notice 3`): the
market sends its agent SIGTERM 3 s before the SIGKILL. The agent publishes the notice; the worker hands the
deadline to the runtime, which, since the deadline leaves time for a step, hands the stage over to its
shadow after the next step: no backward pass is recomputed, no work is lost, and no failover happens. The
neighbours apply the hand-over at that boundary, the node leaves before the kill, and the result is exact.
Once redundancy is rebuilt without it, the test asks the job to finish (`bamboo-launch finish`): the job
ends early, at a step every node reached, and the reference trains that many steps.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.bench.emulated.run import RunOptions, compare_with_reference, run_cluster
from bamboo.launch.events import Failover, Preemption, Reconfiguration, Step, read_events

pytestmark = pytest.mark.timeout(300)


def test_a_node_with_notice_hands_over_at_a_step_boundary_and_nothing_is_lost(
    tmp_path: Path, write_trace: Callable[[int, list[tuple[int, str, str]]], str],
    finish_when: Callable[..., None],
) -> None:
    trace = write_trace(4, [(4000, "remove", "node2")])  # trace node2 is the launcher's node1
    options = RunOptions(redundancy="eflb", nodes=4, stages=2, pipelines=2, steps=1000, zones=("a", "b", "c"), time_scale=1.0,
                         preemptions=trace, notice_s=3.0, run_dir=str(tmp_path / "run"), timeout_s=240.0,
                         size={"layers": 2})
    # once redundancy is rebuilt without the node, the job is asked to finish (`bamboo-launch finish`)
    result = run_cluster(options, during=lambda handles: finish_when(
        handles, lambda events: any(isinstance(e, Reconfiguration) for e in events)))
    events = read_events(result.events)
    assert not [e for e in events if isinstance(e, Failover)], "a notice of 3 s must not end in a failover"
    [left] = [e for e in events if isinstance(e, Preemption)]
    assert left.node == "node1" and left.notice_s > 0.5, left
    assert any(isinstance(e, Reconfiguration) for e in events)  # redundancy rebuilt without it
    logs = (result.run_dir / "logs" / "node1.log").read_text()
    assert "handed stage 1 of pipeline 0 over to its shadow" in logs
    # it ended where it was asked to, well before its 1000 steps, every node at the same step
    assert not result.timed_out and result.steps_done < 1000
    rebuilt = next(e for e in events if isinstance(e, Reconfiguration))
    assert sum(isinstance(e, Step) and e.t > rebuilt.t for e in events) >= 5  # it trained on after the rebuild
    assert {report["steps_done"] for report in result.reports.values()} == {result.steps_done}
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == result.steps_done
    assert comparison["max_relative_diff"] <= 1e-6
