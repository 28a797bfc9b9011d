"""Shared fixtures for bamboo-launch tests: /proc helpers (the hand-driven clock is the root conftest's
``fake_clock``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest


def live_group_members(pgid: int) -> list[int]:
    """Pids of processes in group ``pgid`` that are not zombies (read from /proc)."""
    members = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # Fields after the parenthesised command: state, ppid, pgrp, ...
        fields = stat[stat.rindex(")") + 2 :].split()
        if int(fields[2]) == pgid and fields[0] != "Z":
            members.append(int(entry.name))
    return members


def killed_or_gone(pids: list[int]) -> list[int]:
    """The pids among ``pids`` that no longer run (gone, or zombies waiting to be reaped)."""
    gone = []
    for pid in pids:
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:
            gone.append(pid)
            continue
        if stat[stat.rindex(")") + 2 :].split()[0] == "Z":
            gone.append(pid)
    return gone


def wait_for(predicate, timeout_s: float = 10.0) -> bool:
    """Poll an OS-level effect (a process dying, a file appearing) until true or timeout."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return predicate()


@pytest.fixture
def proc_helpers():
    """The /proc helpers, for tests (test files cannot import each other)."""

    class Helpers:
        group_members = staticmethod(live_group_members)
        wait = staticmethod(wait_for)
        killed_or_gone = staticmethod(killed_or_gone)

    assert os.path.isdir("/proc"), "these tests need Linux /proc"
    return Helpers
