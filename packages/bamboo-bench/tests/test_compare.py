"""``bamboo-bench compare`` without running any system: its errors (unknown system, too few nodes for one
pipeline, a malformed trace) through the CLI and their messages, the trace each system's market replays,
the simulated trace of a run, the profile at full scale, and the ``--json`` records on hand-made results.

The end-to-end run (the three systems measured, the profiles' round trip) is tests/e2e/test_compare_e2e.py.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import attrs
import pytest
from bamboo.bench.cli import main
from bamboo.bench.loaders import load_trace, write_generic_csv
from bamboo.bench.measured.cli import print_comparison
from bamboo.bench.measured.compare import (
    Comparison,
    SystemResult,
    _long_run,
    bamboo_mode,
    full_scale_profile,
    prepare_trace,
    simulation_trace,
    window_figures,
)
from bamboo.bench.measured.options import CompareError, CompareOptions, parse_systems
from bamboo.bench.measured.steady import SteadySteps, steady_step_ms
from bamboo.bench.preemptions import PreemptionsError
from bamboo.bench.profile import ModelProfile
from bamboo.bench.simulator import Policy, RunResult, Strategy, simulate_run
from bamboo.bench.trace import EventKind, Trace, TraceEvent
from bamboo.launch.events import EventLog, RedundancyChoice, Step
from rich.console import Console


def _options(tmp_path: Path, **changes: object) -> CompareOptions:
    values: dict[str, object] = {"preemptions": "synthetic:0.33", "nodes": 4, "stages": 2, "pipelines": 2,
                                 "out": tmp_path / "out", "duration_s": 30.0}
    values.update(changes)
    return CompareOptions(**values)  # type: ignore[arg-type]


def _cli_error(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    assert main(argv) == 2
    return capsys.readouterr().err


def test_unknown_system_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = _cli_error(capsys, ["compare", "--preemptions", "synthetic:0.33", "--nodes", "4", "--stages", "2",
                              "--pipelines", "2", "--steps", "5", "--systems", "bamboo,spot", "--out", str(tmp_path)])
    assert "bamboo-bench: error: unknown system 'spot' in --systems; choose from bamboo, checkpoint, on-demand" in err


def test_too_few_nodes_for_one_pipeline(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    err = _cli_error(capsys, ["compare", "--preemptions", "synthetic:0.33", "--nodes", "3", "--stages", "4",
                              "--pipelines", "1", "--steps", "5", "--out", str(tmp_path)])
    assert "bamboo-bench: error: --nodes 3 is too few for one pipeline of 4 stages (--stages 4)" in err
    err = _cli_error(capsys, ["compare", "--preemptions", "synthetic:0.33", "--nodes", "4", "--stages", "2",
                              "--pipelines", "3", "--steps", "5", "--out", str(tmp_path)])
    assert "--nodes 4 cannot hold 3 pipelines of 2 stages (needs at least 6)" in err


def test_malformed_trace_names_file_and_line(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text("time_s,event,node,zone\n0,add,node1,a\nsoon,remove,node1,a\n")
    err = _cli_error(capsys, ["compare", "--preemptions", str(trace), "--nodes", "4", "--stages", "2",
                              "--pipelines", "1", "--steps", "5", "--out", str(tmp_path / "out")])
    assert f"bamboo-bench: error: {trace}:3:" in err
    assert not (tmp_path / "out" / "runs").exists()  # nothing ran


def test_other_bad_input(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(PreemptionsError, match="needs a number RATE in \\[0, 1\\], got 'often'"):
        prepare_trace(_options(tmp_path, preemptions="synthetic:often"))
    with pytest.raises(PreemptionsError, match="no such file"):
        prepare_trace(_options(tmp_path, preemptions=str(tmp_path / "missing.csv")))
    with pytest.raises(CompareError, match="give --steps S or --duration SECONDS"):
        _options(tmp_path, steps=5)
    with pytest.raises(CompareError, match="trains the built-in example only"):
        _options(tmp_path, script=("train.py",))
    with pytest.raises(SystemExit):
        main(["simulate", "--trace", "x.csv", "--", "train.py"])
    assert "only compare and measure take a script after --, got 'train.py'" in capsys.readouterr().err


def test_systems_run_in_a_fixed_order() -> None:
    assert parse_systems("on-demand, bamboo") == ("bamboo", "on-demand")
    with pytest.raises(CompareError, match="at least one"):
        parse_systems(" , ")


def test_trace_too_small_for_the_pipelines(tmp_path: Path) -> None:
    trace = tmp_path / "two.csv"
    trace.write_text("time_s,event,node,zone\n0,add,n1,a\n0,add,n2,b\n")
    with pytest.raises(CompareError, match="starts with 2 nodes; 2 pipelines of 2 stages need 4"):
        prepare_trace(_options(tmp_path, preemptions=str(trace)))


def test_duration_cuts_the_trace_to_its_trace_time(tmp_path: Path) -> None:
    trace = prepare_trace(_options(tmp_path, nodes=8, duration_s=30.0, time_scale=120.0, seed=0))
    assert trace.duration_s == pytest.approx(3600.0)  # 30 wall s at 120x
    assert trace.alive_at_start() >= 8


def test_simulation_trace_compresses_and_delays_after_the_start() -> None:
    events = [TraceEvent(0.0, EventKind.ADD, "n1", "a"), TraceEvent(0.0, EventKind.ADD, "n2", "a"),
              TraceEvent(600.0, EventKind.REMOVE, "n2", "a")]
    trace = Trace.from_events("t", events, duration_s=1200.0)
    replayed = simulation_trace(trace, 60.0, 5.0, None)
    assert [e.time_s for e in replayed.events()] == [0.0, 0.0, 15.0]  # 600 / 60 + 5
    assert replayed.duration_s == pytest.approx(25.0)
    assert simulation_trace(trace, 60.0, 5.0, 12.0).duration_s == pytest.approx(15.0)  # the last event's time


def test_full_scale_profile_keeps_the_rate_per_pipeline(tiny_profile: ModelProfile) -> None:
    big = full_scale_profile(tiny_profile, 8, None, "big")
    assert big.pipelines == 8 and big.samples_per_step == pytest.approx(40)
    assert big.step_time_s(8) == pytest.approx(1.0)  # the measured 2-pipeline step, each pipeline its share
    assert big.step_time_s(4) == pytest.approx(2.0)
    assert big.on_demand_nodes == 32 and big.on_demand_samples_per_second == pytest.approx(48.0)


def _result(tmp_path: Path, system: str, predicted: RunResult, throughput: float = 1.0,
            value: float = 1.0) -> SystemResult:
    return SystemResult(system=system, throughput=throughput, node_hours=0.1, avg_nodes=4.0, cost=0.1,
                        cost_per_hour=4.0, value=value, redone_steps=2, lost_s=3.0, steps=10, duration_s=90.0,
                        price=1.0, profile=tmp_path / f"{system}.json", run_dir=tmp_path / system,
                        simulate_command=("x",), predicted=predicted, measured={}, timeline={})


def test_records_carry_the_contract_keys_and_ratios(tmp_path: Path, tiny_profile: ModelProfile) -> None:
    trace = Trace.from_events("t", [TraceEvent(0.0, EventKind.ADD, f"n{i}", "ab"[i % 2]) for i in range(8)],
                              duration_s=100.0)
    predicted = simulate_run(trace, tiny_profile, Strategy.BAMBOO, policy=Policy(), target_samples=math.inf,
                             until_s=100.0)

    results = {"bamboo": _result(tmp_path, "bamboo", predicted, 8.0, 2.0),
               "checkpoint": _result(tmp_path, "checkpoint", predicted, 2.0, 0.5),
               "on-demand": _result(tmp_path, "on-demand", predicted, 10.0, 1.0)}
    comparison = Comparison(options=_options(tmp_path), trace=trace, results=results, long_run=None)
    records = comparison.records()
    assert [r["system"] for r in records] == ["bamboo", "checkpoint", "on-demand"]
    for record in records:
        assert {"system", "throughput", "node_hours", "cost", "value", "redone_steps", "lost_s"} <= set(record)
    assert records[0]["vs_checkpoint"] == {"throughput": 4.0, "value": 4.0}
    assert records[0]["vs_on_demand"] == {"throughput": 0.8, "value": 2.0}
    assert records[0]["throughput_error"] == pytest.approx((predicted.throughput - 8.0) / 8.0)
    assert attrs.evolve(results["bamboo"], throughput=predicted.throughput).throughput_error == 0.0


def test_a_run_stopped_while_restarting_is_charged_its_whole_window() -> None:
    """Stopped 90 s after its first step (which ended 30 s in), having trained 672 samples until 35 s: the
    window is 120 s, the 85 s after the last step are lost beside the report's 30 s."""
    report = {"training_s": 35.0, "samples": 672, "lost_s": 30.0}
    window, throughput, lost = window_figures(report, 30.0, 90.0)
    assert (window, throughput, lost) == (120.0, pytest.approx(5.6), 115.0)
    assert window_figures(report, 30.0, None) == (35.0, pytest.approx(19.2), 30.0)  # --steps: the report's


def test_the_long_run_command_reproduces_the_long_run(tmp_path: Path, tiny_profile: ModelProfile,
                                                      capsys: pytest.CaptureFixture[str]) -> None:
    # 6 nodes at the peak make one pipeline of 4 at full scale: the trace has 2 nodes more than it wants, so
    # the printed command must hold every node of the trace, as the long run does.
    events = [TraceEvent(0.0, EventKind.ADD, f"n{i}", "ab"[i % 2]) for i in range(6)]
    events.append(TraceEvent(1800.0, EventKind.REMOVE, "n0", "a"))
    trace_file = tmp_path / "long.csv"
    write_generic_csv(Trace.from_events("long", events, duration_s=3600.0), trace_file)
    (tmp_path / "bamboo.json").write_text(json.dumps(tiny_profile.to_dict()))
    options = _options(tmp_path, stages=4, pipelines=1, long_run=trace_file)
    (options.out / "profiles").mkdir(parents=True)  # run_compare makes it before the runs
    predicted = simulate_run(load_trace(trace_file), tiny_profile, Strategy.BAMBOO, policy=Policy(),
                             target_samples=math.inf, until_s=100.0)
    long_run = _long_run(options, {"bamboo": _result(tmp_path, "bamboo", predicted)}, None)
    assert long_run.pipelines == 1 and long_run.results["bamboo"].nodes == pytest.approx(5.5)
    comparison = Comparison(options=options, trace=load_trace(trace_file), results={}, long_run=long_run)
    console = Console(width=400, record=True)
    print_comparison(comparison, console)
    command = next(line for line in console.export_text().splitlines() if line.startswith("long run bamboo:"))
    words = command.split(": ", 1)[1].split()
    assert words[:2] == ["bamboo-bench", "simulate"] and words[-2:] == ["--hold", "trace"]
    capsys.readouterr()
    assert main([*words[1:], "--json"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed["nodes"] == pytest.approx(5.5)
    assert printed["throughput"] == pytest.approx(long_run.results["bamboo"].throughput)


def _write_bamboo_run(run_dir: Path, modes: dict[int, str], steps_per_generation: dict[int, int]) -> None:
    run_dir.mkdir(parents=True)
    log = EventLog(run_dir / "events.jsonl")
    for generation, mode in modes.items():
        log.write(RedundancyChoice(t=0.0, generation=generation, mode=mode, reason="test",
                                   lost_s_per_hour={mode: 1.0}, step_s=0.1, preemptions_per_node_hour=0.3))
    step = 0
    for generation, count in steps_per_generation.items():
        for _ in range(count):
            log.write(Step(t=float(step), step=step, samples=8, loss=1.0, nodes_active=4, duration_s=0.1,
                           generation=generation))
            step += 1
    log.close()


def test_the_bamboo_run_s_mode_is_the_one_most_of_its_steps_trained_with(tmp_path: Path) -> None:
    _write_bamboo_run(tmp_path / "run", {0: "eflb", 1: "lflb"}, {0: 2, 1: 5})
    assert bamboo_mode(tmp_path / "run", "auto") == "lflb"
    assert bamboo_mode(tmp_path / "run", "efeb") == "efeb"  # a fixed mode is the mode


def test_the_long_run_scales_one_measured_step_by_the_fault_free_ratios(tmp_path: Path,
                                                                         tiny_profile: ModelProfile) -> None:
    """on-demand measured 1,000 ms with 2 pipelines (the tiny profile); one core per stage, none took 25 ms,
    DeepSpeed 20 ms and lflb 30 ms: checkpoint/restart's full-scale step is 800 ms and bamboo's 1,200 ms."""
    events = [TraceEvent(0.0, EventKind.ADD, f"n{i}", "ab"[i % 2]) for i in range(8)]
    trace_file = tmp_path / "long.csv"
    write_generic_csv(Trace.from_events("long", events, duration_s=3600.0), trace_file)
    options = _options(tmp_path, nodes=8, stages=4, pipelines=2, long_run=trace_file)
    (options.out / "profiles").mkdir(parents=True)
    predicted = simulate_run(load_trace(trace_file), tiny_profile, Strategy.BAMBOO, policy=Policy(),
                             target_samples=math.inf, until_s=100.0)
    results = {}
    for system in ("bamboo", "checkpoint", "on-demand"):
        (tmp_path / f"{system}.json").write_text(json.dumps(tiny_profile.to_dict()))
        results[system] = _result(tmp_path, system, predicted)
    _write_bamboo_run(tmp_path / "bamboo", {0: "lflb"}, {0: 3})
    steady = SteadySteps(ms={"deepspeed": 20.0, "none": 25.0, "lflb": 30.0}, stages=2, cores=2,
                         command=("-m", "bamboo.bench.measured.steady"))
    long_run = _long_run(options, results, steady)
    assert long_run.step_ms == pytest.approx({"bamboo": 1200.0, "checkpoint": 800.0, "on-demand": 1000.0})
    assert any("one core per stage" in note for note in long_run.notes)
    slower = _long_run(attrs.evolve(options, steady=False), results, None)  # the emulated runs' own steps
    assert slower.step_ms == pytest.approx({"bamboo": 1000.0, "checkpoint": 1000.0, "on-demand": 1000.0})
    assert long_run.results["checkpoint"].throughput > slower.results["checkpoint"].throughput


def test_the_fault_free_steps_are_measured_in_a_process_of_their_own(tmp_path: Path) -> None:
    steady = steady_step_ms(["none", "lflb"], layers=2, stages=2, out=tmp_path, steps=2, repeats=1)
    assert set(steady.ms) == {"none", "lflb"} and all(ms > 0 for ms in steady.ms.values())
    assert steady.stages == min(2, steady.cores) and "bamboo.bench.measured.steady" in steady.command
    assert "none" in (tmp_path / "steady.log").read_text()


def test_the_fault_free_measurement_names_a_bad_variant(capsys: pytest.CaptureFixture[str]) -> None:
    from bamboo.bench.measured.steady import main as steady_main

    with pytest.raises(SystemExit) as exit_info:
        steady_main(["--variants", "deepspeed,fast"])
    assert exit_info.value.code == 2
    assert "--variants takes some of deepspeed, none, lflb, eflb, efeb, got 'deepspeed,fast'" in capsys.readouterr().err
