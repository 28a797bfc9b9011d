"""The bamboo-reconfig CLI: the layout, standby, same-zone count and transfers; one-line errors."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from bamboo.reconfig.cli import main


def write_nodes(path: Path, nodes: list[dict]) -> Path:
    path.write_text(json.dumps(nodes))
    return path


def nodes_json(count: int, zones: str = "abc") -> list[dict]:
    return [{"id": f"n{i:02d}", "zone": zones[i % len(zones)], "state": "active"} for i in range(count)]


def test_plan_prints_layout_standby_and_same_zone_count(tmp_path: Path, capsys) -> None:
    nodes = write_nodes(tmp_path / "nodes.json", nodes_json(13))
    assert main(["plan", "--nodes", str(nodes), "--stages", "4", "--pipelines", "3"]) == 0
    out = capsys.readouterr().out
    assert "layout: 3 pipeline(s) x 4 stages" in out
    assert "standby queue: n12" in out
    assert "same-zone neighbours: 0" in out
    assert "microbatches per pipeline: 8, 8, 8 (equal shares, global batch 24)" in out


def test_plan_with_old_layout_prints_decision_and_transfers(tmp_path: Path, capsys) -> None:
    nodes = nodes_json(13)
    write_nodes(tmp_path / "nodes.json", nodes)
    assert main(["plan", "--nodes", str(tmp_path / "nodes.json"), "--stages", "4", "--pipelines", "3", "--json"]) == 0
    (tmp_path / "old.json").write_text(capsys.readouterr().out)
    for node in nodes:
        if node["id"] in ("n00", "n01"):
            node["state"] = "preempted"
    write_nodes(tmp_path / "after.json", nodes)
    args = ["plan", "--nodes", str(tmp_path / "after.json"), "--stages", "4", "--pipelines", "3",
            "--old", str(tmp_path / "old.json")]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "decision: now (consecutive-failure, rebuild redundancy after a failover)" in out
    assert "transfers:" in out and "naive" in out
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert set(result) == {"layout", "decision", "transfers"}
    assert result["transfers"]["bytes_moved"] < result["transfers"]["naive_bytes"]
    assert all(t["source"] not in ("n00", "n01") for r in result["transfers"]["rounds"] for t in r)


@pytest.mark.parametrize(
    ("nodes", "extra", "message"),
    [
        ([{"id": "a", "zone": "z", "state": "asleep"}], [], "unknown node state 'asleep'"),
        ([{"id": "a", "zone": "z", "state": "active"}] * 2, [], "duplicate node id(s): a"),
        (nodes_json(4), ["--layers", "3"], "P=4 is larger than the layer count 3"),
        ({"id": "a"}, [], "node list must be a JSON list"),
    ],
)
def test_bad_input_gets_a_one_line_error(tmp_path: Path, capsys, nodes, extra, message: str) -> None:
    path = write_nodes(tmp_path / "nodes.json", nodes)
    assert main(["plan", "--nodes", str(path), "--stages", "4", "--pipelines", "1", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and message in err


def test_missing_file_and_bad_json_are_one_line_errors(tmp_path: Path, capsys) -> None:
    assert main(["plan", "--nodes", str(tmp_path / "absent.json"), "--stages", "2", "--pipelines", "1"]) == 2
    assert "cannot read node file" in capsys.readouterr().err
    (tmp_path / "bad.json").write_text("[{")
    assert main(["plan", "--nodes", str(tmp_path / "bad.json"), "--stages", "2", "--pipelines", "1"]) == 2
    assert "is not valid JSON" in capsys.readouterr().err


def test_console_script_exits_non_zero_without_traceback(tmp_path: Path) -> None:
    path = write_nodes(tmp_path / "nodes.json", [{"id": "a", "zone": "z", "state": "gone"}])
    completed = subprocess.run(
        [sys.executable, "-m", "bamboo.reconfig.cli", "plan", "--nodes", str(path), "--stages", "2",
         "--pipelines", "1"],
        capture_output=True, text=True, check=False,
    )
    assert completed.returncode == 2
    assert "Traceback" not in completed.stderr
    assert completed.stderr.strip() == "bamboo-reconfig: error: unknown node state 'gone' (expected one of: " \
        "active, standby, joining, preempted)"


def test_plan_with_one_stage_puts_ring_neighbours_in_different_zones(tmp_path: Path, capsys) -> None:
    nodes = write_nodes(tmp_path / "nodes.json", nodes_json(6, "aabbcc"))
    assert main(["plan", "--nodes", str(nodes), "--stages", "1", "--pipelines", "6"]) == 0
    out = capsys.readouterr().out
    assert "layout: 6 pipeline(s) x 1 stages" in out
    assert "same-zone neighbours: 0" in out


def test_plan_with_zero_stages_is_a_one_line_error(tmp_path: Path, capsys) -> None:
    nodes = write_nodes(tmp_path / "nodes.json", nodes_json(3))
    assert main(["plan", "--nodes", str(nodes), "--stages", "0", "--pipelines", "1"]) == 2
    assert "--stages must be at least 1" in capsys.readouterr().err
