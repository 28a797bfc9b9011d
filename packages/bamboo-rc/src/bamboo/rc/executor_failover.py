"""How a stage executor applies a failover: the agreement, the groups of the new epoch, the remainder.

`ExecutorFailover` is a layer of :class:`~bamboo.rc.executor.StageExecutor`. When a transfer fails or
a failure event is noticed, :meth:`ExecutorFailover._fail_over` has the coordinator agree on it with
the other survivors and switches to the failover schedule for the rest of the iteration: the
interrupted transfer, the redone all-reduces of other pipelines' lost stages, a commit the other
survivors completed, the record of the failover. With P = 1 the ring agrees instead
(:meth:`ExecutorFailover._fail_over_ring`). After every event applied, the groups whose membership
changed are built again for the new epoch (:meth:`ExecutorFailover._after_event`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from bamboo.rc.agreement import Agreement
from bamboo.rc.comm import GroupTable
from bamboo.rc.coordinator import FailoverCoordinator
from bamboo.rc.failures import ConsecutiveFailure, DeclaredFailed, FailureEvent, FailureNoticed, PeerFailure
from bamboo.rc.interpreter import StageInterpreter
from bamboo.rc.layout import Layout
from bamboo.rc.ports import Clock
from bamboo.rc.records import FailoverRecord
from bamboo.rc.ring import RingNode
from bamboo.schedule import Instruction

__all__ = ["ExecutorFailover"]


class ExecutorFailover:
    """The executor's failovers (P > 1 and the P = 1 ring) and what every applied event changes."""

    # Set by StageExecutor's constructor, or its views: what the methods below read.
    layout: Layout
    rank: int
    node: int
    pipeline: int
    redundancy: str
    clock: Clock
    coordinator: FailoverCoordinator
    groups: GroupTable
    interpreter: StageInterpreter
    ring: RingNode | None
    leaving: bool
    failovers: list[FailoverRecord]
    step: int
    hosted: tuple[int, ...]
    kind_seconds: dict[str, float]

    if TYPE_CHECKING:

        def _withdraw_handover(self) -> None:
            """Defined by `ExecutorHandover`: a leaver whose pipeline lost a node stays."""

    def _fail_over_ring(self, ring: RingNode, failure: PeerFailure | FailureNoticed) -> float | None:
        """P = 1: agree on the failure with every live node, settle the laggards, take the victims'
        shares over (the caller's next stream computes them). Returns the mean loss of the step this
        node was lagging in and committed with the result another node sent (None otherwise).

        A further failure during the agreement or the hand-back of the result starts it again."""
        caught = self.clock.time()
        while True:
            event = failure.event if isinstance(failure, FailureNoticed) else self.coordinator.confirm(failure)
            self._leave_if_named(event)
            confirmed = self.clock.time()
            step = self.step
            try:
                agreement = self.coordinator.agree_ring(
                    event, ring.done, step, on_event=self._after_event, last_commit=self.interpreter.last_commit
                )
                ring.abandon_posted()
                loss = ring.settle_laggards(agreement)
            except (PeerFailure, FailureNoticed) as again:
                failure = again
                continue
            self.failovers.append(FailoverRecord(
                epoch=agreement.epoch, victims={v: (0,) for v in sorted(agreement.victims)}, step=step,
                cut=dict(agreement.progress), caught_at=caught, confirmed_at=confirmed, resumed_at=self.clock.time(),
                own_pipeline=True, kinds_before=self.kind_seconds,
            ))
            return loss
    def _leave_if_named(self, event: FailureEvent) -> None:
        """Raise :class:`DeclaredFailed` when the failure ``event`` names this node itself: it was declared failed
        while alive, and the other survivors' plan has no part for it (a hand-over names its leaver: not this)."""
        if self.rank in event.victims and not event.handover:
            raise DeclaredFailed(self.rank, event.epoch)

    def _agree_between_steps(self, event: FailureEvent) -> list[Instruction]:
        """Agree on `event` at a step boundary (this node's stream not begun): with P > 1 the failover
        agreement with done = 0, returning this pipeline's remainder for the next step (an empty stream when
        this pipeline lost nobody); with P = 1 the ring's agreement, where a laggard may need this node's
        result of the last step (returns an empty stream)."""
        if self.ring is not None:
            self._fail_over_ring(self.ring, FailureNoticed(event))
            return []
        return self._fail_over(FailureNoticed(event), [], 0)
    def _fails_own_pipeline(self, event: FailureEvent) -> bool:
        """Whether `event` is a failure (not a hand-over) of a node of this node's pipeline (P > 1)."""
        return self.ring is None and not event.handover and any(
            self.layout.position(v)[1] == self.pipeline for v in event.victims
        )
    def _after_event(self, event: FailureEvent) -> None:
        """The groups of the new epoch (a group whose membership `event` changed gets its epoch as
        its version), whose builds start now in the background; after a hand-over, the all-reduces
        posted on a group a leaver was in are posted again, each once its group is built (nothing here
        waits for a build: a member that dies before it joins one is noticed where the result is needed).

        Every member of a changed group applies the event, and starts that build then, before anything
        that can block. So a node that uses the group first waits only until its other members have
        noticed the event, never until they reach their own first use of it: two nodes that use two
        new groups in opposite orders (two pipelines' schedules place their all-reduces differently)
        would otherwise each sit in a build the other never joins.

        A leaver whose pipeline lost a node withdraws its hand-over here, before it publishes its progress.
        """
        if self.leaving and self._fails_own_pipeline(event):
            self._withdraw_handover()
        self._rebuild_groups()
        if self.ring is None:  # P = 1 builds its one group at its first use (RingNode._await_group): no cycle
            self.groups.start_builds(changed_in=self.coordinator.epoch)
        if event.handover:
            self.interpreter.repost_changed_allreduces()

    def _rebuild_groups(self) -> None:
        self.groups.set_members(self.coordinator.epoch, self.layout.group_members(self.coordinator.placements))
    # ----------------------------------------------------------------------------- failover
    def _fail_over(
        self, failure: PeerFailure | FailureNoticed, stream: list[Instruction], done: int
    ) -> list[Instruction]:
        """Switch to the failover schedule for the rest of this iteration; returns the new stream
        (the very same `stream` object when this node's pipeline lost nobody).

        The coordinator agrees with the other survivors on the cut and the plan
        (:meth:`FailoverCoordinator.agree`). Groups whose membership changed are rebuilt for the
        new epoch; P2P groups between survivors stay, with anything in flight. A node of another
        pipeline that already all-reduced a victim's stage this iteration joins the shadow's redo
        of that all-reduce with its stored contribution.
        """
        caught = self.clock.time()
        event = failure.event if isinstance(failure, FailureNoticed) else self.coordinator.confirm(failure)
        confirmed = self.clock.time()
        if self.redundancy == "none":
            raise failure
        self._leave_if_named(event)
        hosted = self.hosted
        try:
            agreement = self.coordinator.agree(
                event, done, self.step, on_event=self._after_event, last_commit=self.interpreter.last_commit,
                reduced=self.interpreter.completed_allreduces(),
            )
        except ConsecutiveFailure:
            # Noticed in the commit, with its sums posted: the pipeline-mates may complete it (it was another
            # pipeline's failure), so the node finishes it first if they do, and leaves at the next step with them.
            if not self.interpreter.finish_posted_commit(hosted):
                self.interpreter.abandon_iteration()
            self.coordinator.announce_left()  # the live members of a collective it never joins stop waiting
            raise
        interrupted = self._join_redos(agreement, hosted)  # the joins a failure interrupted first
        if not agreement.victims:  # hand-overs only: nothing was lost
            return stream if interrupted is None else self._fail_over(interrupted, stream, done)
        own = agreement.plans.get(self.pipeline)
        if own is not None and self.node in own.lagging:
            # The victim died during the commit's all-reduce, which the other survivors completed:
            # finish the commit with their result (the stages hosted in the step), then the
            # remainder starts the next step.
            assert own.commit is not None
            self.interpreter.finish_commit(hosted, own.commit)
            done = 0
        self.failovers.append(FailoverRecord(
            epoch=agreement.epoch, victims=agreement.victims, step=self.step, cut=None if own is None else own.cut,
            caught_at=caught, confirmed_at=confirmed, resumed_at=self.clock.time(), own_pipeline=own is not None,
            kinds_before=self.kind_seconds,
        ))
        if own is None:
            resumed = stream  # our pipeline lost nobody: resume where we were (same stream, same index)
        else:
            if own.cut[self.node] > done:
                self.interpreter.execute(stream[done])  # the interrupted transfer: its partner completed it
            self.interpreter.forget_transfers_with(agreement.victims[self.pipeline])
            self.interpreter.apply_replica_updates()
            resumed, done = list(own.plan.remainder.streams[self.node]), 0
        if interrupted is not None:  # noticed where this stream resumes, as if at its next instruction
            return self._fail_over(interrupted, resumed, done)
        return resumed

    def _join_redos(self, agreement: Agreement, hosted: Sequence[int]) -> PeerFailure | FailureNoticed | None:
        """Join the redone all-reduces of the other pipelines' plans (:meth:`StageInterpreter.join_redone_allreduces`),
        after those an earlier failure interrupted (:meth:`StageInterpreter.join_owed_allreduces`). A confirmed
        failure while a join waits for its group, or a failure of a member of a redo's group before this node could
        join it, ends the joins and is returned: the caller agrees on it with the others next, who judge whether
        that redo can still be exact (:class:`~bamboo.rc.failures.LostContribution` when the failed member's
        contribution died with it). The joins not done are owed, and resumed after that agreement where their
        group is unchanged."""
        plans = [(planned, agreement.victims[pipeline]) for pipeline, planned in agreement.plans.items()
                 if pipeline != self.pipeline]
        try:
            self.interpreter.join_owed_allreduces()
        except (PeerFailure, FailureNoticed) as failure:
            for planned, lost in plans:
                self.interpreter.owe_redone_allreduces(planned.plan, lost, planned.step, hosted)
            return failure
        for index, (planned, lost) in enumerate(plans):
            try:
                self.interpreter.join_redone_allreduces(planned.plan, lost, planned.step, hosted)
            except (PeerFailure, FailureNoticed) as failure:
                for later, later_lost in plans[index + 1:]:  # owed too: joined once this failure is agreed on
                    self.interpreter.owe_redone_allreduces(later.plan, later_lost, later.step, hosted)
                return failure
        return None
