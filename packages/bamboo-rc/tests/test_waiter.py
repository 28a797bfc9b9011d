"""The transfer waiter: helper threads wait on works that block, the caller polls a handle."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

import pytest
from bamboo.rc.waiter import TransferWaiter


class BlockingWork:
    """A stand-in for a gloo work: ``wait()`` blocks until the test lets it finish, or fails."""

    def __init__(self, error: str | None = None) -> None:
        self.finish = threading.Event()
        self.error = error
        self.waited = 0

    def wait(self) -> None:
        self.waited += 1
        self.finish.wait(timeout=30)
        if self.error is not None:
            raise RuntimeError(self.error)


def wait_until(condition: Callable[[], bool], timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.001)
    return True


def test_a_handle_is_not_done_until_every_work_completed_and_stays_done() -> None:
    waiter = TransferWaiter()
    first, second = BlockingWork(), BlockingWork()
    handle = waiter.submit([first, second])
    assert handle.wait(0.01) is False
    first.finish.set()
    assert handle.wait(0.01) is False and not handle.done()
    second.finish.set()
    assert wait_until(handle.done)  # done() polls without waiting or raising
    assert handle.wait(5.0) is True
    assert handle.wait(0.0) is True  # polled again after it completed: still done, no second wait on the works
    assert (first.waited, second.waited) == (1, 1)
    waiter.close()


def test_a_failed_work_raises_its_error_where_the_handle_is_polled() -> None:
    waiter = TransferWaiter()
    work = BlockingWork(error="Connection closed by peer")
    handle = waiter.submit([work])
    work.finish.set()
    assert wait_until(handle.done)  # a failed work is done too; its error comes where the handle is waited on
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        handle.wait(5.0)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        handle.wait(0.0)
    waiter.close()


def test_jobs_beyond_the_helper_limit_queue_and_run_when_a_helper_is_free() -> None:
    waiter = TransferWaiter(max_threads=2)
    works = [BlockingWork() for _ in range(5)]
    handles = [waiter.submit([work]) for work in works]
    assert waiter._started == 2
    works[2].finish.set()  # queued behind the first two: it cannot complete before a helper is free
    assert handles[2].wait(0.05) is False
    works[0].finish.set()
    assert handles[0].wait(5.0) is True
    assert handles[2].wait(5.0) is True  # the freed helper took the queued job
    for work in works:
        work.finish.set()
    assert all(handle.wait(5.0) for handle in handles)
    assert waiter._started == 2
    waiter.close()


def test_an_idle_helper_is_reused_and_close_ends_the_idle_ones() -> None:
    waiter = TransferWaiter(max_threads=4, name="test-wait")
    for _ in range(3):
        work = BlockingWork()
        work.finish.set()
        assert waiter.submit([work]).wait(5.0) is True
        # The handle is done before its helper goes idle: wait for that, then the next job must reuse it.
        assert wait_until(lambda: len(waiter._idle) == 1)
    assert waiter._started == 1
    helpers = [t for t in threading.enumerate() if t.name.startswith("test-wait-")]
    assert len(helpers) == 1
    waiter.close()
    helpers[0].join(timeout=5)
    assert not helpers[0].is_alive()
    with pytest.raises(RuntimeError, match="closed"):
        waiter.submit([BlockingWork()])


def test_max_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_threads must be >= 1, got 0"):
        TransferWaiter(max_threads=0)
