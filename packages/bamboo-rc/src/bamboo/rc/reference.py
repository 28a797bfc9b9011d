"""The single-process reference trainer: the one that every exactness check compares a run with.

It trains the whole model in one process on the same global batches, with the same loss scaling
(each microbatch's loss divided by the number of microbatches in the global batch), the same
global-norm clipping and the same optimizer and scheduler math as the pipeline, each layer's
forward under the same generator as in the pipeline (:mod:`bamboo.rc.rng`: seeded from the seed,
the step, the microbatch's global index and the layer's index), and the same precision: bf16 or
fp16 autocast, fp16's loss scale, tied weights summed (:meth:`bamboo.rc.state.TrainableSlice.step_whole`).
At each step the microbatch gradients are accumulated per pipeline and the shares added in pipeline order,
which is how the data-parallel all-reduce associates them; a ``history`` of layouts (a run whose number of
pipelines changed) is replayed with the same grouping, step by step. `verify` and bamboo-launch's ``--verify``
compare against it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, TypeAlias

import attrs
import torch
from bamboo.rc.config import TrainingConfig
from bamboo.rc.data import GlobalBatchSampler, bind_global_batch
from bamboo.rc.device import to_device
from bamboo.rc.precision import autocast, backward
from bamboo.rc.rng import global_microbatch
from bamboo.rc.state import TrainableSlice
from bamboo.reconfig import microbatch_shares

__all__ = ["Microbatch", "Microbatches", "ReferenceResult", "reference_step", "train_reference"]

Microbatch = Callable[[int, int], tuple[Any, Any]]
"""``(step, global microbatch index) -> (inputs, labels)``."""

Microbatches: TypeAlias = "GlobalBatchSampler | Microbatch"
"""Where the reference reads microbatch ``index`` of step ``step``: a sampler (its ``microbatch`` gives tokens and
labels) or a function ``microbatch(step, index) -> (inputs, labels)``."""


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
    accumulated per pipeline of ``pipelines`` (each its share, :func:`bamboo.reconfig.microbatch_shares`: the
    first ``G mod D`` one longer) and the shares added in pipeline order, as the data-parallel all-reduce associates
    them; returns the step's mean loss."""
    total = 0.0
    summed: torch.Tensor | None = None
    first = 0
    for count in microbatch_shares(global_microbatches, pipelines):
        whole.zero_grads()
        for k in range(count):
            index = global_microbatch(first, count, k)
            inputs, labels = microbatch(step, index)
            with autocast(config, whole.device):
                outputs = whole.forward(to_device(inputs, whole.device), step=step, microbatch=index)
            loss = loss_fn(outputs, to_device(labels, whole.device))
            backward(loss / global_microbatches, whole.loss_scale)
            total += float(loss.detach())
        first += count
        share = whole.flat_grads()
        summed = share if summed is None else summed + share
    assert summed is not None
    whole.load_flat_grads(summed)
    whole.step_whole(config)
    return total / global_microbatches


def _reader(data: Microbatches) -> Microbatch:
    if isinstance(data, GlobalBatchSampler):
        def read(step: int, index: int) -> tuple[Any, Any]:
            batch = data.microbatch(step, index)
            return batch.tokens, batch.labels

        return read
    return data


def train_reference(
    specs: Sequence[Any],
    loss_fn: Callable[[Any, Any], torch.Tensor],
    config: TrainingConfig,
    data: Microbatches,
    steps: int,
    pipelines: int,
    seed: int,
    *,
    history: Sequence[Sequence[int]] = (),
    device: torch.device | None = None,
) -> ReferenceResult:
    """Train all layers for `steps` steps on global batches of `config.global_count(pipelines)` microbatches of
    ``data`` (`pipelines × M` unless the config sets the global batch), on
    `device` (default the CPU; a GPU reference for a pipeline on GPUs). The layer states come back in host memory.

    ``history`` lists ``(first step, pipelines)`` of every layout generation of a run whose number of pipelines
    changed (empty: `pipelines` throughout); the global batch stays ``pipelines × M`` microbatches, each
    generation's pipelines taking their shares of it (equal where their number divides it).
    """
    whole = TrainableSlice(specs, range(len(specs)), config, seed, device or torch.device("cpu"))
    whole.zero_grads()
    global_microbatches = config.global_count(pipelines)
    microbatch = _reader(data)
    if not isinstance(data, GlobalBatchSampler):
        bind_global_batch(microbatch, global_microbatches, config.micro_batch_size)
    losses = []
    for step in range(steps):
        at_step = next((int(d) for first, d in reversed(history) if step >= int(first)), pipelines)
        losses.append(reference_step(whole, loss_fn, config, microbatch, step, at_step, global_microbatches))
    states = [{name: tensor.detach().cpu() for name, tensor in layer.state_dict().items()} for layer in whole.layers]
    return ReferenceResult(states, losses, None if whole.loss_scale is None else whole.loss_scale.to_dict())
