"""Shared fixtures for the bamboo-bench tests: the shared trace folder, a tiny hand-computable profile, and /proc
helpers for the emulated cluster's process groups (the hand-driven clock is the root conftest's ``fake_clock``)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from bamboo.bench.profile import ModelProfile, Timing

# <repo>/packages/bamboo-bench/tests/conftest.py -> parents[3] is <repo>; the traces sit beside it.
TRACES = Path(__file__).resolve().parents[3] / ".." / "shared" / "traces"


@pytest.fixture(scope="session")
def traces_dir() -> Path:
    """The shared real traces (`<repo>/../shared/traces`); tests that need them skip if it is missing."""
    if not TRACES.is_dir():
        pytest.skip(f"shared trace folder {TRACES.resolve()} is missing")
    return TRACES.resolve()


@pytest.fixture(scope="session")
def tiny_profile() -> ModelProfile:
    """2 pipelines x 4 stages (immutable, so shared), 10 samples per step, 1.0 s steps with 2 pipelines and 1.5 s with 1.

    Timing: nodes ready 10 s after they are added, global rendezvous 5 s, local 2 s,
    reconfiguration 3 s, failover pause 4 s, fallback x1.5, restart 20 s, checkpoints every 100 s.
    """
    return ModelProfile(
        name="tiny",
        stages=4,
        pipelines=2,
        samples_per_step=10,
        step_time_ms={(4, 2): 1000.0, (4, 1): 1500.0},
        spot_price_per_node_hour=1.0,
        on_demand_price_per_node_hour=3.0,
        on_demand_nodes=6,
        on_demand_samples_per_second=12.0,
        job_samples=1000.0,
        timing=Timing(
            instance_creation_s=10.0,
            global_rendezvous_s=5.0,
            local_rendezvous_s=2.0,
            reconfiguration_s=3.0,
            failover_pause_s=4.0,
            fallback_slowdown=1.5,
            restart_s=20.0,
            checkpoint_interval_s=100.0,
        ),
    )


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
