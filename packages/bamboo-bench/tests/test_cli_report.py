"""Tests of ``bamboo-launch report`` on a real event-log file, through the entry point."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bamboo.launch.cli import main
from bamboo.launch.events import EventLog, Failover, Join, Preemption, RunEnd, RunStart, Step


@pytest.fixture
def event_log(tmp_path: Path, fake_clock) -> Path:
    """A log written the way the launcher writes it: EventLog.emit on a clock."""
    clock = fake_clock
    path = tmp_path / "events.jsonl"
    with EventLog(path, clock=clock) as log:
        log.emit(RunStart, job="cli", unix_time=1.7e9, target_nodes=4, stages=2, pipelines=2)
        for index in range(4):
            log.emit(Join, node=f"n{index}", zone="ab"[index % 2])
        for step in range(10):
            clock.advance(36.0)
            log.emit(Step, step=step, samples=8, loss=1.0 / (step + 1), nodes_active=4, duration_s=36.0)
            if step == 4:
                log.emit(Preemption, node="n3", zone="b", notice_s=0.0)
                log.emit(Failover, victim="n3", shadow="n2", stage=1, pause_s=0.25)
        log.emit(RunEnd, steps=10)
    return path


def test_report_text(event_log: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["report", str(event_log)]) == 0
    out = capsys.readouterr().out
    assert "job cli: 10 steps, 80 samples" in out
    assert "throughput       0.222 samples/s" in out
    assert "failovers        1 (median pause 0.250 s" in out


def test_report_json_and_plot(event_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    plot = tmp_path / "plot.png"
    args = [
        "report",
        str(event_log),
        "--json",
        "--plot",
        str(plot),
        "--spot-price",
        "1",
        "--on-demand-price",
        "3",
    ]
    assert main(args) == 0
    report = json.loads(capsys.readouterr().out)
    # 3 nodes for 360 s, one for 180 s: 1260 node-seconds.
    assert report["node_hours"] == pytest.approx(1260 / 3600)
    assert report["cost_spot"] == pytest.approx(1260 / 3600)
    assert report["cost_on_demand"] == pytest.approx(3 * 1260 / 3600)
    assert report["value"] == pytest.approx((80 / 360) / (1260 / 360))
    assert {"throughput", "node_hours", "cost_spot", "cost_on_demand", "value", "median_pause_s"} <= set(
        report
    )
    assert plot.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["report", "missing.jsonl"], "cannot read missing.jsonl: No such file or directory"),
        (
            ["report", "{log}", "--on-demand-throughput", "5"],
            "--on-demand-throughput and --on-demand-nodes go together",
        ),
        (["report", "{bad}"], "bad.jsonl:2: unknown kind 'jump'"),
        (["report", "{log}", "--bins", "0"], "argument --bins: '0' must be >= 1"),
        (["report", "{empty}"], "the event log is empty"),
        (
            ["report", "{log}", "--plot", "/no/such/dir/plot.png"],
            "/no/such/dir/plot.png: No such file or directory",
        ),
    ],
)
def test_report_errors_are_one_line(
    event_log: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"kind":"join","t":0,"node":"n0","zone":"a"}\n{"kind":"jump","t":1}\n')
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    args = [a.format(log=event_log, bad=bad, empty=empty) for a in args]
    assert main(args) == 2
    error = capsys.readouterr().err
    assert message in error and error.startswith(("bamboo-launch: error: ", "bamboo-launch report: error: "))
    assert len(error.strip().splitlines()) == 1


def test_console_script_runs(event_log: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "bamboo.launch.cli", "report", str(event_log), "--json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["steps"] == 10
    result = subprocess.run(
        [sys.executable, "-m", "bamboo.launch.cli", "report", str(event_log), "--", "x"],
        capture_output=True,
        text=True,
        check=False,
        timeout=120,
    )
    assert result.returncode == 2 and "takes no script" in result.stderr


def test_report_merges_logs_of_one_run(tmp_path: Path, capsys: pytest.CaptureFixture[str], fake_clock) -> None:
    clock = fake_clock
    clock.t = 0.0
    market = EventLog(tmp_path / "market.jsonl", clock=clock, start=0.0)
    run = EventLog(tmp_path / "run.jsonl", clock=clock, start=0.0)
    run.emit(RunStart, job="merged", unix_time=0.0, target_nodes=2, stages=1, pipelines=2)
    market.emit(Join, node="n0", zone="a")
    market.emit(Join, node="n1", zone="b")
    clock.t = 1800.0
    run.emit(Step, step=0, samples=100, loss=1.0, nodes_active=2, duration_s=1800.0)
    market.emit(Preemption, node="n1", zone="b")
    clock.t = 3600.0
    run.emit(Step, step=1, samples=100, loss=0.5, nodes_active=1, duration_s=1800.0)
    run.emit(RunEnd, steps=2)
    market.close()
    run.close()
    assert main(["report", str(tmp_path / "run.jsonl"), str(tmp_path / "market.jsonl"), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["job"] == "merged" and report["samples"] == 200
    assert report["node_hours"] == pytest.approx(1.5) and report["preemptions"] == 1
