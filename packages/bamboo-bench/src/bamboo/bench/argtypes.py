"""What the command lines of bamboo-bench and bamboo-launch share: argparse value types whose errors name the bad
text, a parser whose errors are one line, and flag defaults read from the options class a flag fills."""

from __future__ import annotations

import argparse
import math
from typing import Any, NoReturn

import attrs

USAGE = 2
"""The exit status of a command given bad input."""

__all__ = ["PREEMPTIONS_HELP", "USAGE", "OneLineParser", "default_of", "non_negative_float", "non_negative_int", "positive_float", "positive_int", "zones"]


PREEMPTIONS_HELP = ("a trace file in any format bamboo-bench reads (the paper's EC2 CSV, a GCP log, SkyPilot JSON, "
                    "a generic CSV), a folder of such files (one zone each: one multi-zone trace), or synthetic:RATE, the paper's model at per-hour preemption probability RATE "
                    "(e.g. synthetic:0.1) on about --nodes nodes")
"""The ``--help`` of every command's ``--preemptions``."""


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose errors are one line, ``PROG: error: MESSAGE (see PROG --help)``, exit status
    :data:`USAGE` (its subcommands' parsers are of the same class)."""

    def error(self, message: str) -> NoReturn:
        self.exit(USAGE, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _number(text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None


def positive_float(text: str) -> float:
    """A finite number above 0."""
    value = _number(text)
    if not value > 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number > 0")
    return value


def non_negative_float(text: str) -> float:
    """A finite number of at least 0."""
    value = _number(text)
    if not value >= 0 or math.isinf(value):
        raise argparse.ArgumentTypeError(f"{text!r} must be a finite number >= 0")
    return value


def _whole(text: str, minimum: int) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < minimum:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= {minimum}")
    return value


def positive_int(text: str) -> int:
    """A whole number of at least 1."""
    return _whole(text, 1)


def non_negative_int(text: str) -> int:
    """A whole number of at least 0."""
    return _whole(text, 0)


def zones(text: str) -> tuple[str, ...]:
    """Comma-separated zone names, none empty: ``a,b,c``."""
    names = tuple(zone.strip() for zone in text.split(","))
    if not text or any(not zone for zone in names):
        raise argparse.ArgumentTypeError(f"zones must be comma-separated names like a,b,c, got {text!r}")
    return names


def default_of(options: type, field: str) -> Any:
    """The default of the attrs class ``options``' field ``field``: a flag takes its default from the options
    class it fills, so the two never disagree."""
    default = attrs.fields_dict(options)[field].default
    if isinstance(default, attrs.Factory):  # type: ignore[arg-type]
        raise TypeError(f"{options.__name__}.{field} has a factory default; give the flag its own")
    return default
