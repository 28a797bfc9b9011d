"""End to end: pipelines whose shares of the global batch differ, exact through a failover.

8 nodes (P=2, D=4, 16 microbatches a step, 4 each), and the same with one stage on 4 nodes (the shadow ring). Once training runs, the test SIGKILLs one node: its pipeline
fails over, and the rebuild of redundancy leaves 7 nodes, which hold 3 pipelines of 2 stages, not 4. 16 does not
split evenly over 3, so they train 6, 5 and 5 microbatches a step (`bamboo.reconfig.microbatch_shares`), each
pipeline its own schedule, and the data-parallel sum adds their shares in pipeline order, as the reference does.
Then a node of that layout is killed too, so a pipeline of an uneven layout fails over (every node plans every
pipeline's failover from that pipeline's own schedule). The result is exact against a fault-free run.

With one stage, a node of the ring takes the lost node's share over, whatever its length, and the ring adds the
shares in share order. Before uneven shares, the same loss left 2 pipelines of 8 and the spare nodes on standby
(and before that, ended the job with ``JobCannotContinue: cannot keep the global batch of 16 microbatches over 3
pipelines``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.bench.emulated.run import RunHandles, RunOptions, compare_with_reference, run_cluster
from bamboo.launch.events import Failover, Reconfiguration, Step, read_events

pytestmark = pytest.mark.timeout(300)


def _reached(handles: RunHandles, step: int) -> None:
    deadline = time.monotonic() + 120.0
    while max((e.step for e in read_events(handles.events) if isinstance(e, Step)), default=0) < step:
        assert time.monotonic() < deadline, f"training never reached step {step}"
        time.sleep(0.02)


@pytest.mark.parametrize("stages", [2, 1])
def test_three_pipelines_of_six_five_and_five_microbatches_fail_over_and_stay_exact(
    tmp_path: Path, finish_when: Callable[..., None], stages: int,
) -> None:
    last = stages - 1
    killed: list[str] = []

    def kill_then_kill_in_the_uneven_layout(handles: RunHandles) -> None:
        _reached(handles, 5)
        first = handles.node_of_rank[stages * 3 + last]  # the last stage of pipeline 3
        handles.cluster.kill(first)
        killed.append(first)
        deadline = time.monotonic() + 120.0
        while not any(isinstance(e, Reconfiguration) and e.pipelines == 3 for e in read_events(handles.events)):
            assert time.monotonic() < deadline, "no reconfiguration to 3 pipelines"
            time.sleep(0.02)
        from bamboo.launch.coordinator import read_layout

        layout = read_layout(handles.membership)
        assert layout is not None and layout.plan.microbatches == (6, 5, 5)
        reached = max(e.step for e in read_events(handles.events) if isinstance(e, Step))
        _reached(handles, reached + 3)
        second = layout.node_of_rank[stages * 1 + last]  # the last stage of pipeline 1, whose share is 5
        handles.cluster.kill(second)
        killed.append(second)
        finish_when(handles, lambda events: sum(isinstance(e, Failover) for e in events) >= 2)

    options = RunOptions(redundancy="lflb", nodes=4 * stages, stages=stages, pipelines=4, steps=300, zones=("a", "b", "c"),
                         time_scale=1.0, run_dir=str(tmp_path / "run"), timeout_s=240.0, group_timeout_s=20.0,
                         size={"layers": 2})
    result = run_cluster(options, during=kill_then_kill_in_the_uneven_layout)
    events = read_events(result.events)
    assert len(killed) == 2 and not result.timed_out
    assert sorted(f.victim for f in events if isinstance(f, Failover)) == sorted(killed)
    assert any(isinstance(e, Reconfiguration) and e.pipelines == 3 for e in events)
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == result.steps_done
    assert comparison["max_relative_diff"] == 0.0
