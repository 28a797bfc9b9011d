"""An etcd key's latest value, or a prefix's keys, kept by a watch, so that reading them costs no request.

A process that polls a key (has the job ended? is there a new layout? who is the coordinator?) sends a
request each time and wakes each time: a thousand agents reading one key ten times a second are ten
thousand requests a second to one etcd, and a waiting worker that polls competes with the ones that train.
`WatchedKey` reads the key once, then follows it with a watch (multiplexed on the client's one watch
stream, `bamboo.membership.watch`): `value` is the latest value, `wait(predicate, timeout)` blocks until
the value satisfies the predicate, and `on_change` is called after every change (on the watch's thread).
`WatchedPrefix` does the same for every key under a prefix: `items()` is what was there when it started,
and its callback gets every change after that.

Every `WatchedKey` and `WatchedPrefix` of one key or prefix on one client shares one read and one watch (a
`_Follower`, as a Kubernetes shared informer does): the supervisor, the coordinator and the role watch of an
agent process that all follow the job's end cost etcd one watch, and a second follower of a key already
followed costs no request at all: it starts from what the shared watch last delivered. The shared watch
delivers each change to its followers in the order they attached, on its one thread (a slow callback delays
the others: keep them short, as waking a thread is), and ends when the last one closes.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

from bamboo.membership.kv_base import EventKind, KeyValue, KeyValueStore, WatchEvent, WatchHandle

__all__ = ["WatchedKey", "WatchedPrefix"]

log = logging.getLogger(__name__)

_Deliver = Callable[[WatchEvent], None]


class _Follower:
    """The one read and watch of `prefix` on `kv` that every follower of it there shares (module docstring)."""

    def __init__(self, kv: KeyValueStore, prefix: str) -> None:
        self.kv, self.prefix = kv, prefix
        self.users = 0  # followers attached or attaching (changed under _REGISTRY_LOCK)
        self._start_lock = threading.Lock()
        self._cond = threading.Condition()
        self._followers: list[_Deliver] = []
        self._watch: WatchHandle | None = None
        self._items: dict[str, KeyValue] = {}
        self.revision = 0

    def start(self) -> None:
        """Read the prefix and start its watch, once (the first follower does; the others wait)."""
        with self._start_lock:
            if self._watch is not None:
                return
            range_at = getattr(self.kv, "range_at", None)  # one request for the keys and their revision (EtcdKV)
            if range_at is not None:
                found, revision = range_at(self.prefix)
                with self._cond:
                    self._items, self.revision = {item.key: item for item in found}, revision
                self._watch = self.kv.watch_prefix(self.prefix, self._on_event, start_revision=revision + 1,
                                                   snapshot=found)
                return
            revision = self.kv.revision()
            found = self.kv.get_prefix(self.prefix)
            with self._cond:
                self._items, self.revision = {item.key: item for item in found}, revision
            # A change between the revision and the read comes again through the watch (skipped below).
            self._watch = self.kv.watch_prefix(self.prefix, self._on_event, start_revision=revision + 1)

    def attach(self, deliver: _Deliver) -> tuple[dict[str, KeyValue], int]:
        """Deliver the changes after the current keys to `deliver` from now on; returns those keys and revision."""
        with self._cond:
            self._followers.append(deliver)
            return dict(self._items), self.revision

    def detach(self, deliver: _Deliver) -> None:
        with self._cond:
            if deliver in self._followers:
                self._followers.remove(deliver)

    def stop(self) -> None:
        with self._start_lock:
            if self._watch is not None:
                self._watch.cancel()

    def _on_event(self, event: WatchEvent) -> None:
        with self._cond:
            known = self._items.get(event.key)
            if event.kind is EventKind.PUT:
                if known is not None and event.revision <= known.mod_revision:
                    return  # from before the value the first read saw (the watch starts at the revision before it)
                self._items[event.key] = KeyValue(key=event.key, value=event.value, mod_revision=event.revision,
                                                  create_revision=event.create_revision, lease=event.lease)
            else:
                self._items.pop(event.key, None)
            self.revision = max(self.revision, event.revision)
            followers = list(self._followers)  # those attached from now on start from this state
        for deliver in followers:
            try:
                deliver(event)
            except Exception:  # one follower's failing callback must not keep the change from the others
                log.exception("a follower of %s failed on the change of %s at revision %d", self.prefix,
                              event.key, event.revision)


_REGISTRY_LOCK = threading.Lock()
_FOLLOWERS: weakref.WeakKeyDictionary[KeyValueStore, dict[str, _Follower]] = weakref.WeakKeyDictionary()


def _follow(kv: KeyValueStore, prefix: str, deliver: _Deliver) -> tuple[_Follower, dict[str, KeyValue], int]:
    """Attach `deliver` to the shared follower of `prefix` on `kv` (started if it is new): the follower, the
    keys it holds and their revision."""
    with _REGISTRY_LOCK:
        try:
            followers = _FOLLOWERS.setdefault(kv, {})
        except TypeError:  # a store that cannot be weakly referenced: its followers are not shared
            followers = {}
        follower = followers.get(prefix)
        if follower is None:
            follower = followers[prefix] = _Follower(kv, prefix)
        follower.users += 1
    try:
        follower.start()
    except BaseException:
        _release(follower, deliver)
        raise
    items, revision = follower.attach(deliver)
    return follower, items, revision


def _release(follower: _Follower, deliver: _Deliver) -> None:
    """Detach `deliver`; the last user out takes the follower out of the registry and ends its watch."""
    follower.detach(deliver)
    with _REGISTRY_LOCK:
        follower.users -= 1
        if follower.users > 0:
            return
        try:
            followers = _FOLLOWERS.get(follower.kv)
        except TypeError:
            followers = None
        if followers is not None and followers.get(follower.prefix) is follower:
            del followers[follower.prefix]
    follower.stop()


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
        self._closed = False
        self.changes = 0
        self._follower, items, self.revision = _follow(kv, key, self._deliver)
        self._value = items.get(key)

    @property
    def value(self) -> KeyValue | None:
        with self._cond:
            return self._value

    def wait(self, predicate: Callable[[KeyValue | None], bool], timeout: float | None = None) -> KeyValue | None:
        """Block until `predicate(value)` holds (or `timeout` seconds passed); returns the value then."""
        with self._cond:
            self._cond.wait_for(lambda: predicate(self._value), timeout)
            return self._value

    def _deliver(self, event: WatchEvent) -> None:
        """A change the shared watch delivered (on its thread)."""
        if event.key != self.key:  # a longer key under the same prefix
            return
        value = None
        if event.kind is EventKind.PUT:
            value = KeyValue(key=event.key, value=event.value, create_revision=event.create_revision,
                             mod_revision=event.revision, lease=event.lease)
        with self._cond:
            if self._closed:
                return
            self._value = value
            self.revision = event.revision
            self.changes += 1
            self._cond.notify_all()
        if self._on_change is not None:
            self._on_change(value)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        _release(self._follower, self._deliver)


class WatchedPrefix:
    """Every key under `prefix`, read once (`items()`: the keys when it started), then `callback(event)` for
    each change after that, on the shared watch's thread; see the module docstring. Close it with `cancel()`
    (it is a `WatchHandle`)."""

    def __init__(self, kv: KeyValueStore, prefix: str, callback: Callable[[WatchEvent], None]) -> None:
        self.prefix = prefix
        self._callback = callback
        self._closed = threading.Event()
        self._follower, self._items, self.revision = _follow(kv, prefix, self._deliver)

    def items(self) -> list[KeyValue]:
        """The keys under the prefix when this follower started, in key order."""
        return [self._items[key] for key in sorted(self._items)]

    def _deliver(self, event: WatchEvent) -> None:
        if not self._closed.is_set():
            self._callback(event)

    def cancel(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        _release(self._follower, self._deliver)
