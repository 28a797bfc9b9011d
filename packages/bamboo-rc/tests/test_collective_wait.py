"""The wait for a collective (:meth:`bamboo.rc.comm.GroupTable.wait_collective`) on stand-in works, no gloo: once
the work's future is done it blocks in ``wait()`` instead of looping on ``is_completed()``, which the backend's
thread sets a moment after the future (one core per worker: a loop there took the core that thread needed)."""

from __future__ import annotations

import threading
from collections.abc import Callable

from bamboo.rc.comm import GroupTable
from bamboo.rc.timeouts import CommTimeouts

_LAG = 1000
"""``is_completed()`` calls after the future is done until the stand-in work says it is completed (its
``wait()`` says so at once)."""


class _Future:
    """As torch's: a callback added once the future is done runs at once."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[object], None]] = []
        self.done = False
        self.lock = threading.Lock()

    def add_done_callback(self, callback: Callable[[object], None]) -> None:
        with self.lock:
            if not self.done:
                self.callbacks.append(callback)
                return
        callback(self)

    def finish(self) -> None:
        with self.lock:
            self.done = True
            callbacks, self.callbacks = self.callbacks, []
        for callback in callbacks:
            callback(self)


class _LaggingWork:
    """A work whose future is done after ``done_after`` seconds and which says it completed ``_LAG`` polls after
    that, unless ``wait()`` is called."""

    def __init__(self, done_after: float) -> None:
        self.future = _Future()
        self.future_done = threading.Event()
        self.polls_after_done = 0
        self.waited = False
        threading.Timer(done_after, self._finish).start()

    def _finish(self) -> None:
        self.future_done.set()
        self.future.finish()

    def get_future(self) -> _Future:
        return self.future

    def is_completed(self) -> bool:
        if self.waited:
            return True
        if self.future_done.is_set():
            self.polls_after_done += 1
            return self.polls_after_done > _LAG
        return False

    def wait(self) -> bool:
        self.future_done.wait()
        self.waited = True
        return True


def test_a_collective_whose_future_is_done_is_waited_for_not_polled() -> None:
    table = GroupTable(store=None, job="wait", rank=0, timeouts=CommTimeouts(poll=5.0), names={})  # type: ignore[arg-type]
    interrupts: list[int] = []
    works = [_LaggingWork(done_after=0.05), _LaggingWork(done_after=0.0)]
    table.wait_collective("dp", works, "AR", interrupt=lambda: interrupts.append(1))
    assert [work.waited for work in works] == [True, True]
    assert all(work.polls_after_done <= 1 for work in works), [work.polls_after_done for work in works]
    assert interrupts == []  # done long before the first failure check was due
