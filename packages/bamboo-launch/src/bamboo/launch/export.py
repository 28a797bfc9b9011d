"""``bamboo-launch export``: the trained model as one state dict, loadable into your layers in order.

A run's final state is spread over its workers (``RUN_DIR/out/rank<R>.pt``: each worker's stages), and a
checkpoint's over its shards (``DIR/step-<N>/stage-<s>.pt``: each stage's parameters, optimizer state and
the global indices of its layers). :func:`export_run` and :func:`export_checkpoint` gather them into one
state dict whose keys are ``<layer index>.<parameter name>``, exactly the keys of
``torch.nn.Sequential(*layers).state_dict()`` for the model's layers in order, so::

    model = torch.nn.Sequential(*[spec.build() for spec in layers])
    model.load_state_dict(torch.load("model.pt"))

Layers held by several workers (data-parallel copies, replicas) are bit-equal; the first one found is used.
A layer that no worker or shard holds is an error naming it.

A model split from ``transformers`` (``bamboo.rc.from_transformers``) can also be written as a
``save_pretrained`` folder (:func:`export_hf`: ``config.json`` and ``model.safetensors``) that
``AutoModelForCausalLM.from_pretrained`` loads; the export then reloads it and checks that its logits are
bamboo's on a test batch.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["FORMATS", "ExportError", "export_checkpoint", "export_hf", "export_run", "save_state_dict"]

FORMATS = ("bamboo", "hf")
"""``--format``: one state dict of ``nn.Sequential``'s keys, or a Hugging Face ``save_pretrained`` folder."""


class ExportError(ValueError):
    """The run directory or checkpoint cannot give a whole model; the message says what is missing."""


def _gather(layers: Iterable[tuple[int, Mapping[str, Tensor]]]) -> dict[str, Tensor]:
    by_index: dict[int, Mapping[str, Tensor]] = {}
    for index, state in layers:
        by_index.setdefault(int(index), state)
    if not by_index:
        raise ExportError("no layer state found")
    missing = sorted(set(range(max(by_index) + 1)) - set(by_index))
    if missing:
        raise ExportError(f"layers {missing} are held by no worker or shard: the model is incomplete")
    return {f"{index}.{name}": tensor for index in sorted(by_index) for name, tensor in by_index[index].items()}


def export_run(run_dir: str | os.PathLike[str]) -> dict[str, Tensor]:
    """The final model of a finished run, from its workers' reports (``RUN_DIR/out/rank*.pt``)."""
    import torch

    if not Path(run_dir).is_dir():
        raise ExportError(f"{run_dir}: no such run directory")
    paths = sorted(Path(run_dir, "out").glob("rank*.pt"))
    if not paths:
        raise ExportError(f"{run_dir} has no final worker reports (out/rank*.pt): did the run finish?")

    def layers() -> Iterable[tuple[int, Mapping[str, Tensor]]]:
        for path in paths:
            report = torch.load(path, weights_only=False)
            for stage, indices in report["slice_layers"].items():
                yield from zip(indices, report["slices"][stage], strict=True)

    return _gather(layers())


def export_checkpoint(directory: str | os.PathLike[str], step: int | None = None) -> tuple[int, dict[str, Tensor]]:
    """``(step, state dict)`` of the newest good checkpoint in ``directory`` (or of ``step``)."""
    import torch
    from bamboo.rc.checkpoint_files import (
        CheckpointError,
        list_checkpoints,
        load_checkpoint,
        load_latest_good,
        step_dir_name,
    )

    found = list_checkpoints(directory)
    if not found:
        raise ExportError(f"{directory} holds no checkpoint")
    folder = Path(directory) / step_dir_name(step) if step is not None else found[0][1]
    if not folder.is_dir():
        raise ExportError(f"{directory} has no checkpoint of step {step} (steps: "
                          f"{', '.join(str(s) for s, _ in found[:8])})")
    shards = sorted(path.name.removesuffix(".manifest.json") for path in folder.glob("stage-*.manifest.json"))
    if not shards:
        raise ExportError(f"{folder} has no committed stage shard")
    try:
        loaded = load_checkpoint(folder, shards) if step is not None else load_latest_good(directory, shards)
    except CheckpointError as error:
        raise ExportError(str(error)) from None

    def layers() -> Iterable[tuple[int, Mapping[str, Tensor]]]:
        for name, shard in loaded.shards.items():
            if "layers" not in shard:
                raise ExportError(f"shard {name} of {loaded.path} has no layer indices (written by an older version)")
            state = torch.load(io.BytesIO(shard["state"].numpy().tobytes()), weights_only=False)
            per_layer: dict[int, dict[str, Tensor]] = {}
            for key, tensor in state["layers"].items():
                local, _, parameter = key.partition(".")
                per_layer.setdefault(int(local), {})[parameter] = tensor
            indices = shard["layers"].tolist()
            yield from ((indices[local], per_layer.get(local, {})) for local in range(len(indices)))

    return loaded.step, _gather(layers())


def save_state_dict(state: Mapping[str, Tensor], out: str | os.PathLike[str]) -> Path:
    """Write ``state`` with ``torch.save``, atomically (a temporary file renamed into place)."""
    import torch

    path = Path(out)
    partial = path.with_name(path.name + ".tmp")
    torch.save(dict(state), partial)
    os.replace(partial, path)
    return path


def export_hf(state: Mapping[str, Tensor], out: str | os.PathLike[str]) -> tuple[Path, float]:
    """Write ``state`` (a model split by ``bamboo.rc.from_transformers``) as a ``save_pretrained`` folder, reload it
    with ``AutoModelForCausalLM.from_pretrained`` and compare its logits with bamboo's layers holding ``state``:
    ``(the folder, the largest logit difference)``. ExportError for a model of another kind, or without the
    ``transformers`` package."""
    try:
        from bamboo.rc.hf import compare_logits, save_pretrained
        from transformers.utils import logging as transformers_logging
    except ImportError:
        raise ExportError("--format hf needs the transformers package: pip install 'bamboo-rc[hf]'") from None
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    folder = Path(out)
    if folder.exists() and not folder.is_dir():
        raise ExportError(f"{folder} is a file; --format hf writes a folder (config.json, model.safetensors)")
    try:
        save_pretrained(state, folder)
    except ValueError as error:
        raise ExportError(str(error)) from None
    return folder, compare_logits(state, folder)
