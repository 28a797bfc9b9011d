"""``bamboo-bench paper TABLE``: reproduce one of the paper's tables and print simulated against published.

The command runs `bamboo.bench.paper.reproduce` and prints one row per (model, probability) with each
strategy's metrics as ``simulated / paper (relative error)`` (only the simulated value where the paper's
figure is not available here), then the table's aggregate ratios, then where the figures come from and
which figures are checked. ``--checkpoint-interval`` and ``--restart-s`` change those two settings on every
profile of the table (a checkpoint/restart column depends on them). ``--json`` prints one object per cell
and per ratio instead. ``--strict`` makes the exit status 1 when a checked figure is outside its tolerance.
"""

from __future__ import annotations

import argparse
import json

import attrs
from bamboo.bench.paper import (
    PaperTable,
    Reproduction,
    builtin_tables,
    cell_text,
    columns,
    grouped_rows,
    load_table,
    reproduce,
)
from bamboo.bench.profile import ModelProfile, load_profile
from bamboo.bench.simulator import Policy
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table

__all__ = ["add_paper_arguments", "render", "run_paper_command"]

_DIGITS = {"value": 3, "fatal_failures": 3, "progress_share": 3}


def add_paper_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``bamboo-bench paper`` (the synthetic model's knobs are added by the caller)."""
    parser.add_argument(
        "table",
        help=f"a shipped paper table ({', '.join(builtin_tables())}) or a table JSON file (format in "
        "bamboo.bench.paper's docstring)",
    )
    parser.add_argument("--runs", type=int, default=1000, help="seeds per cell (default 1000)")
    parser.add_argument("--workers", type=int, help="worker processes (default: the number of CPUs)")
    parser.add_argument("--json", action="store_true", help="print one JSON object per cell and per ratio")
    parser.add_argument(
        "--strict", action="store_true",
        help="exit with status 1 when a checked figure is outside its tolerance (default: report only)",
    )


def render(reproduction: Reproduction, console: Console) -> None:
    """Print the reproduction as tables (cells, then ratios) and the provenance lines."""
    table = reproduction.table
    cells = Table(title=f"{table.title} ({reproduction.runs} runs per cell, synthetic model until completion; "
                        "simulated / paper (relative error))")
    cells.add_column("model", justify="left")
    cells.add_column("prob", justify="right")
    shown = columns(table)
    for strategy, metric in shown:
        cells.add_column(f"{metric}\n{strategy.value}", justify="right")
    for model, probability, by_column in grouped_rows(reproduction):
        texts = []
        for key in shown:
            cell = by_column[key]
            texts.append(cell_text(cell.simulated, cell.paper, _DIGITS.get(cell.metric, 2)))
        cells.add_row(model, f"{probability:g}", *texts)
    console.print(cells)
    if reproduction.ratios:
        ratios = Table(title="aggregates: mean over the model x probability cells")
        for header in ("ratio", "simulated", "paper", "relative error", "tolerance", "within"):
            ratios.add_column(header, justify="right")
        for ratio in reproduction.ratios:
            error = ratio.relative_error
            ratios.add_row(
                ratio.label, f"{ratio.simulated:.3f}", f"{ratio.ratio.value:g}",
                "-" if error is None else f"{error:+.1%}",
                "-" if ratio.tolerance is None else f"{ratio.tolerance:.0%}",
                {True: "yes", False: "NO", None: "-"}[ratio.within],
            )
        console.print(ratios)
    console.print(f"source: {table.source}", soft_wrap=True)
    if table.missing:
        console.print(f"not here: {table.missing}", soft_wrap=True)
    checked = ", ".join(f"{metric} within {tolerance:.0%}" for metric, tolerance in table.tolerances.items())
    failures = reproduction.failures
    verdict = "all within tolerance" if not failures else f"{len(failures)} outside: " + "; ".join(failures)
    console.print(f"checked {reproduction.checked} figure(s) ({checked or 'none'}): {verdict}", soft_wrap=True)


def _profiles(
    table: PaperTable, checkpoint_interval_s: float | None, restart_s: float | None
) -> dict[str, ModelProfile]:
    """The table's profiles with the checkpoint interval and restart cost given on the command line, if any."""
    changes: dict[str, float] = {}
    if checkpoint_interval_s is not None:
        changes["checkpoint_interval_s"] = checkpoint_interval_s
    if restart_s is not None:
        changes["restart_s"] = restart_s
    if not changes:
        return {}
    profiles = {}
    for model in table.models:
        profile = load_profile(model)
        profiles[model] = attrs.evolve(profile, timing=attrs.evolve(profile.timing, **changes))
    return profiles


def run_paper_command(args: argparse.Namespace, console: Console, out: Console) -> int:
    """Run ``bamboo-bench paper``: progress on `console` (stderr), the report on `out` (stdout)."""
    if args.runs < 1:
        raise ValueError(f"--runs must be >= 1, got {args.runs}")
    if args.workers is not None and args.workers < 1:
        raise ValueError(f"--workers must be >= 1, got {args.workers}")
    table = load_table(args.table)
    profiles = _profiles(table, getattr(args, "checkpoint_interval", None), getattr(args, "restart_s", None))
    spot = [s for s in table.strategies if s.value != "on-demand"]
    total = args.runs * len(table.probabilities) * len(table.models) * len(spot)
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        task = progress.add_task(f"paper {table.key}", total=total)
        reproduction = reproduce(
            table, args.runs, workers=args.workers, zones=args.zones, bulk_mean=args.bulk_mean,
            policy=Policy(zone_aware=not args.no_zone_aware), profiles=profiles,
            progress=lambda n: progress.advance(task, n),
        )
    if args.json:
        for item in (*reproduction.cells, *reproduction.ratios):
            print(json.dumps({"table": table.key, "runs": args.runs, **item.as_dict()}))
    else:
        render(reproduction, out)
    return 1 if args.strict and reproduction.failures else 0
