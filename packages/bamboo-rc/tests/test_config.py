"""DeepSpeed config parsing: supported keys, clear errors for the rest, DeepSpeed's LR math."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from bamboo.rc.config import ConfigError, build_optimizer, build_scheduler, load_config
from bamboo.rc.engine import initialize
from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss


def test_supported_config_is_read(tiny_config: dict, tmp_path: Path) -> None:
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({**tiny_config, "bf16": {"enabled": True}, "train_batch_size": 16}))
    config = load_config(path, pipelines=2)
    assert (config.micro_batch_size, config.micro_batches, config.gradient_clipping) == (2, 4, 1.0)
    assert config.bf16 and config.optimizer.type == "adamw" and config.scheduler.type == "warmuplr"


@pytest.mark.parametrize(
    ("extra", "named"),
    [
        ({"zero_optimization": {"stage": 1}}, "'zero_optimization'"),
        ({"fp16": {"enabled": True, "fp16_master_weights_and_grads": True}}, "fp16.'fp16_master_weights_and_grads'"),
        ({"optimizer": {"type": "Adam", "params": {"lr": 1e-3, "amsgrad": True}}}, "optimizer.params.'amsgrad'"),
        ({"scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1.0, "cycle": 3}}}, "scheduler.params.'cycle'"),
        ({"bf16": {"enabled": True, "immediate_grad_update": True}}, "bf16.'immediate_grad_update'"),
    ],
)
def test_unsupported_key_is_a_clear_error(tiny_config: dict, extra: dict, named: str) -> None:
    with pytest.raises(ConfigError, match="unsupported DeepSpeed config key") as error:
        load_config({**tiny_config, **extra})
    assert named in str(error.value)


def test_unsupported_key_fails_the_front_door(tiny_config: dict) -> None:
    specs = gpt_layer_specs(GPTSize(layers=2, width=16, heads=2, sequence=8))
    with pytest.raises(ConfigError, match="'activation_checkpointing'"):
        initialize(specs, {**tiny_config, "activation_checkpointing": {}}, "eflb",
                   loss_fn=lm_loss, stages=2, rank=0, world_size=2)


@pytest.mark.parametrize(
    ("config", "message"),
    [
        ({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "Lamb"}}, "unsupported optimizer type 'Lamb'"),
        ({"train_micro_batch_size_per_gpu": 0}, "'micro_batch_size' must be >= 1: 0"),
        ({"train_micro_batch_size_per_gpu": 2, "train_batch_size": 5}, "train_batch_size 5"),
        ({"gradient_accumulation_steps": 2}, "needs 'train_micro_batch_size_per_gpu'"),
        ({"train_micro_batch_size_per_gpu": 2, "gradient_clipping": -1.0}, "'gradient_clipping' must be >= 0.0: -1.0"),
    ],
)
def test_bad_values_name_the_value(config: dict, message: str) -> None:
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        load_config(config)


def test_front_door_rejects_bad_redundancy_and_missing_loss(tiny_config: dict) -> None:
    specs = gpt_layer_specs(GPTSize(layers=2, width=16, heads=2, sequence=8))
    with pytest.raises(ValueError, match="'fast'"):
        initialize(specs, tiny_config, "fast", loss_fn=lm_loss, stages=2, rank=0, world_size=2)
    with pytest.raises(ValueError, match="loss_fn"):
        initialize(specs, tiny_config, "eflb", stages=2, rank=0, world_size=2)


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR"])
@pytest.mark.parametrize("warmup_type", ["log", "linear"])
def test_scheduler_matches_deepspeed(kind: str, warmup_type: str) -> None:
    from deepspeed.runtime import lr_schedules

    params = {"warmup_min_lr": 1e-4, "warmup_max_lr": 2e-3, "warmup_num_steps": 5, "warmup_type": warmup_type}
    if kind == "WarmupDecayLR":
        params["total_num_steps"] = 12
    config = load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": {"type": kind, "params": params}})
    ours_opt = build_optimizer(config.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    ours = build_scheduler(config.scheduler, ours_opt)
    theirs_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    theirs = getattr(lr_schedules, kind)(theirs_opt, **params)
    for _ in range(14):
        assert ours_opt.param_groups[0]["lr"] == pytest.approx(theirs_opt.param_groups[0]["lr"], rel=1e-12, abs=1e-15)
        ours_opt.step()
        ours.step()
        theirs.step()


@pytest.mark.parametrize(
    ("size", "message"),
    [
        ({"width": 0}, "'width' must be >= 1: 0"),
        ({"dropout": 1.0}, "'dropout' must be < 1: 1.0"),
        ({"dropout": -0.1}, "'dropout' must be >= 0: -0.1"),
    ],
)
def test_model_sizes_name_the_bad_value(size: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        GPTSize(**size)


def test_uneven_shares_of_the_global_batch_follow_the_layouts_split_and_check_train_batch_size() -> None:
    """With ``global_microbatches`` (a layout of a number of pipelines that does not divide the global batch), the
    gradient accumulation steps are one pipeline's share; the shares are bamboo-reconfig's (the first G mod D one
    longer), each pipeline's share starts where the previous ends, and ``train_batch_size`` is checked against the
    global batch. Without it, every pipeline runs M."""
    from bamboo.reconfig import microbatch_shares

    base = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 5}
    uneven = load_config(base, pipelines=3, global_microbatches=16)
    assert uneven.global_count(3) == 16 and uneven.shares(3) == microbatch_shares(16, 3) == (6, 5, 5)
    assert [uneven.share(d, 3) for d in range(3)] == [(0, 6), (6, 5), (11, 5)]
    assert load_config({**base, "train_batch_size": 32}, pipelines=3, global_microbatches=16).micro_batches == 5
    with pytest.raises(ConfigError, match=r"train_batch_size 30 != train_micro_batch_size_per_gpu 2 × 16"):
        load_config({**base, "train_batch_size": 30}, pipelines=3, global_microbatches=16)
    even = load_config(base, pipelines=3)
    assert even.global_count(3) == 15 and even.shares(3) == (5, 5, 5) and even.share(2, 3) == (10, 5)
