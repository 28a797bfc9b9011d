"""argparse value types shared by bamboo-bench's commands: one-line errors that name the bad text."""

from __future__ import annotations

import argparse
import math


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


def positive_int(text: str) -> int:
    """A whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} must be >= 1")
    return value
