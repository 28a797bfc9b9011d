"""`bamboo-schedule show`: grid and summary, --json keys, --fail, --costs, --trace, and clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bamboo.schedule.cli import EXIT_CONSECUTIVE, EXIT_USAGE, main, parse_failure


def test_show_prints_grid_and_summary(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--stages", "4", "--microbatches", "6", "--rc", "eflb"]) == 0
    out = capsys.readouterr().out
    assert "node  0 |" in out and "1FR0" in out
    for key in ("makespan", "overhead_pct", "bubble_pct", "frc_hidden_pct", "valid"):
        assert key in out


def test_show_json_has_the_contract_keys(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "--stages", "4", "--microbatches", "8", "--rc", "efeb", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    for key in ("makespan", "overhead_pct", "bubble_pct", "frc_hidden_pct", "peak_stash", "valid"):
        assert key in data
    assert data["valid"] is True
    assert data["overhead_pct"] > 0
    assert set(data["peak_stash"]) == {"0", "1", "2", "3"}


def test_show_with_failures_and_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "trace.json"
    assert main(["show", "-P", "6", "-M", "8", "--fail", "2,5@10", "--json", "--trace", str(trace)]) == 0
    data = json.loads(capsys.readouterr().out)
    assert data["valid"] is True
    assert data["victims"] == [2, 5]
    assert data["placement_after"] == [0, 1, 1, 3, 4, 4]
    assert data["steady_makespan"] > 0
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e["ph"] == "X" and e["name"] == "2BR0" and e["tid"] == 1 for e in events)


def test_show_with_stream_grid_marks_the_failure_point(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "-P", "3", "-M", "2", "--fail", "1@6", "--grid", "stream"]) == 0
    assert "|" in capsys.readouterr().out


def test_costs_file_changes_the_result(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps({"default": {"forward_ms": 10.0, "backward_ms": 20.0}}))
    main(["show", "-P", "2", "-M", "2", "--json"])
    default = json.loads(capsys.readouterr().out)["makespan"]
    main(["show", "-P", "2", "-M", "2", "--json", "--costs", str(costs)])
    assert json.loads(capsys.readouterr().out)["makespan"] > 5 * default


@pytest.mark.parametrize(
    ("argv", "status", "message"),
    [
        (["--fail", "2,3@10"], EXIT_CONSECUTIVE, "consecutive failure: stages 2 and 3"),
        (["--fail", "5,0@4"], EXIT_CONSECUTIVE, "consecutive failure: stages 5 and 0"),
        (["--fail", "x@10"], EXIT_USAGE, "--fail 'x@10'"),
        (["--fail", "9@1"], EXIT_USAGE, "stage 9 out of range 0..5"),
        (["--fail", "3"], EXIT_USAGE, "expected STAGES@INDEX"),
        (["--fail", "3@100000"], EXIT_USAGE, "past the end of stage 3"),
        (["--costs", "/nonexistent/costs.json"], EXIT_USAGE, "cannot read costs file"),
        (["--rc", "none", "--fail", "1@1"], EXIT_USAGE, "--fail needs redundancy"),
    ],
)
def test_bad_input_gives_one_line_errors(
    argv: list[str], status: int, message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["show", "-P", "6", "-M", "4", *argv]) == status
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_bad_sizes_are_named(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["show", "-P", "0", "-M", "4"]) == EXIT_USAGE
    assert "--stages must be >= 1, got 0" in capsys.readouterr().err


def test_parse_failure() -> None:
    assert parse_failure("3@10", 8) == ((3,), 10)
    assert parse_failure("2,5@0", 8) == ((2, 5), 0)


def test_help_explains_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["show", "--help"])
    out = capsys.readouterr().out
    for flag in ("--stages", "--microbatches", "--rc", "--fail", "--costs", "--trace", "--json", "--policy", "--grid"):
        assert flag in out


def test_console_script_runs_without_a_traceback() -> None:
    import subprocess
    import sys
    from pathlib import Path

    script = Path(sys.executable).parent / "bamboo-schedule"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "bamboo.schedule.cli"]
    done = subprocess.run([*command, "show", "-P", "4", "-M", "4", "--fail", "1,2@3"],
                          capture_output=True, text=True, timeout=120, check=False)
    assert done.returncode == 3
    assert done.stderr.startswith("bamboo-schedule: error: consecutive failure")
    assert "Traceback" not in done.stderr
