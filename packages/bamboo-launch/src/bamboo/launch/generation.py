"""Training one generation on this node: its steps, their records, checkpoints and hooks, until its end.

:func:`train_generation` runs the engine of one layout step by step. After each step it writes the records
this node owes (its failovers; the job's ``step`` record and checkpoints as the host of the last stage of
pipeline 0; the ``startup`` record after its first step; the ``reconfiguration`` record after the layout's
first step, as its lowest rank) and asks :class:`bamboo.launch.stop.Boundary` what comes next. It returns
how the generation ended for this node (:class:`Ending`): the job is done, the node handed its stage over
after a preemption notice, the nodes meet at the barrier (a consecutive failure, a plain stop), or they
switch to a layout prepared while this one trained. Under ``none`` a failure is a barrier too: the survivors
keep their state and their warm processes (:func:`_barrier_without_redundancy`).
"""

from __future__ import annotations

import collections
import functools
import sys
import time
from collections.abc import Callable, Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeVar

import attrs
from bamboo.launch.hooks import TrainingHooks, run_step_hooks
from bamboo.launch.prepare import abandon_prepared, scan_prepared
from bamboo.launch.records import StopDecision
from bamboo.launch.session import WorkerSession
from bamboo.launch.step_records import StepRecords, worker_records_prefix
from bamboo.launch.stop import Boundary
from bamboo.launch.worker_phases import Ending
from bamboo.launch.worker_records import StartupClock, reconfiguration_pause, write_reconfiguration

if TYPE_CHECKING:
    from bamboo.launch.copy_service import StageSnapshot
    from bamboo.rc import Engine, FailoverRecord, PeerFailure, StageExecutor
    from bamboo.rc.checkpoint_async import AsyncCheckpointer
    from bamboo.rc.checkpoint_files import CheckpointInfo
    from bamboo.reconfig import JobLayout

__all__ = ["Ending", "WorkerState", "checkpoint", "failover_records", "pipeline_batches", "reports_the_job",
           "train_generation"]

B = TypeVar("B")

USUAL_STEPS = 20
"""How many recent steps (not first steps of a layout) a node keeps to tell a usual step's time."""


@attrs.define
class WorkerState:
    """What a worker keeps across generations."""

    startup: StartupClock
    started: float = attrs.field(factory=time.perf_counter)
    losses: list[float] = attrs.field(factory=list)
    failovers: list[FailoverRecord] = attrs.field(factory=list)
    checkpointers: dict[int, AsyncCheckpointer] = attrs.field(factory=dict)
    told: set[int] = attrs.field(factory=set)
    """The executors this node's preemption notice was handed to."""
    usual: collections.deque[float] = attrs.field(factory=lambda: collections.deque(maxlen=USUAL_STEPS))
    started_up: bool = False
    """Whether this worker wrote its ``startup`` record."""
    steps: StepRecords = attrs.field(factory=StepRecords)
    """The job's step records as this node builds them (:mod:`bamboo.launch.step_records`)."""


def pipeline_batches(microbatch: Callable[[int, int], B], first: int, count: int, first_step: int) -> Iterator[B]:
    """DeepSpeed-style ``(inputs, labels)`` iterator of a pipeline whose share of the global batch is the ``count``
    microbatches from ``first`` (:meth:`bamboo.rc.config.TrainingConfig.share`): global microbatches ``first ..
    first+count-1`` of every step from ``first_step`` on."""
    step = first_step
    while True:
        for k in range(count):
            yield microbatch(step, first + k)
        step += 1


def train_generation(run: WorkerSession, layout: JobLayout, engine: Engine, state: WorkerState,
                     hooks: TrainingHooks | None, *, prepared: bool) -> Ending:
    """Train ``layout`` (a ``JobLayout`` this node has a rank in) with ``engine`` until it ends for this node
    (see the module docstring). ``prepared``: the layout was prepared while the previous one trained."""
    from bamboo.launch.redundancy import choice_record
    from bamboo.rc import ConsecutiveFailure, HandedOver, PeerFailure

    spec, executor = run.spec, engine.executor
    chosen = choice_record(layout, run.log.now())
    if chosen is not None and layout.ranks[run.node] == min(layout.ranks.values()):  # the mode it trains with, why
        run.log.write(chosen)
    boundary = Boundary(run, layout)
    config = executor.config
    data = pipeline_batches(run.program.microbatch, *config.share(executor.pipeline, layout.pipelines), executor.step)
    samples = config.micro_batch_size * config.global_count(layout.pipelines)
    first = True
    seen = len(executor.failovers)
    while executor.step < spec.steps:
        if boundary.stop is not None and executor.step >= boundary.stop.step:
            break
        started = time.perf_counter()
        run.tell_runtime_of_notice(executor, state.told)
        try:
            loss = float(engine.train_batch(data))
        except HandedOver:  # a preemption notice: this node's stage went to its shadow after the step
            boundary.abandon()
            return Ending("handed-over")
        except ConsecutiveFailure as failure:
            print(f"node {run.node}: {failure}", file=sys.stderr, flush=True)
            executor.apply_replica_updates()
            boundary.abandon()
            return Ending("barrier", reason="consecutive failure", consecutive=True)
        except PeerFailure as failure:  # no failover for it
            _report_suspects(run, layout, failure)
            if executor.notices is not None:  # a redundant mode whose failover was never confirmed: it ends here
                raise
            return _barrier_without_redundancy(executor, boundary)
        duration = time.perf_counter() - started
        seen = _after_step(run, layout, engine, state, hooks, loss, duration, seen, samples, boundary.stop)
        if first:
            _first_step_records(run, layout, engine, state, duration, prepared=prepared)
        else:
            state.usual.append(duration)
        first = False
        boundary.after_step(executor)
    stop = boundary.stop
    if executor.step >= spec.steps or (stop is not None and stop.finish):
        boundary.abandon()
        _abandon_open(run, layout)
        engine.finish()
        return Ending("done")
    assert stop is not None
    if stop.attempt is not None:
        boundary.settle()
        return Ending("switch", reason=stop.reason, stop=stop, preparation=boundary.preparation)
    boundary.abandon()
    return Ending("barrier", reason=stop.reason)


NO_REDUNDANCY_REASON = "failure without redundancy"
"""The reason of a barrier after a failure under ``none`` (no shadow to fail over to)."""


def _barrier_without_redundancy(executor: StageExecutor, boundary: Boundary) -> Ending:
    """Under ``none`` no shadow fails over: the survivors meet at the barrier with the state of the step they were
    training (no stage applied its optimizer step: that follows the last message of the iteration), and the next
    layout starts from what they hold, with a data-parallel peer's copy of a lost stage or, when no survivor
    holds one, the nearest restore point. The worker stays warm: a worker that ended would be registered afresh,
    and the restart would wait for its replacement's imports.

    Its groups are given up at once, as a process that ends closes its connections, so that every peer still
    waiting on this node fails now and comes to the barrier too, instead of waiting out the group timeout."""
    executor.groups.release()
    boundary.abandon()
    return Ending("barrier", reason=NO_REDUNDANCY_REASON)


def _report_suspects(run: WorkerSession, layout: JobLayout, failure: PeerFailure) -> None:
    """Tell this node's agent which nodes ``failure`` suspects before the worker ends with it. A redundancy mode
    that fails over has told it already (its failure notices), ``none`` has not: without the report the job learnt
    of a killed node only when its lease expired, which held up the restore by up to ``--ttl`` seconds when that
    node was the elected coordinator (the detector that confirms a node revokes its lease at once)."""
    for peer in failure.peers:
        node = layout.node_of_rank.get(peer)
        if node is not None:
            run.report_suspect(node, f"rank {layout.ranks[run.node]}: {failure.instruction} failed")


def _after_step(run: WorkerSession, layout: JobLayout, engine: Engine, state: WorkerState,
                hooks: TrainingHooks | None, loss: float, duration: float, seen: int, samples: int,
                stop: StopDecision | None) -> int:
    """The records, checkpoint and hooks of a step that completed; returns the failovers seen so far."""
    import torch
    from bamboo.launch.events import Failover, Step

    spec, log, executor = run.spec, run.log, engine.executor
    state.losses.append(loss)
    node_of_rank = layout.node_of_rank
    for victim_rank, victim, failover in failover_records(executor, seen):
        log.write(Failover(t=log.now(), victim=node_of_rank.get(victim_rank, str(victim_rank)),
                           shadow=run.node, stage=victim, pause_s=failover.pause_s,
                           caught_unix=failover.caught_at, resumed_unix=failover.resumed_at,
                           step_end_unix=failover.iteration_end))
    state.failovers.extend(executor.failovers[seen:])
    last = executor.step >= spec.steps or (stop is not None and stop.finish and executor.step >= stop.step)
    # No in-memory copy of the job's last step: nothing restores from it, and its keepers leave with the job.
    copy_every = spec.memory_copy_interval(layout.restore_every)
    due = run.copies is not None and not last and bool(copy_every) and executor.step % copy_every == 0
    checkpoint_every = spec.checkpoint_interval(layout.restore_every)
    checkpoints = spec.checkpoint_dir is not None and reports_the_job(executor)
    if executor.pipeline == 0 or executor.layout.stages == 1:  # the nodes that write the job's steps, or may take it over
        record = Step(t=log.now(), step=executor.step, samples=samples, loss=loss,
                      nodes_active=spec.stages * layout.pipelines - len(executor.dead),
                      duration_s=duration, generation=layout.generation,
                      restore_point=due or (checkpoints and not last and executor.step % checkpoint_every == 0))
        state.steps.after_step(record, writes=reports_the_job(executor) and spec.stages - 1 in executor.hosted,
                               events=log, kv=run.membership.kv,
                               departed=lambda: [worker_records_prefix(spec.job, node_of_rank[rank])
                                                 for rank in sorted(executor.dead) if rank in node_of_rank])
    clones: dict[int, StageSnapshot] = {}  # stage -> its state cloned at this step, for whoever needs it next
    copies = run.copies if due else None
    if copies is not None:  # before any clone: the checkpoint's clones are then those the copies would take
        executor.apply_replica_updates()
    saves: list[Callable[[], None]] = []
    if checkpoints:
        saves = checkpoint(run, layout, executor, state.checkpointers, torch, final=last, clones=clones,
                           every=checkpoint_every)
    if copies is not None:
        copies.take(executor, layout, sends=reports_the_job(executor), clones=clones)
    for save in saves:  # the writers wake once every clone of the boundary is taken: no GIL taken from them
        save()
    if hooks is not None:
        run_step_hooks(engine, hooks)
    return len(executor.failovers)


def _first_step_records(run: WorkerSession, layout: JobLayout, engine: Engine, state: WorkerState,
                        duration: float, *, prepared: bool) -> None:
    """After a layout's first step on this node: its ``startup`` record (once per worker) and, as the layout's
    lowest rank, the ``reconfiguration`` record that started it."""
    log = run.log
    if not state.started_up:
        state.started_up = True
        clock = state.startup
        clock.model_build_s = engine.build_seconds.get("model")
        clock.group_build_s = engine.build_seconds.get("groups")
        log.write(clock.record(log, run.node, duration))
    ranks = layout.ranks
    if layout.generation == 0 or ranks[run.node] != min(ranks.values()):
        return
    pause = reconfiguration_pause(run.membership, layout, duration, list(state.usual))
    source = None
    if layout.restore is not None:
        source = layout.restore.source
    write_reconfiguration(log, layout, pause, stages=run.spec.stages, prepared=prepared, restore_source=source)
    print(f"node {run.node}: generation {layout.generation} ({layout.reason}) paused training {pause.line()}",
          flush=True)


def _abandon_open(run: WorkerSession, layout: JobLayout) -> None:
    """The job ended: a layout still being prepared will never start (its joiners stop waiting for it)."""
    try:
        scan = scan_prepared(run.membership, layout.generation)
        if scan.open is not None:
            abandon_prepared(run.membership, scan.open, "the job ended")
    except Exception as error:  # etcd gone: the joiners end with the job's end record
        print(f"node {run.node}: could not abandon the layout being prepared: {error}", file=sys.stderr)


def failover_records(executor: StageExecutor, seen: int) -> list[tuple[int, int, FailoverRecord]]:
    """``(victim rank, victim stage, failover record)`` of the failovers in which this node took a victim's
    stage (P = 1: a victim's share of the batch, as the ring's owner of it), since ``seen``."""
    records = []
    layout = executor.layout
    for failover in executor.failovers[seen:]:
        if layout.stages == 1:
            records += [(victim, 0, failover) for victim in failover.victims
                        if layout.ring_owner(victim, executor.dead) == executor.rank]
            continue
        for victim in failover.victims.get(executor.pipeline, ()):
            if (victim - 1) % layout.stages == executor.stage:
                records.append((layout.rank(victim, executor.pipeline), victim, failover))
    return records


def reports_the_job(executor: StageExecutor) -> bool:
    """Whether this node writes the job's steps and checkpoints: pipeline 0's (P = 1: the first live node,
    every node holding the whole model)."""
    if executor.layout.stages == 1:
        return executor.rank == min(r for r in range(executor.layout.world) if r not in executor.dead)
    return bool(executor.pipeline == 0)


def checkpoint(run: WorkerSession, layout: JobLayout, executor: StageExecutor,
               checkpointers: dict[int, AsyncCheckpointer], torch: ModuleType, *,
               final: bool = False, clones: dict[int, StageSnapshot] | None = None,
               every: int | None = None) -> list[Callable[[], None]]:
    """Pipeline 0 writes one shard per stage it hosts (a shadow that took over a stage writes it too), every
    ``every`` steps (default: the spec's interval in ``layout``) and, with ``final``, at the last step (so a run can be resumed from its end).

    A shard holds the stage's state (parameters, optimizer, scheduler, step), the global indices of its
    layers (``layers``) and the run's ``history`` so far (the pipelines of each generation), which is what
    ``--resume`` and ``bamboo-launch export`` read. A shard commits only after a fenced write to etcd
    succeeded: a node declared dead writes no checkpoint. The state is only cloned here (serialised in the writer
    thread); each clone taken goes into ``clones`` too, so that an in-memory copy at the same step reuses it and
    its bytes. Returns the saves, to call once the boundary's other clones are taken: a save wakes its writer,
    whose serialising would hold the GIL against those clones.
    """
    from bamboo.launch.copy_service import StageSnapshot
    from bamboo.launch.events import Checkpoint
    from bamboo.rc.checkpoint_async import AsyncCheckpointer
    from bamboo.rc.checkpoint_files import stage_shard

    spec, log = run.spec, run.log

    def committed(info: CheckpointInfo) -> None:
        log.write(Checkpoint(t=log.now(), step=info.step, path=str(info.path), bytes=info.bytes,
                             duration_s=info.duration_s))

    def may_commit(step: int, shard: str) -> None:  # raises (the shard is not committed) once fenced
        run.membership.decide(f"checkpoint-{step}-{shard}", {"v": 1, "node": run.node})

    def shard(stage: int) -> dict[str, object]:  # on the training thread a clone only: serialised in the writer's
        # in host memory: a pending checkpoint takes no accelerator memory
        clone = StageSnapshot(executor.slices[stage].snapshot(device="cpu"))
        if clones is not None:
            clones[stage] = clone
        return {"state": clone,
                "layers": torch.tensor(list(executor.slices[stage].indices), dtype=torch.int64),
                "history": torch.tensor([list(item) for item in layout.history], dtype=torch.int64)}

    saves: list[Callable[[], None]] = []
    step = executor.step
    every = spec.checkpoint_interval(layout.restore_every) if every is None else every
    for stage in executor.hosted:
        if stage not in checkpointers:
            checkpointers[stage] = AsyncCheckpointer(spec.checkpoint_dir, shard=stage_shard(stage),
                                                     every_steps=every, on_commit=committed,
                                                     before_commit=may_commit, prepare=_serialised_state)
        if final or step % every == 0:
            saves.append(functools.partial(checkpointers[stage].save, step, shard(stage), cloned=True))
    return saves


def _serialised_state(shard: dict[str, Any]) -> dict[str, Any]:
    """A checkpoint shard whose ``state`` (a :class:`~bamboo.launch.copy_service.StageSnapshot`) is serialised as
    the shard format stores it (the bytes of ``state_bytes()``, a uint8 tensor); run in the checkpoint's writer
    thread."""
    import torch

    return {**shard, "state": torch.frombuffer(bytearray(shard["state"].data()), dtype=torch.uint8)}
