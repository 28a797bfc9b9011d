"""What the failover logic needs from the world: a key-value store and a clock.

:class:`~bamboo.rc.coordinator.FailoverCoordinator` and
:class:`~bamboo.rc.failures.StoreFailureNotices` talk to the other processes only through a
:class:`KeyValueStore` (any c10d store: a TCPStore, bamboo-membership's etcd-backed store) and
tell time only through a :class:`Clock`, so tests drive them in-process with a dictionary and a
clock whose ``sleep`` only moves its time forward. Nothing here imports torch.
"""

from __future__ import annotations

import time
from typing import Protocol

__all__ = ["Clock", "KeyValueStore", "SystemClock"]


class KeyValueStore(Protocol):
    """The part of a c10d ``Store`` the failover logic uses (values are written as text, read as bytes)."""

    def set(self, key: str, value: str | bytes) -> None:
        """Write ``value`` under ``key`` (last writer wins)."""

    def get(self, key: str) -> bytes:
        """The value of ``key`` (c10d stores block until it exists; callers ``check`` first)."""

    def check(self, keys: list[str]) -> bool:
        """Whether every key exists (never blocks)."""

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Write ``desired_value`` if ``key`` holds ``expected_value``, or is absent and ``expected_value`` is
        empty (first writer wins); returns what ``key`` holds afterwards."""


class Clock(Protocol):
    """Time, as the failover logic sees it."""

    def monotonic(self) -> float:
        """Seconds on a clock that never goes back (deadlines)."""

    def time(self) -> float:
        """Wall-clock seconds since the Unix epoch (records that other processes compare)."""

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (a poll interval) before looking again."""


class SystemClock:
    """The real clock: :func:`time.monotonic`, :func:`time.time`, :func:`time.sleep`."""

    def monotonic(self) -> float:
        return time.monotonic()

    def time(self) -> float:
        return time.time()

    def sleep(self, seconds: float) -> None:
        time.sleep(seconds)
