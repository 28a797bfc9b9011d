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
import datetime
import os
import sys
import threading
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from bamboo.launch import timeouts
from bamboo.launch.finish import finish_requested
from bamboo.launch.hooks import TrainingHooks, run_step_hooks
from bamboo.launch.records import (
    BarrierReady,
    JobEnd,
    StopDecision,
    WorkerError,
    WorkerWarm,
    read_record,
)
from bamboo.launch.roles import RoleWatch
from bamboo.launch.spec import WORKER_DONE, WORKER_ERROR, JobSpec, Program, WorkerContext
from bamboo.membership.kv import StoreError

__all__ = ["TRANSFER_PAUSE_ENV", "JobCannotContinue", "main", "pipeline_batches", "train"]

TRANSFER_PAUSE_ENV = "BAMBOO_LAUNCH_TEST_TRANSFER_PAUSE_S"
"""Test hook: seconds every member of a reconfiguration's transfer group waits once the group is formed,
after publishing decision ``g<G>-transfer-group-<node>`` (so that a test can kill a node mid-transfer)."""

class JobCannotContinue(RuntimeError):
    """The job cannot go on (say, every copy of a stage is gone and there is no checkpoint): the worker
    ends the job with this error."""


class NotEnoughNodes(RuntimeError):
    """Too few live nodes for one pipeline: the holders wait at the barrier for more."""


def read_spec(membership: Any) -> JobSpec:
    """The job's spec from etcd (a clear error when there is none)."""
    found = membership.kv.get(membership.keys.root + "spec")
    if found is None:
        raise RuntimeError(f"job {membership.keys.job} has no spec in etcd (its agents write it)")
    return JobSpec.from_json(found.value)


class _Run:
    """One worker's connections and view of the job across layouts."""

    def __init__(self, context: WorkerContext, program: Program) -> None:
        from bamboo.launch.events import EtcdEventLog
        from bamboo.launch.notices import PatientKV
        from bamboo.membership import AgentClient, EtcdKV, EtcdStore, MembershipStore, c10d_prefix
        from bamboo.rc import CommTimeouts

        self.context = context
        self.program = program
        self.node = context.node
        self.kv = EtcdKV(context.etcd.options())
        patient = PatientKV(self.kv)  # an etcd restart pauses this worker instead of failing it
        self.membership = _fenced(MembershipStore(patient, context.job), context)  # type: ignore[arg-type]
        self.spec = read_spec(self.membership)
        self.timeouts = CommTimeouts(group=self.spec.group_timeout_s, confirm=self.spec.confirm_timeout_s)
        self.store = EtcdStore(patient, c10d_prefix(context.job, "rc"),  # type: ignore[arg-type]
                               timeout=datetime.timedelta(seconds=self.timeouts.build))
        self.agent = AgentClient(context.agent_address, name=f"worker-{self.node}", **_agent_auth(context))
        self.log = EtcdEventLog(self.membership.kv, context.job, f"{self.node}.worker.{os.getpid()}",
                                self.spec.created_unix, guard=self.membership.guard)
        self.layers = self.spec.reconfig_layers()
        self.notice_deadline: float | None = None  # this node's preemption deadline, once its agent was told
        self.roles = RoleWatch(self.membership, self.node)  # the layout and the job's end, watched
        self._notice_watch = self.membership.watch_notices(self._on_notice)
        found = self.kv.get(self.membership.keys.notice(self.node))
        if found is not None:
            self._on_notice_value(found.value)

    def _on_notice(self, event: Any) -> None:
        if event.value and event.key == self.membership.keys.notice(self.node):
            self._on_notice_value(event.value)

    def _on_notice_value(self, value: bytes) -> None:
        from bamboo.membership.records import PreemptionNotice, decode_message

        notice = decode_message(self.membership.keys.notice(self.node), value, PreemptionNotice)
        if self.notice_deadline is None:
            print(f"node {self.node}: preemption notice: the machine goes away at {notice.deadline:.1f} "
                  f"(in {notice.deadline - time.time():.1f} s)", flush=True)
            self.notice_deadline = float(notice.deadline)

    def ended(self) -> JobEnd | None:
        return self.roles.ended()

    def wait_role(self, after: int) -> Any:
        """The first layout of generation > ``after`` that places this node; None once the job has ended.
        It sleeps until the layout or the job's end changes (:class:`bamboo.launch.roles.RoleWatch`)."""
        return self.roles.wait_role(after)

    def wait_decision(self, name: str, timeout: float) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while True:
            try:
                found = self.membership.get_decision(name)
            except Exception:
                found = None
            if found is not None:
                return found.value
            if time.monotonic() > deadline:
                raise RuntimeError(f"decision {name} not taken within {timeout:g} s")
            time.sleep(timeouts.DECISION_POLL_S)

    def tell_runtime_of_notice(self, executor: Any, told: set[int]) -> None:
        """Hand this node's preemption deadline to the runtime (once per executor): at the start of its next
        step it hands its stage over after that step if the deadline leaves time, else it keeps going and
        its death at the deadline is an ordinary failure."""
        from bamboo.rc.records import NoticeRecord

        if self.notice_deadline is None or id(executor) in told:
            return
        self.store.set(executor.coordinator.notice_key(), NoticeRecord(self.notice_deadline).to_json())
        told.add(id(executor))

    def close(self) -> None:
        self._notice_watch.cancel()
        self.roles.close()
        self.log.close()


def _fenced(membership: Any, context: WorkerContext) -> Any:
    """``membership`` with every write guarded by the agent's registration (when the agent gave one)."""
    if not context.fence_key:
        return membership
    from bamboo.membership import Guard

    return membership.fenced(Guard(node=context.node, key=context.fence_key, create_revision=context.fence_revision,
                                   lease=context.fence_lease))


def _agent_auth(context: WorkerContext) -> dict[str, Any]:
    """How to call the agent's gRPC service: its job token or its TLS files."""
    options: dict[str, Any] = {}
    if context.agent_token_file:
        options["token"] = Path(context.agent_token_file).read_text().strip()
    if context.agent_tls_ca:
        from bamboo.membership import TlsFiles

        files = TlsFiles(context.agent_tls_cert or "", context.agent_tls_key or "", context.agent_tls_ca,
                         context.agent_tls_server_name)
        options["credentials"] = files.channel_credentials()
        options["channel_options"] = files.channel_options()
    return options


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
    run = _Run(context, program)
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
        engine = _attempt(run, layout, old)
        if engine is _ABANDONED:
            if ready_record is None:  # it holds nothing (a joiner, or any node of a fresh start): it follows
                layout = _next_attempt_layout(run, layout)
                if layout is not None and node not in layout.ranks:
                    layout = run.wait_role(layout.generation)
                if layout is None:
                    break
                continue
            attempt = layout.attempt + 1
            run.membership.decide(f"{_prefix(base.generation, attempt)}ready-{node}", ready_record.to_dict())
            survivors = list(layout.survivors)
            layout = _next_layout(run, base, lambda records, s=survivors: [n for n in s if n in records],
                                  attempt, layout.reason)
            continue
        if node not in ranks:  # a source that leaves for standby: its transfers are done
            _release_executor(old)
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
            _release_executor(old)
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
                stop_step, stop_reason, finishing = _stop_step(run, layout, executor, ranks)
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
        layout = _next_layout(run, base, lambda records, dead=dead, ranks=ranks: [
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


def _hand_over(run: _Run, layout: Any, executor: Any) -> None:
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


def _final_report(run: _Run, layout: Any, executor: Any, losses: list[float], failovers: list[Any],
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


def _checkpoint(run: _Run, layout: Any, executor: Any, checkpointers: dict[int, Any], torch: Any,
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


def _stop_step(run: _Run, layout: Any, executor: Any, ranks: dict[str, int]) -> tuple[int | None, str, bool]:
    """The step this generation stops at, why, and whether the job ends there, once decided (first writer
    wins); the lowest live rank proposes it: the job's end when someone asked for it (a
    :class:`FinishRequest`), else a reconfiguration when :func:`bamboo.reconfig.decide` wants one."""
    name = f"g{layout.generation}-stop"
    evaluator = min((r for r in ranks.values() if r not in executor.dead), default=min(ranks.values()))
    if executor.rank == evaluator and executor.step + 2 <= run.spec.steps:
        try:
            request = finish_requested(run.membership)
        except Exception as error:  # etcd restarting: look again after the next step
            print(f"node {run.node}: could not read the job's finish request: {error}", file=sys.stderr)
            return None, "", False
        if request is not None:  # each peer reads the decision within the two steps
            proposal = StopDecision(executor.step + 2, f"finish requested by {request.by or 'someone'}",
                                    finish=True)
        else:
            proposal = _reconfiguration_proposal(run, layout, executor)
        if proposal is not None:
            try:
                run.membership.decide(name, proposal.to_dict())
            except Exception as error:  # etcd restarting: propose again after the next step
                print(f"node {run.node}: could not propose a stop: {error}", file=sys.stderr)
                return None, "", False
    try:
        found = read_record(StopDecision, run.membership.get_decision(name))
    except Exception:
        return None, "", False
    if found is None:
        return None, "", False
    return found.step, found.reason, found.finish


def _reconfiguration_proposal(run: _Run, layout: Any, executor: Any) -> StopDecision | None:
    from bamboo.reconfig import When, decide

    view = _view(run, layout, executor)
    if view is None:
        return None
    decision = decide(view)  # after a failover: "rebuild redundancy after a failover", at least
    if decision.when is When.CARRY_ON:
        return None
    return StopDecision(executor.step + 2, ", ".join(r.value for r in decision.reasons))


def _view(run: _Run, layout: Any, executor: Any) -> Any:
    from bamboo.launch.reconfigure import build_view, warm_standby

    try:
        records = run.membership.list_nodes(skip_malformed=True)
        alive = warm_standby(run.membership, records)
    except Exception:
        return None
    ranks = layout.ranks
    dead = [n for n, r in ranks.items() if r in executor.dead]
    alive = sorted(set(alive) | {n for n in ranks if n in records})
    zones = {**layout.zones, **{n: record.zone for n, record in records.items()}}
    return build_view(layout, zones, alive, dead, run.layers, run.spec.pipelines)


_ABANDONED: Any = object()
"""What :func:`_attempt` returns when the attempt's outcome was ``abort``."""


def _prefix(generation: int, attempt: int) -> str:
    """Decision names of the barrier of ``generation``: ``g<g>-`` for its first attempt, ``g<g>-a<k>-`` after."""
    return f"g{generation}-" if attempt == 0 else f"g{generation}-a{attempt}-"


def _release_executor(old: Any) -> None:
    """Let the executor of a layout that ended go (its state is in the next layout's, or handed over): its
    groups are freed once their operations have finished, its failure notices stop watching, and its
    tensors are freed with it. Keeping it would hold, per membership change, a copy of this node's stages
    and optimizer state, and every group's sockets and threads."""
    old.release()
    if old.notices is not None:
        old.notices.close()


def _start_engine(run: _Run, layout: Any, old: Any, store: Any) -> Any:
    """This node's engine for ``layout``, with its stage state (from ``old``, peers or a checkpoint) in place."""
    from bamboo.launch.notices import EtcdFailureNotices
    from bamboo.rc import initialize

    spec, ranks = run.spec, layout.ranks
    job = f"{spec.job}-g{layout.generation}"
    notices = (EtcdFailureNotices(run.membership, layout.generation, run.agent, layout.node_of_rank)
               if spec.redundancy != "none" else None)
    config = {**spec.config, "gradient_accumulation_steps": layout.micro_batches}
    engine = initialize(
        list(run.program.layers), config, spec.redundancy, loss_fn=run.program.loss_fn, stages=spec.stages,
        rank=ranks[run.node], world_size=spec.stages * layout.pipelines, store=store, seed=spec.seed, job=job,
        timeouts=run.timeouts, notices=notices,
        stage_bounds=layout.stage_bounds, microbatch=run.program.microbatch,
    )
    _receive_state(run, layout, old, engine.executor, store)
    engine.executor.step = layout.start_step
    return engine


def _attempt(run: _Run, layout: Any, old: Any) -> Any:
    """Start ``layout`` as one attempt (:mod:`bamboo.launch.attempt`): this node's engine on ``go``,
    :data:`_ABANDONED` on ``abort``; a node that is not in the layout (a source leaving for standby, or a
    holder kept for a possible retry) does its transfers and returns None on ``go``."""
    from bamboo.launch.attempt import AbandonableStore, StartThread, await_outcome

    generation = layout.generation
    owners = set(layout.ranks)
    sources = {transfer.source for transfer in layout.transfers.transfers}
    store = AbandonableStore(run.store)
    if run.node in owners:
        part = StartThread(lambda: _start_engine(run, layout, old, store), name=f"bamboo-start-g{generation}")
    else:
        part = StartThread(lambda: _run_transfers(run, layout, old, None, store), name=f"bamboo-serve-g{generation}")
    outcome = await_outcome(run.membership, generation, run.node, owners, owners | sources, part.progress,
                            run.spec.reconfigure_timeout_s,
                            say=lambda line: print(f"node {run.node}: {line}", flush=True))
    if outcome.go:
        part.join(run.timeouts.group)  # every owner is up, so every transfer of this node is done
        done, error = part.progress()
        if not done or error is not None:
            raise RuntimeError(f"generation {generation} went ahead without this node's part: {error}")
        return part.result
    print(f"node {run.node}: generation {generation} abandoned: {outcome.reason}", flush=True)
    store.abandon()
    part.abandon(lambda engine: _release_executor(engine.executor))  # an engine started for nothing goes
    # A thread blocked in gloo on a dead peer stays blocked until the group's timeout; what it holds goes then.
    part.join(timeouts.ABANDONED_JOIN_S)
    return _ABANDONED


def _publish_layout(run: _Run, layout: Any) -> None:
    """Make ``layout`` the layout in etcd unless a later one is there (any node may do it: its writer may be dead)."""
    current = run.membership.get_layout()
    if current is not None and int(current.value.get("generation", 0)) < layout.generation:
        run.membership.put_layout(layout.to_dict(), current.revision)


def _next_attempt_layout(run: _Run, layout: Any) -> Any:
    """For a node that held no state in the abandoned attempt ``layout``: the next attempt's layout (None once
    the job has ended).

    When nodes held state at the barrier it starts from (``layout.survivors``), they decide the next layout.
    A start that no node's state goes into (no survivors: the first layout, or the coordinator's restart of
    every stage from a checkpoint) is redone by whichever of its nodes decides first, on the nodes registered
    now: no step of it was trained, so nothing is lost.
    """
    from bamboo.reconfig import JobLayout

    root = layout.generation if layout.base_generation is None else int(layout.base_generation)
    name = f"{_prefix(root, layout.attempt + 1)}next"
    if layout.survivors:
        value = JobLayout.from_dict(run.wait_decision(name, run.timeouts.build))
    else:
        value = _redo_start(run, layout, name)
        if value is None:
            return None
    _publish_layout(run, value)
    return value


def _redo_start(run: _Run, lost: Any, name: str) -> Any:
    """Decide (first writer wins, as decision ``name``) the layout that redoes the abandoned start ``lost`` on
    the nodes registered now (as the first layout does), waiting while they are too few for one pipeline;
    None once the job ended."""
    from bamboo.launch.coordinator import redo_start_layout
    from bamboo.reconfig import JobLayout

    next_say = 0.0
    while True:
        if run.ended() is not None:
            return None
        try:
            existing = run.membership.get_decision(name)
            if existing is not None:
                return JobLayout.from_dict(existing.value)
            records = run.membership.list_nodes(skip_malformed=True)
        except StoreError:  # etcd restarting
            time.sleep(timeouts.WORKER_POLL_S)
            continue
        zones = {**lost.zones, **{node: record.zone for node, record in records.items()}}
        planned = redo_start_layout(run.spec, lost, sorted(records), zones)
        if planned is not None:
            return JobLayout.from_dict(run.membership.decide(name, planned.to_dict()).value)
        if time.monotonic() >= next_say:
            print(f"node {run.node}: generation {lost.generation} was abandoned before its first step and the "
                  f"{len(records)} nodes left cannot form a pipeline of {run.spec.stages} stages; waiting for "
                  "more nodes", flush=True)
            next_say = time.monotonic() + timeouts.NODE_SHORTAGE_SAY_S
        time.sleep(timeouts.WORKER_POLL_S)


def _next_layout(run: _Run, base: Any, expected: Any, attempt: int, reason: str) -> Any:
    """Wait for every expected holder at the barrier of ``base``, then the next layout (first writer wins).

    ``expected(records)`` lists the nodes that must publish what they hold, given the registered nodes;
    ``attempt`` counts the abandoned starts of this barrier so far (each retry has its own decision names).
    """
    from bamboo.reconfig import JobLayout

    generation = base.generation
    prefix = _prefix(generation, attempt)
    name = f"{prefix}next"
    # A survivor may reach the barrier only after its own confirmation wait or group timeout.
    deadline = time.monotonic() + run.timeouts.build
    next_say = 0.0
    ready: dict[str, BarrierReady] = {}
    value: JobLayout | None = None
    while value is None:
        existing = run.membership.get_decision(name)
        if existing is not None:
            value = JobLayout.from_dict(existing.value)
            break
        records = run.membership.list_nodes(skip_malformed=True)
        waiting_for = expected(records)
        for other in waiting_for:
            if other not in ready:
                found = read_record(BarrierReady, run.membership.get_decision(f"{prefix}ready-{other}"))
                if found is not None:
                    ready[other] = found
        if all(other in ready for other in waiting_for):
            try:
                planned = _plan_next(run, base, ready, attempt, reason)
            except NotEnoughNodes as shortage:  # wait, holding the state, for the market to add machines
                if time.monotonic() >= next_say:
                    print(f"node {run.node}: at the barrier of generation {generation}: {shortage}; waiting for "
                          "more nodes", flush=True)
                    next_say = time.monotonic() + timeouts.NODE_SHORTAGE_SAY_S
                deadline = time.monotonic() + run.timeouts.build
                time.sleep(timeouts.WORKER_POLL_S)
                continue
            value = JobLayout.from_dict(run.membership.decide(name, planned.to_dict()).value)
            break
        if time.monotonic() > deadline:
            raise RuntimeError(f"survivors {sorted(set(waiting_for) - set(ready))} did not reach the barrier of "
                               f"generation {generation}")
        time.sleep(timeouts.DECISION_POLL_S)
    _publish_layout(run, value)
    print(f"node {run.node}: generation {value.generation} starts at step {value.start_step} "
          f"({value.mode.value}, attempt {attempt + 1}): ranks {value.ranks}, "
          f"{len(value.transfers.transfers)} transfers of {value.transfers.bytes_moved} bytes", flush=True)
    return value


def _plan_next(run: _Run, base: Any, ready: dict[str, BarrierReady], attempt: int, reason: str) -> Any:
    """The next layout from the holders' ``ready`` records at the barrier of ``base``."""
    from bamboo.launch.reconfigure import build_view, next_history, restore_point, warm_standby
    from bamboo.reconfig import JobLayout, RestorePoint, StartMode, TransferPlan, plan_layout, plan_transfers

    spec = run.spec
    records = run.membership.list_nodes(skip_malformed=True)
    # a holder whose lease expired (or was revoked) since it published what it holds is dead: no transfer from it
    ready = {node: record for node, record in ready.items() if node in records} or ready
    # A consecutive failure can leave one pipeline committed at step k+1 while the broken one's
    # survivors abandoned step k: the committed state already holds the whole global batch of k,
    # so the next generation starts from the newest step, held by the nodes that reached it.
    step = max(record.step for record in ready.values())
    holdings = {node: record.holds for node, record in ready.items() if record.step == step}
    dead = [node for node in base.ranks if node not in ready]
    standby = [node for node in warm_standby(run.membership, records) if node not in base.ranks]
    usable = sorted(set(ready) | set(standby))
    zones = {**base.zones, **{n: record.zone for n, record in records.items()}}
    view = build_view(base, zones, usable, dead, run.layers, spec.pipelines)
    plan = plan_layout(view)
    global_batch = base.global_batch
    pipelines = len(plan.owners)
    if plan.stages != spec.stages or pipelines == 0:
        raise NotEnoughNodes(f"{len(usable)} nodes left cannot form a pipeline of {spec.stages} stages")
    if global_batch % pipelines:
        raise JobCannotContinue(f"cannot keep the global batch of {global_batch} microbatches over {pipelines} "
                                "pipelines")
    held = base.holdings_of_stages({node: holdings.get(node, ()) for node in usable})
    transfers = plan_transfers(base.plan, plan, held)
    mode, start, restore = StartMode.PEERS, step, None
    if transfers.restore_from_checkpoint:  # no survivor holds these stages: every node restarts from a checkpoint
        missing = list(transfers.stages_without_copy)
        try:
            start, path = restore_point(spec.checkpoint_dir, spec.stages, missing)
        except RuntimeError as error:
            raise JobCannotContinue(str(error)) from None
        mode, restore = StartMode.CHECKPOINT, RestorePoint(start, path, missing)
        transfers = TransferPlan(rounds=(), bytes_moved=0, naive_bytes=transfers.naive_bytes)
    return JobLayout(
        generation=base.generation + 1 + attempt, plan=plan, start_step=start, mode=mode, reason=reason,
        transfers=transfers, restore=restore, barrier_step=step,
        # when the first holder reached the barrier (wall clock): the reconfiguration's duration counts from
        # it, whichever node writes the record (the lowest rank may be a joiner that started later)
        barrier_unix=min(record.at for record in ready.values()),
        base_generation=base.generation, attempt=attempt, survivors=sorted(ready),
        history=next_history(base.history, start, pipelines),
        zones={node: zones.get(node, "default") for node in (*plan.slots(), *plan.standby)},
    )


def _receive_state(run: _Run, layout: Any, old: Any, executor: Any, store: Any) -> None:
    """Fill the new executor's slices: local copies, transfers by the plan, or the last checkpoint."""
    from bamboo.reconfig import StartMode

    if layout.mode is StartMode.FIRST:
        return
    if layout.mode is StartMode.CHECKPOINT:  # every node loads the checkpoint the layout names
        from bamboo.launch.reconfigure import restore_slices

        restore_slices(layout, executor.slices)
        return
    if old is not None:
        for stage, piece in executor.slices.items():
            if stage in old.slices and old.slices[stage].steps == layout.start_step:
                piece.load_state_bytes(old.slices[stage].state_bytes())
    _run_transfers(run, layout, old, executor, store)


def _run_transfers(run: _Run, layout: Any, old: Any, executor: Any | None, store: Any) -> None:
    """This node's part of the layout's transfer plan, round by round: send what ``old`` holds and, with an
    ``executor`` (a node with a role in the layout), receive into its slices.

    In a round a node sends at most one transfer and receives at most one (bamboo-reconfig's plan); the
    send runs in a thread while the receive runs here, so two nodes that exchange in one round never wait
    on each other.
    """
    from bamboo.launch.reconfigure import transfer_participants
    from bamboo.rc.comm import build_gloo_group, keep_until_settled
    from bamboo.rc.transfer import export_stage_state, import_stage_state

    plan = layout.transfers
    if not any(run.node in (t.source, t.destination) for t in plan.transfers):
        return
    members = transfer_participants(plan)
    group = build_gloo_group(store, f"bamboo/{run.spec.job}/g{layout.generation}/transfer/",
                             members.index(run.node), len(members), run.timeouts.group)
    # Transfers are synchronous: the group is freed at the next membership change (a thread still blocked on a
    # dead peer holds it until its operation times out, and frees it there, off the training thread).
    keep_until_settled(group)
    pause_s = float(os.environ.get(TRANSFER_PAUSE_ENV, "0") or 0)
    if pause_s > 0:  # test hook: the group is formed, no byte has moved yet
        run.membership.decide(f"g{layout.generation}-transfer-group-{run.node}", {"pause_s": pause_s})
        time.sleep(pause_s)
    for round_ in plan.rounds:
        sending = [t for t in round_ if t.source == run.node]
        receiving = [t for t in round_ if t.destination == run.node]
        errors: list[BaseException] = []

        def send(transfer: Any, errors: list[BaseException] = errors) -> None:
            try:
                stages = layout.stages_of_layers(transfer.layers)
                export_stage_state({s: old.slices[s] for s in stages}, group, members.index(transfer.destination))
            except BaseException as error:
                errors.append(error)

        senders = [threading.Thread(target=send, args=(t,), daemon=True) for t in sending]
        for thread in senders:
            thread.start()
        for transfer in receiving:
            assert executor is not None, "a node without a role in the layout receives nothing"
            import_stage_state(executor.slices, group, members.index(transfer.source))
        for thread in senders:
            thread.join()
        if errors:
            raise errors[0]


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
        membership = _fenced(MembershipStore(kv, context.job), context)
        line = f"{type(error).__name__}: {error}".splitlines()[0][:500]
        membership.decide(f"error-{context.node}", WorkerError(context.node, line, time.time()).to_dict())
        if isinstance(error, JobCannotContinue):
            membership.decide("end", JobEnd(steps=0, error=line, node=context.node).to_dict())
        kv.close()
    except Exception as failure:  # etcd gone, or this node was fenced: the agent reports the exit status
        print(f"node {context.node}: could not publish the error: {failure}", file=sys.stderr, flush=True)


if __name__ == "__main__":  # pragma: no cover
    main()
