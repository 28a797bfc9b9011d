"""Shared fixtures of the bamboo-rc tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
from bamboo.rc.failures import FailureNoticed
from bamboo.rc.ports import SystemClock
from bamboo.rc.records import FailureEvent
from bamboo.rc.testing import ForkedRanks

os.environ.setdefault("DS_ACCELERATOR", "cpu")


@pytest.fixture
def tiny_config() -> dict:
    """A small DeepSpeed config that exercises AdamW, WarmupLR and gradient clipping."""
    return {
        "train_micro_batch_size_per_gpu": 2,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 3e-3, "warmup_num_steps": 3}},
        "gradient_clipping": 1.0,
    }


@pytest.fixture
def forked_ranks() -> Callable[[int, Callable[[int, Any], Any]], ForkedRanks]:
    """``forked_ranks(count, member)``: a :class:`bamboo.rc.testing.ForkedRanks` to enter."""
    return ForkedRanks


class NoticingCoordinator:
    """A stand-in for a worker's failure coordinator, for an interpreter driven in-process: ``event`` is the
    confirmed failure of the next epoch (None: none yet), ``dead`` the ranks known dead, ``left`` the ranks that
    left for the barrier."""

    watching = True

    def __init__(self) -> None:
        self.event: FailureEvent | None = None
        self.clock = SystemClock()
        self.dead: set[int] = set()
        self.left: set[int] = set()

    def pending_event(self) -> FailureEvent | None:
        return self.event

    def raise_if_noticed(self) -> None:
        if self.event is not None:
            raise FailureNoticed(self.event)

    def any_left(self, members: tuple[int, ...]) -> bool:
        return bool(self.left & set(members))


@pytest.fixture
def noticing_coordinator() -> NoticingCoordinator:
    """A :class:`NoticingCoordinator` with no failure yet."""
    return NoticingCoordinator()
