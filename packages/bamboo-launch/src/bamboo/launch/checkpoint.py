"""Asynchronous periodic checkpoints, written atomically, and loading the newest good one.

Bamboo's last resort: a checkpoint is restored only when every copy of some stage is gone. So
checkpoints must never slow training down, and a checkpoint that was half written when its node
died must never be loaded.

On disk, ``DIR/step-000000123/`` holds:

- ``state.pt``: the state dict, written with ``torch.save``;
- ``manifest.json``: ``{"format": 1, "step": 123, "created_unix": ..., "files": {"state.pt":
  {"bytes": N, "sha256": "..."}}}``, written last.

A checkpoint is written into a hidden temporary folder ``DIR/.tmp-step-000000123-<random>/``;
each file is fsynced, then the folder is renamed to its final name and ``DIR`` is fsynced. A
rename is atomic, so a reader sees a whole checkpoint or none. Leftover temporary folders (a
writer killed mid-write) are ignored by readers and removed by the next writer.

:func:`load_latest_good` checks the newest checkpoint's manifest and checksums, loads it with
``torch.load(weights_only=True)``, and if anything is wrong logs a clear error naming the folder
and the reason and falls back to the previous one.

:class:`AsyncCheckpointer` takes a snapshot of the state in the caller's thread (tensors are
cloned to CPU, which is a memory copy) and does the slow part (serialise, checksum, fsync,
rename, prune) in one background thread. If a save is requested while the previous one is
still being written, the newer snapshot waits in a single slot; an older waiting snapshot is
replaced (and counted in ``superseded``), so the queue never grows and the training loop never
waits for the disk.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "MANIFEST_NAME",
    "STATE_NAME",
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "NoGoodCheckpointError",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_good",
    "snapshot_state",
    "write_checkpoint",
]

logger = logging.getLogger(__name__)

MANIFEST_NAME = "manifest.json"
STATE_NAME = "state.pt"
FORMAT_VERSION = 1
_FINAL = re.compile(r"^step-(\d{9})$")
_TEMP_PREFIX = ".tmp-step-"


class CheckpointError(RuntimeError):
    """A checkpoint folder that cannot be used; the message names it and says why."""


class NoGoodCheckpointError(CheckpointError):
    """No usable checkpoint exists in the folder (the message lists what was rejected)."""


@attrs.frozen
class CheckpointInfo:
    """A committed checkpoint: its step, folder, size on disk and how long writing it took."""

    step: int
    path: Path
    bytes: int
    duration_s: float


@attrs.frozen
class LoadedCheckpoint:
    """A checkpoint that passed every check, and its state."""

    step: int
    path: Path
    state: dict[str, Any]


def _fsync_path(path: Path) -> None:
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


def snapshot_state(state: Any) -> Any:
    """A deep copy of ``state`` that training may not mutate: tensors are detached CPU clones."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, Mapping):
        return {key: snapshot_state(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot_state(value) for value in state)
    return state


def checkpoint_dir_name(step: int) -> str:
    """The final folder name of ``step``'s checkpoint: ``step-000000123``."""
    if step < 0 or step >= 10**9:
        raise ValueError(f"step must be in [0, 1e9), got {step}")
    return f"step-{step:09d}"


def write_checkpoint(
    directory: str | os.PathLike[str], step: int, state: Mapping[str, Any]
) -> CheckpointInfo:
    """Write ``state`` as ``step``'s checkpoint, atomically (synchronous; the worker thread's job)."""
    import torch

    started = time.monotonic()
    root = Path(directory)
    root.mkdir(parents=True, exist_ok=True)
    final = root / checkpoint_dir_name(step)
    temp = root / f"{_TEMP_PREFIX}{step:09d}-{uuid.uuid4().hex[:8]}"
    temp.mkdir()
    try:
        state_path = temp / STATE_NAME
        with open(state_path, "wb") as handle:
            torch.save(dict(state), handle)
            handle.flush()
            os.fsync(handle.fileno())
        size = state_path.stat().st_size
        manifest = {
            "format": FORMAT_VERSION,
            "step": step,
            "created_unix": time.time(),
            "files": {STATE_NAME: {"bytes": size, "sha256": _sha256(state_path)}},
        }
        with open(temp / MANIFEST_NAME, "w", encoding="utf-8") as handle:
            json.dump(manifest, handle, indent=1)
            handle.flush()
            os.fsync(handle.fileno())
        _fsync_path(temp)
        if final.exists():
            # A checkpoint of the same step already exists (a restarted run): replace it whole.
            shutil.rmtree(final)
        os.rename(temp, final)
        _fsync_path(root)
    except BaseException:
        shutil.rmtree(temp, ignore_errors=True)
        raise
    return CheckpointInfo(step=step, path=final, bytes=size, duration_s=time.monotonic() - started)


def list_checkpoints(directory: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """Committed checkpoint folders as ``(step, path)``, newest first (temporary folders excluded)."""
    root = Path(directory)
    if not root.is_dir():
        return []
    found = []
    for entry in root.iterdir():
        match = _FINAL.match(entry.name)
        if match and entry.is_dir():
            found.append((int(match.group(1)), entry))
    return sorted(found, reverse=True)


def verify_checkpoint(path: Path) -> dict[str, Any]:
    """Check ``path``'s manifest, sizes and checksums; return the manifest or raise CheckpointError."""
    manifest_path = path / MANIFEST_NAME
    if not manifest_path.is_file():
        raise CheckpointError(f"checkpoint {path} has no {MANIFEST_NAME} (partial write?)")
    try:
        manifest = json.loads(manifest_path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as error:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST_NAME} is unreadable: {error}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT_VERSION:
        raise CheckpointError(
            f"checkpoint {path}: {MANIFEST_NAME} is not format {FORMAT_VERSION}: {manifest!r:.120}"
        )
    files = manifest.get("files")
    if not isinstance(files, dict) or STATE_NAME not in files:
        raise CheckpointError(f"checkpoint {path}: {MANIFEST_NAME} lists no {STATE_NAME}")
    for name, expected in files.items():
        file_path = path / name
        if not file_path.is_file():
            raise CheckpointError(f"checkpoint {path}: {name} is missing")
        size = file_path.stat().st_size
        if size != expected.get("bytes"):
            raise CheckpointError(
                f"checkpoint {path}: {name} has {size} bytes, the manifest says {expected.get('bytes')} (truncated?)"
            )
        digest = _sha256(file_path)
        if digest != expected.get("sha256"):
            raise CheckpointError(
                f"checkpoint {path}: {name} sha256 {digest[:16]}... does not match the manifest's "
                f"{str(expected.get('sha256'))[:16]}... (corrupt)"
            )
    return manifest


def load_checkpoint(path: str | os.PathLike[str]) -> LoadedCheckpoint:
    """Verify and load one checkpoint folder; raises CheckpointError saying what is wrong."""
    import torch

    path = Path(path)
    manifest = verify_checkpoint(path)
    try:
        state = torch.load(path / STATE_NAME, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"checkpoint {path}: {STATE_NAME} does not load: {error}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint {path}: {STATE_NAME} holds a {type(state).__name__}, not a dict")
    return LoadedCheckpoint(step=int(manifest["step"]), path=path, state=state)


def load_latest_good(
    directory: str | os.PathLike[str], log: logging.Logger | None = None
) -> LoadedCheckpoint:
    """Load the newest checkpoint that passes every check; log each bad one and fall back.

    Raises :class:`NoGoodCheckpointError` if none is usable (or the folder holds none).
    """
    log = log or logger
    rejected = []
    for _, path in list_checkpoints(directory):
        try:
            loaded = load_checkpoint(path)
        except CheckpointError as error:
            log.error("skipping bad checkpoint: %s; falling back to the previous one", error)
            rejected.append(str(error))
            continue
        if rejected:
            log.warning("restored checkpoint %s after rejecting %d newer one(s)", path, len(rejected))
        return loaded
    detail = "; ".join(rejected) if rejected else "no checkpoints"
    raise NoGoodCheckpointError(f"no usable checkpoint in {directory}: {detail}")


class AsyncCheckpointer:
    """Periodic checkpoints written by one background thread; ``save`` only takes a snapshot.

    Args:
        directory: where checkpoint folders go (created if missing).
        every_steps: :meth:`maybe_save` saves when ``step % every_steps == 0``.
        keep: how many committed checkpoints to keep; older ones are deleted after each commit
            (never the one just written).
        on_commit: called in the writer thread with each committed checkpoint's
            :class:`CheckpointInfo` (the launcher writes a ``checkpoint`` event there).
        writer: the function that writes one checkpoint (``write_checkpoint``); tests inject a
            slow one to prove that the training loop does not wait.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        every_steps: int = 10,
        keep: int = 3,
        on_commit: Callable[[CheckpointInfo], None] | None = None,
        writer: Callable[[Path, int, Mapping[str, Any]], CheckpointInfo] = write_checkpoint,
    ) -> None:
        if every_steps < 1:
            raise ValueError(f"every_steps must be >= 1, got {every_steps}")
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.every_steps = every_steps
        self.keep = keep
        self._on_commit = on_commit
        self._writer = writer
        self._cond = threading.Condition()
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._busy = False
        self._closed = False
        self.committed: list[CheckpointInfo] = []
        self.errors: list[BaseException] = []
        self.superseded = 0
        self._remove_stale_temporaries()
        self._thread = threading.Thread(target=self._run, name="bamboo-checkpoint-writer", daemon=True)
        self._thread.start()

    def _remove_stale_temporaries(self) -> None:
        for entry in self.directory.iterdir():
            if entry.name.startswith(_TEMP_PREFIX):
                logger.warning("removing partial checkpoint %s left by an earlier writer", entry)
                shutil.rmtree(entry, ignore_errors=True)

    def maybe_save(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> bool:
        """Save if ``step`` is on the period; ``state`` may be a callable, only called then."""
        if step % self.every_steps != 0:
            return False
        self.save(step, state() if callable(state) else state)
        return True

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Snapshot ``state`` now and queue it for the writer thread; returns without disk I/O."""
        snapshot = snapshot_state(dict(state))
        with self._cond:
            if self._closed:
                raise RuntimeError("checkpointer is closed")
            if self._pending is not None:
                logger.warning(
                    "checkpoint of step %d superseded by step %d before it was written",
                    self._pending[0],
                    step,
                )
                self.superseded += 1
            self._pending = (step, snapshot)
            self._cond.notify_all()

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is pending or being written; False if ``timeout`` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Write what is pending, stop the thread and raise the first write error, if any."""
        self.wait(timeout)
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)
        if self.errors:
            raise CheckpointError(f"{len(self.errors)} checkpoint write(s) failed; first: {self.errors[0]}")

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                step, snapshot = self._pending
                self._pending = None
                self._busy = True
            try:
                info = self._writer(self.directory, step, snapshot)
                self.committed.append(info)
                self._prune(keep_path=info.path)
                if self._on_commit is not None:
                    self._on_commit(info)
            except BaseException as error:  # a failed write must not kill the thread silently
                logger.error("checkpoint of step %d failed: %s", step, error)
                self.errors.append(error)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _prune(self, keep_path: Path) -> None:
        for _, path in list_checkpoints(self.directory)[self.keep :]:
            if path != keep_path:
                shutil.rmtree(path, ignore_errors=True)
