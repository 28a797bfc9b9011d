"""Tests of ``bamboo-launch market`` through the entry point: plans, bad traces, a real replay."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bamboo.launch.cli import main

SHARED_TRACES = Path(__file__).resolve().parents[3] / ".." / "shared" / "traces"

GENERIC = """# a tiny generic trace
time_s,event,node,zone
0,add,a0,east
0,add,b0,west
60,remove,a0,east
90,add,a1,east
"""


def test_dry_run_prints_the_plan(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "tiny.csv"
    trace.write_text(GENERIC)
    assert (
        main(["market", "--preemptions", str(trace), "--time-scale", "30", "--notice", "0.5", "--dry-run"])
        == 0
    )
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        "add a0@east@0s",
        "add b0@west@0s",
        "notify a0@east@1.5s",
        "kill a0@east@2s",
        "add a1@east@3s",
    ]
    assert "3 nodes started, 1 killed" in captured.err


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            "time_s,event,node,zone\n0,add,a0,east\nsoon,remove,a0,east\n",
            "bad.csv:3: time 'soon' is not a number",
        ),
        ("time_s,event,node,zone\n0,add,a0,east\n5,explode,a0,east\n", "bad.csv:3: event 'explode'"),
        ("0,add,node1\n60000,remove,node1\nabc,add,node2\n", "bad.csv:3:"),
    ],
)
def test_malformed_trace_names_the_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: str, message: str
) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text(content)
    assert main(["market", "--preemptions", str(trace), "--dry-run"]) == 2
    error = capsys.readouterr().err
    assert error.startswith("bamboo-launch: error: ") and message in error, error
    assert len(error.strip().splitlines()) == 1


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--preemptions", "synthetic:often"], "synthetic:RATE needs a number RATE in [0, 1], got 'often'"),
        (["--preemptions", "synthetic:1.5"], "synthetic:RATE needs RATE in [0, 1], got '1.5'"),
        (["--preemptions", "{trace}", "--zones", "p,q"], "already has zones ['east', 'west']; --zones is for traces without zones"),
        (["--preemptions", "{trace}", "--start", "50", "--end", "40"], "--end 40 must be after --start 50"),
        (["--preemptions", "{trace}"], "market needs the node's command after --"),
        (["--preemptions", "nowhere.csv"], "nowhere.csv: no such file"),
        (
            ["--preemptions", "{trace}", "--", "/no/such/agent"],
            "the node command '/no/such/agent' is not an executable",
        ),
    ],
)
def test_bad_arguments_are_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], args: list[str], message: str
) -> None:
    trace = tmp_path / "tiny.csv"
    trace.write_text(GENERIC)
    assert main(["market", *(a.format(trace=trace) for a in args)]) == 2
    error = capsys.readouterr().err
    assert message in error and len(error.strip().splitlines()) == 1, error


def test_a_bad_flag_value_is_one_line_too(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["market", "--preemptions", "synthetic:0.1", "--nodes", "0"]) == 2
    error = capsys.readouterr().err
    assert "argument --nodes: '0' must be >= 1" in error and len(error.strip().splitlines()) == 1, error


def test_synthetic_with_named_zones_is_seeded(capsys: pytest.CaptureFixture[str]) -> None:
    args = [
        "market",
        "--preemptions",
        "synthetic:0.5",
        "--nodes",
        "6",
        "--zones",
        "x,y",
        "--hours",
        "3",
        "--dry-run",
    ]
    assert main([*args, "--seed", "4"]) == 0
    first = capsys.readouterr().out
    assert main([*args, "--seed", "4"]) == 0
    assert capsys.readouterr().out == first
    zones = {line.split("@")[1] for line in first.splitlines()}
    assert zones <= {"x", "y"} and "kill" in first


@pytest.mark.skipif(
    not (SHARED_TRACES / "bamboo" / "p3-trace.csv").is_file(), reason="shared traces not found"
)
def test_paper_trace_spread_over_zones(capsys: pytest.CaptureFixture[str]) -> None:
    trace = SHARED_TRACES / "bamboo" / "p3-trace.csv"
    assert (
        main(
            [
                "market",
                "--preemptions",
                str(trace),
                "--zones",
                "a,b,c",
                "--time-scale",
                "3600",
                "--end",
                "7200",
                "--dry-run",
            ]
        )
        == 0
    )
    lines = capsys.readouterr().out.splitlines()
    assert {line.split("@")[1] for line in lines} == {"a", "b", "c"}
    assert all(float(line.rsplit("@", 1)[1].rstrip("s")) < 2.0 for line in lines)


def test_real_replay_kills_and_logs(tmp_path: Path, proc_helpers) -> None:
    trace = tmp_path / "tiny.csv"
    # b0 leaves at 150 s, so that a1 (started at 90 s) runs a while before the replay ends.
    trace.write_text(GENERIC + "150,remove,b0,west\n")
    events = tmp_path / "events.jsonl"
    pids = tmp_path / "pids"
    pids.mkdir()
    # Each node records its pid (its process-group id) and the pid of a grandchild, then waits.
    script = f"sleep 1000 & echo $$ $! > {pids}/$BAMBOO_NODE_ID.part && mv {pids}/$BAMBOO_NODE_ID.part {pids}/$BAMBOO_NODE_ID; wait"
    code = main(
        [
            "market",
            "--preemptions",
            str(trace),
            "--time-scale",
            "40",
            "--events",
            str(events),
            "--log-dir",
            str(tmp_path / "logs"),
            "--",
            "sh",
            "-c",
            script,
        ]
    )
    assert code == 0
    records = [json.loads(line) for line in events.read_text().splitlines()]
    assert [(r["kind"], r["node"], r["zone"]) for r in records] == [
        ("join", "node0", "east"),
        ("join", "node1", "west"),
        ("preemption", "node0", "east"),
        ("join", "node2", "east"),
        ("preemption", "node1", "west"),
    ]
    # The killed node and, after the replay, every other node: whole groups gone, grandchildren too.
    for name in ("node0", "node1", "node2"):
        assert proc_helpers.wait(lambda name=name: (pids / name).exists())
        leader, grandchild = map(int, (pids / name).read_text().split())
        assert proc_helpers.wait(lambda leader=leader: proc_helpers.group_members(leader) == []), name
        assert grandchild in proc_helpers.killed_or_gone([grandchild])
