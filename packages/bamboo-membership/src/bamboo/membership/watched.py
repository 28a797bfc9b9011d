"""One etcd key's latest value, kept by a watch, so that reading it costs no request.

A process that polls a key (has the job ended? is there a new layout? who is the coordinator?) sends a
request each time and wakes each time: a thousand agents reading one key ten times a second are ten
thousand requests a second to one etcd, and a waiting worker that polls competes with the ones that train.
`WatchedKey` reads the key once, then follows it with a watch (multiplexed on the client's one watch
stream, `bamboo.membership.watch`): `value` is the latest value, `wait(predicate, timeout)` blocks until
the value satisfies the predicate, and `on_change` is called after every change (on the watch's thread).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from bamboo.membership.kv_base import EventKind, KeyValue, KeyValueStore, WatchEvent

__all__ = ["WatchedKey"]


class WatchedKey:
    """The latest value of `key` (None while it does not exist), kept by a watch; see the module docstring.

    `changes` counts the changes seen since the first read; `revision` is the etcd revision of the last
    change applied (of the first read, before any). Close it with `close()`.
    """

    def __init__(self, kv: KeyValueStore, key: str,
                 on_change: Callable[[KeyValue | None], None] | None = None) -> None:
        self.key = key
        self._cond = threading.Condition()
        self._on_change = on_change
        self.changes = 0
        range_at = getattr(kv, "range_at", None)  # one request for the value and its revision (EtcdKV)
        if range_at is not None:
            found, revision = range_at(key)
            self._value = next((item for item in found if item.key == key), None)
            self.revision = revision
            self._watch = kv.watch_prefix(key, self._on_event, start_revision=revision + 1, snapshot=found)
            return
        revision = kv.revision()
        self._value = kv.get(key)
        self.revision = revision
        # A change between the revision and the read comes again through the watch: the last one wins.
        self._watch = kv.watch_prefix(key, self._on_event, start_revision=revision + 1)

    @property
    def value(self) -> KeyValue | None:
        with self._cond:
            return self._value

    def wait(self, predicate: Callable[[KeyValue | None], bool], timeout: float | None = None) -> KeyValue | None:
        """Block until `predicate(value)` holds (or `timeout` seconds passed); returns the value then."""
        with self._cond:
            self._cond.wait_for(lambda: predicate(self._value), timeout)
            return self._value

    def _on_event(self, event: WatchEvent) -> None:
        if event.key != self.key:  # a longer key under the same prefix
            return
        value = None
        if event.kind is EventKind.PUT:
            value = KeyValue(key=event.key, value=event.value, create_revision=event.create_revision,
                             mod_revision=event.revision, lease=event.lease)
        with self._cond:
            if self._value is not None and event.revision <= self._value.mod_revision:
                return  # from before the value the first read saw (the watch starts at the revision before it)
            self._value = value
            self.revision = event.revision
            self.changes += 1
            self._cond.notify_all()
        if self._on_change is not None:
            self._on_change(value)

    def close(self) -> None:
        self._watch.cancel()
