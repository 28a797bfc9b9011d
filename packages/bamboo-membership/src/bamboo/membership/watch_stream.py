"""One etcd client's watch stream, shared by every `bamboo.membership.watch.PrefixWatch` of that client.

Creation, resume and the timeouts that bound them are described in `bamboo.membership.watch`, which holds the
watches themselves; this module holds the stream they share: it sends each watch's creation, matches etcd's
answers to the creations in order, hands each watch what etcd sent it, and makes the stream again when it
breaks.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from typing import TYPE_CHECKING, Any

import grpc
from bamboo.membership.kv_base import EtcdConnection
from bamboo.membership.streams import Deadline, request_iterator
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exceptions

if TYPE_CHECKING:
    from bamboo.membership.watch import PrefixWatch

__all__ = ["WatchStream"]

log = logging.getLogger(__name__)


class WatchStream:
    """One etcd client's watch stream, shared by all of its `PrefixWatch`es (see `bamboo.membership.watch`).

    Its thread runs while at least one watch wants a server-side watch; `streams` counts the streams opened.
    """

    def __init__(self, kv: EtcdConnection) -> None:
        self._kv = kv
        self._cond = threading.Condition()
        self._active: list[PrefixWatch] = []  # the watches that want a server-side watch now
        self._by_id: dict[int, PrefixWatch] = {}  # created on the current stream, by etcd's watch id
        self._to_create: collections.deque[PrefixWatch] = collections.deque()
        self._creating: collections.deque[PrefixWatch] = collections.deque()  # sent, not yet answered
        self._requests: queue.Queue[Any] | None = None
        self._call: Any = None
        self._thread: threading.Thread | None = None
        self._deadline: Deadline | None = None
        self._closed = False
        self._answered = 0.0  # when etcd last answered anything on the current stream (monotonic)
        self.streams = 0

    # -- what the watches ask -------------------------------------------------------------------

    def submit(self, watch: PrefixWatch) -> None:
        """Create a server-side watch for `watch` from its next revision (on the stream, or on the next one)."""
        with self._cond:
            if self._closed:
                return
            if watch not in self._active:
                self._active.append(watch)
            pending = watch in self._to_create or watch in self._creating or watch in self._by_id.values()
            if self._requests is not None and not pending:
                self._to_create.append(watch)
                self._send_next_create()
            if self._thread is None:
                self._deadline = Deadline(f"bamboo-watch-deadline-{id(self):x}")
                self._thread = threading.Thread(target=self._run, name="bamboo-watch-stream", daemon=True)
                self._thread.start()
            self._cond.notify_all()

    def withdraw(self, watch: PrefixWatch, *, cancel: bool = True) -> None:
        """Forget `watch`; with `cancel`, tell etcd to end its server-side watch (etcd ended it otherwise)."""
        with self._cond:
            if watch in self._active:
                self._active.remove(watch)
            if watch in self._to_create:
                self._to_create.remove(watch)
            for watch_id, owner in list(self._by_id.items()):
                if owner is watch:
                    del self._by_id[watch_id]
                    if cancel and self._requests is not None:
                        self._requests.put(etcdrpc.WatchRequest(
                            cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id)))
            if not self._active and self._call is not None:
                self._call.cancel()  # an idle stream would keep a thread that gRPC wakes ten times a second

    def reconnect(self) -> None:
        """Break the current stream, so that it is made again on the client's current channel."""
        with self._cond:
            if self._call is not None:
                self._call.cancel()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            if self._call is not None:
                self._call.cancel()
            self._cond.notify_all()
        if self._deadline is not None:
            self._deadline.close()

    # -- the stream -----------------------------------------------------------------------------

    def _send_next_create(self) -> None:
        """Send every creation waiting to be sent (called with the lock held); the oldest one awaiting its
        answer is the one the deadline watches."""
        if self._requests is None:
            return
        while self._to_create:
            watch = self._to_create.popleft()
            self._creating.append(watch)
            self._requests.put(watch.create_request())
        self._arm()

    def _arm(self) -> None:
        """Watch the oldest creation in flight for its answer (called with the lock held)."""
        assert self._deadline is not None
        if not self._creating:
            self._deadline.disarm()
            return
        head = self._creating[0]
        self._deadline.arm(self._kv.options.timeout, lambda call=self._call, w=head: self._create_timed_out(call, w))

    def answering(self) -> bool:
        """Whether etcd answered anything on the current stream within the RPC timeout: a stream that works
        through a backlog of creations under load, rather than one that stopped answering."""
        with self._cond:
            return self._call is not None and time.monotonic() - self._answered < self._kv.options.timeout

    def _create_timed_out(self, call: Any, watch: PrefixWatch) -> None:
        with self._cond:
            if self._call is not call or not self._creating or self._creating[0] is not watch:
                return
            if time.monotonic() - self._answered < self._kv.options.timeout:
                # etcd is answering this stream (other watches' events, or creations): slow under load, not
                # gone. Breaking the stream would re-create every watch on it and add to that load.
                self._deadline.arm(self._answered + self._kv.options.timeout - time.monotonic(),
                                   lambda: self._create_timed_out(call, watch))
                return
            watch.create_timeouts += 1
            watch.last_error = f"no answer to the watch request within {self._kv.options.timeout} s"
        log.warning("watch %s: %s; re-creating the stream", watch.prefix, watch.last_error)
        call.cancel()

    def _open(self) -> Any:
        client = self._kv.client
        stub = etcdrpc.WatchStub(client.channel)
        requests: queue.Queue[Any] = queue.Queue()
        call = stub.Watch(request_iterator(requests), credentials=client.call_credentials, metadata=client.metadata)
        with self._cond:
            self._requests, self._call = requests, call
            self._answered = time.monotonic()  # the stream is as young as its first creation
            self._to_create = collections.deque(self._active)
            self._creating = collections.deque()
            self._send_next_create()
        self.streams += 1
        return call

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._kv.closed and not self._active:
                    self._cond.wait()
                if self._closed or self._kv.closed:
                    return
            error = "the watch stream ended"
            try:
                call = self._open()
                for response in call:
                    self._on_response(response)
            except (etcd_exceptions.Etcd3Exception, ValueError) as exc:  # no endpoint, or the channel closed
                error = f"cannot open the watch stream: {exc}"
            except grpc.RpcError as exc:
                error = f"{exc.code()}: {exc.details()}" if hasattr(exc, "code") else str(exc)
            self._broken(error)
            with self._cond:
                if self._closed or self._kv.closed:
                    return
                if self._active:
                    self._cond.wait(self._kv.options.watch_retry_interval)

    def _broken(self, error: str) -> None:
        with self._cond:
            if self._deadline is not None:
                self._deadline.disarm()
            if self._requests is not None:
                self._requests.put(None)
            affected = list(self._active)
            self._requests, self._call, self._creating = None, None, collections.deque()
            self._by_id.clear()
            self._to_create.clear()
        for watch in affected:
            watch.last_error = error
        if affected and not self._closed and not self._kv.closed:
            log.debug("watch stream broke (%s); %d watches resume on a new one", error, len(affected))

    def _on_response(self, response: Any) -> None:
        self._answered = time.monotonic()  # (a float store: read under the lock, written without it)
        watch_id = int(response.watch_id)
        if response.created:
            with self._cond:
                watch = self._creating.popleft() if self._creating else None
                self._arm()
                failed = bool(response.canceled) or watch_id < 0
                if watch is not None and not failed:
                    if watch in self._active:
                        self._by_id[watch_id] = watch
                    elif self._requests is not None:  # withdrawn while its creation was in flight
                        self._requests.put(etcdrpc.WatchRequest(
                            cancel_request=etcdrpc.WatchCancelRequest(watch_id=watch_id)))
                        watch = None
                elif watch is not None and watch in self._active:
                    self._active.remove(watch)  # it asks again once it has handled the refusal
            if watch is not None:
                watch.post(("canceled", response.cancel_reason) if failed else ("created",))
            if not response.events and not response.compact_revision:
                return
        with self._cond:
            watch = self._by_id.get(watch_id)
            if watch is not None and (response.compact_revision or response.canceled):
                del self._by_id[watch_id]  # etcd ended this server-side watch
                if watch in self._active:
                    self._active.remove(watch)
        if watch is None:
            return
        if response.compact_revision:
            watch.post(("compacted", int(response.compact_revision)))
        elif response.canceled:
            watch.post(("canceled", response.cancel_reason))
        elif response.events:
            watch.post(("events", list(response.events)))
