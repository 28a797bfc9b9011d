"""``bamboo-bench paper TABLE``: its parser (the table's arguments are :mod:`bamboo.bench.paper_report`'s, with the
knobs of the model and the synthetic model on top) and its run (:func:`bamboo.bench.paper_report.run_paper_command`)."""

from __future__ import annotations

import argparse

from bamboo.bench.argtypes import non_negative_float, positive_float
from bamboo.bench.cli.common import add_synthetic_arguments, check_bulk, stdout_console
from bamboo.bench.paper_report import add_paper_arguments, run_paper_command
from rich.console import Console

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``paper``."""
    paper = commands.add_parser(
        "paper",
        help="reproduce one of the paper's tables and print simulated against published, with relative errors",
        description="Run the table's cells (models, strategies, preemption probabilities) on the synthetic model "
        "until completion, as sweep does, and print each beside the paper's figure with the relative error and "
        "whether it is within the table's tolerance; then the table's aggregate ratios.",
    )
    add_paper_arguments(paper)
    paper.add_argument(
        "--checkpoint-interval", type=positive_float, metavar="S",
        help="seconds between periodic checkpoints, for every model of the table (default: each profile's "
        "checkpoint_interval_s)",
    )
    paper.add_argument(
        "--restart-s", type=non_negative_float, metavar="S",
        help="cost in seconds of one checkpoint/restart restart on top of the global rendezvous, for every model "
        "of the table (default: each profile's restart_s)",
    )
    add_synthetic_arguments(paper)
    paper.add_argument("--no-zone-aware", action="store_true", help="the ablation of zone-aware placement")


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``paper``; returns the exit status."""
    check_bulk(args)
    return run_paper_command(args, console, stdout_console())
