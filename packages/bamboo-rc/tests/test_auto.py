"""``redundancy="auto"`` at the front door: the mode is chosen from the stages' compute and a preemption rate."""

from __future__ import annotations

import datetime

import bamboo.rc
import pytest
from bamboo.rc.auto import choose_for_layers
from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss, stage_bounds
from torch.distributed import TCPStore

SIZE = GPTSize(layers=4, width=16, heads=2, sequence=8)


def test_the_mode_follows_the_preemption_rate() -> None:
    specs = gpt_layer_specs(SIZE)
    bounds = stage_bounds(specs, 2)
    assert choose_for_layers(specs, bounds, 8, 4, preemptions_per_node_hour=0.0).mode == "none"
    busy = choose_for_layers(specs, bounds, 8, 4, preemptions_per_node_hour=1.0)
    assert busy.mode in ("lflb", "eflb")
    assert busy.reason.startswith(f"{busy.mode}: least training lost per hour at 1 preemptions per node-hour on 4")
    assert (busy.failures.pipelines, busy.failures.spare_nodes) == (1, 0)
    two = choose_for_layers(specs, bounds, 8, 4, preemptions_per_node_hour=1.0, pipelines=2)
    assert two.failures.pipelines == 2  # the other pipeline trains on: none's loss has no wait for a replacement
    assert next(e for e in busy.estimates if e.mode == "none").per_failure_s > next(
        e for e in two.estimates if e.mode == "none").per_failure_s


def test_initialize_resolves_auto_before_it_builds_the_executor() -> None:
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine = bamboo.rc.initialize(gpt_layer_specs(SIZE), config, "auto", loss_fn=lm_loss, rank=0, world_size=1,
                                  stages=1, store=store, job="auto")
    assert engine.executor.redundancy == "none"  # one stage, one pipeline: nothing could hold a copy
    engine.finish()
    with pytest.raises(ValueError, match="redundancy must be one of none, lflb, eflb, efeb, auto, got 'eager'"):
        bamboo.rc.initialize(gpt_layer_specs(SIZE), config, "eager", loss_fn=lm_loss, rank=0, world_size=1, stages=1,
                             store=store)
