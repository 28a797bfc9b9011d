"""The job's elected coordinator: the agent that publishes failures and writes the first layout.

Every ``bamboo-launch agent`` runs a :class:`Coordinator`. One of them at a time is *elected*: it
holds the key ``/bamboo/<job>/leader`` under its own lease (created first-writer-wins). When the
elected agent dies, its lease is revoked as soon as its failure is confirmed (or expires after the
TTL), the key goes with it, and the next agent to try takes over; killing the coordinator is just
another failure. Everything it does is idempotent and read back from etcd, so a new coordinator
carries on where the old one stopped. Its duties:

- **Publish confirmed failures at once.** Every agent's failure detector confirms failures (a refused
  probe after a neighbour's report, another incarnation, an expired lease) and writes one report per
  node to etcd; the coordinator reads them back. For each ranked node of the current layout whose
  death is not yet in a published event, it first probes every other node of the layout in parallel
  (so kills that landed together are confirmed together), then publishes one
  :class:`bamboo.rc.FailureEvent` with all of them, first-writer-wins, as decision
  ``g<generation>-epoch-<n>`` (:func:`bamboo.launch.notices.publish_failure_event`). A node confirmed
  later is a second failure, which the runtime survives. No batching window: the runtime acts within
  milliseconds of the confirmation.
- **Preemption records.** Once per confirmed node (decision ``preempted-<node>``), a ``preemption``
  event for the report (billing stops).
- **The first layout.** Once the job's spec asks for it (``min_nodes`` registered, P x D by default)
  and no node has registered for :data:`~bamboo.launch.timeouts.FIRST_LAYOUT_SETTLE_S`, it places the
  registered nodes with :func:`bamboo.reconfig.plan_layout` and writes generation 0 with
  compare-and-swap (only when there is no layout yet).
- **A layout nobody holds any more.** The workers themselves move from one layout to the next at a
  barrier. When every node of the current layout (its owners and the holders it came from) is gone, no
  worker is left to do it: the coordinator then writes the next generation itself, restarting every
  stage from the newest good checkpoint on the warm standby nodes (as soon as they can form a pipeline),
  or, without a checkpoint, ends the job with the error.

Every write goes through the agent's fenced store: a coordinator that was declared dead (its lease is
gone) cannot write anything more.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from bamboo.launch import timeouts
from bamboo.launch.events import Preemption
from bamboo.launch.notices import publish_failure_event, published_events
from bamboo.launch.records import Leader, Preempted
from bamboo.launch.spec import JobSpec
from bamboo.membership.kv import StoreError
from bamboo.membership.records import FailureReport, MalformedValueError, decode_message
from bamboo.rc import FailureEvent

__all__ = ["Coordinator", "first_layout", "published_events", "read_layout", "redo_start_layout", "restart_layout",
           "steps_reached"]

log = logging.getLogger(__name__)


def read_layout(membership: Any) -> Any:
    """The job's current :class:`bamboo.reconfig.JobLayout`, or None before the first one."""
    from bamboo.reconfig import JobLayout

    found = membership.get_layout()
    return None if found is None else JobLayout.from_dict(found.value)


def first_layout(spec: JobSpec, zones: dict[str, str]) -> Any:
    """Generation 0 for the registered nodes (node -> zone): bamboo-reconfig's placement of them.

    With ``spec.resume`` every stage starts from the newest good checkpoint in ``spec.checkpoint_dir``, at
    its step, with the history the checkpoint recorded (RuntimeError when there is none).
    """
    from bamboo.launch.reconfigure import checkpoint_history, restore_point
    from bamboo.reconfig import ClusterView, JobLayout, Node, RestorePoint, StartMode, plan_layout

    view = ClusterView(nodes=[Node(node, zone or "default", "standby") for node, zone in sorted(zones.items())],
                       target_stages=spec.stages, target_pipelines=spec.pipelines,
                       global_batch=spec.micro_batches * spec.pipelines, layers=spec.reconfig_layers())
    plan = plan_layout(view)
    if plan.stages != spec.stages or not plan.owners:
        raise RuntimeError(f"{len(zones)} nodes cannot form a pipeline of {spec.stages} stages")
    if not spec.resume:
        return JobLayout(generation=0, plan=plan, zones=zones)
    step, path = restore_point(spec.checkpoint_dir, spec.stages, range(spec.stages))
    history = [item for item in checkpoint_history(path) if item[0] < step] + [(step, len(plan.owners))]
    return JobLayout(generation=0, plan=plan, start_step=step, mode=StartMode.CHECKPOINT, reason="resume",
                     restore=RestorePoint(step, path, range(spec.stages)), barrier_step=step, history=history,
                     zones=zones)


def _place_afresh(spec: JobSpec, nodes: list[str], zones: dict[str, str], global_batch: int) -> Any:
    """bamboo-reconfig's placement of ``nodes``, none of which holds state, keeping ``global_batch``
    microbatches; None when they cannot form a pipeline of ``spec.stages`` or split the global batch."""
    from bamboo.reconfig import ClusterView, Node, plan_layout

    if len(nodes) < spec.stages:
        return None
    view = ClusterView(nodes=[Node(node, zones.get(node) or "default", "standby") for node in nodes],
                       target_stages=spec.stages, target_pipelines=spec.pipelines,
                       global_batch=global_batch, layers=spec.reconfig_layers())
    plan = plan_layout(view)
    if plan.stages != spec.stages or not plan.owners or global_batch % len(plan.owners):
        return None
    return plan


def steps_reached(events: Iterable[Any], lost: Any, created_unix: float) -> int:
    """The last step generation ``lost`` (a ``JobLayout``) completed, from the job's event log: the highest
    ``step`` record of that generation (``lost.start_step`` when it recorded none).

    A record that names its ``generation`` is judged by it. One that names none (written before records
    carried it) counts if it was written after the generation's barrier: the log's ``t`` counts from
    ``created_unix``, so that test is only as good as the writers' clocks, whose skew can move a record
    across the barrier."""
    from bamboo.launch.events import Step

    since = 0.0 if lost.barrier_unix is None else lost.barrier_unix - created_unix

    def its_own(record: Step) -> bool:
        return record.generation == lost.generation if record.generation is not None else record.t >= since

    return max((e.step for e in events if isinstance(e, Step) and its_own(e)), default=lost.start_step)


def restart_layout(spec: JobSpec, lost: Any, warm: list[str], zones: dict[str, str], step: int,
                   path: str, reached: int | None = None, memory: dict[int, tuple[str, ...]] | None = None,
                   initial: bool = False) -> Any:
    """The generation after ``lost`` (a ``JobLayout`` none of whose nodes is alive) on the ``warm`` nodes,
    every stage restored from the checkpoint of ``step`` at ``path``; None when they cannot form a pipeline.

    ``reached`` is the last step ``lost`` completed (:func:`steps_reached`; default its start step): the
    steps after the checkpoint up to it are trained again (the ``restore`` record's ``discarded_steps``).
    ``memory`` (stage -> the live nodes that keep it at ``step``) restores from in-memory copies instead of
    ``path``; ``initial`` starts over from the seeded initial state (step 0)."""
    from bamboo.launch.reconfigure import next_history
    from bamboo.reconfig import JobLayout, RestorePoint, StartMode

    plan = _place_afresh(spec, warm, zones, lost.global_batch)
    if plan is None:
        return None
    return JobLayout(generation=lost.generation + 1, plan=plan, start_step=step, mode=StartMode.CHECKPOINT,
                     reason="every holder lost",
                     restore=RestorePoint(step, path, range(spec.stages), memory=memory or {}, initial=initial),
                     barrier_step=lost.start_step if reached is None else max(lost.start_step, reached),
                     barrier_unix=time.time(), base_generation=lost.generation,
                     survivors=(), history=next_history(lost.history, step, len(plan.owners)),
                     zones={node: zones.get(node, "default") for node in warm})


def redo_start_layout(spec: JobSpec, lost: Any, nodes: list[str], zones: dict[str, str]) -> Any:
    """The layout that redoes the start of ``lost`` on ``nodes``; None when they cannot form a pipeline.

    ``lost`` is a ``JobLayout`` whose start was abandoned before its first step (a node of it was lost while
    the workers built their groups) and that no node's state went into (``lost.survivors`` is empty: the
    first layout, or a restart of every stage from a checkpoint). Its start is repeated as it was (the same
    step, mode and restore point) with the nodes there are now: the next generation, one more attempt of the
    same barrier.
    """
    from bamboo.launch.reconfigure import next_history
    from bamboo.reconfig import JobLayout

    if lost.survivors:
        raise ValueError(f"generation {lost.generation} starts from the state of {list(lost.survivors)}: its "
                         "holders decide the next attempt")
    plan = _place_afresh(spec, nodes, zones, lost.global_batch)
    if plan is None:
        return None
    return JobLayout(generation=lost.generation + 1, plan=plan, start_step=lost.start_step, mode=lost.mode,
                     reason="a node lost before the first step", restore=lost.restore,
                     barrier_step=lost.barrier_step, barrier_unix=time.time(),
                     base_generation=lost.generation if lost.base_generation is None else lost.base_generation,
                     attempt=lost.attempt + 1, survivors=(),
                     history=next_history(lost.history, lost.start_step, len(plan.owners)),
                     zones={node: zones.get(node, "default") for node in nodes})


class Coordinator:
    """The coordinator duties of one agent, active while it is elected (see the module docstring).

    ``membership`` is the agent's fenced ``MembershipStore``; ``agent`` its ``NodeAgent`` (the lease the
    leader key is held by, and the failure detector); ``events`` its event log. ``clock`` is monotonic
    seconds (injected in tests).
    """

    def __init__(
        self,
        membership: Any,
        agent: Any,
        spec: JobSpec,
        events: Any,
        *,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = lambda line: None,
    ) -> None:
        self.membership = membership
        self.agent = agent
        self.node = agent.node_id
        self.spec = spec
        self.events = events
        self.clock = clock
        self.say = say
        self.leader = False
        self.published: list[tuple[int, FailureEvent]] = []
        self._key = membership.keys.root + "leader"
        self._wake = threading.Condition()
        self._woken = False
        self._stop = threading.Event()
        self._preempted: set[str] = set()
        self._zones: dict[str, str] = {}
        self._registered_count = -1
        self._settle_from = 0.0
        self._thread = threading.Thread(target=self._loop, name=f"bamboo-coordinator-{self.node}", daemon=True)

    def start(self) -> Coordinator:
        if self.agent.detector is not None:
            self.agent.detector.subscribe(lambda _event: self.wake())
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeouts.THREAD_JOIN_S)

    def wake(self) -> None:
        with self._wake:
            self._woken = True
            self._wake.notify_all()

    # ---- election -----------------------------------------------------------------------------------

    def _campaign(self) -> bool:
        """Take the leader key if nobody holds it; True when this agent is the coordinator."""
        registration = self.agent.registration
        if registration is None or registration.lost.is_set():
            self.leader = False
            return False
        found = self.membership.kv.get(self._key)
        if found is None:
            won, found = self.membership.kv.create(self._key, _encode(Leader(self.node, time.time())),
                                                   lease=registration.lease_id, guard=self.membership.guard)
            if won:
                self.say(f"elected coordinator of job {self.membership.keys.job}")
        holder = Leader.from_dict(_decode(found.value)).node
        was = self.leader
        self.leader = holder == self.node and found.lease == registration.lease_id
        if was and not self.leader:
            self.say(f"no longer the coordinator ({holder} is)")
        return self.leader

    # ---- the loop -----------------------------------------------------------------------------------

    def round(self) -> bool:
        """One pass of the duties: campaign, and while elected, the first layout, failures, orphaned layouts.

        Returns whether this agent is the coordinator. The background thread calls it whenever a failure is
        confirmed, and every :data:`~bamboo.launch.timeouts.LEADER_POLL_S`; tests call it directly.
        """
        if not self._campaign():
            return False
        self._first_layout()
        self._publish_failures()
        self._orphaned_layout()
        return True

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.round()
            except StoreError as error:  # etcd restarting, or this agent was fenced
                log.warning("coordinator %s: %s", self.node, error)
            except Exception:
                log.exception("coordinator %s failed a round; trying again", self.node)
            with self._wake:
                if not self._woken:
                    self._wake.wait(timeouts.LEADER_POLL_S)
                self._woken = False

    def _first_layout(self) -> None:
        if self.membership.get_layout() is not None:
            return
        nodes = self.membership.list_nodes(skip_malformed=True)
        zones = {node: record.zone for node, record in nodes.items()}
        if len(zones) < self.spec.first_layout_nodes:
            self._registered_count = -1
            return
        if len(zones) != self._registered_count:
            self._registered_count, self._settle_from = len(zones), self.clock()
            return
        if self.clock() - self._settle_from < timeouts.FIRST_LAYOUT_SETTLE_S:
            return
        try:
            layout = first_layout(self.spec, zones)
        except RuntimeError as error:  # --resume without a good checkpoint
            from bamboo.launch.records import JobEnd

            if self.membership.decide("end", JobEnd(steps=0, error=f"--resume: {error}", node=self.node).to_dict()).won:
                self.say(f"the job cannot start: --resume: {error}")
            return
        if self.membership.put_layout(layout.to_dict(), 0) is not None:
            self.say("first layout: " + "; ".join(f"pipeline {d}: {' '.join(row)}" for d, row in
                                                 enumerate(layout.owners))
                     + (f"; standby: {' '.join(layout.standby)}" if layout.standby else ""))

    def _orphaned_layout(self) -> None:
        """Restart from the newest checkpoint when every holder of the current layout is gone."""
        from bamboo.launch.reconfigure import nearest_restore, warm_standby

        layout = read_layout(self.membership)
        if layout is None or self.membership.get_decision("end") is not None:
            return
        registered = self.membership.list_nodes(skip_malformed=True)
        if any(node in registered for node in (*layout.ranks, *layout.survivors)):
            return
        stages = list(range(self.spec.stages))
        bounds = [tuple(bound) for bound in layout.stage_bounds]
        point = nearest_restore(self.membership.kv, self.spec, stages, bounds, registered, layout.history)
        step = point.step
        restart = restart_layout(self.spec, layout, warm_standby(self.membership, registered),
                                 {n: r.zone for n, r in registered.items()}, step, point.path,
                                 reached=self._steps_reached(layout), memory=point.memory, initial=point.initial)
        if restart is None:
            return  # not enough warm nodes for one pipeline yet: wait for the market to add some
        current = self.membership.get_layout()
        if current is not None and self.membership.put_layout(restart.to_dict(), current.revision) is not None:
            self.say(f"every node of generation {layout.generation} is gone: generation {restart.generation} "
                     f"restarts from the checkpoint of step {step} on {', '.join(restart.ranks)}")

    def _steps_reached(self, lost: Any) -> int:
        """:func:`steps_reached` from the job's event log in etcd (``lost.start_step`` if it cannot be read:
        the figure only says how many steps are trained again)."""
        from bamboo.launch.events import EventLogError, read_etcd_events

        try:
            events = read_etcd_events(self.membership.kv, self.spec.job)
        except (EventLogError, StoreError) as error:
            log.warning("the steps generation %d reached are unknown (%s): counted from its start step %d",
                        lost.generation, error, lost.start_step)
            return lost.start_step
        return steps_reached(events, lost, self.spec.created_unix)

    def _failure_reports(self) -> dict[str, FailureReport]:
        reports: dict[str, FailureReport] = {}
        for item in self.membership.kv.get_prefix(self.membership.keys.failures):
            try:
                report = decode_message(item.key, item.value, FailureReport)
            except MalformedValueError as error:
                log.error("%s", error)
                continue
            reports.setdefault(report.node, report)
        return reports

    def _publish_failures(self) -> None:
        reports = self._failure_reports()
        layout = read_layout(self.membership)
        if layout is not None:
            self._zones.update(layout.zones)
        known = dict(self.agent.detector.known_nodes()) if self.agent.detector else {}
        known.update(self.membership.list_nodes(skip_malformed=True))
        for node, record in known.items():  # remembered while they are alive: a dead node's record is gone
            if record.zone:
                self._zones.setdefault(node, record.zone)
        for node, report in sorted(reports.items()):
            if node in self._preempted:
                continue
            zone = self._zones.get(node) or "unknown"
            decision = self.membership.decide(f"preempted-{node}", Preempted(node, zone, report.reason).to_dict())
            if decision.won:
                self.events.write(Preemption(t=self.events.now(), node=node, zone=zone, notice_s=0.0))
                self.say(f"confirmed failure of {node}: {report.reason}")
            self._preempted.add(node)
        if layout is None:
            return
        ranks = layout.ranks
        while True:
            published = published_events(self.membership, layout.generation)
            covered = {rank for event in published.values() for rank in event.victims}
            pending = sorted(ranks[node] for node in reports if node in ranks and ranks[node] not in covered)
            if not pending:
                return
            if self.agent.detector is not None:  # kills that landed together: confirm them all before publishing
                self.agent.detector.probe_all([node for node in ranks if node not in reports and node != self.node],
                                              "swept after a confirmed failure in the layout")
                reports = self._failure_reports()
                pending = sorted(ranks[node] for node in reports if node in ranks and ranks[node] not in covered)
            epoch = max(published, default=0) + 1
            won, event = publish_failure_event(self.membership, layout.generation, FailureEvent(epoch, pending))
            if won:
                self.published.append((layout.generation, event))
                victims = [layout.node_of_rank[rank] for rank in event.victims]
                self.say(f"published the failure of {', '.join(victims)}: ranks {list(event.victims)} "
                         f"(generation {layout.generation}, runtime epoch {epoch})")


def _encode(record: Any) -> bytes:
    import json

    return json.dumps(record.to_dict()).encode()


def _decode(value: bytes) -> Any:
    import json

    return json.loads(value)
