"""Prefix watches that lose nothing, all of one etcd client's on one gRPC stream.

`EtcdKV.watch_prefix` returns a `PrefixWatch`. Every watch of one `EtcdKV` shares that client's
`WatchStream`, one bidirectional etcd `Watch` stream (as etcd's own Go client does): etcd multiplexes
any number of watches on a stream, each answered under its own watch id. An agent then holds one
stream and one reading thread however many keys it watches; one stream per watch cost each agent a
thread that gRPC wakes ten times a second, and etcd one stream per watch.

- **Creation.** Creations are sent as they come, without waiting for the answers to the earlier ones, and
  matched to etcd's `created` answers in order (etcd answers the creations of a stream in the order it
  received them, one answer each, a refused one included). A creation that gets no answer within the RPC
  timeout, on a stream that etcd answered nothing on for that long, counts in the watch's `create_timeouts`
  and breaks the stream, which is then re-created.
- **Resume.** When the stream breaks (etcd restarted, the network cut, a creation unanswered), every
  watch is created again on a new stream from the revision after the last one it delivered, so nothing
  is lost or delivered twice.
- **Relist.** When etcd compacted its history past that revision, the watch relists its prefix and
  reconciles it with its snapshot (key -> last value seen), as Kubernetes informers do: synthetic PUT
  events (`relisted=True`) for keys that appeared or changed, DELETE events for keys that vanished, in
  revision order; then it resumes from the relist's revision.
- **Puts only.** A watch made with `puts_only` asks etcd to leave deletions out (the `NODELETE` filter) and no
  previous values (`prev_kv`), and keeps no snapshot: its relist delivers the keys written since its last
  revision, and nothing for keys that vanished. A reader of a log whose writers delete their oldest records
  as they go (`bamboo.launch.events`) then gets one message per record, not two.
- **Delivery.** Each watch delivers its events to its callback on its own thread, in revision order (a
  slow callback delays only its own watch); an exception in a callback is logged and the watch goes on.
  Those threads wait on a queue without a timeout, so an idle watch costs no CPU.

Timeouts (`EtcdOptions`): `timeout` bounds each creation; `watch_retry_interval` is the pause before a
broken stream is re-created; `watch_start_timeout` bounds a watch's first registration (its starting
list and its creation, retried), after which `start` raises `StoreUnavailableError` naming the prefix.
Under load, a creation that waits behind others is not a failure: as long as etcd answered something on
the stream within the RPC timeout, the creation's deadline and the start's bound are extended (a thousand
agents starting together once broke their streams at each 5 s timeout, re-created every watch, and never
caught up).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

from bamboo.membership import timeouts
from bamboo.membership.kv_base import (
    EtcdConnection,
    EventKind,
    KeyValue,
    RevisionOutOfRange,
    StoreError,
    StoreUnavailableError,
    WatchEvent,
    key_value,
)
from pyetcd import etcdrpc
from pyetcd import utils as etcd_utils
from pyetcd.etcdrpc import kv_pb2

__all__ = ["PrefixWatch"]

log = logging.getLogger(__name__)


class PrefixWatch:
    """A watch of every key under a prefix that survives etcd restarts and compaction (module docstring).

    Counters for tests and logs: `reconnects` (creations after the first), `relists`, `list_failures`
    (failed attempts at the starting list), `create_timeouts` (creations that got no answer within the RPC
    timeout).
    """

    def __init__(
        self, kv: EtcdConnection, prefix: str, callback: Callable[[WatchEvent], None], start_revision: int | None,
        *, snapshot: list[KeyValue] | None = None, puts_only: bool = False,
    ) -> None:
        if snapshot is not None and start_revision is None:
            raise ValueError(f"watch of {prefix}: a snapshot goes with the revision after it (start_revision)")
        if snapshot is not None and puts_only:
            raise ValueError(f"watch of {prefix}: a puts-only watch keeps no snapshot; none can be given")
        self.puts_only = puts_only
        self._given = snapshot
        self._kv = kv
        self.prefix = prefix
        self._range_end = etcd_utils.prefix_range_end(prefix.encode())
        self._callback = callback
        self._start_revision = start_revision
        self._next_revision = 0
        self._snapshot: dict[str, KeyValue] | None = {}
        self._inbox: queue.Queue[tuple[Any, ...] | None] = queue.Queue()
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self._ever_created = False
        self._thread = threading.Thread(target=self._dispatch, name=f"bamboo-watch{prefix}", daemon=True)
        self.last_error = "no attempt finished yet"
        self.reconnects = 0
        self.relists = 0
        self.list_failures = 0
        self.create_timeouts = 0

    # -- start -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Read the starting snapshot and create the watch, retrying both within `watch_start_timeout`."""
        bound = self._kv.options.watch_start_timeout
        deadline = time.monotonic() + bound
        while True:
            try:
                self._load_snapshot()
                break
            except StoreUnavailableError as exc:
                self.last_error = str(exc)
                self.list_failures += 1
                if time.monotonic() + self._kv.options.watch_retry_interval >= deadline:
                    raise self._start_failed(bound) from exc
                log.debug("watch %s: initial list failed (%s); retrying", self.prefix, exc)
                time.sleep(self._kv.options.watch_retry_interval)
        self._thread.start()
        stream = self._kv.watch_stream()
        stream.submit(self)
        while not self._created.wait(max(0.0, deadline - time.monotonic())):
            if not stream.answering():
                self.cancel()
                raise self._start_failed(bound)
            # etcd answers the stream but has not reached this creation yet (a backlog under load): wait on,
            # one RPC timeout at a time, for as long as it keeps answering.
            deadline = time.monotonic() + self._kv.options.timeout

    def _start_failed(self, bound: float) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"watch on {self.prefix} at etcd {self._kv.where} could not be set up within {bound} s "
            f"(watch_start_timeout; each attempt bounded by the {self._kv.options.timeout} s RPC timeout); "
            f"last error: {self.last_error}"
        )

    def _load_snapshot(self) -> None:
        if self.puts_only:  # no snapshot (None): nothing to reconcile deletions with, only where to start
            self._snapshot = None
            self._next_revision = (self._kv.revision() + 1 if self._start_revision is None
                                   else self._start_revision)
            return
        if self._given is not None and self._start_revision is not None:
            self._snapshot = {kv.key: kv for kv in self._given}
            self._next_revision = self._start_revision
            return
        if self._start_revision is None:
            kvs, revision = self._kv.range_at(self.prefix)
            self._snapshot = {kv.key: kv for kv in kvs}
            self._next_revision = revision + 1
            return
        self._next_revision = self._start_revision
        if self._start_revision <= 1:
            self._snapshot = {}
            return
        try:
            kvs, _ = self._kv.range_at(self.prefix, self._start_revision - 1)
        except RevisionOutOfRange as exc:
            if exc.compacted:
                # The stream will be told it is compacted and relist; deletions before then cannot be known.
                self._snapshot = None
                return
            kvs, _ = self._kv.range_at(self.prefix)  # a start in the future: what exists now precedes it
        self._snapshot = {kv.key: kv for kv in kvs}

    def create_request(self) -> Any:
        """The request that creates this watch's server-side watch, from the revision after the last delivered."""
        wanted = {"filters": [etcdrpc.WatchCreateRequest.NODELETE]} if self.puts_only else {"prev_kv": True}
        return etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
            key=self.prefix.encode(), range_end=self._range_end, start_revision=self._next_revision, **wanted))

    # -- delivery (this watch's own thread) --------------------------------------------------------

    def post(self, item: tuple[Any, ...]) -> None:
        """Hand what the stream received for this watch to its thread."""
        self._inbox.put(item)

    def _dispatch(self) -> None:
        while True:
            item = self._inbox.get()
            if item is None or self._cancelled.is_set():
                return
            kind = item[0]
            if kind == "created":
                if self._ever_created:
                    self.reconnects += 1
                self._ever_created = True
                self._created.set()
            elif kind == "events":
                self._deliver(item[1])
            elif kind == "compacted":
                log.warning("watch %s: etcd compacted its history to revision %d, past revision %d that the watch "
                            "resumes from; relisting", self.prefix, item[1], self._next_revision)
                self._relist_until_done()
                self._resubmit()
            elif kind == "canceled":
                self._refused(str(item[1]) or "no reason given")

    def _refused(self, reason: str) -> None:
        """etcd refused or ended this watch for another reason than compaction: ask again after a pause."""
        self.last_error = f"etcd cancelled the watch: {reason}"
        log.warning("watch %s: %s", self.prefix, self.last_error)
        if self._kv.options.user is not None:
            stale = self._kv.client
            self._kv.reauthenticate(stale)  # a stale token makes etcd refuse the watch
            self._kv.watch_stream().reconnect()
        self._cancelled.wait(self._kv.options.watch_retry_interval)
        self._resubmit()

    def _resubmit(self) -> None:
        if not self._cancelled.is_set() and not self._kv.closed:
            self._kv.watch_stream().submit(self)

    def _relist_until_done(self) -> None:
        while not self._cancelled.is_set() and not self._kv.closed:
            try:
                self._relist()
                return
            except (StoreError, RevisionOutOfRange) as exc:
                self.last_error = str(exc)
                log.debug("watch %s: relist failed (%s); retrying", self.prefix, exc)
                self._cancelled.wait(self._kv.options.watch_retry_interval)

    def _deliver(self, raw_events: Any) -> None:
        last = None
        for raw in raw_events:
            revision = int(raw.kv.mod_revision)
            if revision < self._next_revision:
                continue  # already delivered before a reconnect
            last = revision if last is None else max(last, revision)
            if self.puts_only and raw.type == kv_pb2.Event.DELETE:
                continue  # etcd leaves them out (NODELETE); never pass one on
            key = raw.kv.key.decode()
            known = self._snapshot.get(key) if self._snapshot is not None else None
            prev = bytes(raw.prev_kv.value) if raw.HasField("prev_kv") else (known.value if known else None)
            if raw.type == kv_pb2.Event.DELETE:
                event = WatchEvent(EventKind.DELETE, key, bytes(raw.kv.value), revision, prev)
                if self._snapshot is not None:
                    self._snapshot.pop(key, None)
            else:
                event = WatchEvent(EventKind.PUT, key, bytes(raw.kv.value), revision, prev,
                                   create_revision=int(raw.kv.create_revision), lease=int(raw.kv.lease))
                if self._snapshot is not None:
                    self._snapshot[key] = key_value(raw.kv)
            self._safe_callback(event)
        if last is not None:
            self._next_revision = last + 1

    def _relist(self) -> None:
        """Reconcile the snapshot with the prefix as it is now, deliver the difference, resume after it."""
        kvs, revision = self._kv.range_at(self.prefix)
        current = {kv.key: kv for kv in kvs}
        old = self._snapshot
        events: list[WatchEvent] = []
        if old is None:
            if not self.puts_only:  # a puts-only watch reports no deletion anyway, and keeps no snapshot
                log.warning("watch %s: the history before its start revision %d was compacted; keys deleted "
                            "before the relist at %d cannot be reported", self.prefix, self._next_revision, revision)
            old = {}
        for key, before in old.items():
            now = current.get(key)
            if now is None:
                events.append(WatchEvent(EventKind.DELETE, key, b"", revision, before.value, relisted=True))
            elif now.create_revision != before.create_revision:  # deleted, then created again
                events.append(WatchEvent(EventKind.DELETE, key, b"", now.create_revision, before.value,
                                         relisted=True))
        for key, now in current.items():
            if now.mod_revision < self._next_revision:
                continue  # unchanged since it was delivered (or since before the watch started)
            before = old.get(key)
            prev = before.value if before is not None and before.create_revision == now.create_revision else None
            events.append(WatchEvent(EventKind.PUT, key, now.value, now.mod_revision, prev, relisted=True,
                                     create_revision=now.create_revision, lease=now.lease))
        events.sort(key=lambda e: (e.revision, e.kind is EventKind.PUT, e.key))
        log.warning("watch %s: relisted at revision %d after missing revisions from %d: %d changes delivered",
                    self.prefix, revision, self._next_revision, len(events))
        self._snapshot = None if self.puts_only else current
        self._next_revision = revision + 1
        self.relists += 1
        for event in events:
            self._safe_callback(event)

    def _safe_callback(self, event: WatchEvent) -> None:
        if self._cancelled.is_set():
            return
        try:
            self._callback(event)
        except Exception:
            log.exception("watch callback for %s failed on %s", self.prefix, event)

    def cancel(self) -> None:
        self._cancelled.set()
        self._kv.watch_stream().withdraw(self)
        self._inbox.put(None)
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout=timeouts.THREAD_JOIN_TIMEOUT_S)
