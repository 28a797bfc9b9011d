"""Starting a layout on this node: its engine, the stage state it needs, as one attempt.

Every start of a layout, the first one's included, is an attempt that every node of it commits to or all
abandon (:mod:`bamboo.launch.attempt`). This node's part runs in a thread: its engine (bamboo-rc's
``initialize`` with exactly the layout's stage bounds), and its slices' state from where the layout says
(its own previous executor, the transfer plan over a gloo group round by round, or a checkpoint); a node
that only sends (it leaves for standby) runs its transfers alone.
"""

from __future__ import annotations

import enum
import os
import threading
import time
from typing import TYPE_CHECKING, Final, TypeVar

import attrs
from bamboo.launch import timeouts
from bamboo.launch.records import NodeUp
from bamboo.launch.session import WorkerSession

if TYPE_CHECKING:
    from bamboo.launch.attempt import AbandonableStore, StartThread
    from bamboo.rc import Engine, StageExecutor
    from bamboo.reconfig import JobLayout, Transfer
    from torch.distributed import Store
    from torch.distributed.distributed_c10d import ProcessGroupGloo

__all__ = ["ABANDONED", "TRANSFER_PAUSE_ENV", "Abandoned", "StartMarks", "build_engine", "follow_attempt", "move_state",
           "receive_state", "release_executor", "run_transfers", "start_attempt", "start_engine", "transfer_group"]

TRANSFER_PAUSE_ENV = "BAMBOO_LAUNCH_TEST_TRANSFER_PAUSE_S"
"""Test hook: seconds every member of a reconfiguration's transfer group waits once the group is formed,
after publishing decision ``g<G>-transfer-group-<node>`` (so that a test can kill a node mid-transfer)."""

T = TypeVar("T")


class Abandoned(enum.Enum):
    """The type of :data:`ABANDONED`, its one value."""

    ABANDONED = "abandoned"


ABANDONED: Final = Abandoned.ABANDONED
"""What :func:`start_attempt` returns when the attempt's outcome was ``abort``."""


def release_executor(old: StageExecutor) -> None:
    """Let the executor of a layout that ended go (its state is in the next layout's, or handed over): its
    groups are freed once their operations have finished, its failure notices stop watching, and its
    tensors are freed with it. Keeping it would hold, per membership change, a copy of this node's stages
    and optimizer state, and every group's sockets and threads."""
    old.release()
    if old.notices is not None:
        old.notices.close()


@attrs.define
class StartMarks:
    """When each part of this node's start ended (wall clock), for its ``up`` record (see
    :mod:`bamboo.launch.pauses`): it ``stopped`` training the previous layout (None: a node that held nothing),
    its worker became ``warm`` (its model built, waiting for a role), it had the layout (``planned``), built its
    engine and groups (``built``), and had its state (``state``)."""

    stopped: float | None = None
    warm: float | None = None
    planned: float = attrs.field(factory=time.time)
    built: float | None = None
    state: float | None = None

    def up(self, node: str) -> NodeUp:
        return NodeUp(node, at=time.time(), stopped=self.stopped, planned=self.planned, built=self.built,
                      state=self.state, warm=self.warm)


def build_engine(run: WorkerSession, layout: JobLayout, store: Store) -> Engine:
    """This node's engine for ``layout`` (its stages' layers, its gloo groups), before any state is put in it."""
    from bamboo.launch.notices import EtcdFailureNotices
    from bamboo.launch.redundancy import layout_mode
    from bamboo.rc import initialize
    from bamboo.reconfig import microbatch_shares

    spec, ranks, mode = run.spec, layout.ranks, layout_mode(run.spec, layout)
    job = f"{spec.job}-g{layout.generation}"
    notices = (EtcdFailureNotices(run.membership, layout.generation, run.agent, layout.node_of_rank)
               if mode != "none" else None)
    # this node's pipeline's share of the global batch (the first G mod D pipelines one microbatch more)
    share = microbatch_shares(layout.global_batch, layout.pipelines)[ranks[run.node] // spec.stages]
    config = {**spec.config, "gradient_accumulation_steps": share}
    return initialize(
        list(run.program.layers), config, mode, loss_fn=run.program.loss_fn, stages=spec.stages,
        rank=ranks[run.node], world_size=spec.stages * layout.pipelines, store=store, seed=spec.seed, job=job,
        timeouts=run.timeouts, notices=notices, global_microbatches=layout.global_batch,
        stage_bounds=layout.stage_bounds, microbatch=run.program.microbatch,
    )


def start_engine(run: WorkerSession, layout: JobLayout, old: StageExecutor | None, store: Store,
                 marks: StartMarks) -> Engine:
    """This node's engine for ``layout``, with its stage state (from ``old``, peers or a checkpoint) in place."""
    engine = build_engine(run, layout, store)
    marks.built = time.time()
    receive_state(run, layout, old, engine.executor, store)
    marks.state = time.time()
    engine.executor.step = layout.start_step
    return engine


def start_attempt(run: WorkerSession, layout: JobLayout, old: StageExecutor | None,
                  stopped: float | None = None) -> Engine | Abandoned | None:
    """Start ``layout`` as one attempt (:mod:`bamboo.launch.attempt`): this node's engine on ``go``,
    :data:`ABANDONED` on ``abort``; a node that is not in the layout (a source leaving for standby, or a
    holder kept for a possible retry) does its transfers and returns None on ``go``. ``stopped``: when this
    node stopped training the previous layout (None: it held nothing)."""
    from bamboo.launch.attempt import AbandonableStore, StartThread

    store = AbandonableStore(run.store)
    marks = StartMarks(stopped=stopped, warm=run.warm_at)
    part: StartThread[Engine | None]
    if run.node in layout.ranks:
        part = StartThread(lambda: start_engine(run, layout, old, store, marks), name=f"bamboo-start-g{layout.generation}")
    else:
        part = StartThread(lambda: run_transfers(run, layout, old, None, store),
                           name=f"bamboo-serve-g{layout.generation}")
    return follow_attempt(run, layout, part, store, marks)


def follow_attempt(run: WorkerSession, layout: JobLayout, part: StartThread[T], store: AbandonableStore,
                   marks: StartMarks) -> T | Abandoned | None:
    """Wait for the outcome of attempt ``layout`` while ``part`` (a :class:`bamboo.launch.attempt.StartThread`)
    does this node's part: its result on ``go``, :data:`ABANDONED` (the part given up) on ``abort``."""
    from bamboo.launch.attempt import AttemptWake, await_outcome

    generation = layout.generation
    owners = set(layout.ranks)
    sources = {transfer.source for transfer in layout.transfers.transfers}
    wake = AttemptWake(run.membership, generation, part)  # the outcome written or this part's end: at once
    try:
        outcome = await_outcome(run.membership, generation, run.node, owners, owners | sources, part.progress,
                                run.spec.reconfigure_timeout_s, sleep=wake.sleep,
                                say=lambda line: print(f"node {run.node}: {line}", flush=True),
                                up_record=lambda: marks.up(run.node),
                                suspect=lambda other: run.report_suspect(
                                    other, f"not up in the attempt of generation {generation} after the straggler "
                                           "wait"),  # STRAGGLER_S, or FIRST_STRAGGLER_S on the first owner
                                waited_s=store.waited_s)
    finally:
        wake.close()
    if outcome.go:
        part.join(run.timeouts.group)  # every owner is up, so every transfer of this node is done
        done, error = part.progress()
        if not done or error is not None:
            raise RuntimeError(f"generation {generation} went ahead without this node's part: {error}")
        return part.result
    print(f"node {run.node}: generation {generation} abandoned: {outcome.reason}", flush=True)
    store.abandon()
    part.abandon(lambda engine: release_executor(engine.executor) if hasattr(engine, "executor") else None)
    # A thread blocked in gloo on a dead peer stays blocked until the group's timeout; what it holds goes then.
    part.join(timeouts.ABANDONED_JOIN_S)
    return ABANDONED


def receive_state(run: WorkerSession, layout: JobLayout, old: StageExecutor | None, executor: StageExecutor,
                  store: Store) -> None:
    """Fill the new executor's slices: local copies, transfers by the plan, or the last checkpoint."""
    from bamboo.reconfig import StartMode

    if layout.mode is StartMode.FIRST:
        return
    if layout.mode is StartMode.CHECKPOINT:  # every node loads the checkpoint the layout names
        from bamboo.launch.reconfigure import restore_slices

        restore_slices(layout, executor.slices, run.copies)
        return
    move_state(run, layout, old, executor, transfer_group(run, layout, store))


def run_transfers(run: WorkerSession, layout: JobLayout, old: StageExecutor | None,
                  executor: StageExecutor | None, store: Store) -> None:
    """This node's part of the layout's transfer plan (see :func:`move_state`), over a group built now."""
    move_state(run, layout, old, executor, transfer_group(run, layout, store))


def transfer_group(run: WorkerSession, layout: JobLayout, store: Store) -> ProcessGroupGloo | None:
    """The gloo group of the layout's transfer plan (every source and receiver), or None when this node has no
    part in it. Transfers are synchronous: the group is freed at the next membership change (a thread still
    blocked on a dead peer holds it until its operation times out, and frees it there, off the training
    thread)."""
    from bamboo.launch.reconfigure import transfer_participants
    from bamboo.rc.comm import build_gloo_group, keep_until_settled

    plan = layout.transfers
    if not any(run.node in (t.source, t.destination) for t in plan.transfers):
        return None
    members = transfer_participants(plan)
    group = build_gloo_group(store, f"bamboo/{run.spec.job}/g{layout.generation}/transfer/",
                             members.index(run.node), len(members), run.timeouts.group)
    keep_until_settled(group)
    return group


def move_state(run: WorkerSession, layout: JobLayout, old: StageExecutor | None,
               executor: StageExecutor | None, group: ProcessGroupGloo | None) -> None:
    """Put this node's state for ``layout`` in place: the stages ``old`` (this node's previous executor) holds
    at the layout's start step are copied into ``executor``'s slices, then the transfer plan runs round by
    round over ``group``: this node sends what ``old`` holds and, with an ``executor``, receives into its slices.

    In a round a node sends at most one transfer and receives at most one (bamboo-reconfig's plan); the
    send runs in a thread while the receive runs here, so two nodes that exchange in one round never wait
    on each other. A stage sent must be at the layout's start step (a RuntimeError otherwise).
    """
    from bamboo.rc.transfer import export_stage_state, import_stage_state

    if executor is not None and old is not None:
        for stage, piece in executor.slices.items():
            if stage in old.slices and old.slices[stage].steps == layout.start_step:
                piece.load_state(old.slices[stage].snapshot())  # cloned tensors: no serialisation
    if group is None:
        return
    members = transfer_participants_of(layout)
    pause_s = float(os.environ.get(TRANSFER_PAUSE_ENV, "0") or 0)
    if pause_s > 0:  # test hook: the group is formed, no byte has moved yet
        run.membership.decide(f"g{layout.generation}-transfer-group-{run.node}", {"pause_s": pause_s})
        time.sleep(pause_s)
    for round_ in layout.transfers.rounds:
        sending = [t for t in round_ if t.source == run.node]
        receiving = [t for t in round_ if t.destination == run.node]
        errors: list[BaseException] = []

        def send(transfer: Transfer, errors: list[BaseException] = errors) -> None:
            try:
                stages = layout.stages_of_layers(transfer.layers)
                stale = [s for s in stages if old.slices[s].steps != layout.start_step]
                if stale:
                    raise RuntimeError(f"stage(s) {stale} of {run.node} are not at step {layout.start_step}")
                try:
                    export_stage_state({s: old.slices[s] for s in stages}, group, members.index(transfer.destination))
                except RuntimeError as error:
                    _suspect(run, transfer.destination, layout.generation, error)
                    raise
            except BaseException as error:
                errors.append(error)

        senders = [threading.Thread(target=send, args=(t,), daemon=True) for t in sending]
        for thread in senders:
            thread.start()
        for transfer in receiving:
            assert executor is not None, "a node without a role in the layout receives nothing"
            try:
                import_stage_state(executor.slices, group, members.index(transfer.source))
            except RuntimeError as error:
                _suspect(run, transfer.source, layout.generation, error)
                raise
        for thread in senders:
            thread.join()
        if errors:
            raise errors[0]


def _suspect(run: WorkerSession, peer: str, generation: int, error: RuntimeError) -> None:
    """A transfer with ``peer`` failed in gloo: tell this node's agent, whose detector probes it. A joiner that died
    is in no training pipeline, so no one else reports it: the next attempt had included it until its lease expired
    (``--ttl``), 2 s of a measured reconfiguration's pause. An abandoned attempt's own error names no peer."""
    from bamboo.launch.attempt import AttemptAbandonedError

    if not isinstance(error, AttemptAbandonedError) and peer != run.node:
        run.report_suspect(peer, f"a transfer of generation {generation} failed: {error}")


def transfer_participants_of(layout: JobLayout) -> list[str]:
    """Members of the layout's transfer group, in group-rank order."""
    from bamboo.launch.reconfigure import transfer_participants

    return transfer_participants(layout.transfers)
