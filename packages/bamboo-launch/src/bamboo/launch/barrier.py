"""The barrier between two generations, and the decision of the next layout.

At the barrier of generation g every holder publishes the stages it holds (``g<g>-ready-<node>``, a
:class:`bamboo.launch.records.BarrierReady`); the first to see every expected holder plans the next layout
(:func:`plan_next`: bamboo-reconfig's placement and transfer plan, or a restore) and writes it first
writer wins (``g<g>-next``); everyone uses the winner's. A retry after an abandoned attempt k uses the
names ``g<g>-a<k>-...`` and generation g+1+k. See :mod:`bamboo.launch.reconfigure`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

from bamboo.launch import timeouts
from bamboo.launch.records import BarrierReady
from bamboo.launch.redundancy import choices_for, holds_replicas, with_mode
from bamboo.launch.session import NotEnoughNodes, WorkerSession, decision_prefix
from bamboo.membership.kv import StoreError

if TYPE_CHECKING:
    from bamboo.membership import NodeRecord
    from bamboo.reconfig import JobLayout

__all__ = ["next_attempt_layout", "next_layout", "plan_next", "publish_layout"]


def publish_layout(run: WorkerSession, layout: JobLayout) -> None:
    """Make ``layout`` the layout in etcd unless a later one is there (any node may do it: its writer may be dead)."""
    current = run.membership.get_layout()
    if current is not None and int(current.value.get("generation", 0)) < layout.generation:
        run.membership.put_layout(layout.to_dict(), current.revision)


def next_attempt_layout(run: WorkerSession, layout: JobLayout) -> JobLayout | None:
    """For a node that held no state in the abandoned attempt ``layout``: the next attempt's layout (None once
    the job has ended).

    When nodes held state at the barrier it starts from (``layout.survivors``), they decide the next layout, or
    the job goes on without their decision (:func:`_survivors_next`). A start that no node's state goes into (no
    survivors: the first layout, or the coordinator's restart of every stage from a checkpoint) is redone by
    whichever of its nodes decides first, on the nodes registered now: no step of it was trained, so nothing is
    lost.
    """
    root = layout.generation if layout.base_generation is None else int(layout.base_generation)
    name = f"{decision_prefix(root, layout.attempt + 1)}next"
    value = _survivors_next(run, layout, name) if layout.survivors else _redo_start(run, layout, name)
    if value is None:
        return None
    publish_layout(run, value)
    return value


def _survivors_next(run: WorkerSession, lost: JobLayout, name: str) -> JobLayout | None:
    """The layout that the survivors of the abandoned start ``lost`` decide next (decision ``name``), or the job's
    layout once a generation after ``lost`` is published without that decision; None once the job has ended.

    A newer layout means the job went on without this decision: the survivors' own next attempt, or, once every
    survivor was lost, the coordinator's restart of every stage from the nearest copy. This node held no state in
    ``lost``, so it goes on from the job's layout. Waiting for the decision alone, a node waited out the build
    timeout (``CommTimeouts.build``, 120 s) while the job had moved on: under heavy churn a live, warm node sat
    out a restore that was waiting for nodes."""
    from bamboo.reconfig import JobLayout

    deadline = time.monotonic() + run.timeouts.build
    while True:
        seen = run.roles.changes()
        if run.ended() is not None:
            return None
        try:
            found = run.membership.get_decision(name)
        except StoreError:  # etcd restarting: look again
            found = None
        if found is not None:
            return JobLayout.from_dict(found.value)
        current = run.layout()
        if current is not None and current.generation > lost.generation:
            return current
        if time.monotonic() > deadline:
            raise RuntimeError(f"decision {name} not taken within {run.timeouts.build:g} s")
        run.roles.wait_change(seen, timeouts.DECISION_POLL_S)


def _redo_start(run: WorkerSession, lost: JobLayout, name: str) -> JobLayout | None:
    """Decide (first writer wins, as decision ``name``) the layout that redoes the abandoned start ``lost`` on
    the nodes registered now (as the first layout does), waiting while they are too few for one pipeline;
    None once the job ended."""
    from bamboo.launch.coordinator_layouts import redo_start_layout
    from bamboo.launch.reconfigure import live_restore
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
        planned = redo_start_layout(run.spec, live_restore(run.membership.kv, run.spec, lost, records), sorted(records),
                                    zones)
        if planned is not None:
            planned = with_mode(run.spec, planned, run.membership.kv, reader=run.event_reader)
            return JobLayout.from_dict(run.membership.decide(name, planned.to_dict()).value)
        if time.monotonic() >= next_say:
            print(f"node {run.node}: generation {lost.generation} was abandoned before its first step and the "
                  f"{len(records)} nodes left cannot form a pipeline of {run.spec.stages} stages; waiting for "
                  "more nodes", flush=True)
            next_say = time.monotonic() + timeouts.NODE_SHORTAGE_SAY_S
        time.sleep(timeouts.WORKER_POLL_S)


def next_layout(run: WorkerSession, base: JobLayout,
                expected: Callable[[dict[str, NodeRecord]], Sequence[str]], attempt: int,
                reason: str) -> JobLayout:
    """Wait for every expected holder at the barrier of ``base``, then the next layout (first writer wins).

    ``expected(records)`` lists the nodes that must publish what they hold, given the registered nodes;
    ``attempt`` counts the abandoned starts of this barrier so far (each retry has its own decision names). An
    expected holder that has not published :data:`~bamboo.launch.timeouts.STRAGGLER_S` into the wait is reported
    to this node's agent as a suspect, once: one killed at the barrier leaves the membership when the probe finds it
    dead, not when its lease expires.
    """
    from bamboo.reconfig import JobLayout

    generation = base.generation
    prefix = decision_prefix(generation, attempt)
    name = f"{prefix}next"
    # A survivor may reach the barrier only after its own confirmation wait or group timeout.
    deadline = time.monotonic() + run.timeouts.build
    suspect_at = time.monotonic() + timeouts.STRAGGLER_S
    next_say = 0.0
    ready: dict[str, BarrierReady] = {}
    written: dict[str, BarrierReady] = {}  # every ready record read; each read takes those written since the last
    ready_read = 0  # (one request, where reading each node's record was one request a node at every poll)
    suspected: set[str] = set()
    value: JobLayout | None = None
    while value is None:
        existing = run.membership.get_decision(name)
        if existing is not None:
            value = JobLayout.from_dict(existing.value)
            break
        records = run.membership.list_nodes(skip_malformed=True)
        waiting_for = expected(records)
        new, ready_read = run.membership.read_decisions(f"{prefix}ready-", changed_after=ready_read)
        written.update({key.removeprefix(f"{prefix}ready-"): BarrierReady.from_dict(found.value)
                        for key, found in new.items()})
        for other in waiting_for:
            if other in written:
                ready.setdefault(other, written[other])
        if all(other in ready for other in waiting_for):
            try:
                planned = plan_next(run, base, ready, attempt, reason)
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
        if time.monotonic() >= suspect_at:
            for other in sorted(set(waiting_for) - set(ready) - suspected - {run.node}):
                suspected.add(other)
                run.report_suspect(other, f"not at the barrier of generation {generation} after "
                                          f"{timeouts.STRAGGLER_S:g} s")
        time.sleep(timeouts.DECISION_POLL_S)
    publish_layout(run, value)
    print(f"node {run.node}: generation {value.generation} starts at step {value.start_step} "
          f"({value.mode.value}, attempt {attempt + 1}): ranks {value.ranks}, "
          f"{len(value.transfers.transfers)} transfers of {value.transfers.bytes_moved} bytes", flush=True)
    return value


def plan_next(run: WorkerSession, base: JobLayout, ready: dict[str, BarrierReady], attempt: int,
              reason: str) -> JobLayout:
    """The next layout from the holders' ``ready`` records at the barrier of ``base``."""
    from bamboo.launch.reconfigure import build_view, nearest_restore, next_history, warm_standby
    from bamboo.reconfig import JobLayout, StartMode, TransferPlan, plan_layout, plan_transfers

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
    pipelines = len(plan.owners)
    if plan.stages != spec.stages or pipelines == 0:
        raise NotEnoughNodes(f"{len(usable)} nodes left cannot form a pipeline of {spec.stages} stages")
    held = base.holdings_of_stages({node: holdings.get(node, ()) for node in usable})
    # the dead nodes' records may still be on their way
    choices = choices_for(spec, plan, run.membership.kv, lost=dead, reader=run.event_reader)
    transfers = plan_transfers(base.plan, plan, held, replicas=holds_replicas(spec, choices.redundancy))
    mode, start, restore = StartMode.PEERS, step, None
    if transfers.restore_from_checkpoint:  # no survivor holds these stages: every node restarts from a copy
        missing = list(transfers.stages_without_copy)
        restore = nearest_restore(run.membership.kv, spec, missing, base.stage_bounds, records, base.history)
        mode, start = StartMode.CHECKPOINT, restore.step
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
        redundancy=choices.redundancy, restore_every=choices.restore_every,
    )
