"""End to end: ``run_cluster`` with a user script (``bamboo-launch run ... -- SCRIPT``).

Real processes: an embedded etcd, one agent per node, each spawning ``python SCRIPT ARGS`` (the
example residual MLP, ``examples/train_mlp.py``), the spot market replaying a scripted trace with a
real SIGKILL. The final parameters are compared with a fault-free single-process run that the
script itself trains in ``reference`` mode (1e-6 relative).

With 4 nodes in zones a,b,c (node i in zone i mod 3), P=2, D=2, the placement is pipeline 0:
node0 node1, pipeline 1: node3 node2; trace node K is the launcher's node K-1.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from bamboo.launch.events import Failover, Join, Preemption, Reconfiguration, read_events
from bamboo.launch.run import RunError, RunOptions, compare_with_reference, run_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_mlp.py"
TOLERANCE = 1e-6


def _options(tmp_path: Path, script: tuple[str, ...], **changes: object) -> RunOptions:
    base: dict[str, object] = {
        "nodes": 4, "stages": 2, "pipelines": 2, "steps": 400, "zones": ("a", "b", "c"), "time_scale": 1.0,
        "run_dir": str(tmp_path / "run"), "confirm_timeout_s": 30.0, "timeout_s": 240.0, "group_timeout_s": 20.0,
        "script": script,
    }
    base.update(changes)
    return RunOptions(**base)  # type: ignore[arg-type]


def test_example_script_survives_a_kill_takes_a_joiner_and_matches_a_fault_free_run(tmp_path: Path) -> None:
    """node1 (stage 1 of pipeline 0) is killed 0.7 s into training: its shadow node0 fails over; node4
    joins, and with node3 it fills the second pipeline again: script workers spawned in a later
    generation, stage state moved over gloo, the global batch unchanged."""
    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\n700,remove,node2\n1000,add,node5\n")
    options = _options(tmp_path, (str(EXAMPLE), "--blocks", "3"), preemptions=str(trace))
    result = run_cluster(options)
    events = read_events(result.events)
    assert {e.node for e in events if isinstance(e, Preemption)} == {"node1"}
    assert result.failed_nodes == ("node1",)
    assert [f.victim for f in events if isinstance(f, Failover)] == ["node1"]
    assert "node4" in {e.node for e in events if isinstance(e, Join)}
    reconfigurations = [e for e in events if isinstance(e, Reconfiguration)]
    # One reconfiguration (the joiner already waits when the failover's is decided) or two (1 pipeline,
    # then 2 once it registers): either way the run ends on 2 full pipelines, the joiner's stages moved.
    assert reconfigurations and reconfigurations[-1].pipelines == 2 and reconfigurations[-1].standby == 0
    assert reconfigurations[-1].bytes_moved > 0, reconfigurations
    assert not result.timed_out
    assert result.steps_done == options.steps and sorted(result.reports) == [0, 1, 2, 3]
    assert not [code for code in result.exit_codes.values() if code is not None and code > 0], result.exit_codes
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == options.steps and comparison["tensors"] > 0
    assert comparison["history"][-1][1] == 2 and len(comparison["history"]) == 1 + len(reconfigurations)
    assert comparison["max_relative_diff"] <= TOLERANCE
    assert (result.run_dir / "reference.log").exists()  # the script trained the reference itself


def test_a_script_that_skips_the_entry_point_in_its_workers_is_reported_not_waited_for(tmp_path: Path) -> None:
    script = tmp_path / "skips.py"
    script.write_text(textwrap.dedent(f'''
        import os
        import runpy
        import sys

        if os.environ["BAMBOO_SCRIPT_MODE"] == "worker":
            sys.exit(0)  # a worker that never trains
        sys.argv = [{str(EXAMPLE)!r}]
        runpy.run_path({str(EXAMPLE)!r}, run_name="__main__")
    '''))
    options = _options(tmp_path, (str(script),), steps=5, timeout_s=120.0)
    with pytest.raises(RunError) as caught:
        run_cluster(options)
    message = str(caught.value)
    assert message.startswith("before the first step, node node")
    logs = tmp_path / "run" / "logs"
    # whichever workers exited first are named (which ones depends on timing), each with its own log
    named = re.findall(r"node (node\d+) exited with status 1: [^(]*\(log: ([^)]+)\)", message)
    assert named, message
    for node, log in named:
        assert log == str(logs / f"{node}.log")
        assert "without calling bamboo.launch.train_worker" in Path(log).read_text()
