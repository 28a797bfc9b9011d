"""One etcd key's latest value, kept by a watch, so that reading it costs no request.

A process that polls a key (has the job ended? is there a new layout? who is the coordinator?) sends a
request each time and wakes each time: a thousand agents reading one key ten times a second are ten
thousand requests a second to one etcd, and a waiting worker that polls competes with the ones that train.
`WatchedKey` reads the key once, then follows it with a watch (multiplexed on the client's one watch
stream, `bamboo.membership.watch`): `value` is the latest value, `wait(predicate, timeout)` blocks until
the value satisfies the predicate, and `on_change` is called after every change (on the watch's thread).

Every `WatchedKey` of one key on one client shares one read and one watch (a `_Follower`, as a Kubernetes
shared informer does): the supervisor, the coordinator and the role watch of an agent process that all
follow the job's end cost etcd one watch, and a second `WatchedKey` of a key already followed costs no
request at all: it starts from the value the shared watch last delivered. The shared watch delivers each
change to its followers in the order they attached, on its one thread (a slow `on_change` delays the
others: keep them short, as waking a thread is), and ends when the last one closes.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable

from bamboo.membership.kv_base import EventKind, KeyValue, KeyValueStore, WatchEvent, WatchHandle

__all__ = ["WatchedKey"]

log = logging.getLogger(__name__)


class _Follower:
    """The one read and watch of `key` on `kv` that every `WatchedKey` of it there shares (module docstring)."""

    def __init__(self, kv: KeyValueStore, key: str) -> None:
        self.kv, self.key = kv, key
        self.users = 0  # WatchedKeys attached or attaching (changed under _REGISTRY_LOCK)
        self._start_lock = threading.Lock()
        self._cond = threading.Condition()
        self._followers: list[WatchedKey] = []
        self._watch: WatchHandle | None = None
        self.value: KeyValue | None = None
        self.revision = 0

    def start(self) -> None:
        """Read the key and start its watch, once (the first `WatchedKey` of it does; the others wait)."""
        with self._start_lock:
            if self._watch is not None:
                return
            range_at = getattr(self.kv, "range_at", None)  # one request for the value and its revision (EtcdKV)
            if range_at is not None:
                found, revision = range_at(self.key)
                with self._cond:
                    self.value = next((item for item in found if item.key == self.key), None)
                    self.revision = revision
                self._watch = self.kv.watch_prefix(self.key, self._on_event, start_revision=revision + 1,
                                                   snapshot=found)
                return
            revision = self.kv.revision()
            value = self.kv.get(self.key)
            with self._cond:
                self.value, self.revision = value, revision
            # A change between the revision and the read comes again through the watch: the last one wins.
            self._watch = self.kv.watch_prefix(self.key, self._on_event, start_revision=revision + 1)

    def attach(self, watched: WatchedKey) -> tuple[KeyValue | None, int]:
        """Deliver the changes after the current value to `watched` from now on; returns that value and revision."""
        with self._cond:
            self._followers.append(watched)
            return self.value, self.revision

    def detach(self, watched: WatchedKey) -> None:
        with self._cond:
            if watched in self._followers:
                self._followers.remove(watched)

    def stop(self) -> None:
        with self._start_lock:
            if self._watch is not None:
                self._watch.cancel()

    def _on_event(self, event: WatchEvent) -> None:
        if event.key != self.key:  # a longer key under the same prefix
            return
        value = None
        if event.kind is EventKind.PUT:
            value = KeyValue(key=event.key, value=event.value, create_revision=event.create_revision,
                             mod_revision=event.revision, lease=event.lease)
        with self._cond:
            if self.value is not None and event.revision <= self.value.mod_revision:
                return  # from before the value the first read saw (the watch starts at the revision before it)
            self.value, self.revision = value, event.revision
            followers = list(self._followers)  # those attached from now on start from this value
        for watched in followers:
            try:
                watched._changed(value, event.revision)
            except Exception:  # one follower's failing callback must not keep the change from the others
                log.exception("a follower of %s failed on its change at revision %d", self.key, event.revision)


_REGISTRY_LOCK = threading.Lock()
_FOLLOWERS: weakref.WeakKeyDictionary[KeyValueStore, dict[str, _Follower]] = weakref.WeakKeyDictionary()


def _follower_of(kv: KeyValueStore, key: str) -> _Follower:
    """The shared follower of `key` on `kv` (made if there is none), counted as used once more."""
    with _REGISTRY_LOCK:
        try:
            followers = _FOLLOWERS.setdefault(kv, {})
        except TypeError:  # a store that cannot be weakly referenced: its WatchedKeys are not shared
            follower = _Follower(kv, key)
            follower.users = 1
            return follower
        follower = followers.get(key)
        if follower is None:
            follower = followers[key] = _Follower(kv, key)
        follower.users += 1
        return follower


def _release(follower: _Follower) -> bool:
    """One user fewer; True when it was the last (the follower is then out of the registry, to be stopped)."""
    with _REGISTRY_LOCK:
        follower.users -= 1
        if follower.users > 0:
            return False
        with_kv = _FOLLOWERS.get(follower.kv) if _is_weakrefable(follower.kv) else None
        if with_kv is not None and with_kv.get(follower.key) is follower:
            del with_kv[follower.key]
        return True


def _is_weakrefable(kv: KeyValueStore) -> bool:
    try:
        weakref.ref(kv)
    except TypeError:
        return False
    return True


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
        self._follower = _follower_of(kv, key)
        try:
            self._follower.start()
        except BaseException:
            if _release(self._follower):
                self._follower.stop()
            raise
        self._value, self.revision = self._follower.attach(self)

    @property
    def value(self) -> KeyValue | None:
        with self._cond:
            return self._value

    def wait(self, predicate: Callable[[KeyValue | None], bool], timeout: float | None = None) -> KeyValue | None:
        """Block until `predicate(value)` holds (or `timeout` seconds passed); returns the value then."""
        with self._cond:
            self._cond.wait_for(lambda: predicate(self._value), timeout)
            return self._value

    def _changed(self, value: KeyValue | None, revision: int) -> None:
        """A change the shared watch delivered (on its thread)."""
        with self._cond:
            if self._closed:
                return
            self._value = value
            self.revision = revision
            self.changes += 1
            self._cond.notify_all()
        if self._on_change is not None:
            self._on_change(value)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = True
        self._follower.detach(self)
        if _release(self._follower):
            self._follower.stop()
