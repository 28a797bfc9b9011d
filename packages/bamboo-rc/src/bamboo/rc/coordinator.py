"""The failover coordinator: what one node agrees with the others when a failure is confirmed.

:class:`FailoverCoordinator` is pure logic over an injected key-value store and clock
(:mod:`bamboo.rc.ports`) and the failure notices (:mod:`bamboo.rc.failures`); it holds no tensor
and imports no torch, so it is tested in-process with a dictionary for a store. It owns:

- **epochs and the dead**: the membership epoch of the last event applied, and every rank
  confirmed failed or gone;
- **what each pipeline runs** (``layouts``: the fault-free schedule, or a failover's steady
  schedule, whose ``placement``/``shadows`` say who runs and who shadows each stage), its
  ``placements``, and the failover plan whose remainder a pipeline runs (``recovering``);
- **the agreement** on a failure: :meth:`FailoverCoordinator.confirm` reports the suspects and
  waits for the authority's event; :meth:`FailoverCoordinator.agree` checks every failed
  pipeline's victims and moves their stages to the shadows with bamboo-schedule's own rules
  (:func:`~bamboo.schedule.check_victims`, :func:`~bamboo.schedule.placement_after`), publishes
  this node's progress (a :class:`~bamboo.rc.records.ProgressRecord` under
  ``bamboo/<job>/progress/d<p>/v<victims>/n<node>``: keyed by the victims, so nodes that learn of
  the deaths in different epochs read the same agreement), waits for every survivor's, and
  derives from the same facts the same consistent cut and ``failover_schedule`` on every node.
  The commit that ends a step is an all-reduce over the pipeline, and it is not atomic: a victim
  that dies during it can leave some survivors done with it (and into the next step) and others
  not. Each survivor publishes the result of its last commit with its progress, and those that
  had not completed it finish it with that result (:attr:`PipelinePlan.lagging`) before the
  failover's remainder, which then starts the next step for them. A
  further failure during the wait restarts the agreement with every victim so far; a victim
  without a live shadow is a :class:`~bamboo.rc.failures.ConsecutiveFailure`; survivors that
  disagree (some in a failover's remainder, some not) are an
  :class:`~bamboo.rc.failures.AgreementError`. A redo decided in an earlier agreement whose
  other-pipeline partner this one loses is judged by its host: its completion mark
  (``redone/d<p>/s<stage>/t<step>``) or the all-reduces it had completed when it learned of the loss
  (a :class:`~bamboo.rc.records.ReducedRecord` under ``reduced/r<lost>/n<rank>``); one not completed is a
  :class:`~bamboo.rc.failures.LostContribution` on every node;
- **hand-over events** (a node that left at an iteration boundary after a preemption notice:
  its pipeline switches to the merged schedule; the notice itself is told in-process,
  :meth:`~bamboo.rc.coordinator_signals.CoordinatorSignals.tell_notice`), the hand-over keys
  (``handover/d<p>/<step>/<rank>``, ``handover/any/<step>``,
  ``handover_cancelled/<step>/<rank>``, ``passed/<step>/<rank>``). The leaver publishes its own
  hand-over event, first writer wins, as the epoch after the last event it applied
  (:meth:`FailoverCoordinator.claim_handover`): a failure published first takes that epoch, and the
  leaver handles it before it can leave. So every node sees a leaver's departure and any failure in
  the same order;
- **the ring of a P = 1 job** (pure data parallelism): every node holds the whole model and its
  shadow is the next live pipeline (:meth:`~bamboo.rc.layout.Layout.ring_owners`). On a failure,
  :meth:`FailoverCoordinator.agree_ring` publishes this node's step (a
  :class:`~bamboo.rc.records.ProgressRecord` under ``bamboo/<job>/progress/ring/e<epoch>/n<rank>``),
  waits for every live node's, and derives the same :class:`RingAgreement` on every node: the step
  the survivors run, the laggards (nodes whose gradient all-reduce of the previous step failed while
  others completed it) and the node that sends them that step's reduced gradients;
- the **group barrier** (``ready/e<version>/<group>/<rank>``: a gloo group's first build in an
  epoch waits until every member is about to build it, noticing failures meanwhile) and the
  **finish barrier** (``finished/<rank>``).

The coordinator is built in layers, one module each: :mod:`bamboo.rc.coordinator_state` (epochs and the
dead, each pipeline's schedule, the plan of a cut, the ring), :mod:`bamboo.rc.coordinator_signals` (notices,
hand-overs, the group and finish barriers), :mod:`bamboo.rc.agreement` (what an agreement decides),
:mod:`bamboo.rc.pending` (an agreement in progress), and this module: :class:`FailoverCoordinator`, which
starts an agreement and polls it to the end.

The executor (:mod:`bamboo.rc.executor`) applies what the coordinator decides to its tensors and
groups.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from typing import Any

from bamboo.rc.agreement import Agreement, PipelinePlan, RingAgreement
from bamboo.rc.coordinator_signals import CoordinatorSignals
from bamboo.rc.failures import AgreementError, FailureEvent
from bamboo.rc.pending import PendingFailover, PendingRingFailover
from bamboo.rc.records import CommitResult
from bamboo.rc.timeouts import STORE_POLL_S, STRAGGLER_S

__all__ = [
    "Agreement",
    "FailoverCoordinator",
    "PendingFailover",
    "PendingRingFailover",
    "PipelinePlan",
    "RingAgreement",
]


class FailoverCoordinator(CoordinatorSignals):
    """One node's side of the failover agreement (see the module docstring).

    `schedule` is the fault-free schedule every pipeline starts with; `node` and `pipeline` say
    which node this is. `notices` is None when failures are fatal (then nothing is ever noticed). `timeouts` bounds
    the waits: ``confirm`` (a confirmation, the survivors' progress, a hand-over event), ``group``
    (the group barrier) and ``build`` (the finish barrier).
    """

    # --------------------------------------------------------------------------------- agreement
    def begin(
        self, event: FailureEvent, done: int, step: int, on_event: Callable[[FailureEvent], None] | None = None,
        last_commit: CommitResult | None = None, reduced: Mapping[int, Collection[int]] | None = None,
    ) -> PendingFailover:
        """Start agreeing on `event`: this node had completed `done` instructions of its current
        stream in step `step` (`done` is the stream's length while it waits in the commit),
        `last_commit` is the result of the last commit it completed (that of step `step - 1`), and
        `reduced` maps each stage it holds to the steps whose all-reduce of it it completed.
        :meth:`PendingFailover.poll` finishes it (:meth:`agree` does both).

        `on_event` is called after each event is applied (this one and any later one met on the
        way), before anything else happens: the caller rebuilds its groups there, so that a group
        whose membership an event changed gets that event's epoch as its version on every node,
        whichever events a node learns of together.
        """
        in_remainder = self.recovering.get(self.pipeline, (None, -1))[1] == step
        pending = PendingFailover(self, done, step, in_remainder, on_event, last_commit, reduced)
        pending.absorb(event)
        return pending

    def agree(
        self, event: FailureEvent, done: int, step: int, on_event: Callable[[FailureEvent], None] | None = None,
        last_commit: CommitResult | None = None, reduced: Mapping[int, Collection[int]] | None = None,
    ) -> Agreement:
        """Agree on `event` with the other survivors (blocking; see the module docstring and :meth:`begin`).

        Raises ConsecutiveFailure, or AgreementError when the survivors disagree or some did not
        publish their progress within the confirm timeout.
        """
        return self._settle(self.begin(event, done, step, on_event, last_commit, reduced))

    def _settle(self, pending: PendingFailover | PendingRingFailover) -> Any:
        """Poll `pending` until it agrees; the confirm timeout restarts with every later event. The survivors that
        have not published their progress :data:`~bamboo.rc.timeouts.STRAGGLER_S` into the wait for an event are
        reported as suspects, once each (:meth:`report_stragglers`): one that died meanwhile is confirmed at once,
        and the agreement restarts with it."""
        now = self.clock.monotonic()
        epoch, deadline, check_stragglers_at = self.epoch, now + self.timeouts.confirm, now + STRAGGLER_S
        reported: set[int] = set()
        while True:
            agreement = pending.poll()
            if agreement is not None:
                return agreement
            now = self.clock.monotonic()
            if self.epoch != epoch:  # a later failure restarted the agreement
                epoch, deadline, check_stragglers_at = self.epoch, now + self.timeouts.confirm, now + STRAGGLER_S
            elif now > deadline:
                pipeline, missing = pending.missing()
                where = "the ring" if pipeline < 0 else f"pipeline {pipeline}"
                raise AgreementError(
                    f"survivors {missing} (global ranks) of {where} did not publish their progress in epoch "
                    f"{self.epoch} within {self.timeouts.confirm} s"
                )
            elif now >= check_stragglers_at:
                check_stragglers_at = float("inf")  # once per event: the detector follows up on a suspect
                self.report_stragglers(pending.missing()[1], reported, "the failover agreement")
            self.clock.sleep(STORE_POLL_S)

    # ------------------------------------------------------------------------------ P = 1: the ring
    def agree_ring(
        self, event: FailureEvent, done: int, step: int, on_event: Callable[[FailureEvent], None] | None = None,
        last_commit: CommitResult | None = None,
    ) -> RingAgreement:
        """P = 1: agree on `event` with every live node (blocking).

        This node is in step `step` (it committed `step` steps) and completed `done` instructions of
        it; `last_commit` is the result of its last commit (that of step `step - 1`). Every live node
        publishes the same under the current epoch; a later event restarts the wait (everyone
        publishes again under the new epoch, so nodes that learn of deaths together or one by one
        read the same records). Raises AgreementError when the survivors are more than one step
        apart, disagree on the result of the step some of them completed, or did not publish within
        the confirm timeout.
        """
        return self._settle(self.begin_ring(event, done, step, on_event, last_commit))

    def begin_ring(
        self, event: FailureEvent, done: int, step: int, on_event: Callable[[FailureEvent], None] | None = None,
        last_commit: CommitResult | None = None,
    ) -> PendingRingFailover:
        """P = 1: start agreeing on `event` (:meth:`PendingRingFailover.poll` finishes it; :meth:`agree_ring`
        does both)."""
        if not self.ring:
            raise RuntimeError(f"the ring agreement is for P = 1, this job has P = {self.layout.stages}")
        pending = PendingRingFailover(self, done, step, on_event, last_commit)
        pending.absorb(event)
        return pending
