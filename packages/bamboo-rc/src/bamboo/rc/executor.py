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

The executor is one class built in layers, one module each: :mod:`bamboo.rc.executor_failover`
(applying an agreed failover, the groups of each new epoch), :mod:`bamboo.rc.executor_handover`
(hand-overs at iteration boundaries), and this module: the construction, the views, the iterations and
the end.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import torch
from bamboo.rc.comm import GroupTable
from bamboo.rc.config import TrainingConfig
from bamboo.rc.coordinator import FailoverCoordinator
from bamboo.rc.executor_handover import HANDOVER_MARGIN, ExecutorHandover
from bamboo.rc.failures import FailureNoticed, FailureNotices, PeerFailure
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
from bamboo.schedule import Costs, Instruction, RCMode, Schedule, one_f_one_b

__all__ = ["HANDOVER_MARGIN", "REDUNDANCY_MODES", "ExecutorHook", "Layout", "StageExecutor"]

REDUNDANCY_MODES = tuple(mode.value for mode in RCMode)


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


def _check_node(
    redundancy: str, layout: Layout, stage: int, pipeline: int, ring: bool, microbatch: MicrobatchSource | None
) -> None:
    """Raise ValueError for an unknown redundancy mode, a node outside the layout, or a node of the shadow
    ring (`ring`: one stage with redundancy) without its data source."""
    if redundancy not in REDUNDANCY_MODES:
        raise ValueError(f"redundancy must be one of {', '.join(REDUNDANCY_MODES)}, got {redundancy!r}")
    if not (0 <= stage < layout.stages and 0 <= pipeline < layout.pipelines):
        raise ValueError(f"stage {stage} pipeline {pipeline} is outside {layout}")
    if ring and microbatch is None:
        raise ValueError(
            f"redundancy {redundancy!r} with one stage (P = 1) needs microbatch=: the data as a function of "
            "(step, global microbatch index), so that a shadow can compute its neighbour's microbatches"
        )


class StageExecutor(ExecutorHandover):
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
        schedule_costs: Costs | None = None,
    ) -> None:
        ring = layout.stages == 1 and redundancy != "none"
        _check_node(redundancy, layout, stage, pipeline, ring, microbatch)
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
        self.schedule_costs = schedule_costs
        """The stages' costs the schedule's placement of redundant work is searched for (every node of the job must
        be given the same); None: the placement for unit costs, with no search."""
        bounds = planned_stage_bounds(specs, layout.stages) if stage_bounds is None else stage_bounds
        self.stage_bounds = check_stage_bounds(bounds, len(specs), layout.stages)
        self._build_node(ring, microbatch)
        self._start_boundary_state()

    def _fault_free_schedule(self, microbatches: int, ring: bool) -> Schedule:
        """A pipeline's fault-free schedule for ``microbatches``: with :attr:`schedule_costs`, the placement of the
        redundant work that `bamboo.schedule`'s search finds for them (`refine`: it reaches the schedule's
        ``overhead_bound_pct`` where the unit-cost placement does not); else the unit-cost placement."""
        if ring:
            return one_f_one_b(self.layout.stages, microbatches, rc="none")
        if self.schedule_costs is None:
            return one_f_one_b(self.layout.stages, microbatches, rc=self.redundancy)
        return one_f_one_b(self.layout.stages, microbatches, self.redundancy, self.schedule_costs.linearizer_cost(),
                           refine=True)

    def _build_node(self, ring: bool, microbatch: MicrobatchSource | None) -> None:
        """Build this node's parts: its slices (its stage and its replica), its coordinator, its groups, its
        interpreter and, with one stage and redundancy (`ring`), its node of the shadow ring."""
        layout, stage, pipeline, config = self.layout, self.stage, self.pipeline, self.config
        self.slices: dict[int, TrainableSlice] = {
            s: TrainableSlice(self.specs, indices, config, self.seed, self.device)
            for s, indices in stage_slices(self.stage_bounds, stage, self.redundancy).items()
        }
        shares = config.shares(layout.pipelines)
        if shares[pipeline] != config.micro_batches:
            raise ValueError(f"pipeline {pipeline}'s share of the global batch is {shares[pipeline]} microbatches "
                             f"(shares {list(shares)}), but its config runs {config.micro_batches}")
        built = {count: self._fault_free_schedule(count, ring) for count in sorted(set(shares))}
        fault_free = {d: built[count] for d, count in enumerate(shares)}  # each pipeline's, from its share
        self.coordinator = FailoverCoordinator(
            self.store, self.job, layout, pipeline, stage, fault_free, self.notices, self.timeouts, self.clock
        )
        self.groups = GroupTable(self.store, self.job, self.rank, self.timeouts, {r: layout.name(r) for r in range(layout.world)})  # type: ignore[arg-type]
        self._rebuild_groups()
        self.interpreter = StageInterpreter(
            self.slices, self.loss_fn, config, layout, stage, pipeline, self.groups, self.coordinator,
            keeps_contributions=self.redundancy != "none", device=self.device,
            ties=tied_weights(self.specs) if not ring else None, receives_ahead=RCMode(self.redundancy).receives_ahead,
        )
        self.ring: RingNode | None = None
        """P = 1 with redundancy: this node of the shadow ring (see :mod:`bamboo.rc.ring`)."""
        if ring:
            self.ring = RingNode(
                self.slices[0], self.loss_fn, config, layout, self.rank, self.groups, self.coordinator,
                self.interpreter, self.redundancy, microbatch, device=self.device,
            )

    def _start_boundary_state(self) -> None:
        """The state kept from one iteration boundary to the next, as it is before the first: no hand-over
        announced, no failover or iteration recorded, no remainder pending."""
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
                self.groups.build_eagerly(name)

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
                    self.interpreter.post_ahead(stream, index)
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

    def leave_together(self) -> None:
        """After a consecutive failure (every survivor leaves the iteration): wait until every live node has
        left too, within the build timeout, keeping this node's groups open meanwhile, as a node of
        ``bamboo-launch`` does while it goes to the barrier. A survivor still waiting in a collective with this
        node learns why from the store (:meth:`~bamboo.rc.coordinator_signals.CoordinatorSignals.any_left`),
        not from a connection this node's exit closed."""
        if not self.coordinator.watching:
            return
        self.coordinator.announce_finished()
        deadline = self.clock.monotonic() + self.timeouts.build
        while not self.coordinator.everyone_finished() and self.clock.monotonic() < deadline:
            self.clock.sleep(FINISH_POLL_S)

    def release(self) -> None:
        """Let this executor go (a layout that ended; its state was handed to the next one): its gloo groups
        are freed once the operations posted on them have finished (:func:`bamboo.rc.comm.keep_until_settled`),
        and its idle waiting threads end. The failure notices it was given are the caller's to close. Drop
        every reference to it after: its tensors are freed with it."""
        self.groups.release()
        self.interpreter.close()
