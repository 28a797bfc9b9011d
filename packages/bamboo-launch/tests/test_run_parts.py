"""Unit tests of `bamboo-launch run`'s pure parts: the transfer plan, the market plan, CLI errors."""

from __future__ import annotations

import pytest
from bamboo.launch.cli import main
from bamboo.launch.market import ActionKind
from bamboo.launch.reconfigure import transfer_participants, transfer_plan
from bamboo.launch.run import RunOptions, initial_plan
from bamboo.launch.worker import _pause_s


def test_transfer_plan_fetches_only_missing_stages_from_holders() -> None:
    holdings = {"a": [0, 1], "b": [1, 2], "c": [2, 3]}  # the node of stage 3 (holding 3 and 0) died
    transfers, local, missing = transfer_plan({"a": 0, "b": 1, "c": 2, "j": 3}, 4, holdings)
    assert missing == []
    assert local == {"a": [0, 1], "b": [1, 2], "c": [2, 3]}
    assert transfers == [("a", "j", [0]), ("c", "j", [3])]
    assert transfer_participants(transfers) == ["a", "c", "j"]


def test_transfer_plan_is_independent_of_input_order_and_balances_sources() -> None:
    holdings = {"x": [0, 1], "y": [0, 1], "z": [2, 3]}
    forward = transfer_plan({"n1": 0, "n2": 4}, 4, holdings)
    backward = transfer_plan(dict(reversed(list({"n1": 0, "n2": 4}.items()))), 4, dict(reversed(list(holdings.items()))))
    assert forward == backward
    sent = {src: sum(len(stages) for s, _, stages in forward[0] if s == src) for src, _, _ in forward[0]}
    assert sent == {"x": 2, "y": 2}  # four stage copies, balanced over the two holders


def test_transfer_plan_reports_stages_with_no_surviving_copy() -> None:
    transfers, _, missing = transfer_plan({"a": 0, "b": 1}, 2, {"a": [0]})
    assert missing == [1]  # the worker then restores the checkpoint instead of transferring
    assert transfers == [("a", "b", [0])]


def test_initial_plan_without_preemptions_spreads_nodes_over_zones() -> None:
    plan = initial_plan(RunOptions(nodes=5, stages=2, pipelines=2, zones=("x", "y")))
    assert [(a.kind, a.at_s, a.zone) for a in plan] == [(ActionKind.ADD, 0.0, z) for z in "xyxyx"]


def test_run_options_refuse_too_few_nodes() -> None:
    with pytest.raises(ValueError, match="--nodes 3 cannot hold 2 pipelines of 2 stages"):
        RunOptions(nodes=3, stages=2, pipelines=2)


def test_pause_from_runtime_timing_records() -> None:
    assert _pause_s({"caught_at": 10.0, "resumed_at": 12.5}) == 2.5
    assert _pause_s({"detect_s": 0.25, "reroute_s": 0.5}) == 0.75


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--", "no-such-train.py", "--lr", "1"], "script 'no-such-train.py' not found"),
        (["run", "--nodes", "3"], "--nodes 3 cannot hold 2 pipelines of 4 stages"),
        (["run", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["run", "--stages", "9", "--nodes", "18"], "--stages 9 is more than the example's 6 layers"),
        (["run", "--preemptions", "synthetic:lots"], "synthetic:RATE needs a number RATE"),
    ],
)
def test_run_cli_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_run_cli_names_the_line_of_a_malformed_trace(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text("0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\nsoon,remove,node1\n")
    assert main(["run", "--nodes", "4", "--stages", "2", "--pipelines", "2", "--preemptions", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "bad.csv" in err and "5" in err and "Traceback" not in err
