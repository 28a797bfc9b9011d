"""Helpers shared by the failover benchmarks (run as scripts, so this directory is on ``sys.path``)."""

from __future__ import annotations

import math
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) with linear interpolation between closest ranks; NaN when empty."""
    ordered = sorted(values)
    if not ordered:
        return math.nan
    position = (len(ordered) - 1) * q / 100.0
    low = math.floor(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


class Log:
    """Progress lines with the seconds since the benchmark started, on stderr: stdout carries the results (the
    table, or the JSON of ``--json``) alone."""

    def __init__(self) -> None:
        self.started = time.monotonic()

    def __call__(self, message: str) -> None:
        print(f"[{time.monotonic() - self.started:7.1f}s] {message}", file=sys.stderr, flush=True)


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, poll_s: float = 0.02) -> Any:
    """Poll ``predicate`` until it is truthy and return its value; TimeoutError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(poll_s)
    raise TimeoutError(f"{what} did not happen within {timeout_s:g} s")
