"""The single-process reference trainer.

It trains the whole model in one process on the same global batches, with the same loss scaling
(each microbatch's loss divided by the number of microbatches in the global batch), the same
global-norm clipping and the same optimizer and scheduler math as the pipeline, and each layer's
forward under the same generator as in the pipeline (:mod:`bamboo.rc.rng`: seeded from the seed,
the step, the microbatch's global index and the layer's index). `verify` compares
the pipeline's parameters against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from bamboo.rc.config import TrainingConfig
from bamboo.rc.data import GlobalBatchSampler
from bamboo.rc.rng import global_microbatch
from bamboo.rc.state import TrainableSlice, clip_coefficient

__all__ = ["ReferenceResult", "train_reference"]


@attrs.frozen
class ReferenceResult:
    """Per-layer state dicts after training and the mean loss of every step."""

    layer_states: list[dict[str, torch.Tensor]]
    losses: list[float]


def train_reference(
    specs: Sequence[Any],
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    config: TrainingConfig,
    sampler: GlobalBatchSampler,
    steps: int,
    pipelines: int,
    seed: int,
) -> ReferenceResult:
    """Train all layers for `steps` steps on global batches of `pipelines × M` microbatches."""
    whole = TrainableSlice(specs, range(len(specs)), config, seed)
    whole.zero_grads()
    global_microbatches = pipelines * config.micro_batches
    losses: list[float] = []
    for step in range(steps):
        total = 0.0
        summed: torch.Tensor | None = None
        for pipeline in range(pipelines):
            # Accumulate each pipeline's share on its own, then add the shares in pipeline order,
            # as the data-parallel all-reduce does: the same sums, associated the same way.
            whole.zero_grads()
            for k in range(config.micro_batches):
                index = global_microbatch(pipeline, config.micro_batches, k)
                batch = sampler.microbatch(step, index)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=config.bf16):
                    logits = whole.forward(batch.tokens, step=step, microbatch=index)
                loss = loss_fn(logits, batch.labels)
                (loss / global_microbatches).backward()
                total += float(loss.detach())
            share = whole.flat_grads()
            summed = share if summed is None else summed + share
        assert summed is not None
        whole.load_flat_grads(summed)
        losses.append(total / global_microbatches)
        whole.apply_step(clip_coefficient(config.gradient_clipping, whole.squared_grad_norm()))
    return ReferenceResult([layer.state_dict() for layer in whole.layers], losses)
