"""``bamboo-bench simulate``: compare strategies side by side on one real trace (``--trace``) or on synthetic runs
(``--synthetic``), print a table (or JSON lines with ``--json``), and optionally plot (``--plot``)."""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Sequence
from pathlib import Path

from bamboo.bench.argtypes import non_negative_float, positive_float, positive_int
from bamboo.bench.cli.common import (
    UsageError,
    add_model_arguments,
    add_synthetic_arguments,
    check_bulk,
    fmt,
    policy_from_args,
    probability,
    profile_from_args,
    progress_bar,
    stdout_console,
)
from bamboo.bench.loaders import load_skypilot_counts, load_trace
from bamboo.bench.profile import ModelProfile
from bamboo.bench.results import AveragedResult, RunResult, average_results
from bamboo.bench.simulator import simulate_run
from bamboo.bench.strategy import Strategy
from bamboo.bench.synthetic import SyntheticSpec, SyntheticTraceGenerator
from bamboo.bench.trace import Trace
from rich.console import Console
from rich.table import Table

__all__ = ["add_parser", "run"]


_MAX_SYNTHETIC_HOURS = 1000.0  # a synthetic run that has not completed by then is reported as not completed


def _strategies(text: str) -> list[Strategy]:
    try:
        values = [Strategy.parse(part) for part in text.split(",") if part.strip()]
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None
    if not values:
        raise argparse.ArgumentTypeError(f"no strategy in {text!r}")
    return list(dict.fromkeys(values))


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``simulate``."""
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
        "our generic CSV; or a folder of per-zone files, one multi-zone trace",
    )
    source.add_argument("--synthetic", action="store_true", help="use the synthetic preemption model instead of a trace")
    simulate.add_argument("--zone", help="zone name for traces that carry none (EC2 events: default ec2; count logs: the file name)")
    simulate.add_argument("--start-h", type=non_negative_float, default=0.0, help="replay the trace from this hour (default 0)")
    simulate.add_argument("--end-h", type=positive_float, help="replay the trace up to this hour (default: its end)")
    simulate.add_argument(
        "--compress", type=positive_float, default=1.0, metavar="F",
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
        "--probability", type=probability, default=0.1,
        help="synthetic: per-hour preemption probability of each instance (default 0.1)",
    )
    simulate.add_argument("--seed", type=int, default=0, help="synthetic: first seed (default 0)")
    simulate.add_argument(
        "--runs", type=positive_int, default=1,
        help="synthetic: number of seeds to average (default 1; the plot shows the first)",
    )
    add_synthetic_arguments(simulate)
    add_model_arguments(simulate, default="gpt2")
    simulate.add_argument("--plot", type=Path, metavar="OUT.png", help="write the four-panel figure (trace, throughput, cost, value)")
    simulate.add_argument("--json", action="store_true", help="print one JSON object per strategy instead of a table")
    simulate.add_argument(
        "--check-policy", action="store_true",
        help="also compute every placement and reconfiguration decision of the bamboo strategy with "
        "bamboo-reconfig's plan_layout and decide, and stop with an error on the first difference (slow)",
    )


def _results_table(title: str, rows: Sequence[tuple[str, AveragedResult | RunResult]]) -> Table:
    table = Table(title=title)
    table.add_column("strategy", justify="left", max_width=56)
    for header in ( "preemptions", "interval h", "lifetime h", "fatal", "nodes", "throughput",
                   "$/h", "value", "progress", "hours"):
        table.add_column(header, justify="right")
    for label, r in rows:
        table.add_row(
            label, fmt(float(r.preemptions), 2), fmt(r.interval_h, 3), fmt(r.lifetime_h, 2),
            fmt(float(r.fatal_failures), 2), fmt(r.nodes, 2), fmt(r.throughput, 2), fmt(r.cost_per_hour, 2),
            fmt(r.value, 3), f"{r.progress_share:.0%}", fmt(r.duration_h, 2),
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
            raise UsageError("several --trace files are only supported for SkyPilot zone JSON files (a folder of "
                             "per-zone files of any format is one --trace)")
        trace = load_skypilot_counts(files)
    else:
        trace = load_trace(files[0], args.zone)
    if args.start_h or args.end_h is not None:
        end_s = args.end_h * 3600.0 if args.end_h is not None else trace.duration_s
        if end_s <= args.start_h * 3600.0:
            raise UsageError(f"--end-h {args.end_h} must be after --start-h {args.start_h}")
        trace = trace.slice(args.start_h * 3600.0, end_s)
    if args.compress != 1.0:
        trace = trace.compress(args.compress)
    if len(trace) == 0:
        raise UsageError(f"trace {trace.name!r} has no events in the chosen window")
    return trace


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``simulate``; returns the exit status."""
    profile = profile_from_args(args)
    policy = policy_from_args(args)
    check_bulk(args)
    strategies: list[Strategy] = args.strategy
    until = args.until or ("trace-end" if args.trace else "completion")
    runs_by_strategy: dict[Strategy, list[RunResult]] = {s: [] for s in strategies}
    trace: Trace | None = None
    if args.trace:
        trace = _load_trace(args)
        held = "each its desired cluster" if args.hold == "desired" else "every node of the trace"
        title = f"{profile.name} on {trace.name} ({trace.duration_s / 3600:.2f} h, until {until}, holding {held})"
        for strategy in strategies:
            outcome = simulate_run(
                trace, profile, strategy, policy=policy,
                target_samples=math.inf if until == "trace-end" else None,
                until_s=trace.duration_s if until == "trace-end" else None,
                record=args.plot is not None, check_policy=args.check_policy and strategy is Strategy.BAMBOO,
                desired_nodes=(profile.desired_nodes_for(redundancy=strategy is Strategy.BAMBOO)
                               if args.hold == "desired" else None),
            )
            runs_by_strategy[strategy].append(outcome)
    else:
        if until == "trace-end":
            raise UsageError("--until trace-end needs --trace (synthetic runs go until completion)")
        if args.hold == "trace":
            raise UsageError("--hold trace needs --trace (a synthetic cluster always asks for its desired size)")
        title = (f"{profile.name}, synthetic p={args.probability:g}, {args.runs} run(s) from seed {args.seed}, "
                 "until completion")
        total = args.runs * len(strategies)
        with progress_bar(console) as progress:
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
                    outcome = simulate_run(
                        events, profile, strategy, policy=policy, until_s=_MAX_SYNTHETIC_HOURS * 3600.0,
                        record=args.plot is not None and i == 0,
                        check_policy=args.check_policy and strategy is Strategy.BAMBOO,
                    )
                    runs_by_strategy[strategy].append(outcome)
                    progress.advance(task)
    averaged = {s: average_results(r) for s, r in runs_by_strategy.items()}
    warnings = {s: _warning(s, r, profile, trace) for s, r in averaged.items()}
    if args.json:
        for strategy, result in averaged.items():
            document = {"model": profile.name, "source": title, **result.as_dict(), "warning": warnings[strategy]}
            print(json.dumps(document))
    else:
        console_out = stdout_console()
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

