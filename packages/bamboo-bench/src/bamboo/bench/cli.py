"""The ``bamboo-bench`` command line: simulate strategies on a trace, sweep probabilities, inspect traces.

Subcommands:

- ``simulate``: compare strategies on one real trace (``--trace``) or on synthetic runs
  (``--synthetic``), print a table (or JSON lines with ``--json``), optionally plot (``--plot``).
- ``sweep``: the paper's Table 6: many synthetic runs per preemption probability, until completion.
- ``paper``: reproduce one of the paper's tables (``table6``, ``dp``) and print simulated against published.
- ``compare``: measure Bamboo, checkpoint/restart and on-demand on one replayed trace (each through
  ``bamboo-bench measure``, a subprocess) and check the simulator against each run; ``measure``: one system's
  run and its measured profile. Both are the measured layer's (:mod:`bamboo.bench.measured.cli`, installed with
  ``bamboo-bench[measured]``: they need bamboo-launch).
- ``trace summary`` / ``trace synthesize``: summarise trace files; write a synthetic trace as CSV.

Bad input prints one line ``bamboo-bench: error: ...`` and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections.abc import Sequence
from pathlib import Path

import attrs
from bamboo.bench.argtypes import OneLineParser
from bamboo.bench.argtypes import non_negative_float as _non_negative_float
from bamboo.bench.argtypes import positive_float as _positive_float
from bamboo.bench.argtypes import positive_int as _positive_int
from bamboo.bench.loaders import TraceFormatError, load_skypilot_counts, load_trace, write_generic_csv
from bamboo.bench.paper_report import add_paper_arguments, run_paper_command
from bamboo.bench.profile import ModelProfile, ProfileError, builtin_profiles, load_profile
from bamboo.bench.simulator import (
    AveragedResult,
    Policy,
    PolicyMismatch,
    RunResult,
    Strategy,
    average_results,
    simulate_run,
)
from bamboo.bench.sweep import sweep
from bamboo.bench.synthetic import SyntheticSpec, SyntheticTraceGenerator, generate_trace
from bamboo.bench.trace import Trace
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["main"]


_MAX_SYNTHETIC_HOURS = 1000.0  # a synthetic run that has not completed by then is reported as not completed


class _UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def _probability(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"probability {text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"probability {text!r} is not in [0, 1]")
    return value


def _probabilities(text: str) -> list[float]:
    values = [_probability(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no probabilities in {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"repeated probability in {text!r}")
    return values


def _strategies(text: str) -> list[Strategy]:
    try:
        values = [Strategy.parse(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not values:
        raise argparse.ArgumentTypeError(f"no strategy in {text!r}")
    return list(dict.fromkeys(values))


def _add_model_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    parser.add_argument(
        "--model",
        default=default,
        help=f"model profile: a shipped name ({', '.join(builtin_profiles())}) or a profile JSON file "
        f"(format in the package README; default {default})",
    )
    parser.add_argument(
        "--checkpoint-interval", type=_positive_float, metavar="S",
        help="seconds between periodic checkpoints (default: the profile's checkpoint_interval_s)",
    )
    parser.add_argument(
        "--restart-s", type=_non_negative_float, metavar="S",
        help="cost in seconds of one checkpoint/restart restart on top of the global rendezvous "
        "(default: the profile's restart_s)",
    )
    parser.add_argument(
        "--no-zone-aware", action="store_true",
        help="the ablation of zone-aware placement: the planner sees every node in one zone, as when nodes "
        "register without a zone (Bamboo's decisions are the system's and have no knob)",
    )


def _add_synthetic_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--zones", type=_positive_int, default=3, help="number of zones in the synthetic model (default 3)"
    )
    parser.add_argument(
        "--bulk-mean", type=float, default=2.0, metavar="B",
        help="how preemptions bunch within a zone: a victim joins its zone's current bulk with probability "
        "1 - 1/B, so B is the mean bulk size before a zone's victims of the hour run out (B >= 1; 1 means "
        "independent). Default 2.0: effective mean bulks of 1.07 to 1.43 nodes at p=0.01 to 0.5 on 48 nodes, "
        "below the EC2 p3 trace's 2.1 nodes per preemption minute",
    )


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``bamboo-bench``."""
    parser = OneLineParser(
        prog="bamboo-bench",
        description="Spot traces and the trace-driven simulator: throughput, cost and value of training on spot.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    simulate = commands.add_parser(
        "simulate",
        help="compare strategies on a trace or on synthetic runs",
        description="Simulate training strategies side by side on one trace (--trace) or on synthetic "
        "preemptions (--synthetic) and print preemptions, fatal failures, nodes, throughput, cost, value and "
        "the share of time spent making progress.",
    )
    source = simulate.add_mutually_exclusive_group(required=True)
    source.add_argument(
        "--trace", nargs="+", type=Path, metavar="FILE",
        help="trace file: the EC2 event CSV, a GCP count log (.txt), an AWS x,y count curve, an Auto Scaling "
        "Group 'timestamp,count' CSV, SkyPilot count JSON (several zone files make one multi-zone trace) or "
        "our generic CSV",
    )
    source.add_argument("--synthetic", action="store_true", help="use the synthetic preemption model instead of a trace")
    simulate.add_argument("--zone", help="zone name for traces that carry none (EC2 events: default ec2; count logs: the file name)")
    simulate.add_argument("--start-h", type=_non_negative_float, default=0.0, help="replay the trace from this hour (default 0)")
    simulate.add_argument("--end-h", type=_positive_float, help="replay the trace up to this hour (default: its end)")
    simulate.add_argument(
        "--compress", type=_positive_float, default=1.0, metavar="F",
        help="divide the trace's time by F (default 1: real time)",
    )
    simulate.add_argument(
        "--until", choices=("trace-end", "completion"),
        help="stop at the end of the trace, or when the job's samples are trained (default: trace-end with "
        "--trace, completion with --synthetic)",
    )
    simulate.add_argument(
        "--hold", choices=("desired", "trace"), default="desired",
        help="with --trace, which of the trace's instances a strategy holds (and pays for): 'desired', at most "
        "the cluster it asks for (the profile's pipelines x stages, with or without redundancy; a declined "
        "instance is never taken later), as in the synthetic model; 'trace', every one, as the published "
        "simulator and the emulated cluster do (default desired; the two differ only when the trace has more "
        "nodes alive than a strategy wants)",
    )
    simulate.add_argument(
        "--strategy", type=_strategies, default=[Strategy.BAMBOO, Strategy.CHECKPOINT, Strategy.ON_DEMAND],
        help="comma-separated strategies: bamboo, checkpoint, on-demand, sample-dropping "
        "(default bamboo,checkpoint,on-demand)",
    )
    simulate.add_argument(
        "--probability", type=_probability, default=0.1,
        help="synthetic: per-hour preemption probability of each instance (default 0.1)",
    )
    simulate.add_argument("--seed", type=int, default=0, help="synthetic: first seed (default 0)")
    simulate.add_argument(
        "--runs", type=_positive_int, default=1,
        help="synthetic: number of seeds to average (default 1; the plot shows the first)",
    )
    _add_synthetic_arguments(simulate)
    _add_model_arguments(simulate, default="gpt2")
    simulate.add_argument("--plot", type=Path, metavar="OUT.png", help="write the four-panel figure (trace, throughput, cost, value)")
    simulate.add_argument("--json", action="store_true", help="print one JSON object per strategy instead of a table")
    simulate.add_argument(
        "--check-policy", action="store_true",
        help="also compute every placement and reconfiguration decision of the bamboo strategy with "
        "bamboo-reconfig's plan_layout and decide, and stop with an error on the first difference (slow)",
    )

    sweep_parser = commands.add_parser(
        "sweep",
        help="average many synthetic runs per preemption probability (the paper's Table 6)",
        description="For each probability, run --runs synthetic seeds until the job completes and print the "
        "means: preemptions, interval between preemptions, instance lifetime, fatal failures, nodes, "
        "throughput, $/h and value.",
    )
    sweep_parser.add_argument(
        "--probabilities", type=_probabilities, default=[0.01, 0.05, 0.1, 0.25, 0.5],
        help="comma-separated per-hour preemption probabilities (default 0.01,0.05,0.1,0.25,0.5)",
    )
    sweep_parser.add_argument("--runs", type=_positive_int, default=1000, help="seeds per probability (default 1000)")
    sweep_parser.add_argument(
        "--strategy", type=Strategy.parse, default=Strategy.BAMBOO,
        help="one strategy: bamboo, checkpoint, on-demand or sample-dropping (default bamboo)",
    )
    sweep_parser.add_argument(
        "--workers", type=_positive_int, help="worker processes (default: the number of CPUs)"
    )
    _add_synthetic_arguments(sweep_parser)
    _add_model_arguments(sweep_parser, default="bert-table6")
    sweep_parser.add_argument("--json", action="store_true", help="print one JSON object per probability")

    paper = commands.add_parser(
        "paper",
        help="reproduce one of the paper's tables and print simulated against published, with relative errors",
        description="Run the table's cells (models, strategies, preemption probabilities) on the synthetic model "
        "until completion, as sweep does, and print each beside the paper's figure with the relative error and "
        "whether it is within the table's tolerance; then the table's aggregate ratios.",
    )
    add_paper_arguments(paper)
    paper.add_argument(
        "--checkpoint-interval", type=_positive_float, metavar="S",
        help="seconds between periodic checkpoints, for every model of the table (default: each profile's "
        "checkpoint_interval_s)",
    )
    paper.add_argument(
        "--restart-s", type=_non_negative_float, metavar="S",
        help="cost in seconds of one checkpoint/restart restart on top of the global rendezvous, for every model "
        "of the table (default: each profile's restart_s)",
    )
    _add_synthetic_arguments(paper)
    paper.add_argument("--no-zone-aware", action="store_true", help="the ablation of zone-aware placement")

    _add_measured(commands)

    trace = commands.add_parser("trace", help="summarise trace files or write a synthetic trace")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    summary = trace_commands.add_parser(
        "summary", help="preemptions per hour, bulk sizes, zones and alive nodes of trace files",
        description="Load each file (any supported format) and summarise it.",
    )
    summary.add_argument("files", nargs="+", type=Path, metavar="FILE", help="trace files")
    summary.add_argument("--zone", help="zone name for EC2 and GCP traces (default: ec2 / the file name)")
    summary.add_argument("--json", action="store_true", help="print one JSON object per file")
    synthesize = trace_commands.add_parser(
        "synthesize", help="write a synthetic trace in the generic CSV format",
        description="Generate the synthetic model's trace for one seed and write it as generic CSV.",
    )
    synthesize.add_argument("out", type=Path, metavar="OUT.csv", help="where to write the CSV")
    synthesize.add_argument("--probability", type=_probability, required=True, help="per-hour preemption probability")
    synthesize.add_argument("--hours", type=_positive_float, default=24.0, help="trace length in hours (default 24)")
    synthesize.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synthesize.add_argument("--nodes", type=_positive_int, default=48, help="desired cluster size (default 48)")
    _add_synthetic_arguments(synthesize)
    return parser


# ---------------------------------------------------------------------------- helpers
MEASURED_COMMANDS = ("compare", "measure")
"""The subcommands of the measured layer (:mod:`bamboo.bench.measured`), above bamboo-launch."""

MEASURED_MISSING = ("bamboo-bench {command} runs the systems with bamboo-launch, which is not installed here: "
                    "pip install 'bamboo-bench[measured]' (or packages/bamboo-launch)")


def _add_measured(commands: argparse._SubParsersAction) -> None:
    """``compare`` and ``measure``: the measured layer's parsers, or, without bamboo-launch, commands that say
    how to install it."""
    try:
        from bamboo.bench.measured.cli import add_parsers
    except ImportError:
        for name in MEASURED_COMMANDS:
            stub = commands.add_parser(name, help="(needs bamboo-bench[measured])", add_help=False)
            stub.add_argument("rest", nargs=argparse.REMAINDER)
        return
    add_parsers(commands)


def _run_measured(args: argparse.Namespace, console: Console) -> int:
    try:
        from bamboo.bench.measured.cli import run_command
    except ImportError:
        raise _UsageError(MEASURED_MISSING.format(command=args.command)) from None
    return run_command(args, console, _stdout_console())


def _profile(args: argparse.Namespace) -> ModelProfile:
    profile = load_profile(args.model)
    changes = {}
    if args.checkpoint_interval is not None:
        changes["checkpoint_interval_s"] = args.checkpoint_interval
    if args.restart_s is not None:
        changes["restart_s"] = args.restart_s
    if changes:
        profile = attrs.evolve(profile, timing=attrs.evolve(profile.timing, **changes))
    return profile


def _policy(args: argparse.Namespace) -> Policy:
    return Policy(zone_aware=not args.no_zone_aware)


def _check_bulk(args: argparse.Namespace) -> None:
    if not args.bulk_mean >= 1.0:
        raise _UsageError(f"--bulk-mean must be >= 1, got {args.bulk_mean}")


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )


def _stdout_console() -> Console:
    """Tables go to stdout; when it is not a terminal, give them room instead of 80 columns."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def _fmt(value: float, digits: int) -> str:
    return "-" if math.isnan(value) else f"{value:.{digits}f}"


def _results_table(title: str, rows: Sequence[tuple[str, AveragedResult | RunResult]]) -> Table:
    table = Table(title=title)
    table.add_column("strategy", justify="left", max_width=56)
    for header in ( "preemptions", "interval h", "lifetime h", "fatal", "nodes", "throughput",
                   "$/h", "value", "progress", "hours"):
        table.add_column(header, justify="right")
    for label, r in rows:
        table.add_row(
            label, _fmt(float(r.preemptions), 2), _fmt(r.interval_h, 3), _fmt(r.lifetime_h, 2),
            _fmt(float(r.fatal_failures), 2), _fmt(r.nodes, 2), _fmt(r.throughput, 2), _fmt(r.cost_per_hour, 2),
            _fmt(r.value, 3), f"{r.progress_share:.0%}", _fmt(r.duration_h, 2),
        )
    return table


def _warning(strategy: Strategy, result: AveragedResult, profile: ModelProfile, trace: Trace | None) -> str | None:
    """What a reader of `result` must be told, or None: a spot run that trained nothing but was charged."""
    if strategy is Strategy.ON_DEMAND or result.throughput > 0:
        return None
    charged = f"{result.nodes:.2f} node(s) on average were still charged (${result.cost_per_hour:.2f}/h)"
    if trace is not None:
        most = trace.summary().max_alive
        if most < profile.stages:
            return (f"no pipeline can ever form: trace {trace.name!r} never has more than {most} node(s) alive at once, "
                    f"fewer than the {profile.stages} stages of one pipeline of {profile.name!r}; throughput is 0 "
                    f"and {charged}")
    return f"nothing was trained (throughput 0) and {charged}"


def _load_trace(args: argparse.Namespace) -> Trace:
    files: list[Path] = args.trace
    if len(files) > 1:
        if not all(f.suffix == ".json" for f in files):
            raise _UsageError("several --trace files are only supported for SkyPilot zone JSON files")
        trace = load_skypilot_counts(files)
    else:
        trace = load_trace(files[0], args.zone)
    if args.start_h or args.end_h is not None:
        end_s = args.end_h * 3600.0 if args.end_h is not None else trace.duration_s
        if end_s <= args.start_h * 3600.0:
            raise _UsageError(f"--end-h {args.end_h} must be after --start-h {args.start_h}")
        trace = trace.slice(args.start_h * 3600.0, end_s)
    if args.compress != 1.0:
        trace = trace.compress(args.compress)
    if len(trace) == 0:
        raise _UsageError(f"trace {trace.name!r} has no events in the chosen window")
    return trace


# ---------------------------------------------------------------------------- commands
def _cmd_simulate(args: argparse.Namespace, console: Console) -> int:
    profile = _profile(args)
    policy = _policy(args)
    _check_bulk(args)
    strategies: list[Strategy] = args.strategy
    until = args.until or ("trace-end" if args.trace else "completion")
    runs_by_strategy: dict[Strategy, list[RunResult]] = {s: [] for s in strategies}
    trace: Trace | None = None
    if args.trace:
        trace = _load_trace(args)
        held = "each its desired cluster" if args.hold == "desired" else "every node of the trace"
        title = f"{profile.name} on {trace.name} ({trace.duration_s / 3600:.2f} h, until {until}, holding {held})"
        for strategy in strategies:
            run = simulate_run(
                trace, profile, strategy, policy=policy,
                target_samples=math.inf if until == "trace-end" else None,
                until_s=trace.duration_s if until == "trace-end" else None,
                record=args.plot is not None, check_policy=args.check_policy and strategy is Strategy.BAMBOO,
                desired_nodes=(profile.desired_nodes_for(redundancy=strategy is Strategy.BAMBOO)
                               if args.hold == "desired" else None),
            )
            runs_by_strategy[strategy].append(run)
    else:
        if until == "trace-end":
            raise _UsageError("--until trace-end needs --trace (synthetic runs go until completion)")
        if args.hold == "trace":
            raise _UsageError("--hold trace needs --trace (a synthetic cluster always asks for its desired size)")
        title = (f"{profile.name}, synthetic p={args.probability:g}, {args.runs} run(s) from seed {args.seed}, "
                 "until completion")
        total = args.runs * len(strategies)
        with _progress(console) as progress:
            task = progress.add_task("simulating", total=total)
            for strategy in strategies:
                # Each strategy asks the market for its own cluster (the profile's, with or without redundancy).
                spec = SyntheticSpec(
                    preemption_probability=args.probability,
                    desired_nodes=profile.desired_nodes_for(redundancy=strategy is Strategy.BAMBOO),
                    zones=args.zones, bulk_mean=args.bulk_mean,
                )
                for i in range(args.runs):
                    seed = args.seed + i
                    events = SyntheticTraceGenerator(spec, seed).events(until_s=_MAX_SYNTHETIC_HOURS * 3600.0)
                    run = simulate_run(
                        events, profile, strategy, policy=policy, until_s=_MAX_SYNTHETIC_HOURS * 3600.0,
                        record=args.plot is not None and i == 0,
                        check_policy=args.check_policy and strategy is Strategy.BAMBOO,
                    )
                    runs_by_strategy[strategy].append(run)
                    progress.advance(task)
    averaged = {s: average_results(r) for s, r in runs_by_strategy.items()}
    warnings = {s: _warning(s, r, profile, trace) for s, r in averaged.items()}
    if args.json:
        for strategy, result in averaged.items():
            document = {"model": profile.name, "source": title, **result.as_dict(), "warning": warnings[strategy]}
            print(json.dumps(document))
    else:
        console_out = _stdout_console()
        table = _results_table(title, [(s.value, r) for s, r in averaged.items()])
        said: dict[str, list[str]] = {}
        for strategy, warning in warnings.items():
            if warning is not None:
                said.setdefault(warning, []).append(strategy.value)
        for warning, names in said.items():
            table.add_row(f"[bold yellow]warning[/] ({', '.join(names)}): [yellow]{warning}[/]", end_section=True)
        console_out.print(table)
        console_out.print(f"on-demand reference value: {profile.on_demand_value:.3f} samples/s per $/h")
    if args.plot is not None:
        from bamboo.bench.plot import plot_runs

        path = plot_runs([r[0] for r in runs_by_strategy.values()], profile, args.plot, title=title)
        console.print(f"wrote {path}")
    return 0


def _cmd_sweep(args: argparse.Namespace, console: Console) -> int:
    profile = _profile(args)
    _check_bulk(args)
    total = args.runs * len(args.probabilities)
    with _progress(console) as progress:
        task = progress.add_task(f"sweep {profile.name}", total=total)
        rows = sweep(
            profile, args.probabilities, args.runs, strategy=args.strategy, zones=args.zones,
            bulk_mean=args.bulk_mean, policy=_policy(args), workers=args.workers,
            progress=lambda n: progress.advance(task, n),
        )
    if args.json:
        for row in rows:
            print(json.dumps({"model": profile.name, **row.as_dict()}))
        return 0
    table = Table(title=f"{profile.name}: {args.strategy.value}, {args.runs} runs per row, until completion "
                        f"(on-demand value {profile.on_demand_value:.2f})")
    for header in ("prob", "preemptions", "interval h", "lifetime h", "fatal", "nodes", "throughput", "$/h",
                   "value", "progress"):
        table.add_column(header, justify="right")
    for row in rows:
        r = row.result
        table.add_row(
            f"{row.probability:g}", _fmt(r.preemptions, 2), _fmt(r.interval_h, 3), _fmt(r.lifetime_h, 2),
            _fmt(r.fatal_failures, 2), _fmt(r.nodes, 2), _fmt(r.throughput, 2), _fmt(r.cost_per_hour, 2),
            _fmt(r.value, 2), f"{r.progress_share:.0%}",
        )
    _stdout_console().print(table)
    return 0


def _cmd_trace(args: argparse.Namespace, console: Console) -> int:
    if args.trace_command == "summary":
        table = Table(title="trace summary")
        for header in ("trace", "hours", "adds", "preemptions", "per hour", "mean bulk", "max bulk", "zones",
                       "max alive", "mean alive"):
            table.add_column(header, justify="right")
        for path in args.files:
            summary = load_trace(path, args.zone).summary().as_dict()
            if args.json:
                print(json.dumps({"file": str(path), **summary}))
                continue
            table.add_row(
                str(summary["name"]), f"{summary['duration_h']:.2f}", str(summary["adds"]), str(summary["preemptions"]),
                f"{summary['preemptions_per_hour']:.2f}", f"{summary['mean_bulk_size']:.2f}",
                str(summary["max_bulk_size"]), ",".join(summary["zones"]),  # type: ignore[arg-type]
                str(summary["max_alive"]), f"{summary['mean_alive']:.1f}",
            )
        if not args.json:
            _stdout_console().print(table)
        return 0
    _check_bulk(args)
    spec = SyntheticSpec(
        preemption_probability=args.probability, desired_nodes=args.nodes, zones=args.zones, bulk_mean=args.bulk_mean
    )
    trace = generate_trace(spec, args.hours, args.seed)
    write_generic_csv(trace, args.out)
    console.print(f"wrote {args.out}: {len(trace)} events over {args.hours:g} h")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``bamboo-bench``; returns the exit status."""
    parser = build_parser()
    words = list(sys.argv[1:] if argv is None else argv)
    script: list[str] = []
    if "--" in words:  # compare's (or measure's) training script: everything after --
        split = words.index("--")
        words, script = words[:split], words[split + 1:]
    args = parser.parse_args(words)
    if script and args.command not in MEASURED_COMMANDS:
        parser.error(f"only compare and measure take a script after --, got {' '.join(script)!r}")
    args.script = script
    console = Console(stderr=True)
    try:
        if args.command == "simulate":
            return _cmd_simulate(args, console)
        if args.command == "sweep":
            return _cmd_sweep(args, console)
        if args.command == "paper":
            _check_bulk(args)
            return run_paper_command(args, console, _stdout_console())
        if args.command in MEASURED_COMMANDS:
            return _run_measured(args, console)
        return _cmd_trace(args, console)
    except (_UsageError, TraceFormatError, ProfileError, PolicyMismatch, ValueError, KeyError, OSError,
            RuntimeError) as error:  # RuntimeError: a measured run that failed (its message names its log)
        message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        print(f"bamboo-bench: error: {message}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
