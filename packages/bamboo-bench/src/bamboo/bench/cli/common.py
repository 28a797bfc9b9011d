"""What the ``bamboo-bench`` subcommands share: the usage error, the probability type, the model's and the
synthetic model's arguments and what they build (the profile, the policy), the progress bar, the stdout console
and number formatting."""

from __future__ import annotations

import argparse
import math
import sys

import attrs
from bamboo.bench.argtypes import non_negative_float, positive_float, positive_int
from bamboo.bench.profile import ModelProfile, builtin_profiles, load_profile
from bamboo.bench.strategy import Policy
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

__all__ = [
    "UsageError",
    "add_model_arguments",
    "add_synthetic_arguments",
    "check_bulk",
    "fmt",
    "policy_from_args",
    "probability",
    "profile_from_args",
    "progress_bar",
    "stdout_console",
]


class UsageError(Exception):
    """Bad input from the user: printed as one line, exit status 2."""


def probability(text: str) -> float:
    """An argparse type: a probability in [0, 1]."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"probability {text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"probability {text!r} is not in [0, 1]")
    return value


def add_model_arguments(parser: argparse.ArgumentParser, default: str) -> None:
    """``--model`` (default `default`), ``--checkpoint-interval``, ``--restart-s`` and ``--no-zone-aware``."""
    parser.add_argument(
        "--model",
        default=default,
        help=f"model profile: a shipped name ({', '.join(builtin_profiles())}) or a profile JSON file "
        f"(format in the package README; default {default})",
    )
    parser.add_argument(
        "--checkpoint-interval", type=positive_float, metavar="S",
        help="seconds between periodic checkpoints (default: the profile's checkpoint_interval_s)",
    )
    parser.add_argument(
        "--restart-s", type=non_negative_float, metavar="S",
        help="cost in seconds of one checkpoint/restart restart on top of the global rendezvous "
        "(default: the profile's restart_s)",
    )
    parser.add_argument(
        "--no-zone-aware", action="store_true",
        help="the ablation of zone-aware placement: the planner sees every node in one zone, as when nodes "
        "register without a zone (Bamboo's decisions are the system's and have no knob)",
    )


def add_synthetic_arguments(parser: argparse.ArgumentParser) -> None:
    """The synthetic model's ``--zones`` and ``--bulk-mean``."""
    parser.add_argument(
        "--zones", type=positive_int, default=3, help="number of zones in the synthetic model (default 3)"
    )
    parser.add_argument(
        "--bulk-mean", type=float, default=2.0, metavar="B",
        help="how preemptions bunch within a zone: a victim joins its zone's current bulk with probability "
        "1 - 1/B, so B is the mean bulk size before a zone's victims of the hour run out (B >= 1; 1 means "
        "independent). Default 2.0: effective mean bulks of 1.07 to 1.43 nodes at p=0.01 to 0.5 on 48 nodes, "
        "below the EC2 p3 trace's 2.1 nodes per preemption minute",
    )


def profile_from_args(args: argparse.Namespace) -> ModelProfile:
    """The ``--model`` profile, with ``--checkpoint-interval`` and ``--restart-s`` applied."""
    profile = load_profile(args.model)
    changes = {}
    if args.checkpoint_interval is not None:
        changes["checkpoint_interval_s"] = args.checkpoint_interval
    if args.restart_s is not None:
        changes["restart_s"] = args.restart_s
    if changes:
        profile = attrs.evolve(profile, timing=attrs.evolve(profile.timing, **changes))
    return profile


def policy_from_args(args: argparse.Namespace) -> Policy:
    """The simulated cluster's `Policy` (``--no-zone-aware``)."""
    return Policy(zone_aware=not args.no_zone_aware)


def check_bulk(args: argparse.Namespace) -> None:
    """Refuse a ``--bulk-mean`` under 1."""
    if not args.bulk_mean >= 1.0:
        raise UsageError(f"--bulk-mean must be >= 1, got {args.bulk_mean}")


def progress_bar(console: Console) -> Progress:
    """A transient progress bar on `console` (stderr): description, bar, done of total, elapsed time."""
    return Progress(
        TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=console, transient=True,
    )


def stdout_console() -> Console:
    """Tables go to stdout; when it is not a terminal, give them room instead of 80 columns."""
    return Console() if sys.stdout.isatty() else Console(width=160)


def fmt(value: float, digits: int) -> str:
    """`value` with `digits` decimals; NaN as ``-``."""
    return "-" if math.isnan(value) else f"{value:.{digits}f}"

