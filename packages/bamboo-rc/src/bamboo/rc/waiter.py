"""Waiting for posted gloo transfers on helper threads, so that the waiting thread can poll for failures meanwhile.

A gloo send or receive completes only inside its work's ``wait()``, which cannot be interrupted: such a work has
no future, ``is_completed()`` stays false until ``wait()`` ran, and a ``wait(timeout)`` that times out breaks the
connection. A node blocked on a transfer must still notice a confirmed failure elsewhere in its pipeline (its
peer may be alive and never post the other side), so a helper thread calls ``wait()`` and the node polls the
handle. This happens for every transfer of a run with redundancy, dozens per step, so the handle is a bare lock
the helper releases, not a ``concurrent.futures`` future: a submit and a wait through `ThreadPoolExecutor`
(a future, its condition, a work item, the executor's queue and semaphore) took 62 us of CPU against 42 us this
way, on this project's 2-core development machine. Where the workers share cores that time is the step's:
`bamboo-rc verify` with P = 3, D = 2 and lflb (six workers on two cores) went from 46.0 to 46.9 ms per
iteration to 43.0 to 43.1 ms, where `none`, which waits inline, took 39.7 to 40.6 ms.

The helpers are started on demand, up to `max_threads`; a job submitted while all are busy waits in a queue for
the first one free (as with `ThreadPoolExecutor`). Each helper sleeps on a lock of its own between jobs.
"""

from __future__ import annotations

import collections
import threading
from collections.abc import Sequence

from bamboo.rc.comm import wait_works

__all__ = ["TransferWaiter", "WaitHandle"]


class WaitHandle:
    """One submitted wait: :meth:`wait` polls it; the helper's error, if any, is raised there."""

    __slots__ = ("_done", "_finished", "error", "works")

    def __init__(self, works: Sequence[object]) -> None:
        self.works = works
        self.error: BaseException | None = None
        self._done = threading.Lock()
        self._done.acquire()  # released by the helper once the works completed or failed
        self._finished = False

    def wait(self, timeout: float) -> bool:
        """True once the works completed (raising the error of one that failed), False after `timeout` seconds."""
        if not self._finished:
            if not self._done.acquire(timeout=timeout):
                return False
            self._finished = True
        if self.error is not None:
            raise self.error
        return True

    def done(self) -> bool:
        """Whether the works completed or failed (never blocks, never raises)."""
        return self._finished or not self._done.locked()

    def _complete(self) -> None:
        try:
            wait_works(self.works)
        except BaseException as error:  # handed to the thread that waits on the handle
            self.error = error
        self._done.release()


class _Helper:
    """A helper thread that sleeps on its own lock until it is given a job."""

    def __init__(self, waiter: TransferWaiter, job: WaitHandle, name: str) -> None:
        self._waiter = waiter
        self.job: WaitHandle | None = job
        self.go = threading.Lock()
        self.go.acquire()
        threading.Thread(target=self._run, name=name, daemon=True).start()

    def _run(self) -> None:
        job = self.job
        while job is not None:
            job._complete()
            job = self._waiter._next_job(self)


class TransferWaiter:
    """Helper threads that wait for posted transfers: :meth:`submit` returns a :class:`WaitHandle` at once."""

    def __init__(self, max_threads: int = 8, name: str = "bamboo-wait") -> None:
        if max_threads < 1:
            raise ValueError(f"max_threads must be >= 1, got {max_threads}")
        self.max_threads = max_threads
        self._name = name
        self._lock = threading.Lock()
        self._idle: list[_Helper] = []
        self._started = 0
        self._queue: collections.deque[WaitHandle] = collections.deque()
        self._closed = False

    def submit(self, works: Sequence[object]) -> WaitHandle:
        """Wait for `works` on a helper thread; the handle says when they completed."""
        handle = WaitHandle(works)
        with self._lock:
            if self._closed:
                raise RuntimeError("the transfer waiter was closed")
            if self._idle:
                helper = self._idle.pop()
                helper.job = handle
                helper.go.release()
            elif self._started < self.max_threads:
                self._started += 1
                _Helper(self, handle, f"{self._name}-{self._started}")
            else:
                self._queue.append(handle)
        return handle

    def _next_job(self, helper: _Helper) -> WaitHandle | None:
        """The next job of a helper that just finished one: a queued one, else the one it is given after it
        slept as idle; None ends it (the waiter is closed)."""
        with self._lock:
            if self._queue:
                return self._queue.popleft()
            helper.job = None
            if self._closed:
                return None
            self._idle.append(helper)
        helper.go.acquire()  # released by submit (with a job) or close (without)
        return helper.job

    def close(self) -> None:
        """End the idle helpers; a helper still waiting ends with its transfer. Jobs still queued run first."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for helper in idle:
            helper.go.release()  # its job is None: it ends
