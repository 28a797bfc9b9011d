"""What a node's failover coordinator knows: epochs, the dead, each pipeline's schedule, the plan of a cut.

`CoordinatorState` is the base of :class:`~bamboo.rc.coordinator.FailoverCoordinator` (whose docstring
gives the constructor's arguments): the membership epoch of the last event applied and every rank confirmed
failed or gone; the schedule each pipeline runs (``layouts``), its ``placements`` and the failover plans
being recovered (``recovering``); the store keys of the progress records; the events (noticing one,
confirming a suspicion); the ring of a P = 1 job; and the failover plan of a pipeline from its survivors'
progress, derived the same on every node. The agreement in progress (:mod:`bamboo.rc.pending`) reads and
updates it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bamboo.rc.agreement import PipelinePlan
from bamboo.rc.failures import FailureEvent, FailureNoticed, FailureNotices, PeerFailure
from bamboo.rc.layout import Layout
from bamboo.rc.ports import Clock, KeyValueStore, SystemClock
from bamboo.rc.timeouts import CommTimeouts
from bamboo.schedule import FailoverPlan, Kind, Schedule, merged_schedule
from bamboo.schedule.engine import counterpart
from bamboo.schedule.failover import failover_schedule

__all__ = ["CoordinatorState", "redone_allreduces", "taken_over"]


class CoordinatorState:
    """One node's view of the job's failures and the schedules its pipelines run (no torch, no tensor)."""

    def __init__(
        self,
        store: KeyValueStore,
        job: str,
        layout: Layout,
        pipeline: int,
        node: int,
        schedule: Schedule | Mapping[int, Schedule],
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
        self.layouts: dict[int, Schedule] = (
            {d: schedule[d] for d in range(layout.pipelines)} if isinstance(schedule, Mapping)
            else dict.fromkeys(range(layout.pipelines), schedule))
        """The schedule each pipeline runs in its next fault-free iteration (fault-free or merged). ``schedule``
        is every pipeline's, or one per pipeline where their shares of the global batch differ."""
        self.placements: dict[int, tuple[int, ...]] = {d: self.layouts[d].placement for d in range(layout.pipelines)}
        self.recovering: dict[int, tuple[FailoverPlan, int]] = {}
        """Pipeline -> (the failover plan whose remainder it runs or ran, the step of that plan)."""
        self._redone: dict[int, tuple[FailoverPlan, frozenset[int]]] = {}
        """id(plan) -> (the plan, the stages whose all-reduce it redoes): :meth:`redone_stages`."""

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

    def report_stragglers(self, ranks: Sequence[int], reported: set[int], waiting_for: str) -> None:
        """Report each of ``ranks`` that is not in ``reported`` (and adds it there) as a suspect: it did not show up
        :data:`~bamboo.rc.timeouts.STRAGGLER_S` into ``waiting_for``. Nothing is reported without notices."""
        if self.notices is None:
            return
        for rank in ranks:
            if rank != self.rank and rank not in reported:
                reported.add(rank)
                self.notices.suspect(self.epoch, self.rank, rank, waiting_for)

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

    def _apply_ring_deaths(self, ranks: Sequence[int]) -> set[int]:
        """P = 1: mark `ranks` dead (their pipelines leave the placements); returns the newly dead."""
        new_dead = set(ranks) - self.dead
        self.dead |= new_dead
        for rank in new_dead:
            self.placements.pop(self.layout.position(rank)[1], None)
        return new_dead

    # ------------------------------------------------------------------------------ the plan of a cut
    def progress_key(self, pipeline: int, lost: set[int] | frozenset[int], node: int) -> str:
        return self._key("progress", f"d{pipeline}", "v" + "-".join(map(str, sorted(lost))), f"n{node}")

    def reduced_key(self, lost: int, rank: int) -> str:
        """Where rank `rank` publishes its :class:`~bamboo.rc.records.ReducedRecord` when it learns that rank
        `lost` died."""
        return self._key("reduced", f"r{lost}", f"n{rank}")

    def redone_key(self, pipeline: int, stage: int, step: int) -> str:
        """Set once pipeline `pipeline`'s redo of stage `stage`'s all-reduce of step `step` has completed."""
        return self._key("redone", f"d{pipeline}", f"s{stage}", f"t{step}")

    def note_allreduce_completed(self, stage: int, step: int) -> None:
        """Stage `stage`'s all-reduce of step `step` completed here: if it redoes a lost stage's all-reduce (this
        pipeline's failover plan of that step, :func:`redone_allreduces`), say so in the store
        (:meth:`redone_key`), where a later agreement that loses a node which had to join it reads it."""
        known = self.recovering.get(self.pipeline)
        if known is not None and known[1] == step and stage in self.redone_stages(known[0]):
            self.store.set(self.redone_key(self.pipeline, stage, step), b"1")

    def redone_stages(self, plan: FailoverPlan) -> frozenset[int]:
        """:func:`redone_allreduces` of `plan`, remembered for the plans in :attr:`recovering` (an agreement asks
        at every poll, and a plan's streams are long)."""
        cached = self._redone.get(id(plan))
        if cached is None or cached[0] is not plan:
            live = {id(known) for known, _ in self.recovering.values()}
            self._redone = {key: value for key, value in self._redone.items() if key in live}
            cached = self._redone[id(plan)] = (plan, frozenset(redone_allreduces(plan)))
        return cached[1]

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

    # ------------------------------------------------------------------------------ events applied
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


def taken_over(plan: FailoverPlan) -> set[int]:
    """The stages a failover plan (and the earlier plans of its iteration) moved onto their shadows."""
    before, after = plan.schedule.placement, plan.remainder.placement
    moved = {stage for stage, node in enumerate(before) if after[stage] != node}
    return moved if plan.earlier is None else moved | taken_over(plan.earlier)


def redone_allreduces(plan: FailoverPlan) -> set[int]:
    """The stages taken over by `plan` whose all-reduce its remainder redoes (their victim had not finished)."""
    taken = taken_over(plan)
    return {
        instruction.stage
        for stream in plan.remainder.streams.values()
        for instruction in stream
        if instruction.kind is Kind.ALLREDUCE and instruction.stage in taken
    }
