"""The fault-free single-process reference that ``--verify`` compares a run with.

:func:`train_reference_program` trains the whole model in one process for the run's steps with bamboo-rc's
reference trainer (:func:`bamboo.rc.reference.train_reference`): the same global batch at every step,
accumulated per pipeline as the run's layouts grouped it (``history``: ``(first step, pipelines)`` of every
generation) and the shares added in pipeline order, each step in the run's precision and loss scale, tied
weights summed. So a run that changed the number of pipelines mid-way is
compared with the same sums, associated the same way, and an exact run matches bit for bit.
:func:`compare_reports` and :func:`compare_states` compare the workers' final layers with it.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from bamboo.launch.json_types import JSON
    from bamboo.launch.run_options import Verification, WorkerReport
    from bamboo.launch.spec import JobSpec, LayerBuilder
    from torch import Tensor

__all__ = ["compare_reports", "compare_states", "train_reference_history", "train_reference_program"]


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


def train_reference_history(
    specs: Sequence[LayerBuilder], config: Mapping[str, JSON], size: Mapping[str, int], seed: int,
    history: Sequence[Sequence[int]], steps: int, *, pipelines: int | None = None,
) -> list[dict[str, Tensor]]:
    """:func:`train_reference_program` of the built-in example (the GPT of ``size`` on its corpus)."""
    from bamboo.launch.example import example_program

    program = example_program(dict(size), config, seed)
    return train_reference_program(specs, program.loss_fn, program.microbatch, config, seed, history, steps,
                                   pipelines=pipelines)


def compare_states(reports: Sequence[WorkerReport], reference: Sequence[Mapping[str, Tensor]]) -> tuple[float, int]:
    """``(max relative difference, tensors compared)`` between the workers' final reports and the reference's
    layer states: each layer a worker built (``slice_layers``) against the reference's layer of that index.

    The relative difference of a tensor is ``max|a-b| / max|b|``.
    """
    worst = 0.0
    tensors = 0
    for report in reports:
        for stage in report["hosted"]:
            for index, layer in zip(report["slice_layers"][stage], report["slices"][stage], strict=True):
                for name, tensor in layer.items():
                    expected = reference[index][name]
                    diff = (tensor.double() - expected.double()).abs().max().item()
                    scale = expected.double().abs().max().item()
                    worst = max(worst, diff / scale if scale > 0 else diff)
                    tensors += 1
    return worst, tensors


def compare_reports(reports: Sequence[WorkerReport], spec: JobSpec) -> Verification:
    """Compare final worker reports of the built-in example with its fault-free single-process run.

    ``spec`` is the job's :class:`~bamboo.launch.spec.JobSpec`. The reference trains the steps every
    worker finished, grouped by pipeline as the job's layouts were (the longest ``history``). Returns
    ``{"steps", "max_relative_diff", "tensors", "history"}``.
    """
    from bamboo.rc.model import GPTSize, gpt_layer_specs
    from bamboo.rc.worker import exact_mode

    if spec.script:
        raise ValueError("compare_reports replays the built-in example; a script replays itself "
                         "(bamboo.launch.script.reference_from_script)")
    steps = min(int(report["steps_done"]) for report in reports)
    history = max((report["history"] for report in reports), key=len)
    exact_mode()
    reference = train_reference_history(gpt_layer_specs(GPTSize(**spec.size)), spec.config, spec.size, spec.seed,
                                        history, steps, pipelines=spec.pipelines)
    worst, tensors = compare_states(reports, reference)
    return {"steps": steps, "max_relative_diff": worst, "tensors": tensors, "history": history}
