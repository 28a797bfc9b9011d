"""``bamboo-bench trace summary FILE...`` (preemptions per hour, bulk sizes, zones and alive nodes of trace files)
and ``bamboo-bench trace synthesize OUT.csv`` (the synthetic model's trace for one seed, as generic CSV)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from bamboo.bench.argtypes import positive_float, positive_int
from bamboo.bench.cli.common import add_synthetic_arguments, check_bulk, probability, stdout_console
from bamboo.bench.loaders import load_trace, write_generic_csv
from bamboo.bench.synthetic import SyntheticSpec, generate_trace
from rich.console import Console
from rich.table import Table

__all__ = ["add_parser", "run"]


def add_parser(commands: argparse._SubParsersAction) -> None:
    """Register ``trace`` and its actions, ``summary`` and ``synthesize``."""
    trace = commands.add_parser("trace", help="summarise trace files or write a synthetic trace")
    trace_commands = trace.add_subparsers(dest="trace_command", required=True, metavar="ACTION")
    summary = trace_commands.add_parser(
        "summary", help="preemptions per hour, bulk sizes, zones and alive nodes of trace files",
        description="Load each file (any supported format) and summarise it.",
    )
    summary.add_argument("files", nargs="+", type=Path, metavar="FILE",
                         help="trace files, or folders of per-zone files (a folder is one multi-zone trace)")
    summary.add_argument("--zone", help="zone name for EC2 and GCP traces (default: ec2 / the file name)")
    summary.add_argument("--json", action="store_true", help="print one JSON object per file")
    synthesize = trace_commands.add_parser(
        "synthesize", help="write a synthetic trace in the generic CSV format",
        description="Generate the synthetic model's trace for one seed and write it as generic CSV.",
    )
    synthesize.add_argument("out", type=Path, metavar="OUT.csv", help="where to write the CSV")
    synthesize.add_argument("--probability", type=probability, required=True, help="per-hour preemption probability")
    synthesize.add_argument("--hours", type=positive_float, default=24.0, help="trace length in hours (default 24)")
    synthesize.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    synthesize.add_argument("--nodes", type=positive_int, default=48, help="desired cluster size (default 48)")
    add_synthetic_arguments(synthesize)


def run(args: argparse.Namespace, console: Console) -> int:
    """Run ``trace summary`` or ``trace synthesize``; returns the exit status."""
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
            stdout_console().print(table)
        return 0
    check_bulk(args)
    spec = SyntheticSpec(
        preemption_probability=args.probability, desired_nodes=args.nodes, zones=args.zones, bulk_mean=args.bulk_mean
    )
    trace = generate_trace(spec, args.hours, args.seed)
    write_generic_csv(trace, args.out)
    console.print(f"wrote {args.out}: {len(trace)} events over {args.hours:g} h")
    return 0
