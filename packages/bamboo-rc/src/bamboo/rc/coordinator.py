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
  :class:`~bamboo.rc.failures.AgreementError`;
- **hand-over events** (a node that left at an iteration boundary after a preemption notice:
  its pipeline switches to the merged schedule), the notice and hand-over keys
  (``notice/<rank>``, ``handover/d<p>/<step>/<rank>``, ``handover/any/<step>``,
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

The executor (:mod:`bamboo.rc.executor`) applies what the coordinator decides to its tensors and
groups.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs
from bamboo.rc.failures import (
    AgreementError,
    ConsecutiveFailure,
    FailureEvent,
    FailureNoticed,
    FailureNotices,
    PeerFailure,
)
from bamboo.rc.layout import Layout
from bamboo.rc.ports import Clock, KeyValueStore, SystemClock
from bamboo.rc.records import CommitResult, HandoverRecord, NoticeRecord, ProgressRecord
from bamboo.rc.timeouts import STORE_POLL_S, CommTimeouts
from bamboo.schedule import ConsecutiveFailure as LostEveryCopy
from bamboo.schedule import FailoverPlan, Schedule, check_victims, merged_schedule, placement_after
from bamboo.schedule.engine import counterpart
from bamboo.schedule.failover import failover_schedule

__all__ = [
    "Agreement",
    "FailoverCoordinator",
    "PendingFailover",
    "PendingRingFailover",
    "PipelinePlan",
    "RingAgreement",
]


@attrs.frozen
class PipelinePlan:
    """The agreed failover of one pipeline: the plan, the cut it was derived from, and the step."""

    plan: FailoverPlan
    cut: dict[int, int]
    """Node -> instructions completed (the survivors' published progress, with transfers that one
    side completed counted as completed on the other side too)."""
    step: int
    """The step in which the pipeline failed."""
    lagging: frozenset[int] = frozenset()
    """Survivors that had not completed the commit of step ``step - 1`` when the failure struck,
    while the others had (the victim died during the commit's all-reduce). They finish it with
    ``commit`` and then run their remainder from its start (``cut`` is 0 for them)."""
    commit: CommitResult | None = None
    """The result of the commit of step ``step - 1`` (None unless some survivors are ``lagging``)."""


@attrs.frozen
class Agreement:
    """What every node derived from the same facts once a failure was agreed on."""

    epoch: int
    victims: dict[int, frozenset[int]]
    """Pipeline -> the nodes that failed in it (in this failover)."""
    plans: dict[int, PipelinePlan]
    """Pipeline -> its failover (every pipeline in ``victims``)."""


@attrs.frozen
class RingAgreement:
    """What every node of a P = 1 ring derived from the same facts once a failure was agreed on.

    The reduced gradients of a step are a function of the step's parameters and data alone (every
    share is reduced in its own slot and the slots are added in share order), so a node that completed
    a step's all-reduce holds exactly what a redo would give: the laggards take it from ``source``
    instead of anybody recomputing it.
    """

    epoch: int
    victims: frozenset[int]
    """Ranks that died (or left) in this failover."""
    step: int
    """The step every survivor runs once the laggards finished theirs: the latest step a survivor is in."""
    lagging: frozenset[int] = frozenset()
    """Survivors still in step ``step - 1``: its all-reduce failed on them while others completed it."""
    source: int | None = None
    """The survivor that sends the laggards the reduced gradients of step ``step - 1`` (None when none lags)."""
    commit: CommitResult | None = None
    """The result of step ``step - 1`` (squared norm, loss) as the survivors ahead published it (None when none lags)."""
    owners: dict[int, int] = attrs.field(factory=dict)
    """Share (pipeline) -> the live node that computes it from now on."""
    progress: dict[int, int] = attrs.field(factory=dict)
    """Live rank -> the instructions it had completed in its step (as published)."""


class FailoverCoordinator:
    """One node's side of the failover agreement (see the module docstring).

    `schedule` is the fault-free schedule every pipeline starts with; `node` and `pipeline` say
    which node this is. `notices` is None when failures are fatal (then nothing is ever noticed). `timeouts` bounds
    the waits: ``confirm`` (a confirmation, the survivors' progress, a hand-over event), ``group``
    (the group barrier) and ``build`` (the finish barrier).
    """

    def __init__(
        self,
        store: KeyValueStore,
        job: str,
        layout: Layout,
        pipeline: int,
        node: int,
        schedule: Schedule,
        notices: FailureNotices | None = None,
        timeouts: CommTimeouts | None = None,
        clock: Clock | None = None,
    ) -> None:
        self.store = store
        self.job = job
        self.layout = layout
        self.pipeline = pipeline
        self.node = node
        self.rank = layout.rank(node, pipeline)
        self.notices = notices
        self.timeouts = timeouts or CommTimeouts()
        self.clock = clock or SystemClock()
        self.epoch = 0
        self.dead: set[int] = set()
        self.layouts: dict[int, Schedule] = dict.fromkeys(range(layout.pipelines), schedule)
        """The schedule each pipeline runs in its next fault-free iteration (fault-free or merged)."""
        self.placements: dict[int, tuple[int, ...]] = {d: schedule.placement for d in range(layout.pipelines)}
        self.recovering: dict[int, tuple[FailoverPlan, int]] = {}
        """Pipeline -> (the failover plan whose remainder it runs or ran, the step of that plan)."""

    def _key(self, *parts: object) -> str:
        return "/".join(["bamboo", self.job, *map(str, parts)])

    # ------------------------------------------------------------------------------------ events
    @property
    def watching(self) -> bool:
        """Whether failures can be noticed (there are failure notices)."""
        return self.notices is not None

    def pending_event(self) -> FailureEvent | None:
        """The event of the next epoch, if it was published (never blocks)."""
        return self.notices.poll(self.epoch + 1) if self.notices is not None else None

    def raise_if_noticed(self) -> None:
        """Raise :class:`FailureNoticed` if the next epoch's event was published."""
        event = self.pending_event()
        if event is not None:
            raise FailureNoticed(event)

    def confirm(self, failure: PeerFailure) -> FailureEvent:
        """Report every suspect of `failure` and wait for the authority's event of the next epoch.

        Raises `failure` itself when there are no notices or nothing is confirmed within the
        confirm timeout: a slow or partitioned peer is not treated as dead.
        """
        if self.notices is None:
            raise failure
        for peer in failure.peers:
            self.notices.suspect(self.epoch, self.rank, peer, failure.instruction)
        event = self.notices.wait(self.epoch + 1, self.timeouts.confirm)
        if event is None:
            raise failure
        return event

    # --------------------------------------------------------------------------------- agreement
    def begin(
        self, event: FailureEvent, done: int, step: int, on_event: Callable[[FailureEvent], None] | None = None,
        last_commit: CommitResult | None = None,
    ) -> PendingFailover:
        """Start agreeing on `event`: this node had completed `done` instructions of its current
        stream in step `step` (`done` is the stream's length while it waits in the commit), and
        `last_commit` is the result of the last commit it completed (that of step `step - 1`).
        :meth:`PendingFailover.poll` finishes it (:meth:`agree` does both).

        `on_event` is called after each event is applied (this one and any later one met on the
        way), before anything else happens: the caller rebuilds its groups there, so that a group
        whose membership an event changed gets that event's epoch as its version on every node,
        whichever events a node learns of together.
        """
        in_remainder = self.recovering.get(self.pipeline, (None, -1))[1] == step
        pending = PendingFailover(self, done, step, in_remainder, on_event, last_commit)
        pending.absorb(event)
        return pending

    def agree(
        self, event: FailureEvent, done: int, step: int, on_event: Callable[[FailureEvent], None] | None = None,
        last_commit: CommitResult | None = None,
    ) -> Agreement:
        """Agree on `event` with the other survivors (blocking; see the module docstring and :meth:`begin`).

        Raises ConsecutiveFailure, or AgreementError when the survivors disagree or some did not
        publish their progress within the confirm timeout.
        """
        return self._settle(self.begin(event, done, step, on_event, last_commit))

    def _settle(self, pending: PendingFailover | PendingRingFailover) -> Any:
        """Poll `pending` until it agrees; the confirm timeout restarts with every later event."""
        epoch, deadline = self.epoch, self.clock.monotonic() + self.timeouts.confirm
        while True:
            agreement = pending.poll()
            if agreement is not None:
                return agreement
            if self.epoch != epoch:  # a later failure restarted the agreement
                epoch, deadline = self.epoch, self.clock.monotonic() + self.timeouts.confirm
            elif self.clock.monotonic() > deadline:
                pipeline, missing = pending.missing()
                where = "the ring" if pipeline < 0 else f"pipeline {pipeline}"
                raise AgreementError(
                    f"survivors {missing} of {where} did not publish their progress in epoch "
                    f"{self.epoch} within {self.timeouts.confirm} s"
                )
            self.clock.sleep(STORE_POLL_S)

    # ------------------------------------------------------------------------------ P = 1: the ring
    @property
    def ring(self) -> bool:
        """Whether this is a P = 1 job: the shadow of a node is the next live pipeline's node."""
        return self.layout.stages == 1

    @property
    def live(self) -> list[int]:
        """Global ranks not confirmed failed or gone."""
        return [r for r in range(self.layout.world) if r not in self.dead]

    def ring_owners(self) -> dict[int, int]:
        """P = 1: share -> the live node that computes it (:meth:`bamboo.rc.layout.Layout.ring_owners`)."""
        return self.layout.ring_owners(self.dead)

    def ring_progress_key(self, epoch: int, rank: int) -> str:
        return self._key("progress", "ring", f"e{epoch}", f"n{rank}")

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

    def _apply_ring_deaths(self, ranks: Sequence[int]) -> set[int]:
        """P = 1: mark `ranks` dead (their pipelines leave the placements); returns the newly dead."""
        new_dead = set(ranks) - self.dead
        self.dead |= new_dead
        for rank in new_dead:
            self.placements.pop(self.layout.position(rank)[1], None)
        return new_dead

    def ring_handover_announced(self, step: int) -> bool:
        """P = 1: whether any live node announced that it leaves after step `step`."""
        return bool(self.handover_leavers(step))

    def progress_key(self, pipeline: int, lost: set[int] | frozenset[int], node: int) -> str:
        return self._key("progress", f"d{pipeline}", "v" + "-".join(map(str, sorted(lost))), f"n{node}")

    def surviving_copies(self, stage: int, layouts: dict[int, Schedule] | None = None) -> list[tuple[str, int]]:
        """Where copies of `stage` survive, judged on `layouts` (default: the current ones): the
        same stage in other pipelines, and the live replica of its shadow (if the stage has one)."""
        copies: list[tuple[str, int]] = []
        for d, schedule in (layouts if layouts is not None else self.layouts).items():
            host = self.layout.rank(schedule.placement[stage], d)
            if d != self.pipeline and host not in self.dead:
                copies.append(("data-parallel", host))
            shadow_node = schedule.shadows[stage]
            if shadow_node is not None and self.layout.rank(shadow_node, d) not in self.dead:
                copies.append(("shadow", self.layout.rank(shadow_node, d)))
        return copies

    def plan(
        self, pipeline: int, victims: set[int] | frozenset[int], progress: dict[int, int], recovering: bool, step: int
    ) -> PipelinePlan:
        """The failover plan of a pipeline from its survivors' progress (the same on every node).

        `progress` indexes the pipeline's steady schedule (`layouts`), or, when `recovering`, the
        remainder of the failover plan it was running (a second failure in the same iteration).
        A transfer that one side completed is completed by the other side too, so the cut pairs up.
        """
        base: Schedule | FailoverPlan
        if recovering:
            base = self.recovering[pipeline][0]
            streams = base.remainder.streams
        else:
            base = self.layouts[pipeline]
            streams = base.streams
        cut = dict(progress)
        for n, i in progress.items():
            if i < len(streams[n]):
                instruction = streams[n][i]
                partner = instruction.peer
                if partner is not None and partner in progress and counterpart(instruction, n) in streams[partner][
                    : progress[partner]
                ]:
                    cut[n] = i + 1
        return PipelinePlan(failover_schedule(base, victims, cut), cut, step)

    # --------------------------------------------------------------------------------- hand-over
    def apply_handover(self, event: FailureEvent) -> None:
        """Apply a hand-over event (nodes that left at an iteration boundary): their pipelines switch
        to the merged schedule. Nothing was lost, so there is no plan."""
        if not event.handover:
            raise RuntimeError(f"a failure at an iteration boundary during a hand-over: {event}")
        self.epoch = event.epoch
        if self.ring:  # P = 1: the leaver's share goes to its ring successor
            self._apply_ring_deaths(event.victims)
            return
        new_dead = set(event.victims) - self.dead
        self.dead |= new_dead
        leavers: dict[int, set[int]] = {}
        for rank in new_dead:
            stage, pipeline = self.layout.position(rank)
            leavers.setdefault(pipeline, set()).add(stage)
        for pipeline, nodes in leavers.items():
            self.layouts[pipeline] = merged_schedule(self.layouts[pipeline], nodes)
            self.placements[pipeline] = self.layouts[pipeline].placement

    def notice_key(self) -> str:
        """Where this node's agent writes the :class:`~bamboo.rc.records.NoticeRecord` of a preemption."""
        return self._key("notice", self.rank)

    def notice_deadline(self) -> float | None:
        """The preemption deadline this node was told of (wall clock), if any."""
        key = self.notice_key()
        if not self.store.check([key]):
            return None
        return NoticeRecord.from_json(self.store.get(key)).deadline

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
        joins would otherwise leave the others in a gloo build that only times out). Gives up
        after the group timeout (the gloo build then times out on its own)."""
        self.announce_group(group, version)
        keys = [self._key("ready", f"e{version}", group, rank) for rank in members]
        deadline = self.clock.monotonic() + self.timeouts.group
        while not self.store.check(keys) and self.clock.monotonic() < deadline:
            self.raise_if_noticed()
            self.clock.sleep(STORE_POLL_S)

    def announce_finished(self) -> None:
        self.store.set(self._key("finished", self.rank), "1")

    def everyone_finished(self) -> bool:
        """Whether every live rank announced that it finished."""
        return self._every_live_rank_wrote("finished")

    def _every_live_rank_wrote(self, *parts: object) -> bool:
        """Whether the key `parts`/<rank> exists for every live rank (one store check)."""
        live = [r for r in range(self.layout.world) if r not in self.dead]
        return self.store.check([self._key(*parts, r) for r in live])


class PendingFailover:
    """One failover agreement in progress on one node (:meth:`FailoverCoordinator.begin`).

    :meth:`absorb` applies an event (more victims restart the agreement); :meth:`poll` returns the
    :class:`Agreement` once every survivor of every failed pipeline published its progress, and
    None while one is missing (absorbing a later event if one arrived). `on_event` is called after
    each event is applied.
    """

    def __init__(
        self,
        coordinator: FailoverCoordinator,
        done: int,
        step: int,
        in_remainder: bool,
        on_event: Callable[[FailureEvent], None] | None,
        last_commit: CommitResult | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.done = done
        self.step = step
        self.in_remainder = in_remainder
        self.on_event = on_event
        self.last_commit = last_commit
        self.victims: dict[int, set[int]] = {}
        # The copies of lost stages are judged on the placements before this failover: when the
        # victims' deaths are confirmed in separate events, a first victim's stage has already
        # moved onto its shadow before this node learns that a neighbour died too.
        self.layouts_before = dict(coordinator.layouts)

    def absorb(self, event: FailureEvent) -> None:
        """Apply `event`: its victims join this failover (every pipeline's stages move to the shadows
        and this node publishes its progress again), or, for a hand-over, the leavers' pipelines
        switch to the merged schedule."""
        c = self.coordinator
        if event.handover:
            c.apply_handover(event)
            # The leavers' pipelines run the merged schedule from here on: a later failure there (in this
            # agreement) is judged on it, and the leavers are no survivors to wait for.
            self.layouts_before.update({d: s for d, s in c.layouts.items() if d not in self.victims})
            if self.on_event is not None:
                self.on_event(event)
            return
        c.epoch = event.epoch
        new_dead = set(event.victims) - c.dead
        c.dead |= new_dead
        for rank in new_dead:
            stage, pipeline = c.layout.position(rank)
            self.victims.setdefault(pipeline, set()).add(stage)
        for pipeline, lost in self.victims.items():
            before = self.layouts_before[pipeline]
            try:
                check_victims(before, lost)  # every stage a victim ran needs a live shadow
            except LostEveryCopy as error:
                copies = {s: c.surviving_copies(s, self.layouts_before) for s in error.lost}
                raise ConsecutiveFailure(pipeline, error.lost, copies) from error
            c.placements[pipeline] = placement_after(before, lost)[0]
        if self.on_event is not None:
            self.on_event(event)
        mine = self.victims.get(c.pipeline)
        if mine:
            record = ProgressRecord(self.done, self.step, self.in_remainder, self.last_commit)
            c.store.set(c.progress_key(c.pipeline, mine, c.node), record.to_json())

    def survivors(self, pipeline: int) -> list[int]:
        return [n for n in self.layouts_before[pipeline].nodes if n not in self.victims[pipeline]]

    def missing(self) -> tuple[int, list[int]]:
        """The first failed pipeline (by number) some of whose survivors did not publish their
        progress yet, and those survivors; (-1, []) when none is missing."""
        c = self.coordinator
        for pipeline, lost in sorted(self.victims.items()):
            absent = [n for n in self.survivors(pipeline) if not c.store.check([c.progress_key(pipeline, lost, n)])]
            if absent:
                return pipeline, absent
        return -1, []

    def poll(self) -> Agreement | None:
        c = self.coordinator
        if self.victims and self.missing()[1] == []:
            return self._decide()
        later = c.pending_event()
        if later is not None:
            self.absorb(later)
            return None
        if not self.victims:  # hand-overs only: nothing to agree on
            return Agreement(c.epoch, {}, {})
        return None

    def _decide(self) -> Agreement:
        c = self.coordinator
        plans: dict[int, PipelinePlan] = {}
        for pipeline, lost in sorted(self.victims.items()):
            progress = {
                n: ProgressRecord.from_json(c.store.get(c.progress_key(pipeline, lost, n)))
                for n in self.survivors(pipeline)
            }
            progress, lagging, commit = self._settle_commit(pipeline, progress)
            recovering = self._agreed_recovering(pipeline, progress)
            done = {n: r.done for n, r in progress.items()}
            planned = c.plan(pipeline, lost, done, recovering, max(r.step for r in progress.values()))
            plans[pipeline] = attrs.evolve(planned, lagging=lagging, commit=commit)
        for pipeline, planned in plans.items():
            c.recovering[pipeline] = (planned.plan, planned.step)
            c.layouts[pipeline] = planned.plan.steady
            c.placements[pipeline] = planned.plan.steady.placement
        return Agreement(c.epoch, {d: frozenset(v) for d, v in self.victims.items()}, plans)

    def _settle_commit(
        self, pipeline: int, progress: dict[int, ProgressRecord]
    ) -> tuple[dict[int, ProgressRecord], frozenset[int], CommitResult | None]:
        """The survivors' progress with the commit of the previous step settled: (progress, the
        survivors that had not completed that commit, its result).

        The commit of a step is an all-reduce over the pipeline, and a victim that dies during it
        may have passed every contribution on to some survivors but not to others. Those that
        completed it stepped their optimizers and went on into the next step; the others' all-reduce
        failed (or they noticed the event first) while they waited in it, at the end of their
        stream. Every contribution was in, so the result is the one the survivors that completed it
        publish, and the step is committed: the laggards finish the commit with that result and
        count as at the start of the next step (progress 0, in no remainder). Mixing the two steps'
        progress in one cut would pair a full stream with a stream just begun.
        """
        steps = sorted({record.step for record in progress.values()})
        if len(steps) == 1:
            return progress, frozenset(), None
        shown = {n: (r.done, r.step) for n, r in sorted(progress.items())}
        step = steps[-1]
        if steps != [step - 1, step]:
            raise AgreementError(
                f"survivors of pipeline {pipeline} are in steps {steps} (node: (done, step)): {shown}"
            )
        lagging = frozenset(n for n, record in progress.items() if record.step == step - 1)
        for n in sorted(lagging):
            if progress[n].done != self._stream_length(pipeline, n, progress[n]):
                raise AgreementError(
                    f"survivors of pipeline {pipeline}: node {n} is in step {step - 1} short of its commit while "
                    f"others are in step {step} (node: (done, step)): {shown}"
                )
        results = {record.commit for n, record in progress.items() if n not in lagging}
        result = next(iter(results)) if len(results) == 1 else None
        if result is None or result.step != step - 1:
            published = {n: r.commit for n, r in sorted(progress.items()) if n not in lagging}
            raise AgreementError(
                f"survivors of pipeline {pipeline} in step {step} publish no single result of the commit of step "
                f"{step - 1} for nodes {sorted(lagging)} to finish it with: {published}"
            )
        settled = {n: ProgressRecord(0, step, False, result) if n in lagging else r for n, r in progress.items()}
        return settled, lagging, result

    def _stream_length(self, pipeline: int, node: int, record: ProgressRecord) -> int:
        """The length of the stream `record` counts in: the remainder of the plan of its step, or
        the schedule the pipeline ran before this failover."""
        if record.remainder:
            known = self.coordinator.recovering.get(pipeline)
            if known is None or known[1] != record.step:
                return -1  # no plan of that step is known here: it cannot be a finished remainder
            return len(known[0].remainder.streams.get(node, ()))
        return len(self.layouts_before[pipeline].streams.get(node, ()))

    def _agreed_recovering(self, pipeline: int, progress: dict[int, ProgressRecord]) -> bool:
        """Whether `pipeline`'s survivors were running a failover remainder (all of them, in the
        step of the plan this node computed for it), or its steady schedule (all of them)."""
        flags = {record.remainder for record in progress.values()}
        shown = {n: (r.done, r.step, r.remainder) for n, r in progress.items()}
        if len(flags) != 1:
            raise AgreementError(
                f"survivors of pipeline {pipeline} disagree on running a failover remainder "
                f"(node: (done, step, in a remainder)): {shown}"
            )
        if not flags.pop():
            return False
        known = self.coordinator.recovering.get(pipeline)
        steps = {record.step for record in progress.values()}
        if known is None or steps != {known[1]}:
            raise AgreementError(
                f"pipeline {pipeline} runs a failover remainder in steps {sorted(steps)}, but the last plan known "
                f"here is for step {None if known is None else known[1]}"
            )
        return True


class PendingRingFailover:
    """One P = 1 agreement in progress on one node (:meth:`FailoverCoordinator.agree_ring`).

    :meth:`absorb` applies an event (deaths, or a hand-over: either way the node leaves the ring) and
    publishes this node's progress under the new epoch; :meth:`poll` returns the
    :class:`RingAgreement` once every live node published under the current epoch, and None while one
    is missing (absorbing a later event if one arrived).
    """

    def __init__(
        self,
        coordinator: FailoverCoordinator,
        done: int,
        step: int,
        on_event: Callable[[FailureEvent], None] | None,
        last_commit: CommitResult | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.done = done
        self.step = step
        self.on_event = on_event
        self.last_commit = last_commit
        self.victims: set[int] = set()

    def absorb(self, event: FailureEvent) -> None:
        c = self.coordinator
        c.epoch = event.epoch
        self.victims |= c._apply_ring_deaths(event.victims)
        if c.rank in c.dead:
            raise RuntimeError(f"rank {c.rank} is confirmed dead in epoch {event.epoch}; it must leave the job")
        if not c.live:
            raise RuntimeError(f"every node is dead in epoch {event.epoch}")
        if self.on_event is not None:
            self.on_event(event)
        record = ProgressRecord(self.done, self.step, False, self.last_commit)
        c.store.set(c.ring_progress_key(c.epoch, c.rank), record.to_json())

    def missing(self) -> tuple[int, list[int]]:
        """(-1, the live nodes that did not publish under the current epoch yet)."""
        c = self.coordinator
        return -1, [r for r in c.live if not c.store.check([c.ring_progress_key(c.epoch, r)])]

    def poll(self) -> RingAgreement | None:
        c = self.coordinator
        if not self.missing()[1]:
            return self._decide()
        later = c.pending_event()
        if later is not None:
            self.absorb(later)
        return None

    def _decide(self) -> RingAgreement:
        c = self.coordinator
        progress = {r: ProgressRecord.from_json(c.store.get(c.ring_progress_key(c.epoch, r))) for r in c.live}
        shown = {r: record.step for r, record in sorted(progress.items())}
        steps = sorted(set(shown.values()))
        step = steps[-1]
        agreement = RingAgreement(
            c.epoch, frozenset(self.victims), step, owners=c.ring_owners(),
            progress={r: record.done for r, record in sorted(progress.items())},
        )
        if len(steps) == 1:
            return agreement
        if steps != [step - 1, step]:
            raise AgreementError(f"the survivors of the ring are in steps {steps} (rank: step): {shown}")
        ahead = sorted(r for r, s in shown.items() if s == step)
        results = {progress[r].commit for r in ahead}
        result = next(iter(results)) if len(results) == 1 else None
        if result is None or result.step != step - 1:
            published = {r: progress[r].commit for r in ahead}
            raise AgreementError(
                f"the survivors of the ring in step {step} publish no single result of step {step - 1}: {published}"
            )
        lagging = frozenset(r for r, s in shown.items() if s == step - 1)
        return attrs.evolve(agreement, lagging=lagging, source=ahead[0], commit=result)
