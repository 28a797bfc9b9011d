"""The ``bamboo-bench`` command line: simulate strategies on a trace, sweep probabilities, inspect traces.

Subcommands, one module each:

- ``simulate``: compare strategies on one real trace (``--trace``) or on synthetic runs
  (``--synthetic``), print a table (or JSON lines with ``--json``), optionally plot (``--plot``)
  (:mod:`bamboo.bench.cli.simulate`).
- ``sweep``: the paper's Table 6: many synthetic runs per preemption probability, until completion
  (:mod:`bamboo.bench.cli.sweep`).
- ``paper``: reproduce one of the paper's tables (``table6``, ``dp``) and print simulated against published
  (:mod:`bamboo.bench.cli.paper`).
- ``compare``: measure Bamboo, checkpoint/restart and on-demand on one replayed trace (each through
  ``bamboo-bench measure``, a subprocess) and check the simulator against each run; ``measure``: one system's
  run and its measured profile. Both are the measured layer's (:mod:`bamboo.bench.measured.cli`, installed with
  ``bamboo-bench[measured]``: they need bamboo-launch); this module registers them.
- ``trace summary`` / ``trace synthesize``: summarise trace files; write a synthetic trace as CSV
  (:mod:`bamboo.bench.cli.trace`).

What they share is :mod:`bamboo.bench.cli.common`'s. Bad input prints one line ``bamboo-bench: error: ...`` and
exits with status 2.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from bamboo.bench.argtypes import OneLineParser
from bamboo.bench.cli import paper, simulate, sweep, trace
from bamboo.bench.cli.common import UsageError, stdout_console
from bamboo.bench.loaders import TraceFormatError
from bamboo.bench.profile import ProfileError
from bamboo.bench.strategy import PolicyMismatch
from rich.console import Console

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``bamboo-bench``."""
    parser = OneLineParser(
        prog="bamboo-bench",
        description="Spot traces and the trace-driven simulator: throughput, cost and value of training on spot.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    simulate.add_parser(commands)
    sweep.add_parser(commands)
    paper.add_parser(commands)
    _add_measured(commands)
    trace.add_parser(commands)
    return parser


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
        raise UsageError(MEASURED_MISSING.format(command=args.command)) from None
    return run_command(args, console, stdout_console())


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
            return simulate.run(args, console)
        if args.command == "sweep":
            return sweep.run(args, console)
        if args.command == "paper":
            return paper.run(args, console)
        if args.command in MEASURED_COMMANDS:
            return _run_measured(args, console)
        return trace.run(args, console)
    except (UsageError, TraceFormatError, ProfileError, PolicyMismatch, ValueError, KeyError, OSError,
            RuntimeError) as error:  # RuntimeError: a measured run that failed (its message names its log)
        message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
        print(f"bamboo-bench: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C, or SIGTERM/SIGHUP in compare and measure: their runs were cleaned up
        print("bamboo-bench: interrupted", file=sys.stderr)
        return 130
