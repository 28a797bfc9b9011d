"""The stage executor: one node of one pipeline, composed of an interpreter and a failover coordinator.

Node `n` of pipeline `d` owns stage `n` and, with redundancy, the replica of stage `(n+1) mod P`,
with exactly the layer ranges of the stage bounds it is given (by default
:func:`bamboo.rc.model.stage_bounds`, bamboo-reconfig's split). :class:`StageExecutor` runs its
iterations:

- :class:`~bamboo.rc.interpreter.StageInterpreter` executes the node's instruction stream with
  real tensors and ends each iteration with the commit;
- :class:`~bamboo.rc.coordinator.FailoverCoordinator` agrees with the other nodes, through the
  store, on what a confirmed failure changes (epochs, the cut, the failover plan, hand-overs);
- the executor applies the agreement: the interrupted transfer, the groups of the new epoch, the
  redone all-reduces, the failover's remainder; and it keeps the record of each failover
  (:class:`~bamboo.rc.records.FailoverRecord`).

With one stage (P = 1, pure data parallelism) and redundancy, the node is one of the shadow ring
(:class:`~bamboo.rc.ring.RingNode`): it runs its share of the global batch and, on a failure, the
shares the coordinator's :class:`~bamboo.rc.agreement.RingAgreement` gives it.

It has no fault-injection code: an optional :class:`ExecutorHook` is called at the start of each
iteration and around each instruction (``verify``, ``soak`` and the chaos tests give it a
:class:`~bamboo.rc.faults.FaultInjector`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from bamboo.rc.comm import GroupTable
from bamboo.rc.config import TrainingConfig
from bamboo.rc.coordinator import FailoverCoordinator
from bamboo.rc.failures import (
    ConsecutiveFailure,
    FailureEvent,
    FailureNoticed,
    FailureNotices,
    HandedOver,
    PeerFailure,
)
from bamboo.rc.interpreter import StageInterpreter
from bamboo.rc.layout import Layout
from bamboo.rc.model import check_stage_bounds, stage_slices
from bamboo.rc.model import stage_bounds as planned_stage_bounds
from bamboo.rc.ports import Clock, KeyValueStore, SystemClock
from bamboo.rc.records import FailoverRecord
from bamboo.rc.ring import MicrobatchSource, RingNode
from bamboo.rc.stash import FrcStash
from bamboo.rc.state import TrainableSlice
from bamboo.rc.ties import tied_weights
from bamboo.rc.timeouts import FINISH_POLL_S, CommTimeouts
from bamboo.schedule import Instruction, RCMode, Schedule, one_f_one_b

__all__ = ["HANDOVER_MARGIN", "REDUNDANCY_MODES", "ExecutorHook", "Layout", "StageExecutor"]

REDUNDANCY_MODES = tuple(mode.value for mode in RCMode)

HANDOVER_MARGIN = 1.5
"""A node told it will be preempted hands over at the next boundary when the deadline leaves this
many median iterations; otherwise it keeps going and fails at the deadline."""


class ExecutorHook(Protocol):
    """Called by :class:`StageExecutor` at the start of each iteration and around each instruction.

    ``length`` is the length of the stream being run and ``recovering`` says whether it is a
    failover's remainder. Production passes no hook; fault injection is one
    (:class:`bamboo.rc.faults.FaultInjector`).
    """

    def iteration_starting(self, executor: StageExecutor) -> None: ...

    def before_instruction(
        self, executor: StageExecutor, instruction: Instruction, index: int, length: int, recovering: bool
    ) -> None: ...

    def after_instruction(
        self, executor: StageExecutor, instruction: Instruction, index: int, length: int, recovering: bool
    ) -> None: ...


class StageExecutor:
    """Runs one node of one pipeline: its stages, its replica, its groups, its steps and failovers.

    ``stage_bounds`` are the layer ranges of every stage (default: :func:`bamboo.rc.model.stage_bounds`
    of ``specs``); the node builds exactly ``stage_bounds[stage]`` and, with redundancy, its
    successor's range, on ``device`` (default the CPU). Call :meth:`connect` before the first iteration
    (``initialize`` does).
    """

    def __init__(
        self,
        specs: Sequence[Any],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        config: TrainingConfig,
        layout: Layout,
        stage: int,
        pipeline: int,
        store: KeyValueStore,
        redundancy: str = "eflb",
        seed: int = 0,
        job: str = "job",
        timeouts: CommTimeouts | None = None,
        notices: FailureNotices | None = None,
        stage_bounds: Sequence[Sequence[int]] | None = None,
        hook: ExecutorHook | None = None,
        clock: Clock | None = None,
        microbatch: MicrobatchSource | None = None,
        device: torch.device | None = None,
    ) -> None:
        if redundancy not in REDUNDANCY_MODES:
            raise ValueError(f"redundancy must be one of {', '.join(REDUNDANCY_MODES)}, got {redundancy!r}")
        if not (0 <= stage < layout.stages and 0 <= pipeline < layout.pipelines):
            raise ValueError(f"stage {stage} pipeline {pipeline} is outside {layout}")
        ring = layout.stages == 1 and redundancy != "none"
        if ring and microbatch is None:
            raise ValueError(
                f"redundancy {redundancy!r} with one stage (P = 1) needs microbatch=: the data as a function of "
                "(step, global microbatch index), so that a shadow can compute its neighbour's microbatches"
            )
        self.specs = specs
        self.loss_fn = loss_fn
        self.config = config
        self.layout = layout
        self.stage = stage
        self.pipeline = pipeline
        self.node = stage
        self.rank = layout.rank(stage, pipeline)
        self.redundancy = redundancy
        self.seed = seed
        self.job = job
        self.store = store
        self.timeouts = timeouts or CommTimeouts()
        self.notices = notices
        self.hook = hook
        self.clock = clock or SystemClock()
        self.device = device or torch.device("cpu")
        """Where this node's layers, replica, optimizer state and activations live (:mod:`bamboo.rc.device`)."""
        bounds = planned_stage_bounds(specs, layout.stages) if stage_bounds is None else stage_bounds
        self.stage_bounds = check_stage_bounds(bounds, len(specs), layout.stages)
        self.slices: dict[int, TrainableSlice] = {
            s: TrainableSlice(specs, indices, config, seed, self.device)
            for s, indices in stage_slices(self.stage_bounds, stage, redundancy).items()
        }
        fault_free = one_f_one_b(layout.stages, config.micro_batches, rc="none" if ring else redundancy)
        self.coordinator = FailoverCoordinator(
            store, job, layout, pipeline, stage, fault_free, notices, self.timeouts, self.clock
        )
        self.groups = GroupTable(store, job, self.rank, self.timeouts, {r: layout.name(r) for r in range(layout.world)})  # type: ignore[arg-type]
        self._rebuild_groups()
        self.interpreter = StageInterpreter(
            self.slices, loss_fn, config, layout, stage, pipeline, self.groups, self.coordinator,
            keeps_contributions=redundancy != "none", device=self.device,
            ties=tied_weights(specs) if not ring else None,
        )
        self.ring: RingNode | None = None
        """P = 1 with redundancy: this node of the shadow ring (see :mod:`bamboo.rc.ring`)."""
        if ring:
            self.ring = RingNode(
                self.slices[0], loss_fn, config, layout, self.rank, self.groups, self.coordinator, self.interpreter,
                redundancy, microbatch, device=self.device,
            )
        self.leaving = False
        """True once this node announced that it hands its role over at the next boundary (until it
        withdraws: :meth:`_withdraw_handover`)."""
        self.handover_step: int | None = None
        """The step after which this node announced it would leave."""
        self.leave_by = float("inf")
        """When a leaver stops waiting for the others to pass its last step (wall clock): its notice's
        deadline less the time it kept for the step."""
        self.preemption_deadline: float | None = None
        """The deadline of a preemption notice this node could not hand over for (wall clock)."""
        self.handovers: list[dict[str, Any]] = []
        self.failovers: list[FailoverRecord] = []
        self.iteration_times: list[tuple[float, float]] = []
        self._resume: tuple[list[Instruction], int] | None = None
        """(the remainder of a failover of the next step, its record's index): set when a failure
        struck while this node waited in a commit that the other survivors had completed."""

    def connect(self) -> None:
        """Build the groups this node uses first, eagerly: neighbours at distance 1 and 2, collectives."""
        for name in sorted(self.groups.members):
            ranks = self.groups.members[name]
            if self.rank in ranks and len(ranks) > 1 and (not name.startswith("p2p") or self._near(ranks)):
                try:
                    self.groups.group(name)
                except RuntimeError as exc:
                    if self.ring is None:
                        raise
                    # P = 1: a member built its side and died at once (a kill at its first
                    # instruction); the ring's first use of the group reports it, and fails over
                    self.ring.unbuilt = (self.groups.versions[name], self.groups.collective_failure(
                        name, f"the first build of {name}", exc))

    def _near(self, ranks: Sequence[int]) -> bool:
        a, b = (self.layout.position(r)[0] for r in ranks)
        return (a - b) % self.layout.stages in (1, 2, self.layout.stages - 1, self.layout.stages - 2)

    # ----------------------------------------------------------------------------- views
    @property
    def schedule(self) -> Schedule:
        """The schedule this node's pipeline runs (fault-free, or merged after failovers)."""
        return self.coordinator.layouts[self.pipeline]

    @property
    def hosted(self) -> tuple[int, ...]:
        """The stages this node runs as their primary copy."""
        return self.schedule.stages_on(self.node)

    @property
    def replica_stage(self) -> int | None:
        """The stage whose live replica this node holds (None when it shadows nothing)."""
        replica = [s for s, shadow in enumerate(self.schedule.shadows) if shadow == self.node]
        return replica[0] if replica else None

    @property
    def dead(self) -> set[int]:
        """Global ranks confirmed failed or gone."""
        return self.coordinator.dead

    @property
    def epoch(self) -> int:
        return self.coordinator.epoch

    @property
    def layouts(self) -> dict[int, Schedule]:
        """The schedule each pipeline runs (its placement and shadows drive the groups)."""
        return self.coordinator.layouts

    @property
    def placements(self) -> dict[int, tuple[int, ...]]:
        return self.coordinator.placements

    @property
    def step(self) -> int:
        """Steps committed (the next iteration's step number)."""
        return self.interpreter.step

    @step.setter
    def step(self, value: int) -> None:
        self.interpreter.step = value

    @property
    def losses(self) -> list[float]:
        return self.interpreter.losses

    @property
    def stash(self) -> FrcStash:
        return self.interpreter.stash

    @property
    def sync_bytes(self) -> int:
        return self.interpreter.sync_bytes

    @property
    def kind_seconds(self) -> dict[str, float]:
        """Wall seconds spent per instruction kind (and ``replica_step``)."""
        return self.interpreter.kind_seconds

    def needs_data(self) -> bool:
        """Whether this node reads samples: it runs (or shadows) the first or the last stage."""
        last = self.layout.stages - 1
        return any(s in (0, last) for s in self.slices)

    def set_microbatches(self, microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This iteration's (tokens, labels) by microbatch index within the pipeline."""
        if self.ring is not None:
            self.ring.set_microbatches(microbatches)
        self.interpreter.set_microbatches(microbatches)

    def apply_replica_updates(self) -> None:
        """Apply the received replica updates now (before reading the replica's weights)."""
        self.interpreter.apply_replica_updates()

    # ----------------------------------------------------------------------------- iterations
    def run_iteration(self) -> float:
        """Run this iteration's stream, fail over as needed, commit. Returns the mean loss."""
        if self.hook is not None:
            self.hook.iteration_starting(self)
        self._check_notice()
        if self.ring is not None:
            return self._run_ring_iteration(self.ring)
        stream = list(self.schedule.streams[self.node])
        started = self.clock.time()
        index = 0
        recovering = False
        failover: int | None = None  # the record of the failover whose remainder this iteration runs
        if self._resume is not None:  # agreed on while this node finished the previous step's commit
            (stream, failover), recovering, self._resume = self._resume, True, None
        step = self.step
        while True:
            try:
                while index < len(stream):
                    self._run(stream[index], index, len(stream), recovering)
                    index += 1
                loss = self.interpreter.commit(self.hosted)
            except (PeerFailure, FailureNoticed) as failure:
                new_stream = self._fail_over(failure, stream, index)
                if self.step == step:
                    if new_stream is not stream:  # our pipeline failed over: run the remainder
                        stream, index, recovering = new_stream, 0, True
                        failover = len(self.failovers) - 1
                    continue
                # The failure struck during this step's commit, which the other survivors had
                # completed: the agreement finished it with their result, and the failover's
                # remainder belongs to the next step.
                self._resume = (new_stream, len(self.failovers) - 1)
                loss = self.losses[-1]
            self.iteration_times.append((started, self.clock.time()))
            self._after_boundary(self.step - 1)
            if failover is not None:
                self.failovers[failover] = self.failovers[failover].ended(self.clock.time(), self.kind_seconds)
            return loss

    def _run(self, instruction: Instruction, index: int, length: int, recovering: bool) -> float | None:
        if self.hook is not None:
            self.hook.before_instruction(self, instruction, index, length, recovering)
        result = self.ring.execute(instruction) if self.ring is not None else self.interpreter.execute(instruction)
        if self.hook is not None:
            self.hook.after_instruction(self, instruction, index, length, recovering)
        return result

    def _run_ring_iteration(self, ring: RingNode) -> float:
        """P = 1: this step's stream on the ring, failing over (each failure agreed with every live
        node) until the step commits. See :mod:`bamboo.rc.ring`."""
        started = self.clock.time()
        step = self.step
        recovering = False
        failover: int | None = None
        loss: float | None = None
        while loss is None:
            stream = ring.stream(recovering)
            try:
                for index, instruction in enumerate(stream):
                    loss = self._run(instruction, index, len(stream), recovering)
            except (PeerFailure, FailureNoticed) as failure:
                loss = self._fail_over_ring(ring, failure)
                failover = len(self.failovers) - 1
                recovering = self.step == step
        self.iteration_times.append((started, self.clock.time()))
        self._after_boundary(self.step - 1)
        if failover is not None:
            self.failovers[failover] = self.failovers[failover].ended(self.clock.time(), self.kind_seconds)
        return loss

    def _fail_over_ring(self, ring: RingNode, failure: PeerFailure | FailureNoticed) -> float | None:
        """P = 1: agree on the failure with every live node, settle the laggards, take the victims'
        shares over (the caller's next stream computes them). Returns the mean loss of the step this
        node was lagging in and committed with the result another node sent (None otherwise).

        A further failure during the agreement or the hand-back of the result starts it again."""
        caught = self.clock.time()
        while True:
            event = failure.event if isinstance(failure, FailureNoticed) else self.coordinator.confirm(failure)
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

    def finish(self) -> None:
        """Apply the last replica updates and leave together (call after the last iteration).

        With several pipelines, every live node waits (in the store, watching for failure events)
        until every live node has finished, so a node is still there if a failover in another
        pipeline needs it to redo an all-reduce.
        """
        self.apply_replica_updates()
        if self.layout.pipelines == 1 or not self.coordinator.watching:
            return
        self.coordinator.announce_finished()
        deadline = self.clock.monotonic() + self.timeouts.build
        while True:
            event = self.coordinator.pending_event()
            if event is not None:
                self._agree_between_steps(event)
                continue
            if self.coordinator.everyone_finished():
                return
            if self.clock.monotonic() > deadline:
                live = [r for r in range(self.layout.world) if r not in self.dead]
                raise RuntimeError(f"not every live rank of {live} finished within {self.timeouts.build} s")
            self.clock.sleep(FINISH_POLL_S)

    def _agree_between_steps(self, event: FailureEvent) -> list[Instruction]:
        """Agree on `event` at a step boundary (this node's stream not begun): with P > 1 the failover
        agreement with done = 0, returning this pipeline's remainder for the next step (an empty stream when
        this pipeline lost nobody); with P = 1 the ring's agreement, where a laggard may need this node's
        result of the last step (returns an empty stream)."""
        if self.ring is not None:
            self._fail_over_ring(self.ring, FailureNoticed(event))
            return []
        return self._fail_over(FailureNoticed(event), [], 0)

    def release(self) -> None:
        """Let this executor go (a layout that ended; its state was handed to the next one): its gloo groups
        are freed once the operations posted on them have finished (:func:`bamboo.rc.comm.keep_until_settled`),
        and its idle waiting threads end. The failure notices it was given are the caller's to close. Drop
        every reference to it after: its tensors are freed with it."""
        self.groups.release()
        self.interpreter.close()

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

    def _fails_own_pipeline(self, event: FailureEvent) -> bool:
        """Whether `event` is a failure (not a hand-over) of a node of this node's pipeline (P > 1)."""
        return self.ring is None and not event.handover and any(
            self.layout.position(v)[1] == self.pipeline for v in event.victims
        )

    def _apply_handover(self, event: FailureEvent) -> None:
        self.coordinator.apply_handover(event)
        self._after_event(event)

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
        hosted = self.hosted
        try:
            agreement = self.coordinator.agree(
                event, done, self.step, on_event=self._after_event, last_commit=self.interpreter.last_commit
            )
        except ConsecutiveFailure:
            self.interpreter.abandon_iteration()
            raise
        if not agreement.victims:
            return stream  # hand-overs only: nothing was lost
        for pipeline, planned in agreement.plans.items():
            if pipeline != self.pipeline:
                self.interpreter.join_redone_allreduces(planned.plan, agreement.victims[pipeline], planned.step, hosted)
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
            return stream  # our pipeline lost nobody: resume where we were (same stream, same index)
        if own.cut[self.node] > done:
            self.interpreter.execute(stream[done])  # the interrupted transfer: its partner completed it
        self.interpreter.forget_transfers_with(agreement.victims[self.pipeline])
        self.interpreter.apply_replica_updates()
        return list(own.plan.remainder.streams[self.node])
