"""One training worker of a bamboo-launch job: the bamboo-rc engine of one node, through every layout.

Its agent (:mod:`bamboo.launch.agent`) spawns it as soon as the agent has registered:
``python -m bamboo.launch.worker`` for the built-in example, or ``python SCRIPT ARGS`` for a user script
(which calls :func:`bamboo.launch.train_worker`), in the agent's process group (a kill of the machine
takes both), with ``BAMBOO_WORKER_CONTEXT`` naming its :class:`~bamboo.launch.spec.WorkerContext`. The
worker

- reads the job's spec from etcd, builds its program (torch, DeepSpeed and the script are imported
  now), and publishes ``warm-<node>``: from then on it is a *warm joiner*;
- waits for a role (:mod:`bamboo.launch.roles`): a layout in etcd that places its node (generation 0, or
  a later one), a layout being prepared that does (it builds its part while the others train), or the
  job's end;
- reaches the shared c10d store over etcd (`bamboo.membership.EtcdStore` under
  ``/bamboo/<job>/c10d/rc/``), so groups form and re-form with no store host to lose;
- builds exactly the stage bounds of the layout (``JobLayout.stage_bounds``) and trains the program
  with exact arithmetic, learning of confirmed failures through
  :class:`bamboo.launch.notices.EtcdFailureNotices` (suspicions go to its agent's failure detector);
- writes ``step`` records (the host of the last stage of pipeline 0), ``failover`` records (the shadow
  that took a victim's stage) and ``reconfiguration`` records to the job's event log in etcd;
- when the lowest live rank decides a reconfiguration (:func:`bamboo.reconfig.decide`), builds its part of
  the next layout while this one trains and switches to it at one step boundary (make before break,
  :mod:`bamboo.launch.prepare`); after a consecutive failure, or when the next layout cannot be prepared,
  meets the other holders at a barrier (:mod:`bamboo.launch.barrier`) and starts the next layout there.
  Every start is an attempt (:mod:`bamboo.launch.attempt`), abandoned and decided again if a node it needs
  dies meanwhile; state moves by bamboo-reconfig's transfer plan, round by round;
- a worker left out of a new layout goes back to waiting for a role in the same process;
- after the last step, or at the boundary where the job was asked to end (``bamboo-launch finish``,
  :mod:`bamboo.launch.finish`), writes its final checkpoint, its final state to ``<run dir>/out/rank<R>.pt``
  and the job's end record.

These are the phases of :mod:`bamboo.launch.worker_phases` (warm, attempt, redo, training, barrier, standby,
and the ends): each phase here does its work and returns an outcome, and that module's ``next_phase`` says
which phase comes next.

Every write to etcd is fenced by the agent's registration: once the node is declared dead it cannot
write a step, a checkpoint, a layout or an event of the job any more.

Exit status: 0 done (or the job ended without needing it); 1 an error (its last line is published as
``error-<node>``; a job that cannot go on, such as a global batch no number of pipelines left can split, also ends the
job with that error). The process ends with a flush and ``os._exit``: gloo's destructors can block on a
dead peer.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from typing import TYPE_CHECKING

import attrs
from bamboo.launch.barrier import next_attempt_layout, next_layout, publish_layout
from bamboo.launch.event_records import WorkerPhase
from bamboo.launch.generation import Ending, WorkerState, pipeline_batches, train_generation
from bamboo.launch.hooks import TrainingHooks
from bamboo.launch.prepare import Preparation, Prepared, close_prepared, finalize, switch_part
from bamboo.launch.records import BarrierReady, JobEnd, Preempted, WorkerError, WorkerWarm
from bamboo.launch.roles import Role, wait_role
from bamboo.launch.session import JobCannotContinue, WorkerSession, decision_prefix, fenced, read_spec
from bamboo.launch.spec import WORKER_DONE, WORKER_ERROR, JobSpec, Program, WorkerContext
from bamboo.launch.starting import (
    ABANDONED,
    TRANSFER_PAUSE_ENV,
    Abandoned,
    StartMarks,
    follow_attempt,
    release_executor,
    start_attempt,
)
from bamboo.launch.worker_phases import (
    TERMINAL,
    JobEnded,
    JoinAbandoned,
    LayoutAbandoned,
    LayoutDecided,
    Outcome,
    Phase,
    PhaseChange,
    RoleFound,
    StartDone,
    SwitchAbandoned,
    TrainingEnded,
    WentAhead,
    next_phase,
    phase_change,
)
from bamboo.launch.worker_records import StartupClock, WorkerReport

if TYPE_CHECKING:
    from typing import TypeAlias

    from bamboo.rc import Engine, FailoverRecord, StageExecutor
    from bamboo.reconfig import JobLayout

    Started: TypeAlias = tuple[Engine | None, JobLayout]
    """A layout started on this node: its engine (None: no role in it, a source going to standby), the layout."""

__all__ = ["TRANSFER_PAUSE_ENV", "JobCannotContinue", "main", "pipeline_batches", "train"]


@attrs.define
class _Holding:
    """What this node holds between two generations: the executor it trained (``old``), the layout whose barrier
    its state is from (``base``), what it published there (``ready``; None: not at a barrier yet), and when it
    stopped training."""

    old: StageExecutor | None = None
    base: JobLayout | None = None
    ready: BarrierReady | None = None
    stopped: float | None = None


def train(context: WorkerContext, program: Program | None = None,
          hooks: TrainingHooks | None = None) -> WorkerReport | None:
    """Train ``program`` (default: the built-in example) as ``context.node`` through every layout it has a
    role in; returns the final report (None when the job ended without needing this node, or after it handed
    its stage over).

    ``hooks`` (a script's ``on_step`` and ``evaluate``, :mod:`bamboo.launch.hooks`) run after every step
    that completes, once its records and checkpoint are written."""
    clock = StartupClock()
    import torch  # noqa: F401  (the imports phase of the start-up: torch, then the runtime)
    from bamboo.launch.example import example_program
    from bamboo.rc.worker import exact_mode

    exact_mode()
    clock.imported = time.time()
    if program is None:
        spec = _spec_of(context)
        program = example_program(spec.size, spec.config, spec.seed)
    run = WorkerSession(context, program)
    spec, node = run.spec, run.node
    if spec.memory_copy_every:
        from bamboo.launch.copy_service import CopyService

        run.copies = CopyService(run.context, run.membership, spec.job)
    if len(program.layers) != len(spec.layers):
        raise RuntimeError(f"this worker's model has {len(program.layers)} layers, the job's spec has "
                           f"{len(spec.layers)}: every process of the script must build the same model")
    clock.warm = run.warm_at = time.time()
    run.membership.decide(f"warm-{node}", WorkerWarm(node, run.warm_at, run.context.zone).to_dict())
    state = WorkerState(startup=clock)
    role = wait_role(run, -1)
    clock.role = time.time()
    try:
        return _roles(run, state, hooks, role)
    finally:
        for writer in state.checkpointers.values():
            writer.close()
        run.close()


@attrs.frozen
class _Life:
    """What the phases of one worker's life share: its session, what it keeps across generations, its
    script's hooks, and what it holds between two generations."""

    run: WorkerSession
    state: WorkerState
    hooks: TrainingHooks | None
    holding: _Holding = attrs.field(factory=_Holding)


def _roles(run: WorkerSession, state: WorkerState, hooks: TrainingHooks | None,
           role: Role | None) -> WorkerReport | None:
    """Every role this node takes from ``role`` on, to the job's end: the phases of
    :mod:`bamboo.launch.worker_phases`, each phase's outcome deciding the next one (:func:`next_phase`)."""
    life = _Life(run, state, hooks)
    phase, outcome = Phase.WARM, _found(role)
    while True:
        previous, phase = phase, next_phase(phase, outcome, life.holding.old is not None)
        _observe(life, phase_change(run.node, previous, phase, outcome))
        if phase in TERMINAL:
            return _end(life, phase, outcome)
        outcome = _act(life, phase, outcome)


def _observe(life: _Life, change: PhaseChange) -> None:
    """What observes the worker's life sees ``change``: the event log (a ``phase`` record), the script's
    ``on_phase`` hook, and the checkpoint writers, which finish their writes and close once the node holds
    nothing (they are made again, per stage, when it next trains)."""
    log = life.run.log
    log.write(WorkerPhase(t=log.now(), node=change.node, phase=change.phase.value, previous=change.previous.value,
                          cause=change.cause, generation=change.generation))
    if change.holds_nothing and life.state.checkpointers:
        for writer in life.state.checkpointers.values():
            writer.close()
        life.state.checkpointers.clear()
    if life.hooks is not None and life.hooks.on_phase is not None:
        life.hooks.on_phase(change)


def _act(life: _Life, phase: Phase, cause: Outcome) -> Outcome:
    """Do what ``phase`` does, given ``cause``, the outcome that led to it; returns the phase's outcome."""
    match phase, cause:
        case Phase.WARM, JoinAbandoned() | LayoutDecided() | WentAhead():
            return _found(wait_role(life.run, cause.after))
        case Phase.ATTEMPT, RoleFound() | TrainingEnded() | LayoutDecided():
            return _attempt(life, cause)
        case Phase.REDO, LayoutAbandoned():
            layout = next_attempt_layout(life.run, cause.layout)
            return JobEnded() if layout is None else LayoutDecided(layout, member=life.run.node in layout.ranks)
        case Phase.TRAINING, StartDone():
            return _training(life, cause)
        case Phase.BARRIER, TrainingEnded() | SwitchAbandoned():
            return _barrier(life.run, life.holding, cause.ending.reason)
        case Phase.BARRIER, LayoutAbandoned():
            return _barrier_again(life.run, life.holding, cause.layout)
        case Phase.STANDBY, StartDone():
            _release(life.holding)
            print(f"node {life.run.node}: on standby after generation {cause.layout.generation}", flush=True)
            return _found(wait_role(life.run, cause.layout.generation))
    raise ValueError(f"phase {phase.name} does not follow {type(cause).__name__} ({cause.case!r})")


def _found(role: Role | None) -> RoleFound | JobEnded:
    return JobEnded() if role is None else RoleFound(role)


def _attempt(life: _Life, cause: RoleFound | TrainingEnded | LayoutDecided) -> Outcome:
    """Start what ``cause`` brought: a role found while holding nothing, a switch to a prepared layout, or the
    layout decided at the barrier (or for the next attempt). ``StartDone``, or how the start was abandoned."""
    run, holding = life.run, life.holding
    started: Started | Abandoned
    if isinstance(cause, TrainingEnded):  # a switch to the layout prepared while this node trained
        started, abandoned, prepared = _start_switch(run, holding, cause.ending), SwitchAbandoned(cause.ending), True
    elif isinstance(cause, LayoutDecided):
        started, abandoned, prepared = _start_layout(run, holding, cause.layout), LayoutAbandoned(cause.layout), False
    elif cause.role.prepared is not None:  # a joiner: the layout is being prepared while the others train
        started, abandoned, prepared = _start_join(run, cause.role.prepared), JoinAbandoned(cause.role), True
    else:
        layout = cause.role.layout
        started, abandoned, prepared = _start_layout(run, holding, layout), LayoutAbandoned(layout), False
    if started is ABANDONED:
        return abandoned
    engine, layout = started
    return StartDone(engine, layout, member=run.node in layout.ranks, prepared=prepared)


def _training(life: _Life, started: StartDone) -> TrainingEnded:
    """Train the layout ``started`` went ahead with, until it ends for this node; keep its executor when the
    node goes on to the next layout with it."""
    run, holding = life.run, life.holding
    _release(holding)
    holding.base = started.layout
    assert started.engine is not None
    ending = train_generation(run, started.layout, started.engine, life.state, life.hooks, prepared=started.prepared)
    trained = TrainingEnded(ending, started)
    if trained.holds:
        holding.old, holding.stopped = started.engine.executor, time.time()
    return trained


def _end(life: _Life, phase: Phase, cause: Outcome) -> WorkerReport | None:
    """The last phase: the report (``DONE``), the hand-over (``HANDED_OVER``), or nothing (``ENDED``)."""
    run, state = life.run, life.state
    if phase is Phase.ENDED:
        return None
    assert isinstance(cause, TrainingEnded) and cause.started.engine is not None
    layout, executor = cause.started.layout, cause.started.engine.executor
    if phase is Phase.HANDED_OVER:
        _hand_over(run, layout, executor)
        return None
    report = _final_report(run, layout, executor, state.losses, state.failovers, state.started)
    run.membership.decide("end", JobEnd(steps=executor.step, node=run.node).to_dict())
    return report


def _start_join(run: WorkerSession, prepared: Prepared) -> Started | Abandoned:
    """Start a layout being prepared that this node, holding nothing, joins: ``(engine, layout)``, or ABANDONED."""
    preparation = Preparation(run, prepared)  # a joiner: it builds now, its state comes at the switch
    from bamboo.launch.attempt import StartThread

    part = StartThread(lambda: switch_part(run, preparation, None, None), name=f"bamboo-join-g{prepared.layout.generation}")
    result = follow_attempt(run, prepared.layout, part, preparation.store, preparation.marks)
    if result is ABANDONED:
        preparation.abandon()
    return result


def _start_layout(run: WorkerSession, holding: _Holding, layout: JobLayout) -> Started | Abandoned:
    """Start ``layout`` (a role found while holding nothing, the next attempt's layout, or a layout decided at
    the barrier) with what this node holds: ``(engine, layout)``, or ABANDONED."""
    engine = start_attempt(run, layout, holding.old, holding.stopped)
    return engine if engine is ABANDONED else (engine, layout)


def _start_switch(run: WorkerSession, holding: _Holding, start: Ending) -> Started | Abandoned:
    """Switch, as a node that holds state, to the prepared layout ``start``'s stop names: ``(engine, layout)``,
    or ABANDONED."""
    from bamboo.launch.attempt import AbandonableStore, StartThread

    stop = start.stop
    assert stop is not None and stop.attempt is not None
    preparation = start.preparation
    if preparation is not None and preparation.prepared.attempt != stop.attempt:  # built for another attempt
        preparation.abandon()
        preparation = None
    prepared = preparation.prepared if preparation is not None else _prepared(run, holding.base, stop.attempt)
    layout = finalize(prepared.layout, stop.step, stop.at)
    publish_layout(run, layout)
    holding.old.apply_replica_updates()  # the replicas this node sends or copies are at the switch's step
    if preparation is None and run.node in prepared.needs():  # its part was not started at a boundary
        preparation = Preparation(run, prepared)
    part: StartThread[Started]
    if preparation is None:  # no part in it: it follows the outcome, then goes to standby
        marks, store = StartMarks(stopped=holding.stopped, warm=run.warm_at), AbandonableStore(run.store)
        part = StartThread(lambda: (None, layout), name=f"bamboo-follow-g{layout.generation}")
    else:
        marks, store = preparation.marks, preparation.store
        marks.stopped = holding.stopped
        part = StartThread(lambda: switch_part(run, preparation, holding.old, stop), name=f"bamboo-switch-g{layout.generation}")
    result = follow_attempt(run, layout, part, store, marks)
    if result is ABANDONED and preparation is not None:
        preparation.abandon()
    return result


def _prepared(run: WorkerSession, base: JobLayout, attempt: int) -> Prepared:
    """Attempt ``attempt`` of the layout prepared during generation ``base``, read from etcd."""
    from bamboo.launch.prepare import prepare_name
    from bamboo.launch.records import PreparedLayout
    from bamboo.reconfig import JobLayout

    record = PreparedLayout.from_dict(run.wait_decision(prepare_name(base.generation, attempt), run.timeouts.build))
    if record.layout is None:
        raise RuntimeError(f"attempt {attempt} of generation {base.generation} was closed, yet the stop names it")
    return Prepared(attempt, JobLayout.from_dict(record.layout), record.epoch)


def _barrier(run: WorkerSession, holding: _Holding, reason: str) -> LayoutDecided | WentAhead:
    """Meet the other holders at the barrier of ``holding.base`` (the layout this node trained until it stopped):
    close the layouts being prepared, publish what it holds, and decide the next layout with them (or let its
    state go, when a prepared layout went ahead without it)."""
    base, old = holding.base, holding.old
    attempt, went = close_prepared(run.membership, base.generation, f"a node of generation {base.generation} went "
                                   f"to the barrier ({reason})")
    if went is not None:  # a prepared layout went ahead without this node: it goes to standby
        _release(holding)
        print(f"node {run.node}: generation {went.layout.generation} went ahead without it; on standby", flush=True)
        return WentAhead(went.layout.generation)
    old.apply_replica_updates()
    holds = sorted(s for s, piece in old.slices.items() if piece.steps == old.step)
    holding.ready = BarrierReady(step=old.step, holds=holds, at=holding.stopped or time.time())
    run.membership.decide(f"{decision_prefix(base.generation, attempt)}ready-{run.node}", holding.ready.to_dict())
    print(f"node {run.node}: at the barrier of generation {base.generation} (attempt {attempt + 1}): step "
          f"{old.step}, holds stages {holds}", flush=True)
    dead, ranks = set(old.dead), base.ranks
    layout = next_layout(run, base, lambda records: [n for n, r in ranks.items() if r not in dead and n in records],
                         attempt, reason)
    return LayoutDecided(layout, member=run.node in layout.ranks)


def _barrier_again(run: WorkerSession, holding: _Holding, lost: JobLayout) -> LayoutDecided:
    """The start of ``lost``, decided at the barrier of ``holding.base``, was abandoned: publish again what this
    node holds, for the next attempt, and decide the next layout with the survivors that ``lost`` names."""
    attempt = lost.attempt + 1
    assert holding.ready is not None
    run.membership.decide(f"{decision_prefix(holding.base.generation, attempt)}ready-{run.node}", holding.ready.to_dict())
    survivors = list(lost.survivors)
    layout = next_layout(run, holding.base, lambda records, s=survivors: [n for n in s if n in records], attempt,
                         lost.reason)
    return LayoutDecided(layout, member=run.node in layout.ranks)


def _release(holding: _Holding) -> None:
    """The state this node held is in the new layout's executor (or handed over): let the old executor go."""
    if holding.old is not None:
        release_executor(holding.old)
    holding.old, holding.ready, holding.stopped = None, None, None


def _hand_over(run: WorkerSession, layout: JobLayout, executor: StageExecutor) -> None:
    """This node left at a step boundary after its notice: record the hand-over's event (unless its executor did),
    the node's preemption once (the ``preempted-<node>`` decision, which the coordinator takes too when a peer
    reports this node as it leaves), and tell its agent."""
    from bamboo.launch.events import Preemption
    from bamboo.launch.notices import publish_next_event

    event = publish_next_event(run.membership, layout.generation, [layout.ranks[run.node]], handover=True)
    notice = max(0.0, (run.notice_deadline or time.time()) - time.time())
    left = Preempted(run.node, run.context.zone or "default", "notice: handed over")
    if run.membership.decide(f"preempted-{run.node}", left.to_dict()).won:
        run.log.write(Preemption(t=run.log.now(), node=run.node, zone=left.zone, notice_s=notice))
    run.membership.decide(f"handover-{run.node}", {"v": 1, "node": run.node, "step": executor.step,
                                                   "generation": layout.generation, "epoch": event.epoch})
    print(f"node {run.node}: handed stage {executor.stage} of pipeline {executor.pipeline} over to its shadow "
          f"after step {executor.step} ({notice:.1f} s before the preemption)", flush=True)


def _final_report(run: WorkerSession, layout: JobLayout, executor: StageExecutor, losses: list[float],
                  failovers: list[FailoverRecord],
                  started: float) -> WorkerReport:
    import torch

    rank = layout.ranks[run.node]
    report: WorkerReport = {
        "rank": rank,
        "node": run.node,
        "generation": layout.generation,
        "history": [list(item) for item in layout.history],
        "stage_bounds": [list(bounds) for bounds in layout.stage_bounds],
        "stage": executor.stage,
        "pipeline": executor.pipeline,
        "hosted": list(executor.hosted),
        "slices": {stage: [layer.state_dict() for layer in piece.layers] for stage, piece in executor.slices.items()},
        "slice_layers": {stage: list(piece.indices) for stage, piece in executor.slices.items()},
        "replica_stage": executor.replica_stage,
        "losses": losses,
        "steps_done": executor.step,
        "failovers": [failover.to_dict() for failover in failovers],
        "consecutive": None,
        "seconds": time.perf_counter() - started,
    }
    out = run.context.out_dir
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"rank{rank}.pt"
    torch.save(report, path.with_suffix(".tmp"))
    os.replace(path.with_suffix(".tmp"), path)  # the launcher reads this file: never a partial one
    return report


def main(argv: list[str] | None = None) -> None:
    """Entry point of the built-in example's worker (never returns: ends with ``os._exit``)."""
    parser = argparse.ArgumentParser(prog="python -m bamboo.launch.worker",
                                     description="One bamboo-launch worker of the built-in example (its agent "
                                     "starts it, with BAMBOO_WORKER_CONTEXT set).")
    parser.parse_args(argv)
    run_worker(None)


def run_worker(program: Program | None, hooks: TrainingHooks | None = None) -> None:
    """Train as the worker the environment describes, then end the process (``os._exit``).

    ``program`` is a user script's (None: the built-in example's), ``hooks`` its ``on_step``/``evaluate``.
    Failures are published before the exit.
    """
    code = WORKER_DONE
    context: WorkerContext | None = None
    _die_with_agent()
    try:
        context = WorkerContext.from_environment()
        train(context, program, hooks)
    except BaseException as error:
        traceback.print_exc()
        code = WORKER_ERROR
        if context is not None:
            _publish_error(context, error)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def _die_with_agent() -> None:
    """End this process when its agent ends (:mod:`bamboo.launch.agent_watch`): a worker never outlives the agent
    that fences it."""
    from bamboo.launch.agent_watch import watch_agent

    def gone() -> None:
        print("worker: its agent is gone; exiting", file=sys.stderr, flush=True)
        os._exit(WORKER_ERROR)

    watch_agent(gone)


def _spec_of(context: WorkerContext) -> JobSpec:
    """The job's spec, read as the worker's store reads everything: an etcd outage (or an etcd too loaded to
    answer) pauses the read for up to ``ETCD_OUTAGE_S`` instead of failing the worker at its start."""
    from bamboo.launch.notices import PatientKV
    from bamboo.membership import EtcdKV, MembershipStore

    kv = EtcdKV(context.etcd.options())
    try:
        return read_spec(MembershipStore(PatientKV(kv), context.job))  # type: ignore[arg-type]
    finally:
        kv.close()


def _publish_error(context: WorkerContext, error: BaseException) -> None:
    """Publish the worker's last exception line (and end the job if it cannot go on); never raises."""
    try:
        from bamboo.membership import EtcdKV, MembershipStore

        kv = EtcdKV(context.etcd.options())
        membership = fenced(MembershipStore(kv, context.job), context)
        line = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        membership.decide(f"error-{context.node}", WorkerError(context.node, line, time.time()).to_dict())
        if isinstance(error, JobCannotContinue):
            membership.decide("end", JobEnd(steps=0, error=line, node=context.node).to_dict())
        kv.close()
    except Exception as failure:  # etcd gone, or this node was fenced: the agent reports the exit status
        print(f"node {context.node}: could not publish the error: {failure}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # pragma: no cover
    main()
