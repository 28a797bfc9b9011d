"""Starting a reconfigured generation as an *attempt* that every node of it commits to, or all abandon.

After the barrier of generation g (see :mod:`bamboo.launch.reconfigure`) the next layout is started:
each of its nodes builds its engine, and stage state moves over gloo. A node killed in that window
(a survivor that was to send its stages, a joiner still starting, any new owner) used to leave the
others blocked until the gloo group timeout. Now every start is one attempt with a first-writer-wins
outcome, decision ``g<G>-outcome`` of the attempt's generation G:

- each node runs its part (engine and transfers, or only its transfers for a node going to standby)
  in a background thread, on an :class:`AbandonableStore` over the run's c10d store;
- a node whose part is done publishes ``g<G>-up-<node>``; a node that sees every node of the new
  layout up writes the outcome ``go``;
- a node writes the outcome ``abort`` when its own part failed (a gloo error from a dead peer's
  closed connection comes at once), when a node the attempt needs (a new owner or a transfer source)
  has left the membership (its lease revoked once a probe confirmed its death, or expired: within the
  lease TTL, ``--ttl``, of its death, plus one poll), or when the attempt has not come up within
  ``--reconfigure-timeout`` seconds;
- everyone follows the outcome that won. On ``abort`` each node abandons its thread (its store
  raises at the next call; a thread blocked on a dead peer ends at the group's timeout, off the
  training thread, and an engine it started is let go like any ended layout's), and the nodes that hold stage state at the barrier redo the layout decision
  with the membership as it now is, under the attempt's own key, as generation G+1 (see
  ``bamboo.launch.worker``). A node killed after the outcome ``go`` is an ordinary failure of the new
  generation (the runtime fails over).

Because no node trains a step of an attempt before the outcome is ``go``, and ``go`` needs every
node up, either every node of the attempt trains it or none does.

The first layout (generation 0) starts as an attempt too. No node holds state at it, so when it is
abandoned (a node lost while the workers build their first groups) its nodes redo the same start on the
nodes registered now, as the next generation (``redo_start_layout`` in :mod:`bamboo.launch.coordinator`);
so does a restart of every stage from a checkpoint.
"""

from __future__ import annotations

import contextlib
import datetime
import math
import threading
import time
from collections.abc import Callable, Collection, Sequence
from typing import TYPE_CHECKING, Generic, TypeVar

import attrs
import torch.distributed as dist
from bamboo.launch import timeouts
from bamboo.launch.records import AttemptOutcome, NodeUp, outcome_name
from bamboo.membership.kv import StoreError
from bamboo.membership.watched import WatchedKey

if TYPE_CHECKING:
    from bamboo.membership import MembershipStore

__all__ = ["AbandonableStore", "AttemptAbandonedError", "AttemptWake", "Outcome", "StartThread", "await_outcome"]

T = TypeVar("T")


class AttemptAbandonedError(RuntimeError):
    """Raised inside an abandoned attempt's thread by its store: the attempt's outcome was ``abort``."""


class AbandonableStore(dist.Store):
    """A c10d store over ``inner`` whose every call raises :class:`AttemptAbandonedError` once
    :meth:`abandon` was called; waits poll ``inner`` (1 ms, doubling to ``poll_max_s``) so that a
    wait in progress ends too. :meth:`waited_s` says how long a wait for keys not set yet has been in progress:
    the part using the store waits for other nodes (a group's rendezvous), not on its own work."""

    def __init__(self, inner: dist.Store, poll_max_s: float = timeouts.ATTEMPT_STORE_POLL_MAX_S) -> None:
        super().__init__()
        self.inner = inner
        self.poll_max_s = poll_max_s
        self._abandoned = threading.Event()
        self._waits: dict[int, float] = {}  # each wait in progress: when it began (time.monotonic)
        self._waits_lock = threading.Lock()
        self.set_timeout(inner.timeout)

    def abandon(self) -> None:
        self._abandoned.set()

    @property
    def abandoned(self) -> bool:
        return self._abandoned.is_set()

    def waited_s(self) -> float:
        """How long the oldest call now waiting for keys that other nodes have not set yet has waited (0: none)."""
        with self._waits_lock:
            began = min(self._waits.values(), default=None)
        return 0.0 if began is None else time.monotonic() - began

    def _check(self) -> None:
        if self._abandoned.is_set():
            raise AttemptAbandonedError("this reconfiguration attempt was abandoned")

    def _wait_for(self, keys: Sequence[str], timeout: datetime.timedelta | None) -> None:
        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        self._check()
        if self.inner.check(list(keys)):
            return
        wait = object()
        with self._waits_lock:
            self._waits[id(wait)] = time.monotonic()
        try:
            pause = 0.001
            while True:
                if limit > 0 and time.monotonic() >= deadline:
                    raise TimeoutError(f"keys {list(keys)} not set within {limit:.1f} s")
                self._abandoned.wait(pause)
                pause = min(pause * 2, self.poll_max_s)
                self._check()
                if self.inner.check(list(keys)):
                    return
        finally:
            with self._waits_lock:
                del self._waits[id(wait)]

    def set(self, key: str, value: str | bytes) -> None:
        self._check()
        self.inner.set(key, value)

    def get(self, key: str) -> bytes:
        self._wait_for([key], None)
        return self.inner.get(key)

    def add(self, key: str, amount: int) -> int:
        self._check()
        return self.inner.add(key, amount)

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        self._check()
        return self.inner.compare_set(key, expected_value, desired_value)

    def wait(self, keys: Sequence[str], timeout: datetime.timedelta | None = None) -> None:
        self._wait_for(keys, timeout)

    def check(self, keys: Sequence[str]) -> bool:
        self._check()
        return bool(self.inner.check(list(keys)))

    def num_keys(self) -> int:
        self._check()
        return int(self.inner.num_keys())

    def delete_key(self, key: str) -> bool:
        self._check()
        return bool(self.inner.delete_key(key))


class StartThread(Generic[T]):
    """``work()`` in a daemon thread; :meth:`progress` says whether it finished and how.

    The thread drops ``work`` (and what its closure holds) once it returns. An attempt given up hands its
    result to :meth:`abandon`'s ``cleanup``, at once or when the work ends (in the thread that has it), so
    that a thread still blocked on a dead peer keeps nothing alive after it ends."""

    def __init__(self, work: Callable[[], T], name: str) -> None:
        self.result: T | None = None
        self.error: BaseException | None = None
        self._done = threading.Event()
        self._work: Callable[[], T] | None = work
        self._lock = threading.Lock()
        self._cleanup: Callable[[T], None] | None = None
        self._wakes: list[threading.Event] = []  # set too when the work ends (wake_on_end)
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        result: T | None = None
        try:
            assert self._work is not None
            result = self._work()
        except BaseException as error:  # reported through progress(); an abandoned thread's error is dropped
            self.error = error
        finally:
            self._work = None
            try:
                with self._lock:
                    cleanup = self._cleanup
                    if cleanup is None:
                        self.result = result
                if cleanup is not None and result is not None:
                    cleanup(result)
            finally:
                with self._lock:
                    self._done.set()
                    wakes = list(self._wakes)
                for wake in wakes:
                    wake.set()

    def abandon(self, cleanup: Callable[[T], None]) -> None:
        """The attempt was given up: ``cleanup(result)`` is called with the work's result (not None), now if
        it has finished, else when it does; the result is not kept."""
        with self._lock:
            self._cleanup = cleanup
            result, self.result = self.result, None
        if result is not None:
            cleanup(result)

    def progress(self) -> tuple[bool, BaseException | None]:
        return self._done.is_set(), self.error

    def wake_on_end(self, wake: threading.Event) -> None:
        """Set ``wake`` too when the work ends (now, if it has ended)."""
        with self._lock:
            self._wakes.append(wake)
            ended = self._done.is_set()
        if ended:
            wake.set()

    def join(self, timeout_s: float) -> bool:
        return self._done.wait(timeout_s)


class AttemptWake:
    """What :func:`await_outcome`'s sleeps wait on in a worker (``sleep=wake.sleep``): each ends as soon as the
    attempt's outcome is written (a watch of its decision) or this node's part ends, else after its poll.

    A node whose part is blocked (a transfer or a group's rendezvous with a node killed meanwhile) learned of the
    ``abort`` that another node wrote only at its next poll, :data:`~bamboo.launch.timeouts.ATTEMPT_POLL_S`
    later, plus that round's reads: under heavy churn it reached the next barrier 0.33 and 0.44 s after the node
    that wrote it, and the reconfiguration paused that much longer. An etcd that cannot be read when the watch
    starts leaves the polls alone. ``close()`` ends the watch."""

    def __init__(self, membership: MembershipStore, generation: int, part: StartThread[T]) -> None:
        self._woken = threading.Event()
        self._outcome: WatchedKey | None = None
        with contextlib.suppress(StoreError):
            self._outcome = WatchedKey(membership.kv, membership.keys.decision(outcome_name(generation)),
                                       on_change=lambda _found: self._woken.set())
        part.wake_on_end(self._woken)

    def sleep(self, seconds: float) -> None:
        """Wait ``seconds``, or less when the outcome is written or the part ends; either wakes one round."""
        self._woken.wait(seconds)
        self._woken.clear()

    def close(self) -> None:
        if self._outcome is not None:
            self._outcome.close()


@attrs.frozen
class Outcome:
    """How an attempt ended: ``go`` (every node of it trains it) or not, and why."""

    go: bool
    reason: str
    won: bool = False
    """Whether this node wrote the outcome."""


def up_name(generation: int, node: str) -> str:
    return f"g{generation}-up-{node}"


@attrs.define
class _Stragglers:
    """Who :func:`await_outcome` reported as a suspect (see there): each owner not up once while this node's part
    has waited ``straggler_s`` for the others, and once ``done_s`` after its part is done (``straggler_s``, but
    :data:`~bamboo.launch.timeouts.FIRST_STRAGGLER_S` on the layout's first owner by name: one node reports early,
    so that a joiner killed at the switch is probed soon, and a straggler costs one probe early, not one from
    each node)."""

    node: str
    suspect: Callable[[str], None] | None
    straggler_s: float
    clock: Callable[[], float]
    done_s: float
    done_at: float | None = None
    reported: dict[str, set[str]] = attrs.field(factory=lambda: {"waiting": set(), "done": set()})
    reported_at: float = -math.inf
    """When this node last reported a suspect: its agent's probe may revoke that node's lease soon after."""

    def look(self, finished: bool, waited_s: float, not_up: set[str]) -> None:
        """This node's part is ``finished`` or not, and has waited ``waited_s`` for the others (0: it does not
        wait now); ``not_up``: the owners not up."""
        if self.suspect is None:
            return
        if finished:
            self.done_at = self.clock() if self.done_at is None else self.done_at
            state = "done" if self.clock() - self.done_at >= self.done_s else None
        else:
            state = "waiting" if waited_s >= self.straggler_s else None
        if state is None:
            return
        for other in sorted(not_up - self.reported[state] - {self.node}):
            self.reported[state].add(other)
            self.suspect(other)
            self.reported_at = self.clock()


@attrs.define
class _AttemptReads:
    """What :func:`await_outcome` reads of the other nodes at each poll, in requests that do not grow with the job:
    the ``up`` records written since the last poll (one read, :meth:`not_up`), and every node's record at most
    every ``poll_s`` (:meth:`gone`)."""

    membership: MembershipStore
    generation: int
    owners: set[str]
    needed: set[str]
    poll_s: float
    clock: Callable[[], float]
    up: set[str] = attrs.field(factory=set)
    up_read: int = 0
    """The revision of the last read of the ``up`` records: the next read takes only those written after it."""
    listed_at: float = -math.inf

    def not_up(self) -> set[str]:
        """The owners that have not published ``up`` yet."""
        prefix = up_name(self.generation, "")
        written, self.up_read = self.membership.read_decisions(prefix, changed_after=self.up_read)
        self.up.update(self.owners & {name.removeprefix(prefix) for name in written})
        return self.owners - self.up

    def gone(self, soon_after: float) -> list[str]:
        """The needed nodes without a record: read at most every ``poll_s`` (the read carries every node), but at
        every poll for ``poll_s`` after ``soon_after`` (when this node reported a suspect: its agent's probe may
        revoke that node's lease, and the attempt then aborts at once)."""
        now = self.clock()
        if now - self.listed_at < self.poll_s and now - soon_after > self.poll_s:
            return []
        self.listed_at = now
        records = self.membership.list_nodes(skip_malformed=True)
        return sorted(other for other in self.needed if other not in records)


def await_outcome(
    membership: MembershipStore,
    generation: int,
    node: str,
    new_owners: Collection[str],
    needed: Collection[str],
    progress: Callable[[], tuple[bool, BaseException | None]],
    timeout_s: float,
    *,
    poll_s: float = timeouts.ATTEMPT_POLL_S,
    ready_poll_s: float = timeouts.ATTEMPT_READY_POLL_S,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    say: Callable[[str], None] = lambda line: None,
    up_record: Callable[[], NodeUp] | None = None,
    suspect: Callable[[str], None] | None = None,
    straggler_s: float = timeouts.STRAGGLER_S,
    first_straggler_s: float = timeouts.FIRST_STRAGGLER_S,
    waited_s: Callable[[], float] | None = None,
) -> Outcome:
    """Wait for the outcome of attempt ``generation``, writing it (first writer wins) when this node can tell.

    ``new_owners``: the nodes of the attempt's layout (each must publish that it is up); ``needed``:
    every node whose death breaks the attempt (the new owners and the transfer sources);
    ``progress()``: this node's own part, ``(finished, error)``. ``membership`` is a
    ``bamboo.membership.MembershipStore`` (``decide``, ``get_decision``, ``read_decisions``, ``list_nodes``); an
    unreachable etcd only delays the answer. ``up_record()`` is this node's ``up`` record (default: its
    name alone); the outcome records when it was written. It polls every ``poll_s`` while its own part runs,
    every ``ready_poll_s`` once it is done (then only the others and the outcome are awaited). A poll reads the
    outcome and the ``up`` records written since the last poll (two requests, whatever the number of nodes),
    and every node's record at most every ``poll_s`` (or at every poll for ``poll_s`` after this node reported a
    suspect). ``suspect(node)``, when given, is called for each new owner not up ``straggler_s`` (on the first owner
    by name ``first_straggler_s``, :class:`_Stragglers`) after this node's own part was done, and
    once before that when ``waited_s()`` (how long this node's part has waited for other nodes, as at a group's
    rendezvous, which a node killed before it joined leaves waiting) reaches ``straggler_s``: the node's agent
    probes it, and a dead one leaves the membership at once (the attempt is then abandoned for it); a live one
    answers and is left alone. A running part that is not waiting reports nobody: the others may wait for it.
    """
    deadline = clock() + timeout_s
    published = False
    stragglers = _Stragglers(node, suspect, straggler_s, clock,
                             first_straggler_s if node == min(new_owners, default=None) else straggler_s)
    reads = _AttemptReads(membership, generation, set(new_owners), set(needed), poll_s, clock)
    while True:
        verdict: tuple[bool, str] | None = None
        try:
            found = membership.get_decision(outcome_name(generation))
            if found is not None:
                written = AttemptOutcome.from_dict(found.value)
                return Outcome(go=written.go, reason=written.reason)
            finished, error = progress()
            if error is not None:
                verdict = (False, f"{node} could not start its part: {type(error).__name__}: {error}")
            elif finished and not published and node in new_owners:
                record = up_record() if up_record is not None else NodeUp(node)
                membership.decide(up_name(generation, node), record.to_dict())
                published = True
            gone = reads.gone(soon_after=stragglers.reported_at) if verdict is None else []
            if gone:
                verdict = (False, f"{', '.join(gone)} left the membership (its lease expired or was revoked)")
            if verdict is None:
                not_up = reads.not_up()
                if not not_up:
                    verdict = (True, "every node is up")
                elif clock() > deadline:
                    verdict = (False, f"{', '.join(sorted(not_up))} not up within {timeout_s:g} s")
                else:
                    stragglers.look(finished, waited_s() if waited_s is not None else 0.0, not_up)
            if verdict is not None:
                decision = membership.decide(outcome_name(generation), AttemptOutcome(*verdict, at=time.time()).to_dict())
                if decision.won:
                    say(f"attempt of generation {generation}: {'go' if verdict[0] else 'abort'} ({verdict[1]})")
                written = AttemptOutcome.from_dict(decision.value)
                return Outcome(go=written.go, reason=written.reason, won=decision.won)
        except StoreError as failure:  # etcd restarting: ask again
            say(f"attempt of generation {generation}: etcd unreadable ({failure}); asking again")
        else:
            if not published and node in new_owners and progress()[0]:
                continue  # its part ended during this round's reads: its up record now, not one poll later
        sleep(ready_poll_s if published or (node not in new_owners and progress()[0]) else poll_s)
