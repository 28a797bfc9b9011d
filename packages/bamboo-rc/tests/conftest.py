"""Shared fixtures of the bamboo-rc tests."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import pytest
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
