"""The paper's tables as data (``bamboo.bench.paper``), the P = 1 profiles behind the pure data-parallel table,
the comparison arithmetic, a small reproduction and ``bamboo-bench paper`` (few seeds; the full run is in the
README)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from bamboo.bench.cli import main
from bamboo.bench.paper import (
    ComparedCell,
    PaperTable,
    PaperTableError,
    builtin_tables,
    cell_text,
    load_table,
    reproduce,
)
from bamboo.bench.profile import builtin_profiles, load_profile
from bamboo.bench.simulator import Strategy


def _document(**changes: object) -> dict[str, object]:
    document: dict[str, object] = {
        "format": 1, "key": "t", "title": "T", "source": "S", "models": ["resnet-dp"],
        "strategies": ["bamboo", "on-demand"], "probabilities": [0.1], "metrics": ["throughput", "value"],
        "tolerances": {"throughput": 0.1},
        "figures": [{"model": "resnet-dp", "strategy": "on-demand", "metric": "throughput",
                     "by_probability": {"0.1": 295.38}}],
    }
    document.update(changes)
    return document


def test_shipped_tables_load_and_name_shipped_profiles() -> None:
    assert {"dp", "table6"} <= set(builtin_tables())
    dp = load_table("dp")
    assert dp.models == ("resnet-dp", "vgg-dp")
    assert dp.probabilities == (0.1, 0.16, 0.33)
    assert dp.strategies == (Strategy.BAMBOO, Strategy.CHECKPOINT, Strategy.ON_DEMAND)
    assert {(r.metric, r.value) for r in dp.ratios} == {("throughput", 1.64), ("value", 1.22)}
    assert dp.tolerances == {"throughput": 0.1, "value": 0.1}
    table6 = load_table("table6")
    assert table6.figure("bert-table6", Strategy.BAMBOO, 0.5, "value") == 1.59
    assert table6.figure("bert-table6", Strategy.BAMBOO, 0.5, "preemptions") is None
    for table in (dp, table6):
        assert set(table.models) <= set(builtin_profiles())


@pytest.mark.parametrize(
    ("name", "replicas", "without", "on_demand_step_s"),
    [("resnet-dp", 30, 20, 1.3), ("vgg-dp", 24, 16, 2.2)],
)
def test_data_parallel_profiles_follow_the_published_constants(
    name: str, replicas: int, without: int, on_demand_step_s: float
) -> None:
    profile = load_profile(name)
    assert profile.stages == 1
    # The paper's 1.5x over-provisioning, against the on-demand cluster of the published simulator.
    assert profile.pipelines == replicas == 1.5 * without
    assert profile.pipelines_for(redundancy=False) == without == profile.on_demand_nodes
    assert profile.samples_per_step == 384
    assert profile.on_demand_samples_per_second == pytest.approx(384 / on_demand_step_s, abs=0.01)
    # Without redundancy at full size: the on-demand step; with overbatching: at most 10% slower.
    assert profile.step_time_s(without, redundancy=False) == pytest.approx(on_demand_step_s)
    assert profile.step_time_s(replicas) == pytest.approx(1.1 * on_demand_step_s)
    # Ideal data parallelism at a fixed global batch: d replicas take full/d of the work each.
    assert profile.step_time_s(1) == pytest.approx(replicas * profile.step_time_s(replicas), rel=1e-6)
    assert profile.step_time_s(1, redundancy=False) == pytest.approx(without * on_demand_step_s, rel=1e-6)
    assert profile.timing.checkpoint_interval_s == 1800  # the shipped default, not fitted to the table
    assert profile.timing.restart_s == 0


def test_relative_error_and_tolerance_by_hand() -> None:
    cell = ComparedCell("m", 0.1, Strategy.BAMBOO, "value", simulated=1.08, paper=1.0, tolerance=0.1)
    assert cell.relative_error == pytest.approx(0.08)
    assert cell.within is True
    assert ComparedCell("m", 0.1, Strategy.BAMBOO, "value", 1.12, 1.0, 0.1).within is False
    assert ComparedCell("m", 0.1, Strategy.BAMBOO, "value", 0.89, 1.0, 0.1).within is False
    assert ComparedCell("m", 0.1, Strategy.BAMBOO, "value", 0.89, 1.0, None).within is None
    assert ComparedCell("m", 0.1, Strategy.BAMBOO, "value", 0.89, None, 0.1).relative_error is None
    assert cell_text(85.644, 87.99) == "85.64 / 87.99 (-2.7%)"
    assert cell_text(1.0, None, 3) == "1.000"


@pytest.mark.parametrize(
    ("changes", "words"),
    [
        ({"format": 2}, "'format' must be 1"),
        ({"metrics": ["speed"]}, "unknown metric 'speed'"),
        ({"probabilities": [0.1, 0.1]}, "probabilities repeats a value"),
        ({"probabilities": [0.1, 1.5]}, "'probabilities' must be <= 1: 1.5"),
        ({"figures": [{"model": "resnet-dp", "strategy": "bamboo", "metric": "value", "by_probability": {"-0.1": 1}}]},
         "'probability' must be >= 0: -0.1"),
        ({"tolerances": {"nodes": 0.1}}, "a tolerance for 'nodes'"),
        ({"tolerances": {"throughput": 0}}, "must be > 0, got 0.0"),
        ({"figures": [{"model": "vgg-dp", "strategy": "bamboo", "metric": "value", "by_probability": {"0.1": 1}}]},
         "model and strategy must be among"),
        ({"figures": [{"model": "resnet-dp", "strategy": "bamboo", "metric": "value", "by_probability": {"0.2": 1}}]},
         "probability and metric must be among"),
        ({"figures": [{"model": "resnet-dp", "strategy": "bamboo"}]}, "needs model, strategy, metric and by_probability"),
        ({"ratios": [{"metric": "value", "numerator": "bamboo", "denominator": "checkpoint", "value": 1.2}]},
         "needs both strategies"),
        ({"strategies": ["bamboo", "sideways"]}, "sideways"),
    ],
)
def test_bad_tables_name_the_bad_value(changes: dict[str, object], words: str) -> None:
    with pytest.raises(PaperTableError, match=r"x\.json") as caught:
        PaperTable.from_dict(_document(**changes), "x.json")
    assert words in str(caught.value)


def test_load_table_errors(tmp_path: Path) -> None:
    with pytest.raises(PaperTableError, match="unknown paper table 'nosuch'; shipped: dp, table6"):
        load_table("nosuch")
    broken = tmp_path / "broken.json"
    broken.write_text("{", encoding="utf-8")
    with pytest.raises(PaperTableError, match=r"broken\.json:1: not JSON"):
        load_table(broken)
    with pytest.raises(PaperTableError, match="cannot read"):
        load_table(tmp_path / "absent.json")


def test_a_small_reproduction_of_the_dp_table() -> None:
    table = load_table("dp")
    reproduction = reproduce(table, 4, workers=1)
    assert len(reproduction.cells) == 2 * 3 * 3 * 2
    for model in table.models:
        profile = load_profile(model)
        for probability in table.probabilities:
            bamboo = reproduction.results[(model, Strategy.BAMBOO, probability)]
            checkpoint = reproduction.results[(model, Strategy.CHECKPOINT, probability)]
            on_demand = reproduction.results[(model, Strategy.ON_DEMAND, probability)]
            assert on_demand.throughput == pytest.approx(profile.on_demand_samples_per_second)
            assert on_demand.value == pytest.approx(profile.on_demand_value)
            # The table's claim, cell by cell: overbatching on 1.5x the replicas beats checkpoint/restart.
            assert bamboo.throughput > checkpoint.throughput
            assert bamboo.value > on_demand.value
            assert bamboo.completed_runs == checkpoint.completed_runs == 4
    for compared in reproduction.ratios:
        assert len(compared.per_cell) == 6
        by_hand = [
            getattr(reproduction.results[(m, compared.ratio.numerator, p)], compared.ratio.metric)
            / getattr(reproduction.results[(m, compared.ratio.denominator, p)], compared.ratio.metric)
            for m in table.models for p in table.probabilities
        ]
        assert compared.simulated == pytest.approx(sum(by_hand) / 6)
        assert compared.within is not None
    assert reproduction.checked == 2  # the two aggregates: the per-cell figures are not available here


def test_paper_command_prints_simulated_against_published(capsys) -> None:
    assert main(["paper", "dp", "--runs", "2", "--workers", "1"]) == 0
    text = capsys.readouterr().out
    for words in ("resnet-dp", "vgg-dp", "0.33", "bamboo / checkpoint throughput", "1.64", "1.22",
                  "checked 2 figure(s)", "not here:"):
        assert words in text


def test_paper_command_json_and_strict(tmp_path: Path, capsys) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_document()), encoding="utf-8")
    assert main(["paper", str(good), "--runs", "1", "--workers", "1", "--json", "--strict"]) == 0
    rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert len(rows) == 4
    checked = [row for row in rows if row["within"] is not None]
    assert checked == [{"table": "t", "runs": 1, "kind": "cell", "model": "resnet-dp", "prob": 0.1,
                        "strategy": "on-demand", "metric": "throughput", "simulated": 295.38, "paper": 295.38,
                        "relative_error": 0.0, "tolerance": 0.1, "within": True}]
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_document(figures=[
        {"model": "resnet-dp", "strategy": "on-demand", "metric": "throughput", "by_probability": {"0.1": 200}},
    ])), encoding="utf-8")
    assert main(["paper", str(bad), "--runs", "1", "--workers", "1"]) == 0  # reports only
    assert "1 outside: throughput of on-demand on resnet-dp at p=0.1" in capsys.readouterr().out
    assert main(["paper", str(bad), "--runs", "1", "--workers", "1", "--strict"]) == 1


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["paper", "nosuch"], "unknown paper table 'nosuch'"),
        (["paper", "dp", "--runs", "0"], "--runs must be >= 1, got 0"),
        (["paper", "dp", "--workers", "0"], "--workers must be >= 1, got 0"),
        (["paper", "dp", "--bulk-mean", "0.5"], "--bulk-mean must be >= 1"),
    ],
)
def test_paper_command_errors_are_one_line(argv: list[str], words: str, capsys) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and err.startswith("bamboo-bench: error:") and words in err


def test_paper_command_checkpoint_settings_apply_to_every_model(capsys) -> None:
    def ratios(*extra: str) -> dict[str, float]:
        assert main(["paper", "dp", "--runs", "2", "--workers", "1", "--json", *extra]) == 0
        rows = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
        on_demand = {row["simulated"] for row in rows if row.get("strategy") == "on-demand"}
        assert on_demand == {295.38, 174.55, 4.8265, 3.5652}  # the reference never depends on them
        return {row["metric"]: row["simulated"] for row in rows if row["kind"] == "ratio"}

    shipped = ratios()
    longer = ratios("--checkpoint-interval", "3600")
    # Same seeds, same traces: a longer interval loses more work per checkpoint/restart restart.
    assert longer["throughput"] > shipped["throughput"] and longer["value"] > shipped["value"]
    assert ratios("--restart-s", "300")["throughput"] > shipped["throughput"]
