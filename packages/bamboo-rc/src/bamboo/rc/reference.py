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
from bamboo.rc.device import autocast
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
    device: torch.device | None = None,
) -> ReferenceResult:
    """Train all layers for `steps` steps on global batches of `pipelines × M` microbatches, on `device`
    (default the CPU; a GPU reference for a pipeline on GPUs). The layer states come back in host memory."""
    device = device or torch.device("cpu")
    whole = TrainableSlice(specs, range(len(specs)), config, seed, device)
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
                tokens, labels = batch.tokens.to(device), batch.labels.to(device)
                with autocast(device, config):
                    logits = whole.forward(tokens, step=step, microbatch=index)
                loss = loss_fn(logits, labels)
                (loss / global_microbatches).backward()
                total += float(loss.detach())
            share = whole.flat_grads()
            summed = share if summed is None else summed + share
        assert summed is not None
        whole.load_flat_grads(summed)
        losses.append(total / global_microbatches)
        whole.apply_step(clip_coefficient(config.gradient_clipping, whole.squared_grad_norm()))
    states = [{name: tensor.detach().cpu() for name, tensor in layer.state_dict().items()} for layer in whole.layers]
    return ReferenceResult(states, losses)
