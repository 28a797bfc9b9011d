"""The single-process reference trainer: the one that every exactness check compares a run with.

It trains the whole model in one process on the same global batches, with the same loss scaling
(each microbatch's loss divided by the number of microbatches in the global batch), the same
global-norm clipping and the same optimizer and scheduler math as the pipeline, and each layer's
forward under the same generator as in the pipeline (:mod:`bamboo.rc.rng`: seeded from the seed,
the step, the microbatch's global index and the layer's index). At each step the microbatch gradients
are accumulated per pipeline and the shares added in pipeline order, which is how the data-parallel
all-reduce associates them; a ``history`` of layouts (a run whose number of pipelines changed) is replayed
with the same grouping, step by step. `verify` and bamboo-launch's ``--verify`` compare against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import attrs
import torch
from bamboo.rc.config import TrainingConfig
from bamboo.rc.data import GlobalBatchSampler
from bamboo.rc.device import autocast
from bamboo.rc.rng import global_microbatch
from bamboo.rc.state import TrainableSlice, clip_coefficient

__all__ = ["Microbatches", "ReferenceResult", "train_reference"]

Microbatches: TypeAlias = "GlobalBatchSampler | Callable[[int, int], tuple[Any, Any]]"
"""Where the reference reads microbatch ``index`` of step ``step``: a sampler (its ``microbatch`` gives tokens and
labels) or a function ``microbatch(step, index) -> (inputs, labels)``."""


@attrs.frozen
class ReferenceResult:
    """Per-layer state dicts after training and the mean loss of every step."""

    layer_states: list[dict[str, torch.Tensor]]
    losses: list[float]


def _reader(batches: Microbatches) -> Callable[[int, int], tuple[Any, Any]]:
    if isinstance(batches, GlobalBatchSampler):
        def read(step: int, index: int) -> tuple[Any, Any]:
            batch = batches.microbatch(step, index)
            return batch.tokens, batch.labels

        return read
    return batches


def train_reference(
    specs: Sequence[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    config: TrainingConfig,
    batches: Microbatches,
    steps: int,
    pipelines: int,
    seed: int,
    *,
    history: Sequence[Sequence[int]] = (),
    device: torch.device | None = None,
) -> ReferenceResult:
    """Train all layers for `steps` steps on global batches of `pipelines × M` microbatches, on `device` (default
    the CPU; a GPU reference for a pipeline on GPUs). The layer states come back in host memory.

    ``history`` lists ``(first step, pipelines)`` of every layout generation of a run whose number of pipelines
    changed (empty: `pipelines` throughout); the global batch stays ``pipelines × M`` microbatches, each
    generation's pipelines taking an equal share of it.
    """
    device = device or torch.device("cpu")
    read = _reader(batches)
    whole = TrainableSlice(specs, range(len(specs)), config, seed, device)
    whole.zero_grads()
    global_microbatches = pipelines * config.micro_batches
    losses: list[float] = []
    for step in range(steps):
        at_step = next((int(d) for first, d in reversed(history) if step >= int(first)), pipelines)
        per_pipeline = global_microbatches // at_step
        total = 0.0
        summed: torch.Tensor | None = None
        for pipeline in range(at_step):
            # Accumulate each pipeline's share on its own, then add the shares in pipeline order,
            # as the data-parallel all-reduce does: the same sums, associated the same way.
            whole.zero_grads()
            for k in range(per_pipeline):
                index = global_microbatch(pipeline, per_pipeline, k)
                inputs, labels = read(step, index)
                with autocast(device, config):
                    outputs = whole.forward(inputs.to(device), step=step, microbatch=index)
                loss = loss_fn(outputs, labels.to(device))
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
