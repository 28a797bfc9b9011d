"""Make before break: the next layout is decided and built while the current one keeps training.

A reconfiguration that is not forced at once (a failover to rebuild redundancy after, a warm node that can
fill a pipeline: :func:`bamboo.reconfig.decide` says *next step boundary*) no longer stops training to
decide, build and fill the next layout:

1. **Prepare.** The lowest live rank of generation g plans the next layout from the current one
   (:func:`plan_prepared`: the nodes alive now, the stages each holds, the warm standby nodes) and writes it
   as decision ``g<g>-prepare`` (``g<g>-a<k>-prepare`` for its k-th try), first writer wins, with the number
   of failure events g had seen (its ``epoch``).
2. **Build in the background.** Every node of it starts its part in a thread (:class:`Preparation`): a new
   owner builds its engine (its stages' layers, its gloo groups), a transfer source or receiver its transfer
   group; a warm joiner does it while it waits, a holder while it trains. Each publishes
   ``g<G>-built-<node>`` when done.
3. **Switch at one step boundary.** Once every node of it is built, the lowest live rank writes the stop
   (``g<g>-stop``, four steps ahead, naming the prepared attempt). At that step every holder stops, puts its
   local copies in place and runs the transfer plan over the group built beforehand (:func:`switch`): the
   state of the step it stopped at, in full. Training stops only for that, and for ``go``.

The prepared layout is one attempt of the barrier of g (:mod:`bamboo.launch.attempt`): it goes ahead only if
every node of it comes up. It is abandoned (outcome ``abort``) when a node it needs leaves, when generation g
sees another failure event before the switch (the plan assumed the holders of that time), or when a joiner's
part fails; the lowest live rank then prepares again (the next attempt index). A node that must meet the
others at the barrier instead (a consecutive failure, a stop without a prepared layout) first closes the
prepared attempts (:func:`close_prepared`): it marks the next free index closed, first writer wins, after
aborting every prepared attempt still open, so that every node goes to the barrier with the same attempt
index, and no layout is prepared after it.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import TYPE_CHECKING, Protocol

import attrs
from bamboo.launch import timeouts
from bamboo.launch.attempt import AbandonableStore, StartThread, outcome_name
from bamboo.launch.records import (
    AttemptOutcome,
    NodeBuilt,
    PreparedLayout,
    StopDecision,
    node_of_decision,
    read_record,
)
from bamboo.launch.session import NotEnoughNodes, WorkerSession, decision_prefix
from bamboo.launch.starting import StartMarks, build_engine, release_executor, transfer_group
from bamboo.membership.kv import StoreError

if TYPE_CHECKING:
    from bamboo.membership import MembershipStore
    from bamboo.rc import Engine, StageExecutor
    from bamboo.reconfig import JobLayout
    from torch.distributed.distributed_c10d import ProcessGroupGloo

__all__ = [
    "BREAK_BEFORE_MAKE_ENV",
    "PREPARE_PAUSE_ENV",
    "ExecutorFacts",
    "Preparation",
    "Prepared",
    "PreparedScan",
    "abandon_prepared",
    "built_name",
    "close_prepared",
    "finalize",
    "plan_prepared",
    "prepare_name",
    "scan_prepared",
    "switch_part",
]


class ExecutorFacts(Protocol):
    """What a boundary's decisions read of the executor: a :class:`bamboo.rc.StageExecutor`, or the
    :class:`bamboo.launch.stop.StepFacts` taken of it at a boundary."""

    @property
    def step(self) -> int: ...

    @property
    def dead(self) -> frozenset[int] | set[int]: ...

    @property
    def epoch(self) -> int: ...

    @property
    def rank(self) -> int: ...



PREPARE_PAUSE_ENV = "BAMBOO_LAUNCH_TEST_PREPARE_PAUSE_S"
"""Test hook: seconds every node of a prepared layout waits once its part is built, before it says so (the
others train on meanwhile)."""


BREAK_BEFORE_MAKE_ENV = "BAMBOO_LAUNCH_BREAK_BEFORE_MAKE"
"""Benchmark hook: when set to 1, no layout is prepared; every reconfiguration stops at the barrier and decides
and builds there, as before make before break (the baseline ``bench_churn.py`` measures in the same run)."""


def prepare_name(generation: int, attempt: int) -> str:
    """The decision that holds attempt ``attempt`` of the layout prepared during generation ``generation``."""
    return f"{decision_prefix(generation, attempt)}prepare"


def built_name(generation: int, node: str) -> str:
    """The decision a node of prepared layout ``generation`` writes once its part is built."""
    return f"g{generation}-built-{node}"


@attrs.frozen
class Prepared:
    """A prepared layout, as read back: its attempt index, the layout and the failure epoch it was planned at."""

    attempt: int
    layout: JobLayout
    epoch: int

    def needs(self) -> set[str]:
        """The nodes its start needs: every new owner and every transfer source."""
        return set(self.layout.ranks) | {t.source for t in self.layout.transfers.transfers}


@attrs.frozen
class PreparedScan:
    """The prepared attempts of a generation: the next free index, the one open (none aborted), the one that
    went ahead, and whether a node closed them (it went to the barrier)."""

    next_attempt: int
    open: Prepared | None = None
    went: Prepared | None = None
    closed: bool = False


def scan_prepared(membership: MembershipStore, generation: int, start: int = 0) -> PreparedScan:
    """Read the prepared attempts of ``generation`` from index ``start`` on (the ones before it are known
    abandoned)."""
    from bamboo.reconfig import JobLayout

    attempt = start
    while True:
        record = read_record(PreparedLayout, membership.get_decision(prepare_name(generation, attempt)))
        if record is None:
            return PreparedScan(attempt)
        if record.closed:
            return PreparedScan(attempt, closed=True)
        prepared = Prepared(attempt, JobLayout.from_dict(record.layout), record.epoch)
        outcome = read_record(AttemptOutcome, membership.get_decision(outcome_name(prepared.layout.generation)))
        if outcome is None:
            return PreparedScan(attempt, open=prepared)
        if outcome.go:
            return PreparedScan(attempt, went=prepared)
        attempt += 1


def abandon_prepared(membership: MembershipStore, prepared: Prepared, reason: str) -> bool:
    """Write the outcome ``abort`` of ``prepared`` (first writer wins); False when it had gone ahead."""
    decision = membership.decide(outcome_name(prepared.layout.generation),
                                 AttemptOutcome(False, reason, at=time.time()).to_dict())
    return not AttemptOutcome.from_dict(decision.value).go


def close_prepared(membership: MembershipStore, generation: int, reason: str) -> tuple[int, Prepared | None]:
    """Before meeting at the barrier of ``generation``: abort every prepared attempt still open and mark the next
    index closed. Returns ``(the barrier's attempt index, None)``, or ``(-1, the attempt)`` when a prepared
    attempt went ahead (its nodes train it: a node left out of it goes to standby)."""
    attempt = 0
    while True:
        decision = membership.decide(prepare_name(generation, attempt), PreparedLayout(closed=True).to_dict())
        record = PreparedLayout.from_dict(decision.value)
        if record.closed:
            return attempt, None
        scan = scan_prepared(membership, generation, attempt)
        prepared = scan.open or scan.went
        if prepared is not None and prepared.attempt == attempt and (
                scan.went is not None or not abandon_prepared(membership, prepared, reason)):
            return -1, prepared
        attempt += 1


def finalize(prepared: JobLayout, step: int, at: float | None) -> JobLayout:
    """The layout ``prepared`` (a ``JobLayout`` planned at an earlier step) as it starts: at ``step``, the switch
    decided at ``at`` (wall clock)."""
    from bamboo.launch.reconfigure import next_history

    history = next_history(prepared.history[:-1], step, prepared.pipelines)
    return attrs.evolve(prepared, start_step=step, barrier_step=step, barrier_unix=at, history=history)


def plan_prepared(run: WorkerSession, base: JobLayout, executor: ExecutorFacts, attempt: int,
                  reason: str) -> JobLayout:
    """The next layout after ``base`` (the generation ``executor`` trains), planned now: the live nodes of the
    layout hold what their executors hold, the warm standby nodes nothing. Raises :class:`NotEnoughNodes` when
    they cannot form a pipeline, ValueError when the layout cannot be reached from live copies alone."""
    from bamboo.launch.reconfigure import build_view, next_history, warm_standby
    from bamboo.launch.redundancy import choices_for, holds_replicas, layout_mode
    from bamboo.rc.model import stage_slices
    from bamboo.reconfig import JobLayout, StartMode, plan_layout, plan_transfers

    spec = run.spec
    records = run.membership.list_nodes(skip_malformed=True)
    live = {node: rank for node, rank in base.ranks.items() if rank not in executor.dead and node in records}
    standby = [node for node in warm_standby(run.membership, records) if node not in base.ranks]
    usable = sorted(set(live) | set(standby))
    zones = {**base.zones, **{n: record.zone for n, record in records.items()}}
    dead = [node for node in base.ranks if node not in live]
    plan = plan_layout(build_view(base, zones, usable, dead, run.layers, spec.pipelines))
    pipelines = len(plan.owners)
    if plan.stages != spec.stages or pipelines == 0:
        raise NotEnoughNodes(f"{len(usable)} nodes cannot form a pipeline of {spec.stages} stages")
    mode = layout_mode(spec, base)
    holds = {node: list(stage_slices(base.stage_bounds, rank % base.stages, mode)) for node, rank in live.items()}
    held = base.holdings_of_stages({node: holds.get(node, ()) for node in usable})
    choices = choices_for(spec, plan, run.membership.kv, reader=run.event_reader)
    transfers = plan_transfers(base.plan, plan, held, replicas=holds_replicas(spec, choices.redundancy))
    if transfers.restore_from_checkpoint:
        raise ValueError(f"stage(s) {list(transfers.stages_without_copy)} have no live copy")
    step = executor.step
    return JobLayout(generation=base.generation + 1 + attempt, plan=plan, start_step=step, mode=StartMode.PEERS,
                     reason=reason, transfers=transfers, barrier_step=step, barrier_unix=time.time(),
                     base_generation=base.generation, attempt=attempt, survivors=sorted(live),
                     history=next_history(base.history, step, pipelines),
                     zones={node: zones.get(node, "default") for node in (*plan.slots(), *plan.standby)},
                     redundancy=choices.redundancy, restore_every=choices.restore_every)


class Preparation:
    """This node's part of a prepared layout, built in a background thread: its engine (a new owner) and its
    transfer group (a source or receiver); ``g<G>-built-<node>`` is published when done."""

    def __init__(self, run: WorkerSession, prepared: Prepared) -> None:
        self.run = run
        self.prepared = prepared
        self.layout = prepared.layout
        self.store = AbandonableStore(run.store)
        self.marks = StartMarks(warm=run.warm_at)
        self.reporter: threading.Thread | None = None
        """The thread that reports the nodes not built (:meth:`report_stragglers`), once started."""
        self.thread = StartThread(self._build, name=f"bamboo-prepare-g{self.layout.generation}")

    def _build(self) -> tuple[Engine | None, ProcessGroupGloo | None]:
        run, layout = self.run, self.layout
        engine = build_engine(run, layout, self.store) if run.node in layout.ranks else None
        group = transfer_group(run, layout, self.store)
        pause_s = float(os.environ.get(PREPARE_PAUSE_ENV, "0") or 0)
        if pause_s > 0:  # test hook: a slow joiner
            time.sleep(pause_s)
        self.marks.built = time.time()
        run.membership.decide(built_name(layout.generation, run.node), NodeBuilt(run.node, self.marks.built).to_dict())
        return engine, group

    def report_stragglers(self) -> None:
        """Once this node's build has waited :data:`~bamboo.launch.timeouts.STRAGGLER_S` for the others (a node
        killed before it joined the groups' rendezvous leaves it waiting, while the current layout trains on),
        report the nodes of the layout not built yet to this node's agent, once, from a thread of its own (this is
        called at a step boundary): the agent's probe confirms a dead one, whose lease is revoked, and the
        evaluator abandons the attempt then instead of at its lease's expiry."""
        if self.reporter is not None or self.store.waited_s() < timeouts.STRAGGLER_S:
            return
        self.reporter = threading.Thread(target=self._report_not_built, name="bamboo-prepare-stragglers", daemon=True)
        self.reporter.start()

    def _report_not_built(self) -> None:
        run, generation = self.run, self.layout.generation
        prefix = built_name(generation, "")
        try:
            built = {node_of_decision(item.key, prefix)
                     for item in run.membership.kv.get_prefix(run.membership.keys.decision(prefix))}
        except StoreError as error:  # etcd restarting: the lease of a dead node still expires
            print(f"node {run.node}: could not read which nodes of generation {generation} are built: {error}",
                  file=sys.stderr, flush=True)
            return
        for node in sorted(self.prepared.needs() - built - {run.node}):
            run.report_suspect(node, f"not built in prepared generation {generation} after {timeouts.STRAGGLER_S:g} s")

    def built(self) -> tuple[Engine | None, ProcessGroupGloo | None]:
        """The engine and the transfer group, once built (raises the build's error)."""
        self.thread.join(self.run.timeouts.build)
        done, error = self.thread.progress()
        if error is not None:
            raise error
        if not done:
            raise RuntimeError(f"generation {self.layout.generation}: this node's part was not built within "
                               f"{self.run.timeouts.build:g} s")
        return self.thread.result  # type: ignore[return-value]

    def abandon(self) -> None:
        """The attempt was abandoned: stop the build and let what it built go."""
        self.store.abandon()
        self.thread.abandon(lambda built: release_executor(built[0].executor) if built[0] is not None else None)


def wait_switch(run: WorkerSession, prepared: Prepared, store: AbandonableStore) -> StopDecision:
    """For a joiner: the stop that switches to ``prepared`` (polls etcd; raises once the attempt is abandoned)."""
    base = prepared.layout.base_generation
    while True:
        if store.abandoned:
            raise RuntimeError(f"generation {prepared.layout.generation} was abandoned before its switch")
        try:
            stop = read_record(StopDecision, run.membership.get_decision(f"g{base}-stop"))
        except Exception:  # etcd restarting: ask again
            stop = None
        if stop is not None:
            if stop.attempt != prepared.attempt:
                raise RuntimeError(f"generation {base} stops at step {stop.step} without switching to attempt "
                                   f"{prepared.attempt}")
            return stop
        time.sleep(timeouts.DECISION_POLL_S)


def switch_part(run: WorkerSession, preparation: Preparation, old: StageExecutor | None,
                stop: StopDecision | None) -> tuple[Engine | None, JobLayout]:
    """This node's part of the switch to a prepared layout: its state in place, by its local copies and the
    transfer plan over the group built beforehand. ``old`` is the executor this node trained (None: a joiner,
    which first waits for the stop). Returns ``(engine or None, the layout as it starts)``."""
    from bamboo.launch.starting import move_state

    engine, group = preparation.built()
    if stop is None:
        stop = wait_switch(run, preparation.prepared, preparation.store)
    layout = finalize(preparation.layout, stop.step, stop.at)
    move_state(run, layout, old, engine.executor if engine is not None else None, group)
    preparation.marks.state = time.time()
    if engine is not None:
        engine.executor.step = layout.start_step
    return engine, layout
