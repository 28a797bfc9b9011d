"""fp16's dynamic loss scaling: DeepSpeed's DynamicLossScaler step for step, the skipped step after an
overflow, the scale carried by a slice's state; and the tied weights' summed step (bamboo.rc.ties)."""

from __future__ import annotations

import types

import pytest
import torch
from bamboo.rc import load_config
from bamboo.rc.model import GPTSize, build_layers, gpt_layer_specs
from bamboo.rc.precision import LossScale, LossScaleConfig, LossScaleError, clip_coefficient, step_outcome
from bamboo.rc.reference import reference_step
from bamboo.rc.state import TrainableSlice
from bamboo.rc.ties import model_ties, tied_weights
from hypothesis import given, settings
from hypothesis import strategies as st
from torch import nn


@settings(max_examples=200, deadline=None)
@given(
    power=st.integers(2, 20), window=st.integers(1, 6), hysteresis=st.integers(1, 4), consecutive=st.booleans(),
    minimum=st.sampled_from([1.0, 2.0, 4.0]), overflows=st.lists(st.booleans(), min_size=1, max_size=60),
)
def test_the_loss_scale_follows_deepspeeds_dynamic_loss_scaler(
    power: int, window: int, hysteresis: int, consecutive: bool, minimum: float, overflows: list[bool],
) -> None:
    from deepspeed.runtime.fp16 import (
        loss_scaler,  # imported here: collecting the suite need not import deepspeed
    )

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(loss_scaler, "dist", types.SimpleNamespace(get_rank=lambda: 1))  # no process group, no log
        _compare(power, window, hysteresis, consecutive, minimum, overflows)


def _compare(power: int, window: int, hysteresis: int, consecutive: bool, minimum: float, overflows: list[bool]) -> None:
    from deepspeed.runtime.fp16 import loss_scaler

    config = LossScaleConfig(initial_scale_power=power, loss_scale_window=window, hysteresis=hysteresis,
                             consecutive_hysteresis=consecutive, min_loss_scale=minimum)
    theirs = loss_scaler.DynamicLossScaler(init_scale=2**power, scale_window=window, min_scale=minimum,
                                           delayed_shift=hysteresis, consecutive_hysteresis=consecutive)
    ours = config.initial()
    for overflow in overflows:
        try:
            theirs.update_scale(overflow)
        except Exception as error:  # DeepSpeed's "already at minimum" stop
            with pytest.raises(LossScaleError, match="minimum loss scale"):
                ours.after(overflow, config)
            assert "minimum" in str(error)
            return
        ours = ours.after(overflow, config)
        assert (ours.scale, ours.iteration, ours.last_overflow, ours.hysteresis) == (
            theirs.cur_scale, theirs.cur_iter, theirs.last_overflow_iter, theirs.cur_hysteresis)


def test_a_static_scale_stays_and_an_overflow_still_skips() -> None:
    config = LossScaleConfig(loss_scale=128.0)
    scale = config.initial()
    assert scale.after(True, config).scale == 128.0
    skipped = step_outcome(1.0, float("inf"), scale, config)
    assert skipped.overflow and skipped.loss_scale.iteration == 1
    kept = step_outcome(1.0, 4.0 * 128 * 128, scale, config)  # norm 2 after unscaling: clipped to 1
    assert not kept.overflow and kept.factor == clip_coefficient(1.0, 4.0) / 128.0


def _fp16_config(power: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_max_lr": 1e-2, "warmup_num_steps": 4}},
            "fp16": {"enabled": True, "initial_scale_power": power, "hysteresis": 1, "loss_scale_window": 2}}


def _tokens(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
    window = torch.randint(0, 256, (2, 9), generator=torch.Generator().manual_seed(step * 100 + index))
    return window[:, :-1], window[:, 1:]


def test_an_overflow_skips_the_step_and_halves_the_scale_and_the_state_carries_the_scale() -> None:
    specs = gpt_layer_specs(GPTSize(layers=1, width=16, heads=2, sequence=8))
    config = load_config(_fp16_config(power=24))  # 2^24: the first fp16 gradients overflow
    piece = TrainableSlice(specs, range(len(specs)), config, 0)
    before = [p.detach().clone() for p in piece.parameters]
    reference_step(piece, _loss, config, _tokens, 0, 1, 2)
    assert piece.steps == 1 and piece.loss_scale == LossScale(scale=2.0**23, iteration=1, last_overflow=0,
                                                                hysteresis=1)
    assert all(torch.equal(p, q) for p, q in zip(piece.parameters, before, strict=True))  # skipped
    assert piece.scheduler is not None and piece.scheduler.last_epoch == 0  # the scheduler did not step either
    assert all(p.grad is None or not p.grad.any() for p in piece.parameters)
    for step in range(1, 30):  # halving until the gradients fit fp16, then steps apply
        reference_step(piece, _loss, config, _tokens, step, 1, 2)
        if piece.scheduler.last_epoch:
            break
    assert piece.scheduler.last_epoch == 1 and piece.loss_scale.scale < 2.0**23
    copy = TrainableSlice(specs, range(len(specs)), config, 0)
    copy.load_state_bytes(piece.state_bytes())
    assert copy.loss_scale == piece.loss_scale and copy.steps == piece.steps


def _loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


class _Embedding(nn.Module):
    """A token embedding that is also the output projection when run through ``_logits`` (DeepSpeed's idiom)."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(32, 8) * 0.1)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return nn.functional.embedding(ids, self.weight)


def _logits(module: _Embedding, hidden: torch.Tensor) -> torch.Tensor:
    return nn.functional.linear(hidden, module.weight)


def test_deepspeeds_tied_layer_spec_trains_like_one_shared_weight() -> None:
    from deepspeed.pipe import LayerSpec, TiedLayerSpec

    specs = [TiedLayerSpec("embed", _Embedding), LayerSpec(nn.Linear, 8, 8),
             TiedLayerSpec("embed", _Embedding, forward_fn=_logits)]
    assert model_ties(specs) == {"embed": [(0, "weight"), (2, "weight")]}
    assert tied_weights(specs).shapes == {"embed": torch.Size([32, 8])}
    config = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}, "gradient_clipping": 0.5})
    piece = TrainableSlice(specs, range(3), config, seed=0)
    layers = build_layers(specs, range(3), seed=0)  # the same weights: one shared embedding, trained plainly
    embedding, linear = layers[0], layers[1]
    assert torch.equal(piece.layers[0].weight, piece.layers[2].weight)  # the copies start equal (one seed)
    embedding.load_state_dict(piece.layers[0].state_dict())
    linear.load_state_dict(piece.layers[1].state_dict())
    from bamboo.rc.config import build_optimizer

    shared = [embedding.weight, linear.weight, linear.bias]
    optimizer = build_optimizer(config.optimizer, shared)
    for step in range(3):
        ids, _ = _tokens(step, 0)
        labels = ids % 32
        ids = ids % 32
        piece.zero_grads()
        _loss(piece.forward(ids, step=step, microbatch=0), labels).backward()
        piece.step_whole(config)
        for p in shared:
            p.grad = None
        _loss(_logits(embedding, linear(embedding(ids))), labels).backward()
        torch.nn.utils.clip_grad_norm_(shared, 0.5, foreach=False)
        optimizer.step()
        assert torch.equal(piece.layers[0].weight, piece.layers[2].weight)  # both copies took the same step
        assert torch.allclose(piece.layers[0].weight, embedding.weight, rtol=0, atol=1e-6)
