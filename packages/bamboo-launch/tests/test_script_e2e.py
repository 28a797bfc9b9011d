"""End to end: ``run_cluster`` with a user script (``bamboo-launch run ... -- SCRIPT``).

Real processes: an embedded etcd, one agent per node, each spawning ``python SCRIPT ARGS`` (the
example residual MLP, ``examples/train_mlp.py``), the spot market replaying a scripted trace with a
real SIGKILL. The final parameters are compared with a fault-free single-process run that the
script itself trains in ``reference`` mode (1e-6 relative).

The example script's run with a kill and a joiner, exact, is ``tests/e2e/test_dropout_e2e.py`` (the example
has dropout in every block by default); this file keeps the script failures the launcher must report.

With 4 nodes in zones a,b,c (node i in zone i mod 3), P=2, D=2, the placement is pipeline 0:
node0 node1, pipeline 1: node3 node2; trace node K is the launcher's node K-1.
"""

from __future__ import annotations

import re
import textwrap
from pathlib import Path

import pytest
from bamboo.bench.emulated.run import RunError, RunOptions, run_cluster

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_mlp.py"


def _options(tmp_path: Path, script: tuple[str, ...], **changes: object) -> RunOptions:
    base: dict[str, object] = {
        "nodes": 4, "stages": 2, "pipelines": 2, "steps": 400, "zones": ("a", "b", "c"), "time_scale": 1.0,
        "run_dir": str(tmp_path / "run"), "confirm_timeout_s": 30.0, "timeout_s": 240.0, "group_timeout_s": 20.0,
        "script": script,
    }
    base.update(changes)
    return RunOptions(**base)  # type: ignore[arg-type]


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
