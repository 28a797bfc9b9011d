"""End to end: a node lost before the job's first step.

5 nodes (P=2, D=2, one on standby). As soon as the first layout (generation 0) is in etcd, the test
SIGKILLs the node of stage 1 of pipeline 0, while the workers are still starting: its peers wait for it in
their first gloo groups. The first layout is started as an attempt like any reconfiguration, so the other
nodes see the node leave the membership, abandon generation 0 and redo its start without it, on the four
warm nodes left: generation 1, two pipelines again, from the same initial state (no step was trained).
The run must then train every step, and exactly: the same parameters as a fault-free run.

The workers run the built-in example through a script that holds each worker before it starts training
until the test has killed the node: the kill always lands before the first step, however fast the
workers start (timed against the start alone, it once landed after the first step in ``make test``).

Before the first layout became an attempt, the peers waited out the group timeout (60 s) and the job
failed; a starved agent whose 2 s lease expired during the start did the same in a ``make test`` run.
"""

from __future__ import annotations

import textwrap
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from bamboo.bench.emulated.run import RunHandles, RunOptions, compare_with_reference, run_cluster
from bamboo.launch.events import Reconfiguration, read_events

pytestmark = pytest.mark.timeout(240)

GATED_EXAMPLE = """
    import os, sys, time
    from pathlib import Path

    import bamboo.launch
    from bamboo.launch.example import EXAMPLE_CONFIG, example_program

    if __name__ == "__main__":
        if os.environ.get("BAMBOO_SCRIPT_MODE") == "worker":
            while not Path(sys.argv[1]).exists():  # held until the test has killed a node of the first layout
                time.sleep(0.02)
        program = example_program({"layers": 2}, dict(EXAMPLE_CONFIG), 0)
        bamboo.launch.train_worker(layers=program.layers, loss_fn=program.loss_fn, microbatch=program.microbatch,
                                   config=program.config)
"""


def test_a_node_lost_before_the_first_step_is_left_out_and_the_start_redone(
    tmp_path: Path, wait_for_layout: Callable[..., Any],
    assert_preempted: Callable[..., None],
) -> None:
    killed: list[str] = []
    first: list[Any] = []
    script, gate = tmp_path / "gated_example.py", tmp_path / "released"
    script.write_text(textwrap.dedent(GATED_EXAMPLE))

    def kill_a_node_of_the_first_layout(handles: RunHandles) -> None:
        layout = wait_for_layout(handles, 0, 120.0)
        first.append(layout)
        killed.append(layout.node_of_rank[1])
        handles.preempt(killed[0])
        gate.touch()

    options = RunOptions(redundancy="eflb", nodes=5, stages=2, pipelines=2, steps=30, zones=("a", "b", "c"), time_scale=1.0,
                         run_dir=str(tmp_path / "run"), timeout_s=200.0, size={"layers": 2},
                         script=(str(script), str(gate)))
    result = run_cluster(options, at_start=kill_a_node_of_the_first_layout)
    assert len(killed) == 1 and first[0].generation == 0 and not result.timed_out
    assert result.job_error is None and not result.worker_errors, (result.job_error, result.worker_errors)
    events = read_events(result.events)
    assert_preempted(events, set(killed))
    redone = [e for e in events if isinstance(e, Reconfiguration)]
    assert [e.reason for e in redone] == ["a node lost before the first step"], redone
    assert redone[0].pipelines == 2  # the standby node took the lost node's place
    assert killed[0] not in result.node_of_rank.values()
    assert result.steps_done == 30
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == 30
    assert comparison["max_relative_diff"] == 0.0
