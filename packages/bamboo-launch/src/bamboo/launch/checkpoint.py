"""Asynchronous periodic checkpoints, written atomically, and loading the newest good one.

Bamboo's last resort: a checkpoint is restored only when every copy of some stage is gone. So
checkpoints must never slow training down, and a checkpoint that was half written when its node
died must never be loaded.

A checkpoint of step 123 is the folder ``DIR/step-000000123/``, holding one **shard** per writer
(in pipeline parallelism each stage saves its own layers; a single-process job has one shard,
``state``):

- ``<shard>.pt``: the shard's state dict, written with ``torch.save``;
- ``<shard>.manifest.json``: ``{"format": 1, "step": 123, "shard": "<shard>", "created_unix":
  ..., "file": "<shard>.pt", "bytes": N, "sha256": "..."}``.

Each file is written under a temporary name (``<shard>.pt.tmp-<random>``), flushed and fsynced,
then renamed into place; the manifest is renamed last, so its presence is the commit point, and
the folder is fsynced after. A reader therefore sees a shard whole or not at all. Temporary files
left by a writer killed mid-write are ignored by readers and removed by that shard's next writer.
Writers of different shards never touch each other's files, so the stages of a pipeline write
into the same step folder concurrently.

:func:`load_latest_good` walks the step folders from the newest, checks every requested shard
(manifest present, size and SHA-256 match, ``torch.load(weights_only=True)`` succeeds), and on
any failure logs a clear error naming the file and the reason and falls back to the previous
step.

:class:`AsyncCheckpointer` takes a snapshot of the state in the caller's thread (tensors are
cloned to CPU: a memory copy) and does the slow part (serialise, checksum, fsync, rename, prune)
in one background thread. A save requested while the previous one is still being written waits
in a single slot; an older waiting snapshot is replaced (counted in ``superseded``), so the queue
never grows and the training loop never waits for the disk.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import threading
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, BinaryIO

import attrs

__all__ = [
    "DEFAULT_SHARD",
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointInfo",
    "LoadedCheckpoint",
    "NoGoodCheckpointError",
    "list_checkpoints",
    "load_checkpoint",
    "load_latest_good",
    "snapshot_state",
    "verify_shard",
    "write_checkpoint",
]

logger = logging.getLogger(__name__)

DEFAULT_SHARD = "state"
FORMAT_VERSION = 1
_STEP_DIR = re.compile(r"^step-(\d{9})$")
_SHARD_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
_TEMP_MARK = ".tmp-"


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


def _check_shard_name(shard: str) -> None:
    if not isinstance(shard, str) or not _SHARD_NAME.match(shard) or _TEMP_MARK in shard:
        raise ValueError(
            f"shard name must be 1-64 characters of letters, digits, '_', '.', '-', got {shard!r}"
        )


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
    """A deep copy of ``state`` that training cannot mutate: tensors become detached CPU clones."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, Mapping):
        return {key: snapshot_state(value) for key, value in state.items()}
    if isinstance(state, (list, tuple)):
        return type(state)(snapshot_state(value) for value in state)
    return state


def step_dir_name(step: int) -> str:
    """The folder name of ``step``'s checkpoint: ``step-000000123``."""
    if not isinstance(step, int) or not 0 <= step < 10**9:
        raise ValueError(f"step must be an integer in [0, 1e9), got {step!r}")
    return f"step-{step:09d}"


def _write_then_rename(final: Path, write: Callable[[BinaryIO], object]) -> None:
    temp = final.with_name(f"{final.name}{_TEMP_MARK}{uuid.uuid4().hex[:8]}")
    try:
        with open(temp, "wb") as handle:
            write(handle)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temp, final)
    except BaseException:
        temp.unlink(missing_ok=True)
        raise


def write_checkpoint(
    directory: str | os.PathLike[str],
    step: int,
    state: Mapping[str, Any],
    shard: str = DEFAULT_SHARD,
    *,
    before_commit: Callable[[int, str], None] | None = None,
) -> CheckpointInfo:
    """Write ``state`` as ``shard`` of ``step``'s checkpoint, atomically (synchronous).

    ``before_commit(step, shard)`` runs after the data is on disk and before the manifest (the commit
    point) is renamed into place; if it raises, the shard is not committed and the error propagates (the
    launcher checks there that its node has not been declared dead).

    This is the background thread's job in :class:`AsyncCheckpointer`; call it directly only
    where blocking is fine.
    """
    import torch

    _check_shard_name(shard)
    started = time.monotonic()
    root = Path(directory)
    folder = root / step_dir_name(step)
    folder.mkdir(parents=True, exist_ok=True)
    data = folder / f"{shard}.pt"
    manifest_path = folder / f"{shard}.manifest.json"
    # A shard of this step written before (a restarted run) is replaced: uncommit it first.
    manifest_path.unlink(missing_ok=True)
    _write_then_rename(data, lambda handle: torch.save(dict(state), handle))
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
    _write_then_rename(manifest_path, lambda handle: handle.write(json.dumps(manifest, indent=1).encode()))
    _fsync_path(folder)
    _fsync_path(root)
    return CheckpointInfo(
        step=step, shard=shard, path=data, bytes=size, duration_s=time.monotonic() - started
    )


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


def _load_shard(folder: Path, shard: str) -> dict[str, Any]:
    import torch

    verify_shard(folder, shard)
    data = folder / f"{shard}.pt"
    try:
        state = torch.load(data, map_location="cpu", weights_only=True)
    except Exception as error:
        raise CheckpointError(f"checkpoint shard {data} does not load: {error}") from None
    if not isinstance(state, dict):
        raise CheckpointError(f"checkpoint shard {data} holds a {type(state).__name__}, not a dict")
    return state


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
        _check_shard_name(shard)
    loaded = {shard: _load_shard(folder, shard) for shard in shards}
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


class AsyncCheckpointer:
    """Periodic checkpoints of one shard, written by one background thread; ``save`` only snapshots.

    Args:
        directory: where step folders go (created if missing).
        shard: this writer's shard name (one per pipeline stage, say ``stage-2``).
        every_steps: :meth:`maybe_save` saves when ``step % every_steps == 0``.
        keep: how many of this shard's newest checkpoints to keep; older files of this shard are
            deleted after each commit (and their folder, once empty).
        on_commit: called in the writer thread with each committed shard's :class:`CheckpointInfo`
            (the launcher writes a ``checkpoint`` event there).
        writer: the function that writes one shard (``write_checkpoint``); tests inject a gated
            one to prove that the training loop does not wait for it.
        before_commit: passed to the writer (see :func:`write_checkpoint`): called before each shard
            commits; raising there leaves the shard uncommitted.
        writer_niceness: the writer thread's Linux nice increment (0 to 19; default 10), so that
            serialising and hashing yield the CPU to training on small machines. Ignored where
            per-thread priorities are not available.
    """

    def __init__(
        self,
        directory: str | os.PathLike[str],
        *,
        shard: str = DEFAULT_SHARD,
        every_steps: int = 10,
        keep: int = 3,
        on_commit: Callable[[CheckpointInfo], None] | None = None,
        writer: Callable[..., CheckpointInfo] = write_checkpoint,
        writer_niceness: int = 10,
        before_commit: Callable[[int, str], None] | None = None,
    ) -> None:
        if not isinstance(writer_niceness, int) or not 0 <= writer_niceness <= 19:
            raise ValueError(f"writer_niceness must be an integer in [0, 19], got {writer_niceness!r}")
        self.writer_niceness = writer_niceness
        _check_shard_name(shard)
        if not isinstance(every_steps, int) or every_steps < 1:
            raise ValueError(f"every_steps must be an integer >= 1, got {every_steps!r}")
        if not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be an integer >= 1, got {keep!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.shard = shard
        self.every_steps = every_steps
        self.keep = keep
        self._on_commit = on_commit
        self._writer = writer
        self._before_commit = before_commit
        self._cond = threading.Condition()
        self._pending: tuple[int, dict[str, Any]] | None = None
        self._busy = False
        self._closed = False
        self.committed: list[CheckpointInfo] = []
        self.errors: list[BaseException] = []
        self.superseded = 0
        self._remove_stale_temporaries()
        self._thread = threading.Thread(target=self._run, name=f"bamboo-checkpoint-{shard}", daemon=True)
        self._thread.start()

    def _remove_stale_temporaries(self) -> None:
        for _, folder in list_checkpoints(self.directory):
            for entry in folder.glob(f"{self.shard}.*{_TEMP_MARK}*"):
                logger.warning("removing partial checkpoint file %s left by an earlier writer", entry)
                entry.unlink(missing_ok=True)

    def maybe_save(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]]) -> bool:
        """Save if ``step`` is on the period; ``state`` may be a callable, called only then."""
        if step % self.every_steps != 0:
            return False
        self.save(step, state() if callable(state) else state)
        return True

    def save(self, step: int, state: Mapping[str, Any]) -> None:
        """Snapshot ``state`` now and hand it to the writer thread; returns without disk I/O."""
        step_dir_name(step)  # validate now, in the caller, not later in the thread
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
        """Write what is pending, stop the thread, and raise the first write error, if any."""
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

    def _lower_priority(self) -> None:
        if self.writer_niceness == 0 or not hasattr(os, "setpriority"):
            return
        try:
            # On Linux a thread id names one thread, so only the writer is reniced.
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self.writer_niceness)
        except OSError as error:
            logger.info("could not lower the checkpoint writer's priority: %s", error)

    def _run(self) -> None:
        self._lower_priority()
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                step, snapshot = self._pending
                self._pending = None
                self._busy = True
            try:
                if self._before_commit is None:
                    info = self._writer(self.directory, step, snapshot, self.shard)
                else:
                    info = self._writer(self.directory, step, snapshot, self.shard,
                                        before_commit=self._before_commit)
                self.committed.append(info)
                self._prune(keep_step=step)
                if self._on_commit is not None:
                    self._on_commit(info)
            except BaseException as error:  # a failed write must not end the thread silently
                logger.error("checkpoint of step %d (shard %s) failed: %s", step, self.shard, error)
                self.errors.append(error)
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _prune(self, keep_step: int) -> None:
        mine = [
            (step, folder)
            for step, folder in list_checkpoints(self.directory)
            if (folder / f"{self.shard}.manifest.json").exists()
        ]
        for step, folder in mine[self.keep :]:
            if step == keep_step:
                continue
            (folder / f"{self.shard}.manifest.json").unlink(missing_ok=True)  # uncommit first
            (folder / f"{self.shard}.pt").unlink(missing_ok=True)
            with contextlib.suppress(OSError):
                folder.rmdir()  # only succeeds once every shard of that step is gone
