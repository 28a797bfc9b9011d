"""Long-lived gRPC streams to etcd: a deadline watchdog and the lease keepalive stream.

A unary etcd call costs a Python client about 0.5 ms of CPU; opening a stream for each lease refresh, as
the etcd client library does, about 2 ms. At one refresh every TTL/3 that is 0.3% of a core per agent, and
all of a 2-core machine for a thousand emulated agents. So, as etcd's own Go client does, each `EtcdKV`
keeps one `LeaseKeepAlive` stream open and sends every refresh of every lease on it (`KeepAliveStream`,
0.4 ms a refresh), and one `Watch` stream for all of its watches (`bamboo.membership.watch_stream`).

A thread blocked in a gRPC call wakes ten times a second inside gRPC (`grpc._common.MAXIMUM_WAIT_TIMEOUT`,
0.1 s), so that a signal reaches a main thread blocked there; on Linux a signal interrupts such a wait anyway.
This module lengthens that slice to `GRPC_WAIT_SLICE_S` when imported (`lengthen_grpc_waits`): the thread that
reads a client's watch stream waits for its next message without waking for nothing. And the keepalive stream is
read only right after a request was sent, under a `Deadline` (one watchdog thread that sleeps without a timeout
while no deadline is armed) that cancels the call when etcd does not answer within the RPC timeout.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from bamboo.membership import timeouts
from bamboo.membership.kv_base import EtcdConnection, StoreUnavailableError
from pyetcd import etcdrpc

__all__ = ["Deadline", "KeepAliveStream", "lengthen_grpc_waits", "request_iterator"]


def lengthen_grpc_waits(seconds: float = timeouts.GRPC_WAIT_SLICE_S) -> None:
    """Let a thread blocked in a gRPC call sleep up to ``seconds`` between its checks (module docstring). It
    changes gRPC's module constant for the whole process, once, and never shortens it; a gRPC without that
    constant is left as it is."""
    from grpc import _common

    if isinstance(getattr(_common, "MAXIMUM_WAIT_TIMEOUT", None), float):
        _common.MAXIMUM_WAIT_TIMEOUT = max(_common.MAXIMUM_WAIT_TIMEOUT, seconds)


lengthen_grpc_waits()


def request_iterator(requests: queue.Queue[Any]) -> Iterator[Any]:
    """The request side of a stream: what is put on `requests`, until None (then the side half-closes)."""
    while True:
        item = requests.get()
        if item is None:
            return
        yield item


class Deadline:
    """Calls a function when a deadline passes, unless disarmed first; one armed deadline at a time.

    Its thread waits without a timeout while nothing is armed, so an idle `Deadline` costs no CPU.
    """

    def __init__(self, name: str) -> None:
        self._cond = threading.Condition()
        self._due: float | None = None
        self._action: Callable[[], None] | None = None
        self._closed = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def arm(self, seconds: float, action: Callable[[], None]) -> None:
        with self._cond:
            self._due, self._action = time.monotonic() + seconds, action
            self._cond.notify_all()

    def disarm(self) -> None:
        with self._cond:
            self._due, self._action = None, None
            self._cond.notify_all()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._due is None or self._due > time.monotonic()):
                    self._cond.wait(None if self._due is None else self._due - time.monotonic())
                if self._closed:
                    return
                action, self._due, self._action = self._action, None, None
            if action is not None:
                action()


class _Refresh:
    """One caller's refresh, waiting for its batch."""

    def __init__(self, lease_id: int) -> None:
        self.lease_id = lease_id
        self.done = threading.Event()
        self.ttl = 0
        self.error: BaseException | None = None


class KeepAliveStream:
    """Every lease refresh of one `EtcdKV` on one long-lived `LeaseKeepAlive` stream.

    Refreshes are sent in batches: a caller that finds no batch in flight sends every refresh waiting at that
    moment (its own and those of the other threads of the process, e.g. many agents sharing one client), then
    reads one answer for each and hands each caller the answer for its lease; callers that come meanwhile wait
    for the next batch. A batch that gets no answer within the RPC timeout cancels the stream and raises
    `StoreUnavailableError` to its callers. A stream that broke since its last use (etcd restarted) is
    reopened once, at once, before the error is raised.
    """

    def __init__(self, kv: EtcdConnection) -> None:
        self._kv = kv
        self._lock = threading.Lock()  # one batch at a time
        self._waiting_lock = threading.Lock()
        self._waiting: list[_Refresh] = []
        self._client: Any = None
        self._call: Any = None
        self._requests: queue.Queue[Any] | None = None
        self._deadline: Deadline | None = None
        self.streams = 0
        """How many streams were opened (1 while etcd stays up)."""
        self.batches = 0
        """How many batches were sent."""

    def refresh(self, lease_id: int) -> int:
        """Refresh `lease_id`; its remaining TTL in seconds, 0 when it is gone. Raises `grpc.RpcError`
        (the caller translates it) or `StoreUnavailableError` when etcd does not answer."""
        mine = _Refresh(lease_id)
        with self._waiting_lock:
            self._waiting.append(mine)
        with self._lock:
            if not mine.done.is_set():
                with self._waiting_lock:
                    batch, self._waiting = self._waiting, []
                try:
                    answers = self._send(batch)
                except BaseException as error:
                    for waiter in batch:
                        waiter.error = error
                        waiter.done.set()
                    raise
                for waiter in batch:
                    waiter.ttl = answers.get(waiter.lease_id, 0)
                    waiter.done.set()
        if mine.error is not None:
            raise mine.error
        return mine.ttl

    def _send(self, batch: list[_Refresh]) -> dict[int, int]:
        """Send one refresh per lease of `batch` and read the answers: lease id -> remaining TTL (0: gone)."""
        leases = list(dict.fromkeys(waiter.lease_id for waiter in batch))
        for attempt in (0, 1):
            fresh = self._call is None or self._client is not self._kv.client
            if fresh:
                self._open()
            timed_out = threading.Event()
            call = self._call

            def expire(call: Any = call, timed_out: threading.Event = timed_out) -> None:
                timed_out.set()
                call.cancel()

            assert self._requests is not None and self._deadline is not None
            for lease in leases:
                self._requests.put(etcdrpc.LeaseKeepAliveRequest(ID=lease))
            self.batches += 1
            self._deadline.arm(self._kv.options.timeout, expire)
            answers: dict[int, int] = {}
            try:
                while not answers.keys() >= set(leases):
                    response = next(call)
                    answers[int(response.ID)] = max(0, int(response.TTL))
            except (grpc.RpcError, StopIteration) as exc:
                self._drop()
                if timed_out.is_set():
                    raise StoreUnavailableError(
                        f"etcd at {self._kv.where} did not answer a lease refresh within "
                        f"{self._kv.options.timeout} s") from exc
                if attempt == 0 and not fresh:
                    continue  # the stream broke while idle (etcd restarted): one fresh try
                if isinstance(exc, StopIteration):
                    raise StoreUnavailableError(f"etcd at {self._kv.where} ended the keepalive stream") from None
                raise
            finally:
                self._deadline.disarm()
            return answers
        raise AssertionError("unreachable")

    def _open(self) -> None:
        self._drop()
        client = self._kv.client
        self._requests = queue.Queue()
        stub = etcdrpc.LeaseStub(client.channel)
        self._call = stub.LeaseKeepAlive(request_iterator(self._requests), credentials=client.call_credentials,
                                         metadata=client.metadata)
        self._client = client
        if self._deadline is None:
            self._deadline = Deadline("bamboo-etcd-keepalive-deadline")
        self.streams += 1

    def _drop(self) -> None:
        if self._requests is not None:
            self._requests.put(None)
        if self._call is not None:
            self._call.cancel()
        self._call, self._requests, self._client = None, None, None

    def close(self) -> None:
        with self._lock:
            self._drop()
            if self._deadline is not None:
                self._deadline.close()
