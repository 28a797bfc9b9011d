"""The small configuration of tests/benchmarks/bench_scale.py: 16 agents on one etcd, in seconds.

The benchmark's own run, as a user runs it (`--agents 16 --json`): every node must read the first layout,
every live node of the layout must see each failure published, and every live node must read the layout of
the reconfiguration, with no crash. No timing is asserted (the benchmark reports the times).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "benchmarks" / "bench_scale.py"


@pytest.mark.slow
def test_sixteen_agents_see_the_layout_the_failures_and_the_new_layout() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--agents", "16", "--kills", "1", "--steady-s", "2",
                           "--settle-s", "1", "--pause-s", "0.5", "--replay-hours", "0.02",
                           "--json"],
                          capture_output=True, text=True, timeout=400, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON from bench_scale.py (status {done.returncode}): {done.stderr[-2000:]}"
    result = json.loads(lines[-1])
    checks = result["checks"]
    assert result["agents"] == 16 and result["crashes"] == 0, result["errors"]
    assert checks["layout_read_by"] == checks["layout_expected"] == 16
    assert checks["failure_seen_by"] == checks["failure_expected"] > 0  # one kill and 1% (one node) at once
    assert checks["new_layout_read_by"] == checks["new_layout_expected"] == 16 - 2
    assert result["lost_events"] == 0 and done.returncode == 0
    for key in ("startup_p99_s", "failure_p99_s", "reconfigure_p99_s", "agent_cpu_pct"):
        assert result[key] is not None and result[key] >= 0  # measured (their values are the benchmark's)
