"""The check of ``bamboo-launch run --verify``: a run's final layers against the fault-free single-process run.

:func:`train_reference_history` trains the built-in example with bamboo-launch's
:func:`bamboo.launch.reference.train_reference_program` (the same global batch at every step, grouped per
pipeline as the run's layouts grouped it, so an exact run matches bit for bit); :func:`compare_reports` and
:func:`compare_states` compare the workers' final layers with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

from bamboo.launch.reference import train_reference_program

if TYPE_CHECKING:
    from bamboo.bench.emulated.run_options import Verification, WorkerReport
    from bamboo.launch.json_types import JSON
    from bamboo.launch.spec import JobSpec, LayerBuilder
    from torch import Tensor

__all__ = ["compare_reports", "compare_states", "train_reference_history"]


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
