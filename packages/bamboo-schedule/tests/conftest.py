"""Shared fixtures for bamboo-schedule tests: random consistent cuts and the golden-file directory."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.schedule.engine import counterpart
from bamboo.schedule.ir import Schedule

CutFn = Callable[[Schedule, int], dict[int, int]]


def _random_cut(schedule: Schedule, seed: int) -> dict[int, int]:
    """Progress after a random blocking interleaving stopped at a random step (a consistent cut)."""
    rng = random.Random(seed)
    streams = schedule.streams
    pos = dict.fromkeys(streams, 0)
    for _ in range(rng.randint(0, len(schedule))):
        options = []
        for n, stream in streams.items():
            if pos[n] >= len(stream):
                continue
            instr = stream[pos[n]]
            if instr.peer is None:
                options.append((n, None))
            elif pos[instr.peer] < len(streams[instr.peer]) and streams[instr.peer][pos[instr.peer]] == counterpart(
                instr, n
            ):
                options.append((n, instr.peer))
        if not options:
            break
        n, m = rng.choice(options)
        pos[n] += 1
        if m is not None:
            pos[m] += 1
    return pos


@pytest.fixture(scope="session")
def random_cut() -> CutFn:
    return _random_cut


@pytest.fixture(scope="session")
def golden_dir() -> Path:
    return Path(__file__).parent / "golden"
