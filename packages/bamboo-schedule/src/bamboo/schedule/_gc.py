"""Pausing Python's cyclic garbage collector around allocation-heavy work that makes no cycles.

Generating, merging, validating and simulating a large schedule allocates hundreds of thousands of
small tuples and lists. Each allocation burst triggers collections that scan every tracked object,
including the long-lived schedules, yet this package never creates reference cycles, so those
collections find nothing. `gc_paused` disables the collector for the duration of one public call
(reference counting still frees everything at once) and restores it afterwards. Nested calls and
callers that already disabled the collector are left alone.
"""

from __future__ import annotations

import functools
import gc
from collections.abc import Callable
from typing import ParamSpec, TypeVar

__all__ = ["gc_paused"]

P = ParamSpec("P")
R = TypeVar("R")


def gc_paused(function: Callable[P, R]) -> Callable[P, R]:
    """``function`` run with the cyclic garbage collector disabled (re-enabled after, if it was on)."""

    @functools.wraps(function)
    def paused(*args: P.args, **kwargs: P.kwargs) -> R:
        if not gc.isenabled():
            return function(*args, **kwargs)
        gc.disable()
        try:
            return function(*args, **kwargs)
        finally:
            gc.enable()

    return paused
