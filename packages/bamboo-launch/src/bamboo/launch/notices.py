"""How a bamboo-launch worker learns of confirmed failures, and rides out an etcd outage.

`bamboo.rc` learns of failures through its :class:`bamboo.rc.FailureNotices` interface: a worker
*suspects* a peer, and someone *confirms* failures by publishing a :class:`bamboo.rc.FailureEvent`
(the next runtime epoch and the global ranks that died). Here:

- the elected coordinator of the job (:mod:`bamboo.launch.coordinator`) publishes each event as the
  first-writer-wins decision ``g<generation>-epoch-<epoch>`` in etcd, and a worker that leaves after a
  preemption notice publishes its hand-over the same way (:meth:`EtcdFailureNotices.claim`): a failure
  published first takes the epoch, and the leaver applies it before it may try again;
- :class:`EtcdFailureNotices`, in each worker, watches those decisions (so a poll costs no request:
  the runtime polls while it waits on every transfer) and forwards each suspicion to the node's agent
  over gRPC (``AgentClient.report_peer_failure``), whose failure detector probes the suspect. A
  failure seen in a collective names every member of the group; the probes clear the live ones.

:class:`PatientKV` wraps the worker's etcd client so that an etcd restart pauses the worker instead
of failing it.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from typing import TYPE_CHECKING

from bamboo.launch import timeouts
from bamboo.membership.kv import StoreError, StoreUnavailableError
from bamboo.rc import FailureEvent

if TYPE_CHECKING:
    from bamboo.membership import AgentClient, MembershipStore, WatchEvent
    from bamboo.membership.kv_base import WatchHandle

__all__ = [
    "EtcdFailureNotices",
    "PatientKV",
    "epoch_decision",
    "publish_failure_event",
    "publish_next_event",
    "published_events",
]

log = logging.getLogger(__name__)


def epoch_decision(generation: int, epoch: int) -> str:
    """The decision name of the failure event that starts ``epoch`` of ``generation``."""
    return f"g{generation}-epoch-{epoch}"


def publish_failure_event(membership: MembershipStore, generation: int,
                          event: FailureEvent) -> tuple[bool, FailureEvent]:
    """Write ``event`` first-writer-wins; returns (whether it won, the event that is now published)."""
    decision = membership.decide(epoch_decision(generation, event.epoch), json.loads(event.to_json()))
    return decision.won, FailureEvent.from_json(json.dumps(decision.value))


def published_events(membership: MembershipStore, generation: int) -> dict[int, FailureEvent]:
    """The failure events published for ``generation``, by epoch."""
    events = {}
    for item in membership.kv.get_prefix(membership.keys.decision(f"g{generation}-epoch-")):
        event = FailureEvent.from_json(item.value)
        events[event.epoch] = event
    return events


def publish_next_event(membership: MembershipStore, generation: int, ranks: list[int], *,
                       handover: bool = False) -> FailureEvent:
    """Publish ``ranks`` as the next epoch's event of ``generation`` (first writer wins; a lost race is retried
    with the epoch after), unless an event of that generation already names them all. Returns the event."""
    while True:
        published = published_events(membership, generation)
        covered = {rank for event in published.values() for rank in event.victims}
        pending = sorted(set(ranks) - covered)
        if not pending:
            return next(event for _, event in sorted(published.items()) if set(ranks) & set(event.victims))
        event = FailureEvent(max(published, default=0) + 1, pending, handover=handover)
        won, written = publish_failure_event(membership, generation, event)
        if won:
            return written


class PatientKV:
    """A key-value store whose calls ride out an etcd outage of up to ``outage_s`` seconds.

    Each call that fails with ``StoreUnavailableError`` (etcd down or restarting) is retried every
    ``retry_s`` until ``outage_s`` has passed, then the error is raised. The runtime reads etcd at
    every step, so the workers' store sits on this: a restarted etcd only pauses them. Other errors
    (a fenced write among them) are raised at once.
    """

    def __init__(self, kv: object, outage_s: float = timeouts.ETCD_OUTAGE_S,
                 retry_s: float = timeouts.ETCD_RETRY_S) -> None:
        self._kv = kv
        self.outage_s = outage_s
        self.retry_s = retry_s

    def __getattr__(self, name: str) -> object:
        attribute = getattr(self._kv, name)
        if not callable(attribute):
            return attribute

        def patient(*args: object, **kwargs: object) -> object:
            deadline = time.monotonic() + self.outage_s
            while True:
                try:
                    return attribute(*args, **kwargs)
                except StoreUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(self.retry_s)

        return patient


class EtcdFailureNotices:
    """The worker's :class:`bamboo.rc.FailureNotices` for one generation: events from etcd, suspicions to
    the agent.

    ``membership`` is the worker's ``MembershipStore``; ``node_of_rank`` names the node of each global
    rank of the generation (for the agent's detector). Call :meth:`close` when the generation ends.
    """

    def __init__(self, membership: MembershipStore, generation: int, agent: AgentClient | None,
                 node_of_rank: dict[int, str]) -> None:
        self.membership = membership
        self.generation = generation
        self.agent = agent
        self.node_of_rank = dict(node_of_rank)
        self._events: dict[int, FailureEvent] = {}
        self._cond = threading.Condition()
        self._last_direct_read = 0.0
        self._prefix = membership.keys.decision(f"g{generation}-epoch-")
        self._watch: WatchHandle | None = None
        try:
            self._watch = self._follow(membership)
        except StoreError as error:  # etcd restarting: polls read directly until it is back
            log.warning("failure notices of generation %d: no watch yet (%s)", generation, error)

    def _follow(self, membership: MembershipStore) -> WatchHandle:
        """Read the generation's events and follow them (:class:`bamboo.membership.WatchedPrefix`: the
        workers of one process share one read and one watch of them)."""
        from bamboo.membership import WatchedPrefix

        watched = WatchedPrefix(membership.kv, self._prefix, self._on_watch)
        for item in watched.items():
            self._store(item.key, item.value)
        return watched

    def _store(self, key: str, value: bytes) -> FailureEvent | None:
        """Keep the event published at ``key`` and wake the waiters; returns it (None when malformed)."""
        try:
            event = FailureEvent.from_json(value)
        except (ValueError, TypeError, KeyError) as error:
            log.error("ignoring malformed failure event at %s: %s", key, error)
            return None
        with self._cond:
            self._events[event.epoch] = event
            self._cond.notify_all()
        return event

    def _on_watch(self, event: WatchEvent) -> None:
        if event.value:
            self._store(event.key, event.value)

    def suspect(self, epoch: int, reporter: int, peer: int, instruction: str) -> None:
        """Tell the agent that ``peer``'s node failed an operation of ``reporter`` (its detector probes it)."""
        node = self.node_of_rank.get(peer)
        if self.agent is None or node is None:
            return
        try:
            self.agent.report_peer_failure(node, f"rank {reporter}: {instruction} failed in epoch {epoch}")
        except Exception as error:  # the agent being unreachable must not hide the suspicion
            log.error("could not report %s to the agent: %s", node, error)

    def poll(self, epoch: int) -> FailureEvent | None:
        """The event that starts ``epoch``, if published (no request, unless the watch is not running)."""
        with self._cond:
            found = self._events.get(epoch)
        if found is not None or self._watch is not None:
            return found
        now = time.monotonic()
        if now - self._last_direct_read < timeouts.NOTICE_DIRECT_READ_S:
            return None
        self._last_direct_read = now
        try:
            decision = self.membership.get_decision(epoch_decision(self.generation, epoch))
        except (StoreError, RuntimeError) as error:
            log.warning("failure notices unreadable (epoch %d): %s", epoch, error)
            return None
        if decision is None:
            return None
        self._store(decision.name, json.dumps(decision.value).encode())
        with self._cond:
            return self._events.get(epoch)

    def wait(self, epoch: int, timeout: float) -> FailureEvent | None:
        """Block up to ``timeout`` seconds for the event that starts ``epoch``."""
        deadline = time.monotonic() + timeout
        while True:
            event = self.poll(epoch)
            remaining = deadline - time.monotonic()
            if event is not None or remaining <= 0:
                return event
            with self._cond:
                if epoch not in self._events:
                    self._cond.wait(min(remaining, timeouts.NOTICE_DIRECT_READ_S))

    def claim(self, event: FailureEvent) -> FailureEvent:
        """Publish ``event`` (this node's hand-over) as decision ``g<generation>-epoch-<epoch>`` unless an event
        holds that epoch already (first writer wins); returns the event that holds it now."""
        _, written = publish_failure_event(self.membership, self.generation, event)
        self._store(epoch_decision(self.generation, event.epoch), written.to_json().encode())
        return written

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None
