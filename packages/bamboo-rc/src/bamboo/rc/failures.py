"""How the runtime learns of failures: typed errors and the failure-notice interface.

`bamboo.rc` knows nothing of etcd. A worker that sees a transfer or a collective fail reports a
*suspicion* through :class:`FailureNotices`, for each peer that may have failed (the peer of a
P2P transfer; every other member of a collective's group, since a collective does not say who
failed); an authority outside the workers (the launcher over bamboo-membership, or `verify`'s
parent process, which sees its children die through `waitpid`) *confirms* failures by publishing
a :class:`FailureEvent`: the next membership epoch and the global ranks that failed. Nobody acts
on a suspicion alone (a slow peer is not a dead peer; the launcher's probes clear the live
suspects), and every survivor acts on the same published event, so all derive the same failover.

:class:`StoreFailureNotices` implements the interface over any key-value store (a c10d store),
under `bamboo/<job>/epoch/<e>` (the event that starts epoch e, a :class:`FailureEvent`) and
`bamboo/<job>/suspect/<e>/<reporter>/<peer>` (a :class:`~bamboo.rc.records.SuspicionRecord`).
Events are written first writer wins (:meth:`FailureNotices.claim`): a node that leaves after a
preemption notice publishes its own hand-over, and a failure confirmed at the same time takes the
next free epoch. This module does not import torch.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol

from bamboo.rc.ports import Clock, KeyValueStore, SystemClock
from bamboo.rc.records import FailureEvent, SuspicionRecord
from bamboo.rc.timeouts import EVENT_POLL_S

__all__ = [
    "AgreementError",
    "ConsecutiveFailure",
    "DeclaredFailed",
    "FailureEvent",
    "FailureNoticed",
    "FailureNotices",
    "HandedOver",
    "LostContribution",
    "PeerFailure",
    "StoreFailureNotices",
]


class PeerFailure(RuntimeError):
    """A P2P send or receive, or a collective, failed: a peer's socket closed or it timed out.

    ``peers`` are the global ranks that may have failed: the peer of a send or receive, or every
    other member of the collective's group (a collective does not say which member failed; the
    authority's probes clear the live ones). ``peer`` is the one peer of a send or receive, or -1
    for a collective. ``peer_name`` says who they are (for example ``stage 2 pipeline 0``, or ``a
    member of dp-s1``) and ``instruction`` which instruction was running.
    """

    def __init__(
        self, peers: int | Iterable[int], peer_name: str, instruction: str, cause: BaseException | None = None
    ) -> None:
        self.peers: tuple[int, ...] = (peers,) if isinstance(peers, int) else tuple(sorted(peers))
        self.peer = self.peers[0] if len(self.peers) == 1 else -1
        self.peer_name = peer_name
        self.instruction = instruction
        self.cause = cause
        detail = f": {cause}" if cause is not None else ""
        who = (
            f"peer {peer_name} (rank {self.peer})" if len(self.peers) == 1
            else f"{peer_name} (one of ranks {list(self.peers)})"
        )
        super().__init__(f"{who} failed during {instruction}{detail}")


class FailureNotices(Protocol):
    """The runtime's window on failure detection (the launcher implements it over membership)."""

    def suspect(self, epoch: int, reporter: int, peer: int, instruction: str) -> None:
        """Report that `reporter` saw `peer` fail during `instruction` in epoch `epoch`."""

    def poll(self, epoch: int) -> FailureEvent | None:
        """The event that starts epoch `epoch`, if it was published (must not block)."""

    def wait(self, epoch: int, timeout: float) -> FailureEvent | None:
        """Block up to `timeout` seconds for the event that starts epoch `epoch`."""

    def claim(self, event: FailureEvent) -> FailureEvent:
        """Publish `event` (a node's own hand-over) as the event that starts `event.epoch` unless one was
        published first; returns the event that starts that epoch now (never blocks for long)."""


class FailureNoticed(Exception):
    """Raised inside the executor when a confirmed failure is noticed while waiting."""

    def __init__(self, event: FailureEvent) -> None:
        self.event = event
        super().__init__(f"failure confirmed for epoch {event.epoch}: ranks {list(event.victims)}")


class DeclaredFailed(RuntimeError):
    """A failure event names this node itself: the authority declared it failed while it was alive (slow, not
    dead: its lease ran out while it was starved of CPU, or its probes went unanswered for the grace period). The
    other survivors fail over without it, so it must not take part: it leaves, and comes back as a fresh node."""

    def __init__(self, rank: int, epoch: int) -> None:
        self.rank = rank
        self.epoch = epoch
        super().__init__(f"this node (rank {rank}) was declared failed in epoch {epoch}: the others fail over "
                         f"without it, so it leaves")


class HandedOver(Exception):
    """Raised by the executor of a node that handed its role to its shadow after a preemption
    notice: the process should now exit (cleanly) before its deadline."""


class AgreementError(RuntimeError):
    """The survivors of a pipeline cannot agree on a failover (for example, some ran a failover's
    remainder and some did not, or they published their progress for different steps)."""


class ConsecutiveFailure(RuntimeError):
    """A stage of a pipeline lost its node and its shadow: no failover is possible.

    The rule is bamboo-schedule's (:func:`bamboo.schedule.check_victims`, whose
    :class:`bamboo.schedule.ConsecutiveFailure` is this error's ``__cause__``). Every survivor is
    left at the consistent start-of-iteration state: partial gradients discarded, the optimizer
    not stepped. ``lost_stages`` are the stages of ``pipeline`` whose node died;
    ``surviving_copies[s]`` lists where copies of each lost stage survive, as
    ``("data-parallel", rank)`` for the same stage in another pipeline and ``("shadow", rank)``
    for a live shadow's replica.
    """

    def __init__(
        self, pipeline: int, lost_stages: Sequence[int], surviving_copies: dict[int, list[tuple[str, int]]]
    ) -> None:
        self.pipeline = pipeline
        self.lost_stages = tuple(sorted(lost_stages))
        self.surviving_copies = surviving_copies
        copies = "; ".join(
            f"stage {s}: " + (", ".join(f"{kind} rank {rank}" for kind, rank in surviving_copies.get(s, [])) or "none")
            for s in self.lost_stages
        )
        super().__init__(
            f"consecutive failure in pipeline {pipeline}: lost stages {list(self.lost_stages)} "
            f"(a node and its shadow); surviving copies: {copies}; every survivor is at the start of the iteration"
        )


class LostContribution(ConsecutiveFailure):
    """A redo of a lost stage's all-reduce that another pipeline can no longer join exactly.

    Pipeline ``pipeline``'s shadow must redo stage ``stage``'s data-parallel all-reduce of step ``step`` (its
    victim died before its shadow held the step's result), but pipeline ``other`` had already committed that
    step and has since lost the node that held the stage in it (a failover in step ``other_step``): that
    node's contribution to the all-reduce died with it, and the stage's new holder never had one. Without it
    the sum cannot be formed exactly, so, as after a consecutive failure, every survivor abandons its
    iteration and the job restores from the copies that survive (``surviving_copies``).
    """

    def __init__(
        self, pipeline: int, stage: int, step: int, other: int, other_step: int,
        surviving_copies: dict[int, list[tuple[str, int]]],
    ) -> None:
        self.pipeline = pipeline
        self.lost_stages = (stage,)
        self.surviving_copies = surviving_copies
        self.step = step
        self.other = other
        self.other_step = other_step
        copies = ", ".join(f"{kind} rank {rank}" for kind, rank in surviving_copies.get(stage, [])) or "none"
        RuntimeError.__init__(
            self,
            f"pipeline {pipeline} must redo stage {stage}'s all-reduce of step {step}, but pipeline {other} "
            f"committed that step and lost the stage's node in step {other_step}, and its contribution with it; "
            f"surviving copies of stage {stage}: {copies}; every survivor is at the start of its iteration",
        )


class StoreFailureNotices:
    """:class:`FailureNotices` over a key-value store (TCPStore, or the etcd-backed store).

    `job` scopes the keys. Polls use `store.check`, which does not block; `wait` polls every
    :data:`~bamboo.rc.timeouts.EVENT_POLL_S` on `clock` (default: the system clock).
    """

    def __init__(self, store: KeyValueStore, job: str, clock: Clock | None = None) -> None:
        self.store = store
        self.job = job
        self.clock = clock or SystemClock()

    def _event_key(self, epoch: int) -> str:
        return f"bamboo/{self.job}/epoch/{epoch}"

    def suspect(self, epoch: int, reporter: int, peer: int, instruction: str) -> None:
        record = SuspicionRecord(epoch, reporter, peer, instruction)
        self.store.set(f"bamboo/{self.job}/suspect/{epoch}/{reporter}/{peer}", record.to_json())

    def poll(self, epoch: int) -> FailureEvent | None:
        key = self._event_key(epoch)
        if not self.store.check([key]):
            return None
        return FailureEvent.from_json(self.store.get(key))

    def wait(self, epoch: int, timeout: float) -> FailureEvent | None:
        deadline = self.clock.monotonic() + timeout
        while True:
            event = self.poll(epoch)
            if event is not None or self.clock.monotonic() >= deadline:
                return event
            self.clock.sleep(EVENT_POLL_S)

    def publish(self, event: FailureEvent) -> None:
        """Publish a confirmed event (the authority's side; tests that play the authority)."""
        self.store.set(self._event_key(event.epoch), event.to_json())

    def claim(self, event: FailureEvent) -> FailureEvent:
        """First writer wins at `event.epoch` (a leaver's hand-over against the authority's failures)."""
        return FailureEvent.from_json(self.store.compare_set(self._event_key(event.epoch), "", event.to_json()))

    def publish_next(self, victims: Sequence[int], after: int = 0) -> FailureEvent:
        """Publish a confirmed failure of `victims` as the first epoch after `after` that no event holds yet
        (first writer wins: a leaver may have claimed an epoch for its hand-over); returns the event."""
        epoch = after + 1
        while True:
            event = FailureEvent(epoch, list(victims))
            if self.claim(event) == event:
                return event
            epoch += 1
