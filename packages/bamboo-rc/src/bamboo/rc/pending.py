"""A failover agreement in progress on one node: absorbing events, publishing progress, deciding.

:class:`PendingFailover` (a pipeline-parallel job) and :class:`PendingRingFailover` (a P = 1 ring) absorb the
events of one failover, publish this node's progress, and, once every survivor published its own, derive from
the same facts the same :class:`~bamboo.rc.agreement.Agreement` or :class:`~bamboo.rc.agreement.RingAgreement`
on every node. They read and update the coordinator's state
(:class:`~bamboo.rc.coordinator_state.CoordinatorState`); :class:`~bamboo.rc.coordinator.FailoverCoordinator`
starts them and polls them to the end.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping

import attrs
from bamboo.rc.agreement import Agreement, PipelinePlan, RingAgreement
from bamboo.rc.coordinator_state import CoordinatorState, taken_over
from bamboo.rc.failures import AgreementError, ConsecutiveFailure, FailureEvent, LostContribution
from bamboo.rc.records import CommitResult, ProgressRecord, ReducedRecord
from bamboo.schedule import ConsecutiveFailure as LostEveryCopy
from bamboo.schedule import check_victims, placement_after

__all__ = ["PendingFailover", "PendingRingFailover"]


class PendingFailover:
    """One failover agreement in progress on one node (:meth:`FailoverCoordinator.begin`).

    :meth:`absorb` applies an event (more victims restart the agreement); :meth:`poll` returns the
    :class:`Agreement` once every survivor of every failed pipeline published its progress (and every
    witness of an earlier redo its :class:`ReducedRecord`, :meth:`_witnesses`), and None while one is
    missing (absorbing a later event if one arrived). `on_event` is called after each event is applied.
    `reduced` maps each stage this node holds to the steps whose all-reduce of it this node completed.
    """

    def __init__(
        self,
        coordinator: CoordinatorState,
        done: int,
        step: int,
        in_remainder: bool,
        on_event: Callable[[FailureEvent], None] | None,
        last_commit: CommitResult | None = None,
        reduced: Mapping[int, Collection[int]] | None = None,
    ) -> None:
        self.coordinator = coordinator
        self.done = done
        self.step = step
        self.in_remainder = in_remainder
        self.on_event = on_event
        self.last_commit = last_commit
        self.reduced = ReducedRecord(step, reduced or {})
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
            if self._may_witness(rank):
                c.store.set(c.reduced_key(rank, c.rank), self.reduced.to_json())
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

    def _may_witness(self, lost: int) -> bool:
        """Whether this node may be asked what its all-reduces had done when rank `lost` died: `lost` is of another
        pipeline and held a stage that this node holds or shadows. A superset of the witnesses any node waits for
        (:meth:`_witnesses`), whichever earlier agreements this node has decided when it learns of the loss."""
        c = self.coordinator
        node, pipeline = c.layout.position(lost)
        if pipeline == c.pipeline:
            return False
        mine: set[int] = set()
        for schedule in (self.layouts_before[c.pipeline], c.layouts[c.pipeline]):
            mine |= set(schedule.stages_on(c.node)) | {s for s, shadow in enumerate(schedule.shadows) if shadow == c.node}
        return bool(mine & set(self.layouts_before[pipeline].stages_on(node)))

    def _witnesses(self) -> list[tuple[int, int, int, int, int, int]]:
        """The redos of earlier agreements that a loss in this one may leave without a contribution:
        (pipeline d', stage v, step s', lost rank, pipeline d of the lost rank, witness rank) for each pipeline d'
        that runs the plan of an earlier failover redoing stage v's all-reduce of step s', and loses nobody
        here, while this agreement loses pipeline d's holder of v. That holder had to join the redo; if it died
        before it did, its contribution died with it. The witness is d''s holder of v (the node that redoes
        it), which publishes whether the redo had completed (:class:`ReducedRecord`) when it learned of the loss,
        unless it wrote that the redo completed before (:meth:`CoordinatorState.note_allreduce_completed`): the host
        waits for every all-reduce before its commit, so a host in its commit or past it has written it.
        """
        c = self.coordinator
        found = []
        for pipeline, lost in sorted(self.victims.items()):
            for node in sorted(lost):
                rank = c.layout.rank(node, pipeline)
                for stage in self.layouts_before[pipeline].stages_on(node):
                    for other, (plan, step) in sorted(c.recovering.items()):
                        if other in self.victims or stage not in c.redone_stages(plan):
                            continue
                        witness = c.layout.rank(c.layouts[other].placement[stage], other)
                        if witness not in c.dead:
                            found.append((other, stage, step, rank, pipeline, witness))
        return found

    def survivors(self, pipeline: int) -> list[int]:
        return [n for n in self.layouts_before[pipeline].nodes if n not in self.victims[pipeline]]

    def missing(self) -> tuple[int, list[int]]:
        """The first failed pipeline (by number) some of whose survivors did not publish their
        progress yet, and those survivors' global ranks; then a pipeline whose witness of an earlier redo did not
        publish its record (:meth:`_witnesses`), and the witness's rank; (-1, []) when none is missing."""
        c = self.coordinator
        for pipeline, lost in sorted(self.victims.items()):
            absent = [c.layout.rank(n, pipeline) for n in self.survivors(pipeline)
                      if not c.store.check([c.progress_key(pipeline, lost, n)])]
            if absent:
                return pipeline, absent
        for other, stage, step, lost, _, witness in self._witnesses():
            if not c.store.check([c.redone_key(other, stage, step)]) and not c.store.check([c.reduced_key(lost, witness)]):
                return other, [witness]
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
        self._check_redos_can_be_joined(plans)
        self._check_earlier_redos_were_joined(plans)
        for pipeline, planned in plans.items():
            c.recovering[pipeline] = (planned.plan, planned.step)
            c.layouts[pipeline] = planned.plan.steady
            c.placements[pipeline] = planned.plan.steady.placement
        return Agreement(c.epoch, {d: frozenset(v) for d, v in self.victims.items()}, plans)

    def _check_redos_can_be_joined(self, plans: dict[int, PipelinePlan]) -> None:
        """Raise :class:`LostContribution` when a plan redoes a lost stage's all-reduce of a step that another
        pipeline committed and then lost that stage's node in (its plan, this one's or an earlier one, is of a
        later step): the lost node's contribution to that step is gone, so no exact redo can be joined.

        Every node derives the same plans and the same earlier ones, so every node raises it, or none.
        Pipelines are at most one step apart (each step's all-reduces join them), so the other pipeline's
        holder of the stage in the redone step is the node its later failover lost."""
        c = self.coordinator
        latest = {**c.recovering, **{d: (planned.plan, planned.step) for d, planned in plans.items()}}
        for pipeline, planned in sorted(plans.items()):
            for stage in sorted(c.redone_stages(planned.plan)):
                for other, (plan, step) in sorted(latest.items()):
                    if other != pipeline and step > planned.step and stage in taken_over(plan):
                        raise LostContribution(pipeline, stage, planned.step, other, step, _copies_after(c, plans, stage))

    def _check_earlier_redos_were_joined(self, plans: dict[int, PipelinePlan]) -> None:
        """Raise :class:`LostContribution` when pipeline d' still redoes stage v's all-reduce of step s' (the plan of
        an earlier agreement) and this agreement loses, in step s' + 1, the node of pipeline d that held v: d
        committed step s' with that node's contribution, which had to join the redo, and the redo's witness
        (:meth:`_witnesses`) says it had not completed when the loss was learned of. Had it completed, nothing is
        lost. (In step s', d's own plan redoes the same all-reduce, and the two redos meet.)

        Every node reads the same witness records, so every node raises it, or none."""
        c = self.coordinator
        for other, stage, step, lost, pipeline, witness in self._witnesses():
            planned = plans.get(pipeline)
            if planned is None or planned.step != step + 1:
                continue
            if c.store.check([c.redone_key(other, stage, step)]):
                continue  # the redo's host wrote that it completed (before its commit): nothing was lost
            record = ReducedRecord.from_json(c.store.get(c.reduced_key(lost, witness)))
            if not record.has_completed(stage, step):
                raise LostContribution(other, stage, step, pipeline, planned.step, _copies_after(c, plans, stage))

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


def _copies_after(c: CoordinatorState, plans: dict[int, PipelinePlan], stage: int) -> dict[int, list[tuple[str, int]]]:
    """Where `stage` survives once `plans` are in force (what a :class:`LostContribution` reports)."""
    after = {**c.layouts, **{d: planned.plan.steady for d, planned in plans.items()}}
    return {stage: c.surviving_copies(stage, after)}


class PendingRingFailover:
    """One P = 1 agreement in progress on one node (:meth:`FailoverCoordinator.agree_ring`).

    :meth:`absorb` applies an event (deaths, or a hand-over: either way the node leaves the ring) and
    publishes this node's progress under the new epoch; :meth:`poll` returns the
    :class:`RingAgreement` once every live node published under the current epoch, and None while one
    is missing (absorbing a later event if one arrived).
    """

    def __init__(
        self,
        coordinator: CoordinatorState,
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
