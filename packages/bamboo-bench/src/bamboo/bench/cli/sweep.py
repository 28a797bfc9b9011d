"""``bamboo-bench sweep``: the paper's Table 6, many synthetic runs per preemption probability until completion,
printed as one row (or, with ``--json``, one JSON object) per probability."""

from __future__ import annotations

import argparse
import json

from bamboo.bench.argtypes import positive_int
from bamboo.bench.cli.common import (
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
from bamboo.bench.strategy import Strategy
from bamboo.bench.sweep import sweep
from rich.console import Console
from rich.table import Table

__all__ = ["add_parser", "run"]


def _probabilities(text: str) -> list[float]:
    values = [probability(part) for part in text.split(",") if part.strip()]
    if not values:
        raise argparse.ArgumentTypeError(f"no probabilities in {text!r}")
    if len(set(values)) != len(values):
        raise argparse.ArgumentTypeError(f"repeated probability in {text!r}")
    return values


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``sweep``."""
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
    sweep_parser.add_argument("--runs", type=positive_int, default=1000, help="seeds per probability (default 1000)")
    sweep_parser.add_argument(
        "--strategy", type=Strategy.parse, default=Strategy.BAMBOO,
        help="one strategy: bamboo, checkpoint, on-demand or sample-dropping (default bamboo)",
    )
    sweep_parser.add_argument(
        "--workers", type=positive_int, help="worker processes (default: the number of CPUs)"
    )
    add_synthetic_arguments(sweep_parser)
    add_model_arguments(sweep_parser, default="bert-table6")
    sweep_parser.add_argument("--json", action="store_true", help="print one JSON object per probability")


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``sweep``; returns the exit status."""
    profile = profile_from_args(args)
    check_bulk(args)
    total = args.runs * len(args.probabilities)
    with progress_bar(console) as progress:
        task = progress.add_task(f"sweep {profile.name}", total=total)
        rows = sweep(
            profile, args.probabilities, args.runs, strategy=args.strategy, zones=args.zones,
            bulk_mean=args.bulk_mean, policy=policy_from_args(args), workers=args.workers,
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
            f"{row.probability:g}", fmt(r.preemptions, 2), fmt(r.interval_h, 3), fmt(r.lifetime_h, 2),
            fmt(r.fatal_failures, 2), fmt(r.nodes, 2), fmt(r.throughput, 2), fmt(r.cost_per_hour, 2),
            fmt(r.value, 2), f"{r.progress_share:.0%}",
        )
    stdout_console().print(table)
    return 0
