"""A worker's wait for a role: the job's layout and its end, followed by watches instead of polled.

A warm standby or joining worker waits, maybe for hours, for a layout that places its node. Reading the
layout and the job's end every 50 ms cost each waiting worker 40 etcd requests a second, and at a thousand
nodes (an 84 KB layout, 5 ms to decode) a quarter of a core: a waiting worker competed with the ones that
train. :class:`RoleWatch` reads both keys once, then follows them (:class:`bamboo.membership.WatchedKey`,
on the worker's one etcd watch stream), and decodes a layout once per change (once per process: the decoded value is shared); :mod:`bamboo.launch.roles`
reads them from it, and sleeps until one of them changes.
"""

from __future__ import annotations

import functools
import json
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from bamboo.launch.records import JobEnd

if TYPE_CHECKING:
    from bamboo.membership import KeyValue, MembershipStore
    from bamboo.reconfig import JobLayout

__all__ = ["GENERATION_DECISIONS", "RoleWatch"]

GENERATION_DECISIONS = "g"
"""The first letters of every decision that belongs to a layout's generation (``g<generation>-``: its barrier,
its start's outcome, a layout prepared during it and its outcome, its epochs). A worker that waits for a role
follows only these: the others (a checkpoint's shard written, every ten steps; a worker warm; a hand-over)
never give it a role, and following them woke every worker at each checkpoint for nothing."""

_DECODING = threading.Lock()


def _decode_layout(value: bytes) -> JobLayout:
    """A layout's value decoded once per process: the role watches of one process (the worker's, or a benchmark's
    hundred emulated nodes) that read the same value share the decoded (frozen) ``JobLayout``; those that wake
    together for a new layout wait for the one that decodes it (a thousand-node layout takes milliseconds)."""
    with _DECODING:
        return _decoded(value)


@functools.lru_cache(maxsize=2)
def _decoded(value: bytes) -> JobLayout:
    from bamboo.reconfig import JobLayout

    return JobLayout.from_json(value)


class RoleWatch:
    """The layout and the job's end of ``membership``'s job, for the worker of ``node`` (and, with
    ``follow_decisions``, the decisions of the layouts' generations, :data:`GENERATION_DECISIONS`: a change of
    any of them wakes :meth:`wait_change`).

    :meth:`wait_role` blocks until a layout of a later generation places the node (or the job ends);
    :meth:`next_layout` until any later generation is written (a standby node learns its role in it too).
    """

    def __init__(self, membership: MembershipStore, node: str, *, follow_decisions: bool = False) -> None:
        from bamboo.membership import WatchedKey

        self.node = node
        self._cond = threading.Condition()
        self._changes = 0
        self._decoded: tuple[int, JobLayout | None] = (0, None)
        self._layout = WatchedKey(membership.kv, membership.keys.layout, on_change=self._changed)
        self._end = WatchedKey(membership.kv, membership.keys.decision("end"), on_change=self._changed)
        self._decisions = None
        if follow_decisions:  # a layout being prepared, and its outcome, are decisions: each one counts as a change
            self._decisions = membership.kv.watch_prefix(membership.keys.decision(GENERATION_DECISIONS),
                                                         lambda _event: self._changed(None))

    def _changed(self, _found: KeyValue | None) -> None:
        with self._cond:
            self._changes += 1
            self._cond.notify_all()

    def ended(self) -> JobEnd | None:
        """The job's end record, once written."""
        found = self._end.value
        if found is None:
            return None
        try:
            return JobEnd.from_dict(json.loads(found.value))
        except (ValueError, TypeError, KeyError):  # malformed: the job's writer decides, not this reader
            return None

    def layout(self) -> JobLayout | None:
        """The current :class:`bamboo.reconfig.JobLayout` (None before the first), decoded once per change."""
        found = self._layout.value
        if found is None:
            return None
        if self._decoded[0] != found.mod_revision:
            self._decoded = (found.mod_revision, _decode_layout(found.value))
        return self._decoded[1]

    def next_layout(self, after: int, timeout: float | None = None) -> JobLayout | None:
        """The layout once its generation is above ``after``; None once the job has ended, or at the timeout."""
        return self._wait(lambda layout: layout.generation > after, timeout)

    def wait_role(self, after: int, timeout: float | None = None) -> JobLayout | None:
        """The first layout of a generation above ``after`` that places this node; None once the job has ended
        (or at the timeout)."""
        return self._wait(lambda layout: layout.generation > after and self.node in layout.ranks, timeout)

    def changes(self) -> int:
        """How many times the layout or the job's end changed: :meth:`wait_change` waits for this to move."""
        with self._cond:
            return self._changes

    def wait_change(self, seen: int, timeout: float) -> None:
        """Sleep until :meth:`changes` is past ``seen``, or ``timeout`` seconds."""
        with self._cond:
            self._cond.wait_for(lambda: self._changes != seen, timeout)

    def _wait(self, wanted: Callable[[JobLayout], bool], timeout: float | None) -> JobLayout | None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            with self._cond:
                seen = self._changes
            if self.ended() is not None:
                return None
            layout = self.layout()
            if layout is not None and wanted(layout):
                return layout
            with self._cond:
                remaining = None if deadline is None else deadline - time.monotonic()
                if remaining is not None and remaining <= 0:
                    return None
                self._cond.wait_for(lambda seen=seen: self._changes != seen, remaining)

    def close(self) -> None:
        self._layout.close()
        self._end.close()
        if self._decisions is not None:
            self._decisions.cancel()
