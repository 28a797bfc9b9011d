"""End to end: a reconfiguration prepared while training goes on (make before break).

4 nodes train P=2, D=2 and a fifth waits on standby. The test kills the node of stage 1 of pipeline 0: its
shadow takes the stage over (a failover), and ``decide`` wants a reconfiguration at the next step boundary
(the shadow carries two stages, and a warm node waits). The lowest live rank prepares the next layout
(``g0-prepare``) instead of stopping: every node of it builds its part in the background, and the test hook
``BAMBOO_LAUNCH_TEST_PREPARE_PAUSE_S`` holds each of them 4 s once built, as a slow joiner would be. The
step counter advances all that time. Once every node of the new layout is built, the stop switches to it at
one step boundary: the pause counts no decision and no group build, only the switch (the state transfer,
the barrier of the switch and the first step). The result equals a fault-free run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.bench.emulated.run import RunHandles, RunOptions, compare_with_reference, run_cluster
from bamboo.launch.events import Reconfiguration, Step, read_events
from bamboo.launch.prepare import PREPARE_PAUSE_ENV
from bamboo.launch.records import PreparedLayout, StopDecision

pytestmark = pytest.mark.timeout(240)

TOLERANCE = 1e-6
PAUSE_S = 4.0


def test_training_goes_on_while_the_next_layout_is_prepared_and_the_switch_is_exact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write_trace: Callable[..., str],
    finish_when: Callable[..., None], until_step: Callable[..., None],
) -> None:
    monkeypatch.setenv(PREPARE_PAUSE_ENV, str(PAUSE_S))  # the agents' workers inherit it
    options = RunOptions(redundancy="eflb", nodes=5, stages=2, pipelines=2, steps=400, zones=("a", "b", "c"), time_scale=1.0,
                         preemptions=write_trace(5, []), run_dir=str(tmp_path / "run"), confirm_timeout_s=30.0,
                         timeout_s=200.0, group_timeout_s=20.0, size={"layers": 2})
    seen: dict[str, object] = {}

    def kill_then_watch(handles: RunHandles) -> None:
        until_step(handles, 5)
        handles.preempt(handles.node_of_rank[1])
        deadline = time.monotonic() + 120.0
        while not any(isinstance(e, Reconfiguration) for e in read_events(handles.events)):
            assert time.monotonic() < deadline, "the prepared layout never started"
            time.sleep(0.05)
        seen["prepare"] = handles.membership.get_decision("g0-prepare").value
        seen["stop"] = handles.membership.get_decision("g0-stop").value
        finish_when(handles, lambda events: True)

    result = run_cluster(options, during=kill_then_watch)
    events = read_events(result.events)
    assert not result.timed_out and result.job_error is None
    prepared = PreparedLayout.from_dict(seen["prepare"])
    stop = StopDecision.from_dict(seen["stop"])
    assert prepared.layout is not None and stop.attempt == 0 and stop.at is not None
    planned_at = float(prepared.layout["barrier_unix"])
    created = json.loads((result.run_dir / "spec.json").read_text())["created_unix"]
    during = [e for e in events if isinstance(e, Step) and planned_at < created + e.t < stop.at]
    assert len(during) >= 3, f"only {len(during)} steps while the next layout was prepared ({PAUSE_S} s)"
    assert stop.step >= prepared.layout["start_step"] + 3  # steps trained between the plan and the switch
    [reconfiguration] = [e for e in events if isinstance(e, Reconfiguration)]
    assert reconfiguration.prepared and reconfiguration.generation == 1 and reconfiguration.bytes_moved > 0
    assert reconfiguration.decide_s == 0.0 and reconfiguration.group_builds_s == 0.0
    assert reconfiguration.duration_s < PAUSE_S  # the 4 s of preparation are not in the pause
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == result.steps_done
    assert comparison["max_relative_diff"] <= TOLERANCE
