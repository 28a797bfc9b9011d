"""The fault-free single-process run of a model that a run is compared with: a user script's ``reference``
mode (:func:`bamboo.launch.script.train_worker`) trains it here.

:func:`train_reference_program` trains the whole model in one process for the run's steps with bamboo-rc's
reference trainer (:func:`bamboo.rc.reference.train_reference`): the same global batch at every step,
accumulated per pipeline as the run's layouts grouped it (``history``: ``(first step, pipelines)`` of every
generation) and the shares added in pipeline order, each step in the run's precision and loss scale, tied
weights summed. So a run that changed the number of pipelines mid-way is
compared with the same sums, associated the same way, and an exact run matches bit for bit. The comparison
itself (``bamboo-launch run --verify``) is bamboo-bench's :mod:`bamboo.bench.emulated.reference`.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bamboo.launch.json_types import JSON
    from bamboo.launch.spec import LayerBuilder
    from torch import Tensor

__all__ = ["train_reference_program"]


def train_reference_program(
    specs: Sequence[LayerBuilder],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    microbatch: Callable[[int, int], tuple[Tensor, Tensor]],
    config: Mapping[str, JSON],
    seed: int,
    history: Sequence[Sequence[int]],
    steps: int,
    *,
    pipelines: int | None = None,
) -> list[dict[str, Tensor]]:
    """Single-process training of the whole model for ``steps`` steps, grouped as the run was (``history``:
    ``(first step, pipelines)`` of every layout generation); ``microbatch(step, index)`` gives the ``(inputs,
    labels)`` at position ``index`` of the global batch of ``step``. The final state dict of each layer.

    ``pipelines`` is the job's own number of pipelines (its spec's), which fixes the global batch at that many
    times the config's microbatches whatever each generation ran with; by default, the first generation's. A
    run whose first kept generation had fewer (a restart from the initial state on fewer nodes) needs it."""
    from bamboo.rc import load_config
    from bamboo.rc.reference import train_reference

    job_pipelines = int(history[0][1]) if pipelines is None else pipelines
    trained = train_reference(specs, loss_fn, load_config(config, pipelines=job_pipelines), microbatch, steps,
                              job_pipelines, seed, history=history)
    return trained.layer_states
