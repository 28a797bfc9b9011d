"""One training worker of a bamboo-launch job: the bamboo-rc engine of one node, through every layout.

Its agent (:mod:`bamboo.launch.agent`) spawns it as soon as the agent has registered:
``python -m bamboo.launch.worker`` for the built-in example, or ``python SCRIPT ARGS`` for a user script
(which calls :func:`bamboo.launch.train_worker`), in the agent's process group (a kill of the machine
takes both), with ``BAMBOO_WORKER_CONTEXT`` naming its :class:`~bamboo.launch.spec.WorkerContext`. The
worker

- reads the job's spec from etcd, builds its program (torch, DeepSpeed and the script are imported
  now), and publishes ``warm-<node>``: from then on it is a *warm joiner*, and a reconfiguration that
  brings it in only waits for the barrier and the state transfer;
- waits for a role: a layout in etcd that places its node (generation 0, or a later one), or the
  job's end;
- reaches the shared c10d store over etcd (`bamboo.membership.EtcdStore` under
  ``/bamboo/<job>/c10d/rc/``), so groups form and re-form with no store host to lose;
- builds exactly the stage bounds of the layout (``JobLayout.stage_bounds``) and trains the program
  with exact arithmetic, learning of confirmed failures through
  :class:`bamboo.launch.notices.EtcdFailureNotices` (suspicions go to its agent's failure detector);
- writes ``step`` records (the host of the last stage of pipeline 0), ``failover`` records (the shadow
  that took a victim's stage) and ``reconfiguration`` records to the job's event log in etcd;
- at a step boundary, when the lowest live rank decides so (:func:`bamboo.reconfig.decide`), or at
  once after a consecutive failure, meets the other holders at a barrier and starts the next layout
  as an attempt (:mod:`bamboo.launch.attempt`), which is abandoned and decided again if a node it
  needs dies meanwhile; state moves by bamboo-reconfig's transfer plan, round by round;
- a worker left out of a new layout goes back to waiting for a role in the same process;
- after the last step, or at the boundary where the job was asked to end (``bamboo-launch finish``,
  :mod:`bamboo.launch.finish`), writes its final checkpoint, its final state to ``<run dir>/out/rank<R>.pt``
  and the job's end record.

Every write to etcd is fenced by the agent's registration: once the node is declared dead it cannot
write a step, a checkpoint, a layout or an event of the job any more.

Exit status: 0 done (or the job ended without needing it); 1 an error (its last line is published as
``error-<node>``; a job that cannot go on, such as a stage with no copy and no checkpoint, also ends the
job with that error). The process ends with a flush and ``os._exit``: gloo's destructors can block on a
dead peer.
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from typing import Any

from bamboo.launch import timeouts
from bamboo.launch.barrier import next_attempt_layout, next_layout
from bamboo.launch.hooks import TrainingHooks, run_step_hooks
from bamboo.launch.records import BarrierReady, JobEnd, WorkerError, WorkerWarm
from bamboo.launch.session import JobCannotContinue, WorkerSession, decision_prefix, fenced, read_spec
from bamboo.launch.spec import WORKER_DONE, WORKER_ERROR, JobSpec, Program, WorkerContext
from bamboo.launch.starting import ABANDONED, TRANSFER_PAUSE_ENV, release_executor, start_attempt
from bamboo.launch.stop import decided_stop

__all__ = ["TRANSFER_PAUSE_ENV", "JobCannotContinue", "main", "pipeline_batches", "train"]


def pipeline_batches(microbatch: Any, pipeline: int, micro_batches: int, first_step: int) -> Iterator[Any]:
    """DeepSpeed-style ``(inputs, labels)`` iterator of pipeline ``pipeline``: global microbatches
    ``pipeline*M .. pipeline*M+M-1`` of every step from ``first_step`` on."""
    step = first_step
    while True:
        for k in range(micro_batches):
            yield microbatch(step, pipeline * micro_batches + k)
        step += 1


def _failover_records(executor: Any, seen: int) -> list[tuple[int, int, Any]]:
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


def _reports_the_job(executor: Any) -> bool:
    """Whether this node writes the job's steps and checkpoints: pipeline 0's (P = 1: the first live node,
    every node holding the whole model)."""
    if executor.layout.stages == 1:
        return executor.rank == min(r for r in range(executor.layout.world) if r not in executor.dead)
    return bool(executor.pipeline == 0)


def train(context: WorkerContext, program: Program | None = None, hooks: TrainingHooks | None = None) -> dict[str, Any]:
    """Train ``program`` (default: the built-in example) as ``context.node`` through every layout it has a
    role in; returns the final report (``{"done": False}`` when the job ended without needing this node).

    ``hooks`` (a script's ``on_step`` and ``evaluate``, :mod:`bamboo.launch.hooks`) run after every step
    that completes, once its records and checkpoint are written."""
    import torch
    from bamboo.launch.events import Failover, Reconfiguration, Step
    from bamboo.launch.example import example_program
    from bamboo.launch.reconfigure import log_restore
    from bamboo.rc import ConsecutiveFailure, HandedOver
    from bamboo.rc.worker import exact_mode

    exact_mode()
    if program is None:
        spec = _spec_of(context)
        program = example_program(spec.size, spec.config, spec.seed)
    run = WorkerSession(context, program)
    spec, node, log = run.spec, run.node, run.log
    if len(program.layers) != len(spec.layers):
        raise RuntimeError(f"this worker's model has {len(program.layers)} layers, the job's spec has "
                           f"{len(spec.layers)}: every process of the script must build the same model")
    run.membership.decide(f"warm-{node}", WorkerWarm(node, time.time()).to_dict())
    layout = run.wait_role(-1)
    if layout is None:
        run.close()
        return {"done": False}
    old: Any = None  # the executor of the previous generation (the state this node holds)
    base: Any = layout  # the layout whose barrier this node's state is from (holders only)
    ready_record: BarrierReady | None = None  # what this node published at that barrier (None: holds nothing)
    started = time.perf_counter()
    checkpointers: dict[int, Any] = {}
    losses: list[float] = []
    failovers: list[Any] = []
    told: set[int] = set()  # the executors this node's preemption notice was handed to
    while True:
        generation = layout.generation
        ranks: dict[str, int] = layout.ranks
        # Every start, the first layout's included, is one attempt (bamboo.launch.attempt): a node lost before
        # the attempt is up makes every node abandon it, and the start is redone without that node.
        engine = start_attempt(run, layout, old)
        if engine is ABANDONED:
            if ready_record is None:  # it holds nothing (a joiner, or any node of a fresh start): it follows
                layout = next_attempt_layout(run, layout)
                if layout is not None and node not in layout.ranks:
                    layout = run.wait_role(layout.generation)
                if layout is None:
                    break
                continue
            attempt = layout.attempt + 1
            run.membership.decide(f"{decision_prefix(base.generation, attempt)}ready-{node}", ready_record.to_dict())
            survivors = list(layout.survivors)
            layout = next_layout(run, base, lambda records, s=survivors: [n for n in s if n in records],
                                  attempt, layout.reason)
            continue
        if node not in ranks:  # a source that leaves for standby: its transfers are done
            release_executor(old)
            old, ready_record = None, None
            print(f"node {node}: on standby after generation {generation}", flush=True)
            layout = run.wait_role(generation)
            if layout is None:
                break
            continue
        rank = ranks[node]
        executor = engine.executor
        if generation > 0 and rank == min(ranks.values()):  # one record per reconfiguration, once all are up
            log.write(Reconfiguration(t=log.now(), reason=layout.reason, pipelines=layout.pipelines,
                                      stages=spec.stages, standby=len(layout.standby),
                                      bytes_moved=layout.transfers.bytes_moved,
                                      duration_s=max(0.0, time.time() - float(layout.barrier_unix or time.time())),
                                      attempts=layout.attempt + 1))
            log_restore(log, layout)
        if old is not None:  # the new layout holds this node's state now
            release_executor(old)
        ready_record = None
        old = None
        data = pipeline_batches(program.microbatch, executor.pipeline, layout.micro_batches, executor.step)
        samples = executor.config.micro_batch_size * layout.micro_batches * layout.pipelines
        seen_failovers = 0
        stop_step: int | None = None
        stop_reason = "step boundary"
        finishing = False  # the stop is the job's end (a FinishRequest), not a reconfiguration
        consecutive = False
        while executor.step < spec.steps:
            if stop_step is not None and executor.step >= stop_step:
                break
            step_started = time.perf_counter()
            run.tell_runtime_of_notice(executor, told)
            try:
                loss = float(engine.train_batch(data))
            except HandedOver:  # a preemption notice: this node's stage went to its shadow after the step
                _hand_over(run, layout, executor)
                run.close()
                return {"done": False, "handed_over": True}
            except ConsecutiveFailure as failure:
                print(f"node {node}: {failure}", file=sys.stderr, flush=True)
                executor.apply_replica_updates()
                consecutive = True
                break
            duration = time.perf_counter() - step_started
            losses.append(loss)
            node_of_rank = layout.node_of_rank
            for victim_rank, victim, failover in _failover_records(executor, seen_failovers):
                log.write(Failover(t=log.now(), victim=node_of_rank.get(victim_rank, str(victim_rank)),
                                   shadow=node, stage=victim, pause_s=failover.pause_s,
                                   caught_unix=failover.caught_at, resumed_unix=failover.resumed_at,
                                   step_end_unix=failover.iteration_end))
            failovers.extend(executor.failovers[seen_failovers:])
            seen_failovers = len(executor.failovers)
            if _reports_the_job(executor) and spec.stages - 1 in executor.hosted:
                log.write(Step(t=log.now(), step=executor.step, samples=samples, loss=loss,
                               nodes_active=spec.stages * layout.pipelines - len(executor.dead),
                               duration_s=duration, generation=generation))
            if spec.checkpoint_dir is not None and _reports_the_job(executor):
                _checkpoint(run, layout, executor, checkpointers, torch,
                            final=executor.step >= spec.steps or (finishing and executor.step >= stop_step))
            if hooks is not None:
                run_step_hooks(engine, hooks)
            if stop_step is None:
                stop_step, stop_reason, finishing = decided_stop(run, layout, executor, ranks)
        if (executor.step >= spec.steps or finishing) and not consecutive:
            engine.finish()
            break
        # ---- the barrier: this generation ends at executor.step ----------------------------------
        executor.apply_replica_updates()
        holds = sorted(s for s, piece in executor.slices.items() if piece.steps == executor.step)
        ready_record = BarrierReady(step=executor.step, holds=holds, at=time.time())
        run.membership.decide(f"g{generation}-ready-{node}", ready_record.to_dict())
        print(f"node {node}: at the barrier of generation {generation}: step {executor.step}, holds stages {holds}",
              flush=True)
        dead = set(executor.dead)
        base, old = layout, executor
        layout = next_layout(run, base, lambda records, dead=dead, ranks=ranks: [
            n for n, r in ranks.items() if r not in dead and n in records],
            0, "consecutive failure" if consecutive else stop_reason)
    for writer in checkpointers.values():
        writer.close()
    if layout is None or node not in layout.ranks:
        run.close()
        return {"done": False}
    report = _final_report(run, layout, engine.executor, losses, failovers, started)
    run.membership.decide("end", JobEnd(steps=engine.executor.step, node=node).to_dict())
    run.close()
    return report


def _hand_over(run: WorkerSession, layout: Any, executor: Any) -> None:
    """This node left at a step boundary after its preemption notice: record the hand-over's event (the executor
    already published it, first writer wins, before it left; ``publish_next_event`` finds it, and publishes it
    only if it is missing), the node's preemption, and tell its agent."""
    from bamboo.launch.events import Preemption
    from bamboo.launch.notices import publish_next_event

    rank = layout.ranks[run.node]
    event = publish_next_event(run.membership, layout.generation, [rank], handover=True)
    notice = max(0.0, (run.notice_deadline or time.time()) - time.time())
    run.log.write(Preemption(t=run.log.now(), node=run.node, zone=run.context.zone or "default", notice_s=notice))
    run.membership.decide(f"handover-{run.node}", {"v": 1, "node": run.node, "step": executor.step,
                                                   "generation": layout.generation, "epoch": event.epoch})
    print(f"node {run.node}: handed stage {executor.stage} of pipeline {executor.pipeline} over to its shadow "
          f"after step {executor.step} ({notice:.1f} s before the preemption)", flush=True)


def _final_report(run: WorkerSession, layout: Any, executor: Any, losses: list[float], failovers: list[Any],
                  started: float) -> dict[str, Any]:
    import torch

    rank = layout.ranks[run.node]
    report = {
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


def _checkpoint(run: WorkerSession, layout: Any, executor: Any, checkpointers: dict[int, Any], torch: Any,
                *, final: bool = False) -> None:
    """Pipeline 0 writes one shard per stage it hosts (a shadow that took over a stage writes it too), every
    ``checkpoint_every`` steps and, with ``final``, at the last step (so a run can be resumed from its end).

    A shard holds the stage's state (parameters, optimizer, scheduler, step), the global indices of its
    layers (``layers``) and the run's ``history`` so far (the pipelines of each generation), which is what
    ``--resume`` and ``bamboo-launch export`` read. A shard commits only after a fenced write to etcd
    succeeded: a node declared dead writes no checkpoint.
    """
    from bamboo.launch.checkpoint import AsyncCheckpointer
    from bamboo.launch.events import Checkpoint

    spec, log = run.spec, run.log

    def committed(info: Any) -> None:
        log.write(Checkpoint(t=log.now(), step=info.step, path=str(info.path), bytes=info.bytes,
                             duration_s=info.duration_s))

    def may_commit(step: int, shard: str) -> None:  # raises (the shard is not committed) once fenced
        run.membership.decide(f"checkpoint-{step}-{shard}", {"v": 1, "node": run.node})

    def shard(stage: int) -> dict[str, Any]:
        return {"state": torch.frombuffer(bytearray(executor.slices[stage].state_bytes()), dtype=torch.uint8),
                "layers": torch.tensor(list(executor.slices[stage].indices), dtype=torch.int64),
                "history": torch.tensor([list(item) for item in layout.history], dtype=torch.int64)}

    for stage in executor.hosted:
        if stage not in checkpointers:
            checkpointers[stage] = AsyncCheckpointer(spec.checkpoint_dir, shard=f"stage-{stage}",
                                                     every_steps=spec.checkpoint_every, on_commit=committed,
                                                     before_commit=may_commit)
        if final and executor.step % spec.checkpoint_every:
            checkpointers[stage].save(executor.step, shard(stage))
        else:
            checkpointers[stage].maybe_save(executor.step, lambda stage=stage: shard(stage))


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
    """End this process if its agent (its parent) dies: a worker never outlives the agent that fences it."""
    agent = os.getppid()

    def watch() -> None:
        while os.getppid() == agent:
            time.sleep(timeouts.AGENT_POLL_S)
        print("worker: its agent is gone; exiting", file=sys.stderr, flush=True)
        os._exit(WORKER_ERROR)

    threading.Thread(target=watch, name="bamboo-agent-watch", daemon=True).start()


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
