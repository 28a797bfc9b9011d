"""What nodes tell each other through the store outside an agreement: notices, hand-overs, barriers.

A node told of its preemption leaves at an iteration boundary: it announces its hand-over
(``handover/d<p>/<step>/<rank>``, ``handover/any/<step>``), may withdraw it
(``handover_cancelled/<step>/<rank>``) when a failure in its pipeline comes first, waits until every
live rank committed the step (``passed/<step>/<rank>``), and publishes its hand-over as the next
epoch's event, first writer wins (:meth:`CoordinatorSignals.claim_handover`). The **group barrier**
(``ready/e<version>/<group>/<rank>``: a gloo group's first build in an epoch waits until every member is
about to build it, noticing failures meanwhile) and the **finish barrier** (``finished/<rank>``) are
here too, as is the mark of a node that **left** the layout after a consecutive failure (``left/<rank>``):
a collective it had not completed never will be.
"""

from __future__ import annotations

from collections.abc import Sequence

from bamboo.rc.coordinator_state import CoordinatorState
from bamboo.rc.failures import FailureEvent
from bamboo.rc.records import HandoverRecord
from bamboo.rc.timeouts import STORE_POLL_S, STRAGGLER_S

__all__ = ["CoordinatorSignals"]


class CoordinatorSignals(CoordinatorState):
    """The coordinator's notices, hand-overs and barriers: keys in the store, written and polled (but a
    preemption notice, told in-process)."""

    _notice_deadline: float | None = None
    """This node's preemption deadline, once told (:meth:`tell_notice`); not in the store."""

    # --------------------------------------------------------------------------------- hand-over
    def ring_handover_announced(self, step: int) -> bool:
        """P = 1: whether any live node announced that it leaves after step `step`."""
        return bool(self.handover_leavers(step))

    def tell_notice(self, deadline: float) -> None:
        """This node will be preempted at ``deadline`` (wall clock, seconds since the Unix epoch): told in-process by
        whoever learnt of it (the launcher's worker from its agent, a verify worker's fault injector). No store
        round trip: the node checks at the start of every iteration (:meth:`notice_deadline`)."""
        self._notice_deadline = deadline

    def notice_deadline(self) -> float | None:
        """The preemption deadline this node was told of (wall clock), if any."""
        return self._notice_deadline

    def announce_handover(self, step: int) -> None:
        """Tell the others that this node leaves after step `step`."""
        record = HandoverRecord(self.rank, self.pipeline, self.node, step).to_json()
        self.store.set(self._key("handover", f"d{self.pipeline}", step, self.rank), record)
        self.store.set(self._key("handover", "any", step), "1")

    def cancel_handover(self, step: int) -> None:
        """Withdraw this node's hand-over after step `step` (a failure in its pipeline came first: it stays).

        Written before this node publishes its progress in that failure's agreement, so every node that
        completes the agreement reads the hand-over as withdrawn."""
        self.store.set(self._key("handover_cancelled", step, self.rank), "1")

    def claim_handover(self) -> FailureEvent:
        """Publish this node's hand-over as the event of the epoch after the last one it applied, first
        writer wins; returns the event that now starts that epoch: this hand-over, or an event published
        first (which this node applies before it may try again)."""
        if self.notices is None:
            raise RuntimeError("a hand-over needs failure notices to publish its event")
        return self.notices.claim(FailureEvent(self.epoch + 1, [self.rank], handover=True))

    def handover_anywhere(self, step: int) -> bool:
        """Whether any node announced that it leaves after step `step` (one store check)."""
        return self.store.check([self._key("handover", "any", step)])

    def mark_passed(self, step: int) -> None:
        """Tell a leaver that this node committed step `step` (only after a step a node leaves after)."""
        self.store.set(self._key("passed", step, self.rank), "1")

    def everyone_passed(self, step: int) -> bool:
        """Whether every live rank committed step `step` (:meth:`mark_passed`)."""
        return self._every_live_rank_wrote("passed", step)

    def handover_announced(self, step: int) -> bool:
        """Whether a node of this pipeline announced that it leaves after step `step` (and did not withdraw)."""
        return bool(self.handover_leavers(step))

    def handover_leavers(self, step: int) -> set[int]:
        """The ranks that announced that they leave after step `step` and did not withdraw: of this
        pipeline, or (P = 1) of any live pipeline of the ring. Two store checks per rank looked at."""
        pipelines = list(self.placements) if self.ring else [self.pipeline]
        leavers = set()
        for d in pipelines:
            for node in range(self.layout.stages):
                rank = self.layout.rank(node, d)
                if self.store.check([self._key("handover", f"d{d}", step, rank)]) and not self.store.check(
                    [self._key("handover_cancelled", step, rank)]
                ):
                    leavers.add(rank)
        return leavers

    def await_handover(self, step: int) -> FailureEvent:
        """The event of the next epoch, once published, while waiting for the hand-over announced
        after step `step` (the leaver publishes it just before it leaves): the hand-over, or a failure
        confirmed before it. RuntimeError when nothing is published within the confirm timeout."""
        event = self.notices.wait(self.epoch + 1, self.timeouts.confirm) if self.notices is not None else None
        if event is None:
            raise RuntimeError(f"the hand-over announced after step {step} was never confirmed")
        return event

    # ---------------------------------------------------------------------------------- barriers
    def announce_group(self, group: str, version: int) -> None:
        """Tell the other members that this node is about to build `group` (first use in an epoch)."""
        self.store.set(self._key("ready", f"e{version}", group, self.rank), "1")

    def await_group(self, group: str, version: int, members: Sequence[int]) -> None:
        """Announce `group` and wait until every member is about to build it, raising
        :class:`FailureNoticed` on any confirmed failure meanwhile (a member that dies before it
        joins would otherwise leave the others in a gloo build that only times out). The members
        still absent :data:`~bamboo.rc.timeouts.STRAGGLER_S` into the wait are reported as suspects
        (:meth:`report_stragglers`). Gives up after the group timeout (the gloo build then times out
        on its own)."""
        self.announce_group(group, version)
        keys = {rank: self._key("ready", f"e{version}", group, rank) for rank in members}
        start = self.clock.monotonic()
        deadline, check_stragglers_at = start + self.timeouts.group, start + STRAGGLER_S
        while not self.store.check(list(keys.values())) and self.clock.monotonic() < deadline:
            self.raise_if_noticed()
            if self.clock.monotonic() >= check_stragglers_at:
                check_stragglers_at = float("inf")  # once: a member that arrived does not leave
                absent = [rank for rank, key in keys.items() if not self.store.check([key])]
                self.report_stragglers(absent, set(), f"the build of group {group}")
            self.clock.sleep(STORE_POLL_S)

    def announce_left(self) -> None:
        """Tell the others that this node left the layout's iteration for the barrier (a consecutive failure).

        A collective this node had not completed never will be: its other members, alive and waiting in it,
        give up at once (:meth:`any_left`) instead of after the group timeout."""
        self.store.set(self._key("left", self.rank), "1")

    def any_left(self, members: Sequence[int]) -> bool:
        """Whether a member of ``members`` other than this node left for the barrier (:meth:`announce_left`;
        one store check per member)."""
        return any(self.store.check([self._key("left", rank)]) for rank in members if rank != self.rank)

    def announce_finished(self) -> None:
        self.store.set(self._key("finished", self.rank), "1")

    def everyone_finished(self) -> bool:
        """Whether every live rank announced that it finished."""
        return self._every_live_rank_wrote("finished")

    def _every_live_rank_wrote(self, *parts: object) -> bool:
        """Whether the key `parts`/<rank> exists for every live rank (one store check)."""
        live = [r for r in range(self.layout.world) if r not in self.dead]
        return self.store.check([self._key(*parts, r) for r in live])
