"""The engine's ``save_checkpoint`` and ``load_checkpoint``: DeepSpeed's names, each node its own stages.

A checkpoint is the folder ``<dir>/<tag>/`` (``tag`` defaults to ``global_step<N>``, as DeepSpeed's) with
one shard per stage in Bamboo's one checkpoint format (:mod:`bamboo.rc.checkpoint_files`):
``stage-<s>.pt`` (``torch.save`` of plain tensors and values, read back with ``weights_only=True``) and
its commit point ``stage-<s>.manifest.json`` (size and SHA-256). The shard holds:

- ``state``: the stage's :meth:`~bamboo.rc.state.TrainableSlice.state_bytes` (parameters, optimizer and
  scheduler state, step counter), as bytes in a uint8 tensor: the same serialisation the launcher's
  checkpoints and the reconfiguration transfers use;
- ``layers``: the global indices of the stage's layers (a load into other stage bounds is refused);
- ``step``: the steps trained; ``client_state``: what the caller passed (plain values);
- ``format``: :data:`ENGINE_FORMAT` (2). A stage file without a manifest and without this key was written
  before checkpoints had manifests (format 1): it is loaded unverified, with a warning. One with the key
  but no manifest was never committed and is refused.

A stage file that fails verification (corrupt, truncated, never committed, unloadable) is refused with a
:class:`~bamboo.rc.checkpoint_files.CheckpointError` naming the file and the reason.

The nodes of pipeline 0 write the stages they host (a shadow that took a stage over writes it too),
each through :func:`~bamboo.rc.checkpoint_files.write_shard` (temporary names, fsync, rename, the manifest
last). Each writer then sets a key in the c10d store; every node waits for all of them, the host of stage 0
writes ``<dir>/latest`` (the tag) with :func:`~bamboo.rc.checkpoint_files.write_atomic`, and everyone
returns. A failure confirmed meanwhile ends the wait (False, with a warning;
``latest`` keeps its previous tag). The folder must be shared by the nodes, as DeepSpeed's pipeline
checkpoints require: every node reads the files of the stages it builds, its replica's included.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from bamboo.rc.checkpoint_files import (
    fsync_path,
    load_shard,
    read_shard_file,
    stage_shard,
    verify_shard,
    write_atomic,
    write_shard,
)
from bamboo.rc.timeouts import STORE_POLL_S

if TYPE_CHECKING:
    from bamboo.rc.executor import StageExecutor

__all__ = ["ENGINE_FORMAT", "LATEST", "load", "save", "stage_file"]

LATEST = "latest"
ENGINE_FORMAT = 2
_log = logging.getLogger(__name__)


def stage_file(folder: Path, stage: int) -> Path:
    """Where stage ``stage``'s state lies in the checkpoint ``folder``."""
    return folder / f"{stage_shard(stage)}.pt"


def _check_tag(tag: str) -> str:
    if not isinstance(tag, str) or not tag or tag in (".", "..") or "/" in tag or "\\" in tag or tag != tag.strip():
        raise ValueError(f"a checkpoint tag is one folder name (no '/', not empty), got {tag!r}")
    return tag


def _wait(executor: StageExecutor, keys: list[str], what: str) -> bool:
    """Wait until every key exists: False when a confirmed failure is pending first."""
    deadline = executor.clock.monotonic() + executor.timeouts.build
    while not executor.store.check(keys):
        if executor.coordinator.pending_event() is not None:
            _log.warning("save_checkpoint: %s was not completed: a node failed first (the next train_batch "
                         "handles the failure)", what)
            return False
        if executor.clock.monotonic() > deadline:
            raise RuntimeError(f"save_checkpoint: {what} was not completed within {executor.timeouts.build:g} s")
        executor.clock.sleep(STORE_POLL_S)
    return True


def save(executor: StageExecutor, save_dir: Path, tag: str | None, client_state: Mapping[str, Any] | None,
         save_latest: bool, count: int) -> bool:
    """Save this node's part of checkpoint ``tag`` (see the module docstring); ``count`` numbers the saves
    (every node makes the same ones, so it names this save job-wide in the store)."""
    tag = _check_tag(f"global_step{executor.step}" if tag is None else tag)
    folder = save_dir / tag
    prefix = f"bamboo/{executor.job}/checkpoint/{count}/"
    if executor.pipeline == 0:
        for stage in executor.hosted:
            piece = executor.slices[stage]
            shard = {
                "state": torch.frombuffer(bytearray(piece.state_bytes()), dtype=torch.uint8),
                "layers": torch.tensor(list(piece.indices), dtype=torch.int64),
                "step": torch.tensor(executor.step, dtype=torch.int64),
                "client_state": dict(client_state or {}),
                "format": ENGINE_FORMAT,
            }
            write_shard(folder, executor.step, shard, stage_shard(stage))
            executor.store.set(prefix + f"stage-{stage}", tag)
    what = f"checkpoint {folder}"
    if not _wait(executor, [prefix + f"stage-{s}" for s in range(executor.layout.stages)], what):
        return False
    if executor.pipeline == 0 and 0 in executor.hosted:
        if save_latest:
            write_atomic(save_dir / LATEST, lambda handle: handle.write(tag.encode()))
            fsync_path(save_dir)
        executor.store.set(prefix + "done", tag)
    return _wait(executor, [prefix + "done"], what)


def _read_stage(folder: Path, stage: int) -> dict[str, Any]:
    """Stage ``stage``'s shard of checkpoint ``folder``, verified against its manifest (format 2), or read
    unverified when it predates manifests (format 1); raises CheckpointError naming the file and why."""
    name, path = stage_shard(stage), stage_file(folder, stage)
    if (folder / f"{name}.manifest.json").is_file():
        return load_shard(folder, name)
    if not path.is_file():
        raise FileNotFoundError(f"checkpoint {folder} has no {path.name} (this node builds stage {stage})")
    shard = read_shard_file(path)
    if "format" in shard:
        verify_shard(folder, name)  # raises: written for a manifest that was never committed
    _log.warning("%s has no manifest: a checkpoint written before manifests, loaded without verification", path)
    return shard


def load(executor: StageExecutor, load_dir: Path, tag: str | None) -> tuple[str | None, dict[str, Any] | None]:
    """Load every stage this node builds from checkpoint ``tag`` (default: ``load_dir/latest``)."""
    if tag is None:
        latest = load_dir / LATEST
        if not latest.is_file():
            _log.warning("load_checkpoint: no %s file in %s: nothing loaded (pass tag= to load a given checkpoint)",
                         LATEST, load_dir)
            return None, None
        tag = latest.read_text().strip()
    folder = load_dir / _check_tag(tag)
    shards = {}
    for stage, piece in sorted(executor.slices.items()):
        path = stage_file(folder, stage)
        shard = _read_stage(folder, stage)
        layers = [int(i) for i in shard["layers"]]
        if layers != list(piece.indices):
            raise ValueError(f"{path} holds layers {layers}, but this node's stage {stage} has layers "
                             f"{list(piece.indices)}: the stage bounds differ from the run that saved it")
        shards[stage] = shard
    steps = {int(shard["step"]) for shard in shards.values()}
    if len(steps) != 1:
        raise ValueError(f"checkpoint {folder} mixes the states of steps {sorted(steps)}")
    executor.apply_replica_updates()  # consume the pending replica updates: the loaded state replaces them
    for stage, shard in shards.items():
        executor.slices[stage].load_state_bytes(shard["state"].numpy().tobytes())
    executor.step = steps.pop()
    interpreter = executor.interpreter
    interpreter.last_commit = None
    interpreter._contributions.clear()  # all-reduce contributions kept for a redo belong to the old steps
    return str(folder), dict(shards[min(shards)].get("client_state") or {})
