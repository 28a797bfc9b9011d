"""Shared fixtures of the bamboo-rc tests."""

from __future__ import annotations

import os

import pytest

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
