"""The ``bamboo-bench compare`` subcommand: its arguments, its progress display and its printed tables.

``add_compare_parser`` registers the subcommand on ``bamboo-bench``'s parser and ``run_compare_command`` runs it
(``bamboo.bench.compare`` does the work). Output: the measured table, the simulator's predictions of each run
beside the measured figures with the error, the checkpoint/restart interval and how it was chosen, the
``bamboo-bench simulate`` command of each prediction, and the long-run picture (``--long-run FILE``); ``--json``
prints a JSON list instead, one object per system.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

from bamboo.bench.argtypes import positive_float as _positive_float
from bamboo.bench.argtypes import positive_int as _positive_int
from bamboo.bench.compare import (
    CompareOptions,
    Comparison,
    default_out,
    parse_systems,
    plot_comparison,
    run_compare,
)
from rich.console import Console
from rich.table import Table

__all__ = ["add_compare_parser", "run_compare_command"]


def _zones(text: str) -> tuple[str, ...]:
    zones = tuple(zone.strip() for zone in text.split(","))
    if not text or any(not zone for zone in zones):
        raise argparse.ArgumentTypeError(f"zones must be comma-separated names like a,b,c, got {text!r}")
    return zones


def add_compare_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``compare`` on ``bamboo-bench``'s subcommands."""
    compare = commands.add_parser(
        "compare",
        help="measure Bamboo, checkpoint/restart and on-demand on one replayed trace, and check the simulator",
        usage=("bamboo-bench compare --preemptions FILE|synthetic:RATE [--time-scale X] --nodes N --stages P "
               "--pipelines D (--steps S | --duration SECONDS) [--systems bamboo,checkpoint,on-demand] "
               "[--spot-price P] [--on-demand-price P] [--json] [--plot OUT.png] [options] [-- SCRIPT ARGS]"),
        description=(
            "Train the same model with each system, one after the other, on the same emulated spot market "
            "(bamboo-launch must be installed: each system runs as `python -m bamboo.launch measure SYSTEM`). "
            "bamboo: bamboo-launch with redundant computation. checkpoint: torchrun elastic agents (one per node, "
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
                         help="the trace every system replays: a trace file in any format bamboo-bench reads, or "
                         "synthetic:RATE, the paper's model at per-hour preemption probability RATE on about --nodes "
                         "nodes")
    compare.add_argument("--time-scale", type=_positive_float, default=60.0, metavar="X",
                         help="trace seconds per wall second (default 60)")
    compare.add_argument("--nodes", type=_positive_int, required=True,
                         help="spot nodes at the start (a synthetic trace keeps about this many)")
    compare.add_argument("--stages", type=_positive_int, required=True, help="pipeline depth P")
    compare.add_argument("--pipelines", type=_positive_int, required=True, help="data-parallel pipelines D")
    length = compare.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=_positive_int, help="each system trains this many steps")
    length.add_argument("--duration", type=_positive_float, metavar="SECONDS",
                        help="each system trains this many wall seconds after its first step, then stops (the trace "
                        "is cut to the same trace time)")
    compare.add_argument("--systems", default="bamboo,checkpoint,on-demand",
                         help="comma-separated systems to run: bamboo, checkpoint, on-demand (default: all three)")
    compare.add_argument("--spot-price", type=_positive_float, default=0.918, metavar="P",
                         help="$/h per spot node (default 0.918, EC2 p3 in the paper)")
    compare.add_argument("--on-demand-price", type=_positive_float, default=3.06, metavar="P",
                         help="$/h per on-demand node (default 3.06)")
    compare.add_argument("--json", action="store_true",
                         help="print a JSON list, one object per system: system, throughput, node_hours, cost, value, "
                         "redone_steps, lost_s, and the ratios, predictions and errors")
    compare.add_argument("--plot", type=Path, metavar="OUT.png",
                         help="write the four-panel figure (nodes, throughput, cost, value; simulated dotted)")
    compare.add_argument("--out", type=Path, metavar="DIR",
                         help="where the trace, runs, profiles and simulated traces go (default: a new temporary "
                         "folder, kept and printed)")
    compare.add_argument("--hours", type=_positive_float,
                         help="synthetic: the trace's length in trace hours (default: --duration's trace time, or 1)")
    compare.add_argument("--seed", type=int, default=0, help="synthetic: the trace's seed (default 0)")
    compare.add_argument("--zones", type=_zones,
                         help="zone names: a synthetic trace's, or spread a trace with one zone round-robin over them")
    compare.add_argument("--layers", type=_positive_int, default=4,
                         help="decoder blocks of the built-in example GPT (default 4)")
    compare.add_argument("--timeout", type=_positive_float, default=1800.0, metavar="S",
                         help="seconds each system's run may take (default 1800)")
    compare.add_argument("--long-run", type=Path, metavar="FILE",
                         help="also simulate the measured profiles at full scale on this trace, uncompressed (e.g. the "
                         "paper's EC2 p3 trace)")
    compare.add_argument("--long-run-nodes", type=_positive_int, metavar="N",
                         help="nodes of the full-scale cluster (default: the long-run trace's peak)")


def run_compare_command(args: argparse.Namespace, console: Console, out: Console) -> int:
    """Run ``compare`` with the parsed ``args`` (``args.script``: the words after --); progress on ``console``,
    results on ``out``."""
    options = CompareOptions(
        preemptions=args.preemptions, nodes=args.nodes, stages=args.stages, pipelines=args.pipelines,
        out=args.out or default_out(), steps=args.steps, duration_s=args.duration, systems=parse_systems(args.systems),
        time_scale=args.time_scale, hours=args.hours, seed=args.seed, zones=args.zones, spot_price=args.spot_price,
        on_demand_price=args.on_demand_price, layers=args.layers, script=tuple(getattr(args, "script", ()) or ()),
        timeout_s=args.timeout, long_run=args.long_run, long_run_nodes=args.long_run_nodes)
    console.print(f"compare: files in {options.out}")
    if console.is_terminal:
        with console.status("compare: starting") as spinner:
            comparison = run_compare(options, status=lambda line: spinner.update(f"compare: {line}"))
    else:
        last = [0.0]

        def status(line: str) -> None:
            if time.monotonic() - last[0] >= 15.0 or " done: " in line:
                last[0] = time.monotonic()
                console.print(f"compare: {line}")

        comparison = run_compare(options, status=status)
    if args.plot is not None:
        path = plot_comparison(comparison, args.plot)
        console.print(f"wrote {path}")
    if args.json:
        print(json.dumps(comparison.records()), file=sys.stdout)
        return 0
    print_comparison(comparison, out, args.plot)
    return 0


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
