"""The single-process reference trainer.

It trains the whole model in one process on the same global batches, with the same loss scaling
(each microbatch's loss divided by the number of microbatches in the global batch), the same
global-norm clipping and the same optimizer and scheduler math as the pipeline, each layer's
forward under the same generator as in the pipeline (:mod:`bamboo.rc.rng`: seeded from the seed,
the step, the microbatch's global index and the layer's index), and the same precision: bf16 or
fp16 autocast, fp16's loss scale, tied weights summed (:meth:`bamboo.rc.state.TrainableSlice.step_whole`).
`verify` compares the pipeline's parameters against it; bamboo-launch's ``--verify`` reference runs
:func:`reference_step` too.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from bamboo.rc.config import TrainingConfig
from bamboo.rc.data import GlobalBatchSampler, bind_global_batch
from bamboo.rc.precision import autocast, backward
from bamboo.rc.rng import global_microbatch
from bamboo.rc.state import TrainableSlice

__all__ = ["ReferenceResult", "reference_step", "train_reference"]

Microbatch = Callable[[int, int], tuple[Any, Any]]
"""``(step, global microbatch index) -> (inputs, labels)``."""


@attrs.frozen
class ReferenceResult:
    """Per-layer state dicts after training and the mean loss of every step."""

    layer_states: list[dict[str, torch.Tensor]]
    losses: list[float]
    loss_scale: dict[str, Any] | None = None
    """With fp16: the loss-scale state after the last step (:meth:`bamboo.rc.precision.LossScale.to_dict`)."""


def reference_step(whole: TrainableSlice, loss_fn: Callable[[Any, Any], torch.Tensor], config: TrainingConfig,
                   microbatch: Microbatch, step: int, pipelines: int, global_microbatches: int) -> float:
    """One step of the whole model on the global batch of ``step`` (``global_microbatches`` microbatches),
    accumulated per pipeline of ``pipelines`` and the shares added in pipeline order, as the data-parallel
    all-reduce associates them; returns the step's mean loss."""
    per_pipeline = global_microbatches // pipelines
    total = 0.0
    summed: torch.Tensor | None = None
    for pipeline in range(pipelines):
        whole.zero_grads()
        for k in range(per_pipeline):
            index = global_microbatch(pipeline, per_pipeline, k)
            inputs, labels = microbatch(step, index)
            with autocast(config):
                outputs = whole.forward(inputs, step=step, microbatch=index)  # bamboo.rc.rng's generators
            loss = loss_fn(outputs, labels)
            backward(loss / global_microbatches, whole.loss_scale)
            total += float(loss.detach())
        share = whole.flat_grads()
        summed = share if summed is None else summed + share
    assert summed is not None
    whole.load_flat_grads(summed)
    whole.step_whole(config)
    return total / global_microbatches


def train_reference(
    specs: Sequence[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    config: TrainingConfig,
    data: GlobalBatchSampler | Microbatch,
    steps: int,
    pipelines: int,
    seed: int,
) -> ReferenceResult:
    """Train all layers for `steps` steps on global batches of `pipelines × M` microbatches of ``data`` (the
    example's sampler, or ``microbatch(step, index)``)."""
    whole = TrainableSlice(specs, range(len(specs)), config, seed)
    whole.zero_grads()
    global_microbatches = pipelines * config.micro_batches
    if isinstance(data, GlobalBatchSampler):
        sampler = data

        def microbatch(step: int, index: int) -> tuple[Any, Any]:
            batch = sampler.microbatch(step, index)
            return batch.tokens, batch.labels
    else:
        microbatch = data
        bind_global_batch(microbatch, global_microbatches, config.micro_batch_size)
    losses = [reference_step(whole, loss_fn, config, microbatch, step, pipelines, global_microbatches)
              for step in range(steps)]
    return ReferenceResult([layer.state_dict() for layer in whole.layers], losses,
                           None if whole.loss_scale is None else whole.loss_scale.to_dict())
