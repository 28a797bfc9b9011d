"""``bamboo-bench compare`` end to end: a small comparison (4 nodes, P=2, D=2, 4 s after each first step, a
scripted kill 2 s in) runs bamboo, checkpoint/restart and on-demand through ``bamboo-bench measure``, and
prints one JSON record per system; each run's measured profile loads, and ``bamboo-bench simulate`` with it on
the run's simulated trace gives the prediction that compare printed (the profile round trip).

88 s on the 2-core machine in a `make test` run (three systems, each starting its processes; it runs last in
the short-test lane at nice 15, see the root conftest.py; 68 s when it ran in the cluster lane); marked slow.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from bamboo.bench.cli import main as bench_main
from bamboo.bench.profile import load_profile

pytestmark = pytest.mark.slow

KEYS = {"system", "throughput", "node_hours", "cost", "value", "redone_steps", "lost_s"}


def _bench(*args: str, timeout: float) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONWARNINGS": "ignore"}
    return subprocess.run([sys.executable, "-m", "bamboo.bench.cli", *args], capture_output=True, text=True,
                          env=env, timeout=timeout, check=False)


def test_small_compare_records_and_profile_round_trip(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.csv"
    trace.write_text("time_s,event,node,zone\n" + "".join(f"0,add,node{i},{'ab'[i % 2]}\n" for i in range(4))
                     + "2,remove,node3,b\n")
    out = tmp_path / "compare"
    result = _bench("compare", "--preemptions", str(trace), "--time-scale", "1", "--nodes", "4", "--stages", "2",
                    "--pipelines", "2", "--duration", "4", "--layers", "2", "--json", "--out", str(out),
                    "--plot", str(tmp_path / "compare.png"), timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    records = json.loads(result.stdout)
    assert [r["system"] for r in records] == ["bamboo", "checkpoint", "on-demand"]
    by_system = {r["system"]: r for r in records}
    for record in records:
        assert set(record) >= KEYS, record
        assert record["throughput"] > 0 and record["node_hours"] > 0 and record["cost"] > 0
        price = record["price_per_node_hour"]
        assert record["cost"] == pytest.approx(record["node_hours"] * price)
        assert record["value"] == pytest.approx(record["throughput"] / (record["avg_nodes"] * price), rel=1e-3)
    assert by_system["checkpoint"]["vs_checkpoint"]["throughput"] == pytest.approx(1.0)
    assert by_system["bamboo"]["vs_on_demand"]["value"] == pytest.approx(
        by_system["bamboo"]["value"] / by_system["on-demand"]["value"])
    # on-demand is priced at on-demand rates, the others at spot rates
    assert by_system["on-demand"]["price_per_node_hour"] == pytest.approx(3.06)
    assert by_system["bamboo"]["price_per_node_hour"] == pytest.approx(0.918)
    # the kill: bamboo fails over; checkpoint/restart restarts from its last checkpoint
    assert by_system["checkpoint"]["interruptions"]["kills"] == 1
    assert (tmp_path / "compare.png").stat().st_size > 0

    for system, record in by_system.items():
        profile = load_profile(record["profile"])  # the measured profile loads in bamboo-bench's format
        assert profile.stages == 2 and profile.pipelines == 2
        assert profile.step_time_s(2) > 0
        words = record["simulate_command"].split()
        assert words[:2] == ["bamboo-bench", "simulate"]
        capsys.readouterr()
        assert bench_main([*words[1:], "--json"]) == 0  # in this process: the command, not a new interpreter
        predicted = json.loads(capsys.readouterr().out.splitlines()[0])
        assert predicted["strategy"] == system
        assert predicted["throughput"] == pytest.approx(record["predicted_throughput"], rel=1e-4)
        assert predicted["value"] == pytest.approx(record["predicted_value"], rel=1e-4)
        assert math.isfinite(record["throughput_error"])
    bamboo_profile = load_profile(by_system["bamboo"]["profile"])
    assert bamboo_profile.timing.failover_pause_s >= 0
    checkpoint_profile = load_profile(by_system["checkpoint"]["profile"])
    assert checkpoint_profile.timing.restart_s > 0  # measured, or the cold start when no restart reached a step
    assert checkpoint_profile.checkpoint_restart_on_join == "every-join"
