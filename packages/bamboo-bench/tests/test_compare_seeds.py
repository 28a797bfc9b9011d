"""``compare --seeds N``: one comparison per seed, each in its own folder, summarised by median and range."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from bamboo.bench.measured import seeds as seeds_module
from bamboo.bench.measured.cli import print_spread
from bamboo.bench.measured.compare import Comparison, SystemResult
from bamboo.bench.measured.options import CompareError, CompareOptions
from bamboo.bench.measured.seeds import Spread, run_seeds, spread_records, summarise
from bamboo.bench.profile import ModelProfile
from bamboo.bench.simulator import Policy, Strategy, simulate_run
from bamboo.bench.trace import EventKind, Trace, TraceEvent
from rich.console import Console

# throughput of bamboo and checkpoint/restart per seed; on-demand makes 10 samples/s and costs 4x per node-hour
THROUGHPUT = {5: (8.0, 2.0), 6: (6.0, 3.0), 7: (9.0, 1.0)}


def _fake_compare(tiny_profile: ModelProfile):  # type: ignore[no-untyped-def]
    trace = Trace.from_events("t", [TraceEvent(0.0, EventKind.ADD, f"n{i}", "a") for i in range(4)], duration_s=10.0)
    predicted = simulate_run(trace, tiny_profile, Strategy.BAMBOO, policy=Policy(), target_samples=math.inf,
                             until_s=10.0)

    def run_compare(options: CompareOptions, status: object = None) -> Comparison:
        def result(system: str, throughput: float, price: float) -> SystemResult:
            return SystemResult(system=system, throughput=throughput, node_hours=0.1, avg_nodes=4.0, cost=0.1,
                                cost_per_hour=4.0 * price, value=throughput / (4.0 * price), redone_steps=0,
                                lost_s=0.0, steps=10, duration_s=10.0, price=price, profile=options.out / "p.json",
                                run_dir=options.out, simulate_command=("x",), predicted=predicted, measured={},
                                timeline={})

        bamboo, checkpoint = THROUGHPUT[options.seed]
        results = {"bamboo": result("bamboo", bamboo, 1.0), "checkpoint": result("checkpoint", checkpoint, 1.0),
                   "on-demand": result("on-demand", 10.0, 4.0)}
        return Comparison(options=options, trace=trace, results=results, long_run=None)

    return run_compare


def test_each_seed_runs_in_its_own_folder_and_ratios_are_taken_within_a_seed(
        tmp_path: Path, tiny_profile: ModelProfile, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seeds_module, "run_compare", _fake_compare(tiny_profile))
    options = CompareOptions(preemptions="synthetic:0.33", nodes=4, stages=2, pipelines=2, out=tmp_path,
                             duration_s=10.0, seed=5)
    comparisons = run_seeds(options, 3)
    assert [c.options.seed for c in comparisons] == [5, 6, 7]
    assert [c.options.out for c in comparisons] == [tmp_path / f"seed-{s}" for s in (5, 6, 7)]
    bamboo = summarise(comparisons)[0]
    assert bamboo.system == "bamboo"
    assert bamboo.throughput == Spread(8.0, 6.0, 9.0, (8.0, 6.0, 9.0))
    # per seed 4x, 2x, 9x: the median of the ratios (4x), not the ratio of the medians (8 / 2)
    assert bamboo.vs_checkpoint_throughput == Spread(4.0, 2.0, 9.0, (4.0, 2.0, 9.0))
    assert bamboo.vs_on_demand_value is not None and bamboo.vs_on_demand_value.median == pytest.approx(3.2)
    records = spread_records(comparisons)
    assert [r["system"] for r in records] == ["bamboo", "checkpoint", "on-demand"]
    assert records[0]["vs_checkpoint"] == {"throughput": 4.0, "value": 4.0}
    assert records[1]["vs_checkpoint"] is None  # checkpoint against itself
    assert records[0]["seeds"] == [5, 6, 7] and len(records[0]["runs"]) == 3
    assert records[0]["spread"]["throughput"] == {"median": 8.0, "min": 6.0, "max": 9.0, "values": [8.0, 6.0, 9.0]}
    json.dumps(records)
    console = Console(record=True, width=200)
    print_spread(summarise(comparisons), options, console)
    text = console.export_text()
    assert "median (range) over 3 seeds from 5" in text and "4.00x (2.00x to 9.00x)" in text


def test_seeds_must_be_positive(tmp_path: Path) -> None:
    options = CompareOptions(preemptions="synthetic:0.33", nodes=4, stages=2, pipelines=2, out=tmp_path,
                             duration_s=10.0)
    with pytest.raises(CompareError, match="--seeds must be >= 1, got 0"):
        run_seeds(options, 0)


def _failing_at(seed: int, message: str, tiny_profile: ModelProfile):  # type: ignore[no-untyped-def]
    """The fake comparison, except that seed ``seed`` fails with ``message``."""
    fake = _fake_compare(tiny_profile)

    def flaky(options: CompareOptions, status: object = None) -> Comparison:
        if options.seed == seed:
            raise CompareError(message)
        return fake(options, status)

    return flaky


def test_a_failed_seed_is_reported_and_the_others_still_run(
        tmp_path: Path, tiny_profile: ModelProfile, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(seeds_module, "run_compare", _failing_at(
        6, "the checkpoint run failed (exit status 1): rendezvous timed out", tiny_profile))
    options = CompareOptions(preemptions="synthetic:0.33", nodes=4, stages=2, pipelines=2, out=tmp_path,
                             duration_s=10.0, seed=5)
    with pytest.raises(CompareError, match="rendezvous timed out"):
        run_seeds(options, 3)  # without on_failure, the first failure ends the run
    failed: dict[int, str] = {}
    comparisons = run_seeds(options, 3, on_failure=lambda seed, error: failed.update({seed: str(error)}))
    assert [c.options.seed for c in comparisons] == [5, 7]
    assert list(failed) == [6] and "rendezvous timed out" in failed[6]
    records = spread_records(comparisons, failed)
    assert records[0]["seeds"] == [5, 7] and records[0]["vs_checkpoint"]["throughput"] == pytest.approx(6.5)
    assert records[0]["failed_seeds"] == {"6": failed[6]}


def test_the_command_prints_the_finished_seeds_and_exits_1_naming_the_failed_one(
        tmp_path: Path, tiny_profile: ModelProfile, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    from bamboo.bench.cli import main

    monkeypatch.setattr(seeds_module, "run_compare", _failing_at(7, "the bamboo run printed no result", tiny_profile))
    code = main(["compare", "--preemptions", "synthetic:0.33", "--nodes", "4", "--stages", "2", "--pipelines", "2",
                 "--duration", "10", "--seed", "5", "--seeds", "3", "--out", str(tmp_path), "--json"])
    captured = capsys.readouterr()
    assert code == 1
    records = json.loads(captured.out)
    assert records[0]["seeds"] == [5, 6] and records[0]["failed_seeds"] == {"7": "the bamboo run printed no result"}
    assert "1 of 3 seeds failed (7)" in captured.err + captured.out
