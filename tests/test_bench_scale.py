"""The small configuration of tests/benchmarks/bench_scale.py: 16 agents on one etcd, in seconds.

The benchmark's own run, as a user runs it (`--agents 16 --process-kills --json`: the victims die by a real
`kill -9`): every node must read the first layout,
every live node of the layout must see each failure published, and every live node must read the layout of
the reconfiguration, with no crash. No timing is asserted (the benchmark reports the times). And the summary of
`--repeat K` (`_scale_summary.py`), from given runs.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent / "benchmarks" / "bench_scale.py"


@pytest.mark.slow
def test_sixteen_agents_see_the_layout_the_failures_and_the_new_layout() -> None:
    done = subprocess.run([sys.executable, str(BENCH), "--agents", "16", "--kills", "1", "--steady-s", "2",
                           "--settle-s", "1", "--pause-s", "0.5", "--replay-hours", "0.02",
                           "--process-kills", "--json"],
                          capture_output=True, text=True, timeout=400, check=False)
    lines = [line for line in done.stdout.splitlines() if line.startswith("{")]
    assert lines, f"no JSON from bench_scale.py (status {done.returncode}): {done.stderr[-2000:]}"
    result = json.loads(lines[-1])
    checks = result["checks"]
    assert result["agents"] == 16 and result["crashes"] == 0, result["errors"]
    assert checks["layout_read_by"] == checks["layout_expected"] == 16
    assert checks["failure_seen_by"] == checks["failure_expected"] > 0  # one kill and 1% (one node) at once
    assert result["kills"]["kill -9 of its process"] >= 1  # the victims that run alone die by a real kill -9
    assert checks["new_layout_read_by"] == checks["new_layout_expected"] == 16 - 2
    assert result["lost_events"] == 0 and done.returncode == 0
    for key in ("startup_p99_s", "failure_p99_s", "reconfigure_p99_s", "agent_cpu_pct"):
        assert result[key] is not None and result[key] >= 0  # measured (their values are the benchmark's)


def test_the_summary_of_repeated_runs_adds_the_counts_and_gives_each_p99s_worst_run_and_spread() -> None:
    spec = importlib.util.spec_from_file_location("_scale_summary", BENCH.parent / "_scale_summary.py")
    assert spec is not None and spec.loader is not None
    summary_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(summary_module)
    runs = [{"agents": 16, "startup_p99_s": 0.2, "failure_p99_s": 0.03, "failure_1pct_p99_s": math.nan,
             "reconfigure_p99_s": 0.1, "agent_cpu_pct": 0.05, "lost_events": 0, "crashes": 0, "false_failures": 0},
            {"agents": 16, "startup_p99_s": 0.4, "failure_p99_s": 0.01, "failure_1pct_p99_s": math.nan,
             "reconfigure_p99_s": 0.3, "agent_cpu_pct": 0.07, "lost_events": 2, "crashes": 1, "false_failures": 0},
            {"agents": 16, "startup_p99_s": 0.3, "failure_p99_s": 0.02, "failure_1pct_p99_s": math.nan,
             "reconfigure_p99_s": 0.2, "agent_cpu_pct": 0.06, "lost_events": 1, "crashes": 0, "false_failures": 3},
            {"agents": 64, "startup_p99_s": 0.5, "failure_p99_s": 0.04, "failure_1pct_p99_s": 0.05,
             "reconfigure_p99_s": 0.2, "agent_cpu_pct": 0.04, "lost_events": 0, "crashes": 0, "false_failures": 0}]
    small, large = summary_module.summarize(runs)
    assert (small["summary"], small["agents"], small["runs"], large["agents"], large["runs"]) == (True, 16, 3, 64, 1)
    assert (small["crashes"], small["lost_events"], small["false_failures"]) == (1, 3, 3)
    assert (small["runs_with_a_crash"], small["runs_with_a_lost_event"]) == (1, 2)
    assert small["startup_p99_s"] == 0.4 and small["startup_p99_s_spread"] == {"min": 0.2, "median": 0.3, "max": 0.4}
    assert small["failure_p99_s"] == 0.03 and small["reconfigure_p99_s"] == 0.3 and small["agent_cpu_pct"] == 0.07
    assert small["failure_1pct_p99_s"] is None and small["failure_1pct_p99_s_spread"] is None  # never measured
    assert large["lost_events"] == 0 and large["failure_1pct_p99_s"] == 0.05
    (line, _) = summary_module.summary_lines([small, large])
    assert line.startswith("16 agents, 3 runs: 1 crashes (1 runs), 3 lost events (2 runs)") and "startup_p99_s 200 / 300 / 400 ms" in line
