"""How a stage executor hands its role over at an iteration boundary after a preemption notice.

`ExecutorHandover` is a layer of :class:`~bamboo.rc.executor.StageExecutor`. At the start of an
iteration a node told of its preemption announces that it leaves after it, if the deadline leaves
time (HANDOVER_MARGIN median iterations); after the commit, it waits until every live node passed the
step and publishes its hand-over as the next epoch's event, and the others switch to the merged
schedule. A failure in the leaver's pipeline that comes first makes it withdraw and stay, as a
survivor.
"""

from __future__ import annotations

from bamboo.rc.executor_failover import ExecutorFailover
from bamboo.rc.failures import FailureEvent, HandedOver
from bamboo.rc.timeouts import FINISH_POLL_S
from bamboo.schedule import Instruction, Schedule

__all__ = ["HANDOVER_MARGIN", "ExecutorHandover"]

HANDOVER_MARGIN = 1.5
"""A node told it will be preempted hands over at the next boundary when the deadline leaves this
many median iterations; otherwise it keeps going and fails at the deadline."""


class ExecutorHandover(ExecutorFailover):
    """The executor's hand-overs at iteration boundaries: leaving, waiting for a leaver, withdrawing."""

    # Set by StageExecutor's constructor, or its views: what the methods below read.
    rank: int
    iteration_times: list[tuple[float, float]]
    leave_by: float
    handover_step: int | None
    preemption_deadline: float | None
    _resume: tuple[list[Instruction], int] | None
    epoch: int
    schedule: Schedule

    # ----------------------------------------------------------------------------- hand-over
    def _check_notice(self) -> None:
        """At the start of an iteration: act on a preemption notice for this node.

        If the deadline leaves time for this iteration (HANDOVER_MARGIN × the median iteration so
        far), the node announces that it hands over after it, and leaves at the boundary (no BRC,
        no lost work). Otherwise it keeps going and is treated as an ordinary failure at the
        deadline.
        """
        if self.leaving or self.preemption_deadline is not None:
            return
        deadline = self.coordinator.notice_deadline()
        if deadline is None:
            return
        durations = sorted(end - start for start, end in self.iteration_times)
        needed = HANDOVER_MARGIN * (durations[len(durations) // 2] if durations else float("inf"))
        fault_free = self.schedule.placement == tuple(range(self.layout.stages))
        if self.redundancy != "none" and fault_free and self.clock.time() + needed < deadline:
            self.leaving = True
            self.leave_by = deadline - needed
            self.handover_step = self.step
            self.coordinator.announce_handover(self.step)
        else:
            self.preemption_deadline = deadline

    def _after_boundary(self, step: int) -> None:
        """After the commit of `step`: leave if handing over; take over if a neighbour leaves.

        After a step that a node leaves after, every node tells the leaver that it passed the step, and the
        leaver leaves only once every live node has (:meth:`_leave_after`). The leavers are read again after
        every event: one that withdrew (a failure in its pipeline came first) is no longer waited for."""
        if self.leaving:
            if self._leave_after(step):
                raise HandedOver(f"rank {self.rank} handed its role over after step {step}")
            return  # withdrawn: a failure in this pipeline came first, and this node stays
        if not self.coordinator.watching or not self.coordinator.handover_anywhere(step):
            return
        self.coordinator.mark_passed(step)
        started, handed = self.clock.time(), False
        while leavers := self.coordinator.handover_leavers(step) - self.coordinator.dead:  # this pipeline's (P = 1: the ring's)
            event = self.coordinator.await_handover(step)
            if event.handover:
                self._apply_handover(event)
                handed = True
            else:
                self._fail_over_at_handover(event, step, leavers)
        if handed:
            self.handovers.append({"step": step, "epoch": self.epoch, "seconds": self.clock.time() - started})

    def _leave_after(self, step: int) -> bool:
        """A leaver, after the commit of its last step `step`: wait until every live node has committed it
        too, taking part meanwhile in every failover, as a node at the end of training does (:meth:`finish`).
        A node of another pipeline that dies before its shadow got its replica sync of `step` has that step's
        all-reduces redone with its shadow's recomputed gradients, and the redo needs this node's
        contribution: it leaves with it. It stops waiting at :attr:`leave_by`.

        Then it publishes its hand-over as the next epoch's event, first writer wins
        (:meth:`~bamboo.rc.coordinator.FailoverCoordinator.claim_handover`); an event published first is
        applied here, and it tries again. Returns True once its hand-over is published (it leaves), False
        when a failure in its own pipeline came first: it withdrew (:meth:`_withdraw_handover`) and stays,
        and the next step starts with its pipeline's failover remainder."""
        self.coordinator.mark_passed(step)
        while self.leaving:
            event = self.coordinator.pending_event()
            if event is None:
                if not self.coordinator.everyone_passed(step) and self.clock.time() < self.leave_by:
                    self.clock.sleep(FINISH_POLL_S)
                    continue
                event = self.coordinator.claim_handover()
                if event.handover and self.rank in event.victims:
                    return True
            stream = self._agree_between_steps(event)
            if not self.leaving and self.ring is None:
                self._resume = (stream, len(self.failovers) - 1)
        return False

    def _withdraw_handover(self) -> None:
        """A failure in this node's pipeline (P > 1) was published before its hand-over: it stays, as a
        survivor of that failover (its shadow may be the victim, or be about to host a victim's stage), and
        its notice becomes a deadline: if it is still there then, it is an ordinary failure. Called when the
        event is applied, before this node publishes its progress in the agreement, so every node that
        completes the agreement reads the hand-over as withdrawn."""
        assert self.handover_step is not None
        self.coordinator.cancel_handover(self.handover_step)
        self.leaving = False
        self.leave_by = float("inf")
        self.preemption_deadline = self.coordinator.notice_deadline()

    def _fail_over_at_handover(self, event: FailureEvent, step: int, leavers: set[int]) -> None:
        """A failure confirmed while this node waits at the boundary after step `step` for the hand-over
        of `leavers`, agreed on here as between two steps (the hand-over, when it comes during the
        agreement, is applied there):

        - a node of another pipeline died (that pipeline may have run ahead into the next step, or be
          finishing this one): this node joins the agreement, and any redo of an all-reduce;
        - a node of this pipeline died: a leaver itself (instead of leaving), or another node, published
          before the leaver's hand-over; a leaver still there withdraws its hand-over when it applies the
          event and takes part as a survivor. Either way this pipeline fails over at the start of the
          next step, which then runs the remainder;
        - with P = 1, every live node takes part, as always."""
        own = self._fails_own_pipeline(event)
        stream = self._agree_between_steps(event)
        if own:  # the next step starts with this pipeline's failover remainder
            self._resume = (stream, len(self.failovers) - 1)
    def _apply_handover(self, event: FailureEvent) -> None:
        self.coordinator.apply_handover(event)
        self._after_event(event)
