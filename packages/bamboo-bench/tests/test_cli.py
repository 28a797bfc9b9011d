"""CLI tests: simulate on the real p3 trace, sweep JSON keys, trace subcommands, one-line errors, profiles."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bamboo.bench.cli import main
from bamboo.bench.profile import ModelProfile, ProfileError, builtin_profiles, load_profile
from bamboo.bench.sweep import sweep

SWEEP_KEYS = {"prob", "preemptions", "interval_h", "lifetime_h", "fatal_failures", "nodes", "throughput",
              "cost_per_hour", "value"}


def test_simulate_p3_gpt2_side_by_side_with_plot(traces_dir: Path, tmp_path: Path, capsys) -> None:
    out = tmp_path / "fig.png"
    code = main(["simulate", "--trace", str(traces_dir / "bamboo" / "p3-trace.csv"), "--model", "gpt2",
                 "--strategy", "bamboo,checkpoint,on-demand", "--plot", str(out), "--json"])
    assert code == 0
    rows = {r["strategy"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"bamboo", "checkpoint", "on-demand"}
    assert rows["bamboo"]["preemptions"] == 167
    assert rows["checkpoint"]["progress_share"] < rows["bamboo"]["progress_share"] < 1.0
    assert rows["on-demand"]["progress_share"] == 1.0
    assert rows["bamboo"]["value"] > rows["checkpoint"]["value"]
    assert all(row["warning"] is None for row in rows.values())
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_simulate_synthetic_table(capsys) -> None:
    code = main(["simulate", "--synthetic", "--probability", "0.2", "--runs", "3", "--model", "bert-table6",
                 "--strategy", "bamboo,sample-dropping"])
    assert code == 0
    text = capsys.readouterr().out
    assert "bamboo" in text and "sample-dropping" in text and "on-demand reference value: 1.100" in text


def test_sweep_json_has_the_issue_keys(capsys) -> None:
    code = main(["sweep", "--model", "bert", "--probabilities", "0.05,0.25", "--runs", "6", "--workers", "2",
                 "--json"])
    assert code == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r["prob"] for r in rows] == [0.05, 0.25]
    for row in rows:
        assert set(row) >= SWEEP_KEYS
        assert row["runs"] == row["completed_runs"] == 6
    assert rows[1]["preemptions"] > rows[0]["preemptions"]


def test_sweep_is_the_same_with_one_or_two_workers() -> None:
    profile = load_profile("bert")
    one = sweep(profile, [0.1], 4, workers=1, chunk=2)
    two = sweep(profile, [0.1], 4, workers=2, chunk=2)
    assert one[0].as_dict() == two[0].as_dict()


def test_trace_summary_and_synthesize(traces_dir: Path, tmp_path: Path, capsys) -> None:
    assert main(["trace", "summary", "--json", str(traces_dir / "bamboo" / "g4dn-trace.csv")]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["preemptions"] == 74
    out = tmp_path / "syn.csv"
    assert main(["trace", "synthesize", str(out), "--probability", "0.1", "--hours", "5", "--seed", "3"]) == 0
    capsys.readouterr()
    assert main(["simulate", "--trace", str(out), "--model", "bert", "--strategy", "bamboo", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["duration_h"] == pytest.approx(5.0)


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["simulate", "--trace", "/no/such.csv"], "/no/such.csv: no such file"),
        (["simulate", "--synthetic", "--model", "gpt3"], "unknown model profile 'gpt3'"),
        (["simulate", "--synthetic", "--until", "trace-end"], "--until trace-end needs --trace"),
        (["simulate", "--synthetic", "--hold", "trace"], "--hold trace needs --trace"),
        (["sweep", "--bulk-mean", "0.5", "--runs", "1"], "--bulk-mean must be >= 1, got 0.5"),
    ],
)
def test_errors_are_one_line_with_status_2(argv: list[str], words: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"bamboo-bench: error: {err.split('error: ', 1)[1]}"
    assert words in err
    assert "\n" not in err and "Traceback" not in err


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["sweep", "--probabilities", "0.1,2"], "probability '2' is not in [0, 1]"),
        (["simulate", "--synthetic", "--strategy", "bamboo,magic"], "unknown strategy 'magic'"),
        (["sweep", "--runs", "0"], "'0' must be >= 1"),
    ],
)
def test_argument_errors_exit_2(argv: list[str], words: str, capsys) -> None:
    with pytest.raises(SystemExit) as caught:
        main(argv)
    assert caught.value.code == 2
    assert words in capsys.readouterr().err


@pytest.mark.parametrize(("metadata", "shown"), [("[]", "[]"), ("null", "None"), ('"x"', "'x'")])
def test_skypilot_metadata_not_an_object_is_a_one_line_error(tmp_path: Path, metadata: str, shown: str, capsys) -> None:
    path = tmp_path / "us-east-1a_v100_1.json"
    path.write_text(f'{{"metadata": {metadata}, "data": [4, 3]}}')
    assert main(["simulate", "--trace", str(path)]) == 2
    err = capsys.readouterr().err
    assert err == f"bamboo-bench: error: {path}: 'metadata' must be an object with 'gap_seconds', got {shown}\n"


def _too_small_trace(tmp_path: Path) -> Path:
    path = tmp_path / "small.csv"
    path.write_text("# duration_s=3600\ntime_s,event,node,zone\n0,add,a,z1\n0,add,b,z2\n1000,add,c,z1\n"
                    "2000,remove,a,z1\n")
    return path


def test_simulate_warns_when_no_pipeline_can_form(tmp_path: Path, capsys) -> None:
    path = _too_small_trace(tmp_path)
    assert main(["simulate", "--trace", str(path), "--model", "gpt2", "--json"]) == 0
    rows = {r["strategy"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    expected = ("no pipeline can ever form: trace 'small' never has more than 3 node(s) alive at once, fewer than "
                "the 12 stages of one pipeline of 'gpt2'; throughput is 0 and 2.28 node(s) on average were still "
                "charged ($2.07/h)")
    assert rows["bamboo"]["warning"] == rows["checkpoint"]["warning"] == expected
    assert rows["bamboo"]["throughput"] == 0.0 and rows["bamboo"]["cost_per_hour"] > 0
    assert rows["on-demand"]["warning"] is None
    assert main(["simulate", "--trace", str(path), "--model", "gpt2"]) == 0
    table = capsys.readouterr().out
    assert "│ warning (bamboo, checkpoint): no pipeline can ever" in table
    assert "fewer than the 12 stages of one" in table


def test_simulate_warns_when_nothing_was_trained(tmp_path: Path, capsys) -> None:
    # Enough nodes, but the window ends before the first rendezvous is over.
    path = tmp_path / "short.csv"
    path.write_text("# duration_s=60\ntime_s,event,node,zone\n" + "".join(f"0,add,n{i},z{i % 3}\n" for i in range(12)))
    assert main(["simulate", "--trace", str(path), "--model", "gpt2", "--strategy", "bamboo", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)
    assert row["warning"] == "nothing was trained (throughput 0) and 12.00 node(s) on average were still charged ($10.92/h)"


def test_malformed_trace_error_names_file_and_line(tmp_path: Path, capsys) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("0,add,node1\n60000,remove,node9\n")
    assert main(["simulate", "--trace", str(path)]) == 2
    assert f"{path}:2: remove of 'node9', which is not alive" in capsys.readouterr().err


def test_shipped_profiles_round_trip_and_differ_only_as_documented() -> None:
    assert {"bert", "bert-table6", "gpt2"} <= set(builtin_profiles())
    for name in builtin_profiles():
        profile = load_profile(name)
        assert ModelProfile.from_dict(profile.to_dict(), name) == profile
        assert profile.notes
    bert, table6 = load_profile("bert"), load_profile("bert-table6")
    differs = {k for k, v in bert.to_dict().items() if table6.to_dict()[k] != v}
    assert differs == {"name", "description", "notes", "step_time_scale", "timing"}
    timing = {k for k, v in bert.to_dict()["timing"].items() if table6.to_dict()["timing"][k] != v}
    assert timing == {"failover_pause_s", "reconfiguration_s"}
    assert bert.on_demand_value == pytest.approx(1.1, abs=1e-3)


def test_profile_errors_name_the_file_and_key(tmp_path: Path) -> None:
    document = load_profile("gpt2").to_dict()
    del document["prices"]["spot_per_node_hour"]
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ProfileError, match=r"mine\.json: missing key 'prices\.spot_per_node_hour'"):
        load_profile(path)
    document = load_profile("gpt2").to_dict()
    document["step_time_ms"] = [e for e in document["step_time_ms"] if e["pipelines"] != 2]
    path.write_text(json.dumps(document))
    with pytest.raises(ProfileError, match="no step time for stages=12, pipelines=2"):
        load_profile(path)
