"""Periodic checkpoints that never slow training: a snapshot in the caller, the write in one thread.

:class:`AsyncCheckpointer` takes a snapshot of the state in the caller's thread (tensors are
cloned to CPU: a memory copy) and does the slow part (serialise, checksum, fsync, rename, prune)
in one background thread, in the format of :mod:`bamboo.rc.checkpoint_files`. A save requested while
the previous one is still being written waits in a single slot; an older waiting snapshot is replaced
(counted in ``superseded``), so the queue never grows and the training loop never waits for the disk.

Importing this module does not import torch; taking a snapshot does.
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from bamboo.rc.checkpoint_files import (
    DEFAULT_SHARD,
    TEMP_MARK,
    CheckpointError,
    CheckpointInfo,
    check_shard_name,
    list_checkpoints,
    step_dir_name,
    write_checkpoint,
)

__all__ = ["AsyncCheckpointer", "snapshot_state"]

logger = logging.getLogger(__name__)


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



class AsyncCheckpointer:
    """Periodic checkpoints of one shard, written by one background thread; ``save`` only snapshots.

    Args:
        directory: where step folders go (created if missing).
        shard: this writer's shard name (one per pipeline stage, say ``stage-2``).
        every_steps: :meth:`maybe_save` saves when ``step % every_steps == 0`` (:meth:`due`).
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
        prepare: called in the writer thread on each snapshot before it is written, returning what is
            written: work that need not hold up training (serialising a cloned state into the shard's
            format) moves there.
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
        prepare: Callable[[dict[str, Any]], dict[str, Any]] | None = None,
    ) -> None:
        if not isinstance(writer_niceness, int) or not 0 <= writer_niceness <= 19:
            raise ValueError(f"writer_niceness must be an integer in [0, 19], got {writer_niceness!r}")
        self.writer_niceness = writer_niceness
        check_shard_name(shard)
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
        self._prepare = prepare
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
            for entry in folder.glob(f"{self.shard}.*{TEMP_MARK}*"):
                logger.warning("removing partial checkpoint file %s left by an earlier writer", entry)
                entry.unlink(missing_ok=True)

    def due(self, step: int) -> bool:
        """Whether ``step`` is on the period (``every_steps``)."""
        return step % self.every_steps == 0

    def maybe_save(self, step: int, state: Mapping[str, Any] | Callable[[], Mapping[str, Any]], *,
                   cloned: bool = False) -> bool:
        """Save if ``step`` is on the period (:meth:`due`); ``state`` may be a callable, called only then
        (``cloned``: as :meth:`save`)."""
        if not self.due(step):
            return False
        self.save(step, state() if callable(state) else state, cloned=cloned)
        return True

    def save(self, step: int, state: Mapping[str, Any], *, cloned: bool = False) -> None:
        """Snapshot ``state`` now and hand it to the writer thread; returns without disk I/O. ``cloned``: its
        tensors are already private copies that training will not change (a slice's ``snapshot()``), taken as
        they are."""
        step_dir_name(step)  # validate now, in the caller, not later in the thread
        snapshot = dict(state) if cloned else snapshot_state(dict(state))
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
                if self._prepare is not None:
                    snapshot = self._prepare(snapshot)
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
