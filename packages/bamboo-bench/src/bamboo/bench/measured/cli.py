"""The ``bamboo-bench compare`` and ``bamboo-bench measure`` subcommands: their arguments, progress and tables.

:func:`add_parsers` registers both on ``bamboo-bench``'s parser; :func:`run_command` runs the one parsed.
``compare`` prints the measured table, the simulator's predictions of each run beside the measured figures
with the error, the checkpoint/restart interval and how it was chosen, the ``bamboo-bench simulate`` command of
each prediction, and the long-run picture (``--long-run FILE``); ``--json`` prints a JSON list instead, one
object per system. ``measure`` runs one system (``compare`` runs it once per system, in a process of its own)
and prints its report and measured profile, or with ``--json`` the JSON that ``compare`` reads.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path

import attrs
from bamboo.bench import timeouts
from bamboo.bench.argtypes import PREEMPTIONS_HELP, default_of, positive_float, positive_int, zones
from bamboo.bench.emulated.stop_signals import stopped_like_ctrl_c
from bamboo.bench.measured.compare import Comparison, default_out, prepare_trace, run_compare
from bamboo.bench.measured.figure import plot_comparison
from bamboo.bench.measured.options import (
    BAMBOO_REDUNDANCY,
    SYSTEMS,
    CompareError,
    CompareOptions,
    MeasureOptions,
    parse_systems,
)
from bamboo.bench.measured.run import run_measured
from bamboo.bench.measured.seeds import Spread, SystemSpread, run_seeds, spread_records, summarise
from bamboo.bench.preemptions import size_notice
from bamboo.bench.value import Report, format_report
from bamboo.launch.cli.common import steps_or_auto_flag
from bamboo.launch.spec import REDUNDANCY
from rich.console import Console
from rich.table import Table

__all__ = ["COMMANDS", "add_parsers", "print_comparison", "run_command"]

COMMANDS = ("compare", "measure")
"""The subcommands of ``bamboo-bench`` this module adds."""

def add_parsers(commands: argparse._SubParsersAction) -> None:
    """Register ``compare`` and ``measure`` on ``bamboo-bench``'s subcommands."""
    _add_compare(commands)
    _add_measure(commands)


def _add_compare(commands: argparse._SubParsersAction) -> None:
    compare = commands.add_parser(
        "compare",
        help="measure Bamboo, checkpoint/restart and on-demand on one replayed trace, and check the simulator",
        usage=("bamboo-bench compare --preemptions FILE|synthetic:RATE [--time-scale X] --nodes N --stages P "
               "--pipelines D (--steps S | --duration SECONDS) [--systems bamboo,checkpoint,on-demand] "
               "[--spot-price P] [--on-demand-price P] [--json] [--plot OUT.png] [options] [-- SCRIPT ARGS]"),
        description=(
            "Train the same model with each system, one after the other, on the same emulated spot market "
            "(each system runs as `bamboo-bench measure SYSTEM` in a process of its own). "
            "bamboo: bamboo-launch with redundant computation (--redundancy, auto by default). checkpoint: torchrun elastic agents (one per node, "
            "the rendezvous on a store the market never preempts) training DeepSpeed's PipelineEngine on the same "
            "model, global batch and data order, with DeepSpeed checkpoints every K steps (K by Young's rule, "
            "printed); every membership change restarts the workers from the last checkpoint, and with fewer than "
            "P x D nodes it drops to fewer pipelines. on-demand: the same model on P x D nodes, no preemptions, at "
            "on-demand prices. Trace time runs from each system's first step; with --duration each system is "
            "stopped that many wall seconds after it. Prints one table (throughput, node-hours, cost, value, steps "
            "redone, time lost, ratios against checkpoint and on-demand), then the simulator's prediction of each "
            "run from the profile that run measured (OUT/profiles/SYSTEM.json: step time per pipeline count, "
            "start-up, failover pause, reconfiguration, restart and checkpoint costs) on the same trace, measured "
            "and predicted side by side with the error, and the bamboo-bench simulate command of each. "
            "--long-run FILE also simulates the profiles at full scale on FILE, uncompressed (the long-run "
            "picture). Anything after -- is a training script for bamboo and on-demand (see bamboo-launch run)."
        ),
    )
    compare.add_argument("--preemptions", required=True, metavar="FILE|synthetic:RATE",
                         help=f"the trace every system replays: {PREEMPTIONS_HELP}")
    compare.add_argument("--time-scale", type=positive_float, default=default_of(CompareOptions, "time_scale"),
                         metavar="X", help="trace seconds per wall second (default: %(default)s)")
    compare.add_argument("--nodes", type=positive_int, required=True,
                         help="spot nodes at the start (a synthetic trace keeps about this many)")
    compare.add_argument("--stages", type=positive_int, required=True, help="pipeline depth P")
    compare.add_argument("--pipelines", type=positive_int, required=True, help="data-parallel pipelines D")
    length = compare.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=positive_int, help="each system trains this many steps")
    length.add_argument("--duration", type=positive_float, metavar="SECONDS",
                        help="each system trains this many wall seconds after its first step, then stops, or later "
                        "once its log gives a step time (3 steps at least, and an interval after the first free of "
                        "failovers, reconfigurations, restarts and checkpoints; the trace is cut to the same trace "
                        "time)")
    compare.add_argument("--systems", default=",".join(SYSTEMS),
                         help="comma-separated systems to run: bamboo, checkpoint, on-demand (default: all three)")
    _add_prices(compare, CompareOptions)
    compare.add_argument("--json", action="store_true",
                         help="print a JSON list, one object per system: system, throughput, node_hours, cost, value, "
                         "redone_steps, lost_s, and the ratios, predictions and errors")
    compare.add_argument("--plot", type=Path, metavar="OUT.png",
                         help="write the four-panel figure (nodes, throughput, cost, value; simulated dotted)")
    compare.add_argument("--out", type=Path, metavar="DIR",
                         help="where the trace, runs, profiles and simulated traces go (default: a new temporary "
                         "folder, kept and printed)")
    compare.add_argument("--hours", type=positive_float,
                         help="synthetic: the trace's length in trace hours (default: --duration's trace time, or 1)")
    compare.add_argument("--redundancy", choices=REDUNDANCY, default=BAMBOO_REDUNDANCY,
                         help="the bamboo system's redundancy mode (auto: chosen per generation from the measured step "
                         "and the preemption rate; on-demand always runs none; default: %(default)s)")
    compare.add_argument("--seeds", type=positive_int, default=1, metavar="N",
                         help="run the whole comparison N times, with trace seeds SEED .. SEED+N-1 (a synthetic trace "
                         "is drawn anew each time; a trace file is replayed again, which measures the run-to-run "
                         "noise), each in OUT/seed-S, and print each system's median and range (default: 1)")
    compare.add_argument("--seed", type=int, default=default_of(CompareOptions, "seed"),
                         help="synthetic: the trace's seed (default: %(default)s)")
    compare.add_argument("--zones", type=zones,
                         help="zone names: a synthetic trace's, or spread a trace with one zone round-robin over them")
    compare.add_argument("--layers", type=positive_int, default=default_of(CompareOptions, "layers"),
                         help="decoder blocks of the built-in example GPT (default: %(default)s)")
    compare.add_argument("--timeout", type=positive_float, default=default_of(CompareOptions, "timeout_s"), metavar="S",
                         help="seconds each system's run may take (default: %(default)s)")
    compare.add_argument("--long-run", type=Path, metavar="FILE",
                         help="also simulate the measured profiles at full scale on this trace, uncompressed (e.g. the "
                         "paper's EC2 p3 trace)")
    compare.add_argument("--long-run-nodes", type=positive_int, metavar="N",
                         help="nodes of the full-scale cluster (default: the long-run trace's peak)")
    compare.add_argument("--steady", action=argparse.BooleanOptionalAction, default=default_of(CompareOptions, "steady"),
                         help="with --long-run: measure each system's fault-free step one core per stage "
                         "(python -m bamboo.bench.measured.steady) and scale one measured step by those ratios, "
                         "instead of the emulated runs' steps, which share this machine's cores between every node "
                         "(default: on)")


def _add_prices(parser: argparse.ArgumentParser, options: type) -> None:
    parser.add_argument("--spot-price", type=positive_float, default=default_of(options, "spot_price"), metavar="P",
                        help="$/h per spot node (default: %(default)s, EC2 p3 in the paper)")
    parser.add_argument("--on-demand-price", type=positive_float, default=default_of(options, "on_demand_price"),
                        metavar="P", help="$/h per on-demand node (default: %(default)s)")


def _add_measure(commands: argparse._SubParsersAction) -> None:
    measure = commands.add_parser(
        "measure",
        help="run one system of a comparison (bamboo, checkpoint, on-demand) and write its measured profile",
        usage=("bamboo-bench measure {bamboo,checkpoint,on-demand} --nodes N --stages P --pipelines D "
               "[--preemptions FILE|synthetic:RATE] [--time-scale X] (--steps S | --duration SECONDS) "
               "--run-dir DIR [--json] [options] [-- SCRIPT ARGS...]"),
        description=(
            "Train the built-in example (or, for bamboo and on-demand, your script) with one system on the "
            "emulated spot market, print its report and write its measured profile (RUN_DIR/profile.json, "
            "bamboo-bench's format: step time per pipeline count, start-up, failover pause, reconfiguration, "
            "restart and checkpoint costs; bamboo-bench simulate --model takes it). bamboo: bamboo-launch run with "
            "--redundancy (auto by default) on the trace's nodes. checkpoint: torchrun elastic agents and DeepSpeed's "
            "PipelineEngine on the same model, global batch and data order, DeepSpeed checkpoints every K steps "
            "(K by Young's rule), every membership change restarting the workers from the last checkpoint, and "
            "fewer pipelines while nodes are short. on-demand: bamboo-launch run without redundancy and without "
            "preemptions on P x D nodes, priced at --on-demand-price. The run ends after --steps, or --duration "
            "wall seconds after its first step (every node is then stopped; trace time runs from the first step)."
        ),
    )
    measure.add_argument("system", choices=SYSTEMS, help="the system to run")
    measure.add_argument("--nodes", type=positive_int, required=True, help="initial spot cluster size; synthetic "
                         "traces keep about this many nodes (on-demand runs P x D)")
    measure.add_argument("--stages", type=positive_int, required=True, help="pipeline depth P")
    measure.add_argument("--pipelines", type=positive_int, required=True, help="data-parallel pipelines D")
    length = measure.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=positive_int, default=None, help="train this many steps")
    length.add_argument("--duration", type=positive_float, default=None, metavar="SECONDS",
                        help="train this many wall seconds after the first step, then stop every node (later when "
                        "the log gives no step time by then: 3 steps at least, and an interval after the first free "
                        "of failovers, reconfigurations, restarts and checkpoints)")
    measure.add_argument("--preemptions", default=None, metavar="FILE|synthetic:RATE",
                         help=f"preemption trace, not used by on-demand: {PREEMPTIONS_HELP} (default: none)")
    measure.add_argument("--time-scale", type=positive_float, default=default_of(MeasureOptions, "time_scale"),
                         help="trace seconds per wall second (default: %(default)s)")
    measure.add_argument("--hours", type=positive_float, default=default_of(MeasureOptions, "hours"),
                         help="synthetic only: trace length in hours (default: %(default)s)")
    measure.add_argument("--seed", type=int, default=default_of(MeasureOptions, "trace_seed"),
                         help="synthetic only: the trace's seed (default: %(default)s)")
    measure.add_argument("--zones", type=zones, default=None, help="zone names, comma separated (default: the "
                         "trace's own; synthetic: 3 zones)")
    measure.add_argument("--layers", type=positive_int, default=default_of(MeasureOptions, "layers"),
                         help="decoder blocks of the built-in example GPT (default: %(default)s)")
    measure.add_argument("--checkpoint-every", type=steps_or_auto_flag, default=default_of(MeasureOptions, "checkpoint_every"),
                         metavar="N|auto", help="bamboo: steps between its asynchronous checkpoints and in-memory "
                         "copies, or auto: each layout's by Young's rule (the baseline chooses K itself; default: "
                         "%(default)s)")
    measure.add_argument("--redundancy", choices=REDUNDANCY, default=BAMBOO_REDUNDANCY,
                         help="bamboo: its redundancy mode (on-demand always runs none; default: %(default)s)")
    measure.add_argument("--ttl", type=positive_int, default=default_of(MeasureOptions, "ttl"),
                         help="bamboo: node lease TTL, seconds (default: %(default)s)")
    measure.add_argument("--grace", type=positive_float, default=default_of(MeasureOptions, "grace_s"),
                         help="bamboo: seconds an unresponsive node has before it is declared failed (a killed "
                         "node's closed connections are seen at once; default: %(default)s)")
    measure.add_argument("--timeout", type=positive_float, default=default_of(MeasureOptions, "timeout_s"),
                         help="seconds the whole run may take (default: %(default)s)")
    measure.add_argument("--run-dir", required=True, help="where the run's files go (logs, events.jsonl, "
                         "profile.json)")
    _add_prices(measure, MeasureOptions)
    measure.add_argument("--json", action="store_true", help="print the result as one JSON object: system, "
                         "report, measurements, profile (its path), timeline, and the baseline's K and restarts")


def run_command(args: argparse.Namespace, console: Console, out: Console) -> int:
    """Run the parsed ``compare`` or ``measure`` (``args.script``: the words after --); SIGTERM and SIGHUP stop it
    as Ctrl-C does, its clusters cleaned up."""
    with stopped_like_ctrl_c():
        if args.command == "measure":
            return _run_measure(args)
        return _run_compare(args, console, out)


def _run_measure(args: argparse.Namespace) -> int:
    options = MeasureOptions(
        system=args.system, nodes=args.nodes, stages=args.stages, pipelines=args.pipelines, run_dir=args.run_dir,
        steps=args.steps, duration_s=args.duration, preemptions=args.preemptions, time_scale=args.time_scale,
        hours=args.hours, trace_seed=args.seed, zones=args.zones, layers=args.layers, script=tuple(args.script),
        checkpoint_every=args.checkpoint_every, ttl=args.ttl, grace_s=args.grace, timeout_s=args.timeout,
        spot_price=args.spot_price, on_demand_price=args.on_demand_price, redundancy=args.redundancy)

    def say(line: str) -> None:
        print(f"bamboo-bench measure {args.system}: {line}", file=sys.stderr, flush=True)

    result = run_measured(options, progress=say)
    if args.json:
        print(json.dumps(result))
        return 0
    print(format_report(Report(**result["report"])))
    measured = result["measurements"]
    print(f"  profile          {result['profile']}")
    print("  step time        " + ", ".join(f"{1000 * s:.1f} ms with {d} pipeline(s)"
                                             for d, s in measured["step_time_s"].items()))
    if result.get("checkpoint_interval"):
        print(f"  checkpoints      {result['checkpoint_interval']['describe']}")
    for restart in result.get("restarts", []):
        print(f"  restart          after the {restart['cause']} of {restart['node']}: {restart['to_first_step_s']:.2f} s "
              f"to the first step, {restart['redone_steps']} steps trained again")
    return 0


def _run_compare(args: argparse.Namespace, console: Console, out: Console) -> int:
    """Run ``compare`` with the parsed ``args``; progress on ``console``, results on ``out``."""
    options = CompareOptions(
        preemptions=args.preemptions, nodes=args.nodes, stages=args.stages, pipelines=args.pipelines,
        out=args.out or Path(), steps=args.steps, duration_s=args.duration, systems=parse_systems(args.systems),
        time_scale=args.time_scale, hours=args.hours, seed=args.seed, zones=args.zones, spot_price=args.spot_price,
        on_demand_price=args.on_demand_price, layers=args.layers, script=tuple(getattr(args, "script", ()) or ()),
        timeout_s=args.timeout, long_run=args.long_run, long_run_nodes=args.long_run_nodes, redundancy=args.redundancy,
        steady=args.steady)
    if notice := size_notice(options.preemptions, int(prepare_trace(options).alive_series()[1].max()), options.nodes):
        console.print(f"compare: {notice}")
    if args.out is None:  # a new folder only once the options hold: a refused command leaves nothing behind
        options = attrs.evolve(options, out=default_out())
    console.print(f"compare: files in {options.out}")
    if args.seeds > 1:
        return _run_seeds(args, options, console, out)
    if console.is_terminal:
        with console.status("compare: starting") as spinner:
            comparison = run_compare(options, status=lambda line: spinner.update(f"compare: {line}"))
    else:
        comparison = run_compare(options, status=_status_printer(console))
    if args.plot is not None:
        path = plot_comparison(comparison, args.plot)
        console.print(f"wrote {path}")
    if args.json:
        print(json.dumps(comparison.records()), file=sys.stdout)
        return 0
    print_comparison(comparison, out, args.plot)
    return 0


def _run_seeds(args: argparse.Namespace, options: CompareOptions, console: Console, out: Console) -> int:
    """``compare --seeds N``: every seed's comparison (progress on ``console``), then the medians and ranges of
    those that finished; exit status 1 when a seed failed (each failure is printed as it happens)."""
    failed: dict[int, str] = {}

    def failure(seed: int, error: CompareError) -> None:
        failed[seed] = str(error)
        console.print(f"compare: seed {seed} failed, going on with the next: {error}")

    comparisons = run_seeds(options, args.seeds, status=_status_printer(console), on_failure=failure)
    if not comparisons:
        raise CompareError(f"every one of the {args.seeds} seeds failed; the first: {next(iter(failed.values()))}")
    if args.plot is not None:
        console.print(f"wrote {plot_comparison(comparisons[0], args.plot)} (seed {comparisons[0].options.seed})")
    if args.json:
        print(json.dumps(spread_records(comparisons, failed)), file=sys.stdout)
    else:
        for comparison in comparisons:
            ratios = ", ".join(f"{name} {result.throughput:.2f} samples/s"
                               for name, result in comparison.results.items())
            out.print(f"seed {comparison.options.seed}: {ratios} ({comparison.options.out})")
        print_spread(summarise(comparisons), options, out)
    if failed:
        console.print(f"compare: {len(failed)} of {args.seeds} seeds failed ({', '.join(map(str, failed))}); "
                      f"the figures above are of the {len(comparisons)} that finished")
        return 1
    return 0


def _status_printer(console: Console) -> Callable[[str], None]:
    """Progress lines at most every ``MEASURE_STATUS_S``, and every system's end."""
    last = [0.0]

    def status(line: str) -> None:
        if time.monotonic() - last[0] >= timeouts.MEASURE_STATUS_S or " done: " in line:
            last[0] = time.monotonic()
            console.print(f"compare: {line}")

    return status


def _spread(spread: Spread | None, ratio: bool = False) -> str:
    if spread is None:
        return "-"
    show = _ratio if ratio else (lambda v: f"{v:.3f}")
    return f"{show(spread.median)} ({show(spread.low)} to {show(spread.high)})"


def print_spread(spreads: list[SystemSpread], options: CompareOptions, out: Console) -> None:
    """The table of ``compare --seeds``: each system's median and range over the seeds."""
    seeds = len(spreads[0].throughput.values) if spreads else 0
    table = Table(title=f"median (range) over {seeds} seeds from {options.seed}: {options.preemptions} at "
                        f"x{options.time_scale:g}, {options.nodes} nodes, P={options.stages}, D={options.pipelines}")
    for header in ("system", "throughput", "value", "vs checkpoint: throughput", "value", "vs on-demand: throughput",
                   "value"):
        table.add_column(header, justify="left" if header == "system" else "right")
    for spread in spreads:
        table.add_row(spread.system, _spread(spread.throughput), _spread(spread.value),
                      _spread(spread.vs_checkpoint_throughput, True), _spread(spread.vs_checkpoint_value, True),
                      _spread(spread.vs_on_demand_throughput, True), _spread(spread.vs_on_demand_value, True))
    out.print(table)
    out.print("each ratio is taken within one seed (both systems on the same trace), then its median over the seeds")


def _ratio(value: float | None) -> str:
    if value is None:
        return "-"
    return "inf" if math.isinf(value) else f"{value:.2f}x"


def _percent(value: float) -> str:
    return "inf" if math.isinf(value) else f"{100 * value:+.1f}%"


def print_comparison(comparison: Comparison, out: Console, plot: Path | None = None) -> None:
    """The tables and notes of a comparison."""
    options = comparison.options
    length = f"{options.steps} steps" if options.steps is not None else f"{options.duration_s:g} s after the first step"
    table = Table(title=f"measured: {options.preemptions} at x{options.time_scale:g}, {options.nodes} nodes, "
                        f"P={options.stages}, D={options.pipelines}, {length}")
    for header in ("system", "throughput", "node-hours", "cost $", "value", "steps redone", "time lost s",
                   "vs checkpoint", "vs on-demand"):
        table.add_column(header, justify="left" if header == "system" else "right")
    for name, result in comparison.results.items():
        versus = []
        for against in ("checkpoint", "on-demand"):
            throughput = comparison.ratio(name, against, "throughput")
            value = comparison.ratio(name, against, "value")
            versus.append("-" if throughput is None or against == name else f"{_ratio(throughput)} / {_ratio(value)}")
        table.add_row(name, f"{result.throughput:.3f}", f"{result.node_hours:.4f}", f"{result.cost:.4f}",
                      f"{result.value:.3f}", str(result.redone_steps), f"{result.lost_s:.1f}", *versus)
    out.print(table)
    out.print("throughput: samples/s over the whole run, start-up included; value: throughput per $/h; "
              "vs: throughput ratio / value ratio against that system")
    predictions = Table(title="the simulator with each run's measured profile, on the same trace")
    for header in ("system", "throughput measured", "simulated", "error", "value measured", "simulated", "error"):
        predictions.add_column(header, justify="left" if header == "system" else "right")
    for name, result in comparison.results.items():
        predictions.add_row(name, f"{result.throughput:.3f}", f"{result.predicted.throughput:.3f}",
                            _percent(result.throughput_error), f"{result.value:.3f}", f"{result.predicted.value:.3f}",
                            _percent(result.value_error))
    out.print(predictions)
    checkpoint = comparison.results.get("checkpoint")
    if checkpoint is not None:
        interval = checkpoint.measured.get("checkpoint_interval")
        out.print(f"checkpoint/restart: {interval['describe'] if interval else 'K not chosen (too few steps)'}; with "
                  f"fewer than P x D nodes it drops to fewer pipelines (torchrun --nnodes {options.stages}:MAX); "
                  f"{len(checkpoint.measured.get('restarts', []))} restarts reached a step, "
                  f"{checkpoint.measured.get('job_restarts', 0)} whole-job restarts")
    for name, result in comparison.results.items():
        out.print(f"predict {name}: {' '.join(result.simulate_command)}")
    long_run = comparison.long_run
    if long_run is not None:
        table = Table(title=f"long run (simulated): {Path(long_run.trace).name}, {long_run.hours:.2f} h uncompressed, "
                            f"{long_run.pipelines} pipelines of {options.stages} ({long_run.nodes} nodes)")
        for header in ("system", "throughput", "nodes", "$/h", "value", "progress", "vs checkpoint", "vs on-demand"):
            table.add_column(header, justify="left" if header == "system" else "right")
        runs = long_run.results
        for name, run in runs.items():
            versus = []
            for against in ("checkpoint", "on-demand"):
                base = runs.get(against)
                if base is None or against == name:
                    versus.append("-")
                    continue
                throughput = run.throughput / base.throughput if base.throughput else math.inf
                value = run.value / base.value if base.value else math.inf
                versus.append(f"{_ratio(throughput)} / {_ratio(value)}")
            table.add_row(name, f"{run.throughput:.2f}", f"{run.nodes:.2f}", f"{run.cost_per_hour:.2f}",
                          f"{run.value:.3f}", f"{run.progress_share:.0%}", *versus)
        out.print(table)
        for note in long_run.notes:
            out.print(f"  {note}")
        for name, path in long_run.profiles.items():
            out.print(f"long run {name}: bamboo-bench simulate --trace {long_run.trace} --model {path} "
                      f"--strategy {name} --hold trace")
    else:
        out.print("the long-run picture: add --long-run FILE (e.g. the paper's EC2 p3 trace, "
                  "../shared/traces/bamboo/p3-trace.csv) to simulate these profiles at full scale on it, uncompressed")
    out.print(f"files: {options.out} (trace.csv, runs/, profiles/, sim/)" + (f"; plot {plot}" if plot else ""))
