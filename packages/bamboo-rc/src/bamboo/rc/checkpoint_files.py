"""Bamboo's one checkpoint format: shards with manifests, each file written atomically, verified on load.

Checkpoints are Bamboo's last resort: one is restored only when every copy of some stage is gone. A
checkpoint that was half written when its node died must never be loaded. Two writers use this format:
the launcher's periodic checkpoints of the live system (:class:`bamboo.rc.checkpoint_async.AsyncCheckpointer`)
and the engine's DeepSpeed-style ``save_checkpoint`` (:mod:`bamboo.rc.checkpoints`).

A checkpoint is a folder holding one **shard** per writer (in pipeline parallelism each stage saves its
own layers, as ``stage-<s>``; a single-process job has one shard, ``state``):

- ``<shard>.pt``: the shard's state dict, written with ``torch.save``;
- ``<shard>.manifest.json``: ``{"format": 1, "step": 123, "shard": "<shard>", "created_unix":
  ..., "file": "<shard>.pt", "bytes": N, "sha256": "..."}``.

The periodic checkpoint of step 123 is the folder ``DIR/step-000000123/`` (:func:`write_checkpoint`);
the engine's folder is ``<dir>/<tag>/`` (:func:`write_shard` writes into any folder).

Each file is written under a temporary name (``<shard>.pt.tmp-<random>``), flushed and fsynced,
then renamed into place (:func:`write_atomic`); the manifest is renamed last, so its presence is the
commit point, and the folder and its parent are fsynced after. A reader therefore sees a shard whole
or not at all. Temporary files left by a writer killed mid-write are ignored by readers and removed by
that shard's next periodic writer. Writers of different shards never touch each other's files, so the
stages of a pipeline write into the same folder concurrently.

:func:`load_shard` checks one shard (manifest present, size and SHA-256 match,
``torch.load(weights_only=True)`` succeeds) and raises :class:`CheckpointError` naming the file and
the reason. :func:`load_latest_good` walks the step folders from the newest, checks every requested
shard, and on any failure logs that error and falls back to the previous step.

Importing this module does not import torch; the functions that save and load do.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import attrs

__all__ = [
    "DEFAULT_SHARD",
    "FORMAT_VERSION",
    "TEMP_MARK",
    "CheckpointError",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "NoGoodCheckpointError",
    "check_shard_name",
    "fsync_path",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_good",
    "load_shard",
    "read_shard_file",
    "stage_shard",
    "step_dir_name",
    "verify_shard",
    "write_atomic",
    "write_checkpoint",
    "write_shard",
]

logger = logging.getLogger(__name__)

DEFAULT_SHARD = "state"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
TEMP_MARK = ".tmp-"


class CheckpointError(RuntimeError):
    """A checkpoint shard that cannot be used; the message names the file and says why."""


class NoGoodCheckpointError(CheckpointError):
    """No step has every requested shard in good order (the message lists what was rejected)."""


@attrs.frozen
class CheckpointInfo:
    """A committed shard: its step, shard name, data file, size on disk and time to write."""

    step: int
    shard: str
    path: Path
    bytes: int
    duration_s: float


@attrs.frozen
class LoadedCheckpoint:
    """A step whose requested shards all passed every check, and their states."""

    step: int
    path: Path
    shards: dict[str, dict[str, Any]]

    @property
    def state(self) -> dict[str, Any]:
        """The state of a single-shard checkpoint (raises if several shards were loaded)."""
        if len(self.shards) != 1:
            raise ValueError(
                f"checkpoint {self.path} has shards {sorted(self.shards)}; pick one from .shards"
            )
        return next(iter(self.shards.values()))


def check_shard_name(shard: str) -> None:
    """Raise ValueError unless ``shard`` is a safe file-name stem (letters, digits, ``_.-``)."""
    if not isinstance(shard, str) or not _SHARD_NAME.match(shard) or TEMP_MARK in shard:
        raise ValueError(
            f"shard name must be 1-64 characters of letters, digits, '_', '.', '-', got {shard!r}"
        )


def fsync_path(path: Path) -> None:
    """fsync a file or a folder (a folder's fsync makes the renames inside it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def stage_shard(stage: int) -> str:
    """The shard name of pipeline stage ``stage``: ``stage-<s>`` (the launcher's and the engine's)."""
    return f"stage-{stage}"


def step_dir_name(step: int) -> str:
    """The folder name of ``step``'s checkpoint: ``step-000000123``."""
    if not isinstance(step, int) or not 0 <= step < 10**9:
        raise ValueError(f"step must be an integer in [0, 1e9), got {step!r}")
    return f"step-{step:09d}"


def write_atomic(final: Path, write: Callable[[BinaryIO], object]) -> None:
    """Write ``final`` whole or not at all: a temporary file beside it, fsynced, renamed into place.

    The caller fsyncs the folder (:func:`fsync_path`) once its renames are done.
    """
    temp = final.with_name(f"{final.name}{TEMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_shard(
    folder: str | os.PathLike[str],
    step: int,
    state: Mapping[str, Any],
    shard: str = DEFAULT_SHARD,
    *,
    before_commit: Callable[[int, str], None] | None = None,
) -> CheckpointInfo:
    """Write ``state`` as ``shard`` of the checkpoint ``folder`` (created if missing), atomically.

    ``before_commit(step, shard)`` runs after the data is on disk and before the manifest (the commit
    point) is renamed into place; if it raises, the shard is not committed and the error propagates (the
    launcher checks there that its node has not been declared dead).
    """
    import torch

    check_shard_name(shard)
    started = time.monotonic()
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{shard}.pt"
    manifest_path = folder / f"{shard}.manifest.json"
    # A shard of this checkpoint written before (a restarted run) is replaced: uncommit it first.
    manifest_path.unlink(missing_ok=True)
    write_atomic(data, lambda handle: torch.save(dict(state), handle))
    size = data.stat().st_size
    manifest = {
        "format": FORMAT_VERSION,
        "step": step,
        "shard": shard,
        "created_unix": time.time(),
        "file": data.name,
        "bytes": size,
        "sha256": _sha256(data),
    }
    if before_commit is not None:
        before_commit(step, shard)
    write_atomic(manifest_path, lambda handle: handle.write(json.dumps(manifest, indent=1).encode()))
    fsync_path(folder)
    fsync_path(folder.parent)
    return CheckpointInfo(
        step=step, shard=shard, path=data, bytes=size, duration_s=time.monotonic() - started
    )


def write_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    state: Mapping[str, Any],
    shard: str = DEFAULT_SHARD,
    *,
    before_commit: Callable[[int, str], None] | None = None,
) -> CheckpointInfo:
    """Write ``state`` as ``shard`` of ``step``'s checkpoint, ``directory/step-NNNNNNNNN/``, atomically
    (synchronous; ``before_commit`` as in :func:`write_shard`).

    This is the background thread's job in :class:`~bamboo.rc.checkpoint_async.AsyncCheckpointer`; call
    it directly only where blocking is fine.
    """
    folder = Path(directory) / step_dir_name(step)
    return write_shard(folder, step, state, shard, before_commit=before_commit)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Step folders as ``(step, path)``, newest first (whether or not their shards are good)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _STEP_DIR.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def verify_shard(folder: Path, shard: str = DEFAULT_SHARD) -> dict[str, Any]:
    """Check one shard's manifest, size and checksum; return the manifest or raise CheckpointError."""
    manifest_path = folder / f"{shard}.manifest.json"
    data = folder / f"{shard}.pt"
    if not manifest_path.is_file():
        state = (
            "its data file exists but was never committed (partial write)"
            if data.exists()
            else "it is missing"
        )
        raise CheckpointError(f"checkpoint shard {data}: no manifest, {state}")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint manifest {manifest_path} is unreadable: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint manifest {manifest_path} is not format {FORMAT_VERSION}: {manifest!r:.120}"
        )
    if manifest.get("shard") != shard or manifest.get("file") != data.name:
        raise CheckpointError(
            f"checkpoint manifest {manifest_path} describes shard {manifest.get('shard')!r} file "
            f"{manifest.get('file')!r}, not {shard!r}"
        )
    if not data.is_file():
        raise CheckpointError(f"checkpoint shard {data} is missing although its manifest exists")
    size = data.stat().st_size
    if size != manifest.get("bytes"):
        raise CheckpointError(
            f"checkpoint shard {data} has {size} bytes, its manifest says {manifest.get('bytes')} (truncated?)"
        )
    digest = _sha256(data)
    if digest != manifest.get("sha256"):
        raise CheckpointError(
            f"checkpoint shard {data}: sha256 {digest[:16]}... does not match the manifest's "
            f"{str(manifest.get('sha256'))[:16]}... (corrupt)"
        )
    return manifest


def read_shard_file(data: Path) -> dict[str, Any]:
    """``torch.load(weights_only=True)`` of a shard's data file, unverified; CheckpointError if it is no dict."""
    import torch

    try:
        state = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"checkpoint shard {data} does not load: {error}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint shard {data} holds a {type(state).__name__}, not a dict")
    return state


def load_shard(folder: Path, shard: str) -> dict[str, Any]:
    """Verify (:func:`verify_shard`) and load one shard's state dict, or raise CheckpointError."""
    verify_shard(folder, shard)
    return read_shard_file(folder / f"{shard}.pt")


def load_checkpoint(
    folder: str | os.PathLike[str], shards: Sequence[str] = (DEFAULT_SHARD,)
) -> LoadedCheckpoint:
    """Verify and load ``shards`` of one step folder; raises CheckpointError saying what is wrong."""
    folder = Path(folder)
    match = _STEP_DIR.match(folder.name)
    if not match:
        raise CheckpointError(f"{folder} is not a checkpoint folder (step-NNNNNNNNN)")
    if not shards:
        raise ValueError("load at least one shard")
    for shard in shards:
        check_shard_name(shard)
    loaded = {shard: load_shard(folder, shard) for shard in shards}
    return LoadedCheckpoint(step=int(match.group(1)), path=folder, shards=loaded)


def load_latest_good(
    directory: str | os.PathLike[str],
    shards: Sequence[str] = (DEFAULT_SHARD,),
    log: logging.Logger | None = None,
) -> LoadedCheckpoint:
    """Load the newest step whose ``shards`` all pass every check; log each bad one and fall back.

    Raises :class:`NoGoodCheckpointError` if no step qualifies (or there are none).
    """
    log = log or logger
    rejected: list[str] = []
    for _, folder in list_checkpoints(directory):
        try:
            loaded = load_checkpoint(folder, shards)
        except CheckpointError as error:
            log.error("skipping bad checkpoint: %s; falling back to the previous one", error)
            rejected.append(str(error))
            continue
        if rejected:
            log.warning("restored checkpoint %s after rejecting %d newer one(s)", folder, len(rejected))
        return loaded
    detail = "; ".join(rejected) if rejected else "no checkpoints"
    raise NoGoodCheckpointError(f"no usable checkpoint with shards {list(shards)} in {directory}: {detail}")
