"""The job's elected coordinator: the agent that publishes failures and writes the first layout.

Every ``bamboo-launch agent`` runs a :class:`Coordinator`. One of them at a time is *elected*: it
holds the key ``/bamboo/<job>/leader`` under its own lease (created first-writer-wins). When the
elected agent dies, its lease is revoked as soon as its failure is confirmed (or expires after the
TTL), the key goes with it, and the next agent to try takes over; killing the coordinator is just
another failure. An agent whose detector confirms a failure probes the coordinator that must publish it (one
connect): killed in the same bulk preemption with no neighbour to report it, it is confirmed then, not at its
lease's expiry. Everything it does is idempotent and read back from etcd, so a new coordinator
carries on where the old one stopped. Its duties:

- **Publish confirmed failures at once.** Every agent's failure detector confirms failures (a refused probe
  after a neighbour's report, another incarnation, an expired lease) and writes one report per node to etcd;
  the coordinator reads them back. For each ranked node of the current layout whose death is not yet in a
  published event, it first probes the victims' ring neighbours in their pipelines in parallel, and the
  neighbours of any found dead there (a consecutive failure is confirmed with it: at most two probes per
  victim), then publishes one :class:`bamboo.rc.FailureEvent` with all of them, first-writer-wins, as decision
  ``g<generation>-epoch-<n>`` (:func:`bamboo.launch.notices.publish_failure_event`). A node confirmed later is
  a second failure, which the runtime survives. No batching window: the runtime acts within milliseconds.
  Then it probes the victims' zones: their waiting nodes, and the layout's nodes of a zone struck as a whole
  (:mod:`bamboo.launch.coordinator_failures`).
- **Preemption records.** Once per lost node (decision ``preempted-<node>``), confirmed or gone with a
  whole layout before any probe reported it, a ``preemption`` event for the report (billing stops). A newly
  elected coordinator also records the nodes (of the layout, or warm on standby) that had left the membership
  unreported before it followed it (a bulk kill that took the coordinator and a node's neighbours too).
- **The first layout.** As soon as the job's spec asks for it (``min_nodes`` registered, P x D by
  default), it places the registered nodes with :func:`bamboo.reconfig.plan_layout` and writes
  generation 0 with compare-and-swap (only when there is no layout yet). Nodes that register later wait
  on standby for a reconfiguration.
- **A layout nobody holds any more.** The workers themselves move from one layout to the next at a
  barrier. When every node of the current layout (its owners and the holders it came from) is gone, the
  coordinator writes the next generation on the warm standby nodes, once they can form a pipeline: a
  layout that trained no step has its start redone; otherwise every stage restarts from the nearest
  restore point (an in-memory copy, the newest good checkpoint, or else the seeded initial state).

Every write goes through the agent's fenced store: a coordinator that was declared dead (its lease is
gone) cannot write anything more.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from bamboo.launch import timeouts
from bamboo.launch.accounting import last_step_end_unix, progress_records, steps_reached
from bamboo.launch.coordinator_failures import FailurePublisher
from bamboo.launch.coordinator_layouts import first_layout, redo_start_layout, restart_layout
from bamboo.launch.notices import published_events
from bamboo.launch.records import (
    AttemptOutcome,
    Leader,
    NodeJoined,
    WorkerWarm,
    node_of_decision,
    outcome_name,
    read_record,
)
from bamboo.launch.redundancy import with_mode
from bamboo.launch.spec import JobSpec
from bamboo.membership.kv import StoreError
from bamboo.membership.members import EMPTY_VIEW, MembershipView
from bamboo.membership.probing import connect_probe
from bamboo.rc import FailureEvent
from bamboo.reconfig import RecordError

if TYPE_CHECKING:
    from bamboo.launch.events import EventWriter
    from bamboo.membership import KeyValue, MembershipStore, NodeAgent, NodeFailed, WatchedKey, WatchedPrefix
    from bamboo.reconfig import JobLayout

__all__ = ["Coordinator", "published_events", "read_layout"]

log = logging.getLogger(__name__)


def read_layout(membership: MembershipStore) -> JobLayout | None:
    """The job's current :class:`bamboo.reconfig.JobLayout`, or None before the first one."""
    from bamboo.reconfig import JobLayout

    found = membership.get_layout()
    return None if found is None else JobLayout.from_dict(found.value)


class Coordinator(FailurePublisher):
    """The coordinator duties of one agent, active while it is elected (see the module docstring).

    ``membership`` is the agent's fenced ``MembershipStore``; ``agent`` its ``NodeAgent`` (the lease the
    leader key is held by, and the failure detector); ``events`` its event log. ``clock`` is monotonic
    seconds (injected in tests).

    It reads nothing per round that grows with the job: the leader key, the layout and the job's end are
    followed by watches (:class:`bamboo.membership.WatchedKey`), and while elected its detector follows
    the membership (the one agent of the job that does: every node record and failure report), which is
    what it places, checks and publishes. It reads the membership as the detector's immutable
    :class:`~bamboo.membership.MembershipView` (no copy) and derives the nodes' zones once per version of it:
    a round that no registration or departure preceded does no work that grows with the job.
    Rounds run when something changed (a failure confirmed, the membership, the layout, the leader key, and
    while elected a worker that became warm: a restart may be waiting for one), and every :data:`~bamboo.launch.timeouts.LEADER_POLL_S` in case a change was missed.
    """

    def __init__(
        self,
        membership: MembershipStore,
        agent: NodeAgent,
        spec: JobSpec,
        events: EventWriter,
        *,
        clock: Callable[[], float] = time.monotonic,
        say: Callable[[str], None] = lambda line: None,
    ) -> None:
        from bamboo.launch.events import EtcdEventReader

        self.membership = membership
        self.agent = agent
        self.node = agent.node_id
        self.spec = spec
        self._event_reader = EtcdEventReader(membership.kv, spec.job)  # the job's log: its new records at each read
        self.events = events
        self.clock = clock
        self.say = say
        self.leader = False
        self.published: list[tuple[int, FailureEvent]] = []
        self._known_events: tuple[int, dict[int, FailureEvent]] = (-1, {})  # see FailurePublisher
        self._key = membership.keys.root + "leader"
        self._wake = threading.Condition()
        self._woken = False
        self._news = True  # woken by something that may have changed the failure reports (not a registration)
        self._failures_heard = 0  # failures the detector confirmed so far (FailurePublisher reads it)
        self._reports_read_at = 0  # the count above when the failure reports were last read from etcd
        self._stop = threading.Event()
        self._preempted: set[str] = set()
        self._catch_up = False  # elected: the layout's nodes lost before this agent followed the membership
        self._zones: dict[str, str] = {}
        self._leader_key: WatchedKey | None = None  # once started
        self._vacated_at: int | None = None  # the revision at which the last holder's key went
        self._layout_key: WatchedKey | None = None  # the layout and the job's end, while elected
        self._end_key: WatchedKey | None = None
        self._warm_records: WatchedPrefix | None = None  # workers that became warm, while elected
        self._decoded: tuple[int, JobLayout | None] = (0, None)  # the layout decoded at its mod revision
        self._holder_in_doubt = False  # a failure was confirmed here: is the coordinator alive to publish it?
        self._derived: tuple[int, Mapping[str, str]] = (-1, MappingProxyType({}))  # zones at a membership version
        self._thread = threading.Thread(target=self._loop, name=f"bamboo-coordinator-{self.node}", daemon=True)
        if agent.detector is not None:  # the elected one acts on a failure; the others check that it is alive
            agent.detector.subscribe(self._on_failure)

    def start(self) -> Coordinator:
        from bamboo.membership import WatchedKey

        if self.agent.detector is not None:  # only the elected one acts on these
            self.agent.detector.subscribe_membership(lambda: self.leader and self.wake(reports=False))
        self._leader_key = WatchedKey(self.membership.kv, self._key, on_change=self._on_leader_change)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        self.wake()
        if self._thread is not threading.current_thread():
            self._thread.join(timeouts.THREAD_JOIN_S)
        if self._leader_key is not None:
            self._leader_key.close()
        self._step_down()

    def wake(self, *, reports: bool = True) -> None:
        """Run a round soon; ``reports=False``: only the membership changed (a registration or a departure, whose
        failure, if any, comes as its own report), so the round need not read the failure reports back."""
        with self._wake:
            self._woken = True
            self._news = self._news or reports
            self._wake.notify_all()

    def _on_failure(self, _event: NodeFailed) -> None:
        with self._wake:  # heard on the detector's threads, and on this one's sweeps
            self._failures_heard += 1
        if not self.leader:
            self._holder_in_doubt = True
        self.wake()

    def _on_leader_change(self, found: KeyValue | None) -> None:
        if found is None and self._leader_key is not None:
            self._vacated_at = self._leader_key.revision
        self.wake()

    # ---- election -----------------------------------------------------------------------------------

    def _campaign(self) -> bool:
        """Take the leader key if nobody holds it; True when this agent is the coordinator."""
        registration = self.agent.registration
        if registration is None or registration.lost.is_set():
            self.leader = False
            return False
        found = self._leader_key.value if self._leader_key is not None else self.membership.kv.get(self._key)
        if found is None:
            record = json.dumps(Leader(self.node, time.time()).to_dict()).encode()
            won, found = self.membership.kv.create(self._key, record, lease=registration.lease_id,
                                                   guard=self.membership.guard)
            if won:
                self.say(f"elected coordinator of job {self.membership.keys.job}")
        holder = Leader.from_dict(json.loads(found.value)).node
        was = self.leader
        self.leader = holder == self.node and found.lease == registration.lease_id
        if was and not self.leader:
            self.say(f"no longer the coordinator ({holder} is)")
        return self.leader

    def _check_holder(self) -> None:
        """After a failure this agent's detector confirmed, probe the coordinator that must publish it: killed in the
        same bulk preemption with no neighbour left to report it (a standby node), it held the key, and published
        nothing, until its lease expired (9 s of a measured run's failover, at its 10 s TTL)."""
        if not self._holder_in_doubt or self.agent.detector is None:
            return
        found = self._leader_key.value if self._leader_key is not None else self.membership.kv.get(self._key)
        if found is None:
            return
        self._holder_in_doubt = False
        self.agent.detector.probe_all([Leader.from_dict(json.loads(found.value)).node],
                                      "the coordinator, checked after a confirmed failure", prober=connect_probe)

    def _take_up(self) -> None:
        """Elected: follow the membership (from when the last coordinator's key went, so that an expiry in
        between is declared), the layout and the job's end."""
        from bamboo.membership import WatchedKey

        if self._layout_key is not None:
            return
        self._catch_up = True
        if self.agent.detector is not None:
            self.agent.detector.follow_membership(since_revision=self._vacated_at)
        self._layout_key = WatchedKey(self.membership.kv, self.membership.keys.layout, on_change=lambda _: self.wake())
        self._end_key = WatchedKey(self.membership.kv, self.membership.keys.decision("end"),
                                   on_change=lambda _: self.wake())

    def _follow_warm_workers(self) -> None:
        """Once a layout exists: wake at each worker that becomes warm. A restart waits for warm workers (a node's
        worker publishes ``warm-<node>`` after its agent registered): without this wake-up a restart waited for
        the next poll, LEADER_POLL_S, after the last one became warm. Not before the first layout, which places
        registered nodes whatever their workers: at 1,000 nodes the job's start would deliver a thousand warm
        records to this agent's watch stream, and a round for each, while it waits for the registrations."""
        from bamboo.membership import WatchedPrefix

        if self._warm_records is None:
            self._warm_records = WatchedPrefix(self.membership.kv, self.membership.keys.decision("warm-"),
                                               lambda _: self.wake(reports=False))

    def _step_down(self) -> None:
        self._known_events = (-1, {})  # another coordinator may publish meanwhile: read again once elected
        for watched in (self._layout_key, self._end_key):
            if watched is not None:
                watched.close()
        self._layout_key = self._end_key = None
        if self._warm_records is not None:
            self._warm_records.cancel()
            self._warm_records = None
        if self.agent.detector is not None:
            self.agent.detector.unfollow_membership()

    # ---- the loop -----------------------------------------------------------------------------------

    def round(self, *, reports: bool = True) -> bool:
        """One pass of the duties: campaign, and while elected, the first layout, failures, orphaned layouts.

        Returns whether this agent is the coordinator. The background thread calls it whenever something
        changed, and every :data:`~bamboo.launch.timeouts.LEADER_POLL_S`; tests call it directly.
        ``reports=False`` skips reading the failure reports back (the loop's rounds after registrations only: a
        thousand registrations were a thousand reads of the reports while the job started).
        """
        if not self._campaign():
            if self._layout_key is not None:
                self._step_down()
            self._check_holder()
            return False
        self._take_up()
        self._first_layout()
        layout = self._layout()
        if layout is not None:
            self._follow_warm_workers()
            self._events_of(layout.generation)  # read ahead of the first failure of a new generation
        if reports:
            self._publish_failures()
            self._catch_up_lost(layout)
        if layout is not None:  # (before the first layout only the count of nodes matters: `_first_layout`)
            self.registered_zones()  # remembered while they are alive, once per membership version
        self._orphaned_layout()
        return True

    def _catch_up_lost(self, layout: JobLayout | None) -> None:
        """Once per election, after the failures known were published: a node of the current layout, or a node
        that joined (its ``joined-`` record: a standby or joining node, warm or still starting), that is neither
        registered nor recorded left the membership before this agent followed it (its lease expired while its
        killed coordinator no longer watched, and no neighbour of it was left to report it). It gets its
        preemption record now; a node that handed its stage over after a notice recorded its own. Four prefix
        reads, whatever the job's history."""
        if not self._catch_up or layout is None:
            return
        self._catch_up = False
        if self._end_key is not None and self._end_key.value is not None:
            return  # the job ended: its nodes leave on purpose
        registered = self.membership.list_nodes(skip_malformed=True)  # read now: a view may predate the following
        known = set(layout.ranks)
        known |= self._nodes_named(self._warm_records.items() if self._warm_records is not None else [], WorkerWarm)
        known |= self._nodes_named(self.membership.kv.get_prefix(self.membership.keys.decision("joined-")), NodeJoined)
        recorded = {node_of_decision(item.key, "preempted-")
                    for item in self.membership.kv.get_prefix(self.membership.keys.decision("preempted-"))}
        recorded |= {node_of_decision(item.key, "handover-")
                     for item in self.membership.kv.get_prefix(self.membership.keys.decision("handover-"))}
        for node in sorted(known - set(registered) - recorded - self._preempted - {self.node}):
            self._confirm_lost(node, "its lease expired before this coordinator took over")

    def _nodes_named(self, items: Iterable[KeyValue], kind: type[WorkerWarm | NodeJoined]) -> set[str]:
        """The nodes that the ``warm-`` or ``joined-`` decisions ``items`` name, their zones remembered (a malformed
        record still names its node)."""
        prefix = "warm-" if kind is WorkerWarm else "joined-"
        nodes: set[str] = set()
        for item in items:
            nodes.add(node := node_of_decision(item.key, prefix))
            with contextlib.suppress(ValueError, RecordError):
                zone = kind.from_dict(json.loads(item.value)).zone
                if zone:
                    self._zones.setdefault(node, zone)
        return nodes

    def _loop(self) -> None:
        polled = True
        while not self._stop.is_set():
            with self._wake:
                reports, self._news = self._news or polled, False
            try:
                self.round(reports=reports)
            except StoreError as error:  # etcd restarting, or this agent was fenced
                log.warning("coordinator %s: %s", self.node, error)
                self._news = True
            except Exception:
                log.exception("coordinator %s failed a round; trying again", self.node)
                self._news = True
            with self._wake:
                polled = False
                if not self._woken:
                    polled = not self._wake.wait(timeouts.LEADER_POLL_S)
                self._woken = False

    def view(self) -> MembershipView:
        """The registered nodes: the records the detector follows (elected, it follows them all), immutable."""
        return self.agent.detector.membership_view() if self.agent.detector is not None else EMPTY_VIEW

    def registered_zones(self) -> Mapping[str, str]:
        """Each registered node's zone, derived once per version of :meth:`view` (the same object until the
        membership changes), and remembered for when the node is gone: its record goes with it."""
        view = self.view()
        if self._derived[0] != view.version:
            zones = {node: record.zone for node, record in view.nodes.items()}
            for node, zone in zones.items():
                if zone:
                    self._zones.setdefault(node, zone)
            self._derived = (view.version, MappingProxyType(zones))
        return self._derived[1]

    def _layout(self) -> JobLayout | None:
        """The current ``JobLayout`` (None before the first), from the watched key, decoded once per change."""
        from bamboo.reconfig import JobLayout

        found = self._layout_key.value if self._layout_key is not None else None
        if found is None:
            return None
        if self._decoded[0] != found.mod_revision:
            decoded = JobLayout.from_json(found.value)
            self._decoded = (found.mod_revision, decoded)
            self._zones.update(decoded.zones)
        return self._decoded[1]

    def _write_layout(self, layout: JobLayout, expected_revision: int) -> bool:
        """Write ``layout`` if the key is still at ``expected_revision``, and wait (at most
        :data:`~bamboo.launch.timeouts.OWN_WRITE_SEEN_S`) until the watched key holds it, so that the rest of the
        round works on the layout just written (a failure reported in the same round is published in it)."""
        written = self.membership.put_layout(layout.to_dict(), expected_revision)
        if written is None:
            return False
        if self._layout_key is not None:
            self._layout_key.wait(lambda seen: seen is not None and seen.mod_revision >= written.revision,
                                  timeouts.OWN_WRITE_SEEN_S)
        return True

    def _first_layout(self) -> None:
        if self._layout() is not None:
            return
        if len(self.view().nodes) < self.spec.first_layout_nodes:
            return  # (not their zones: at 1,000 nodes that was 0.27 ms for each registration the job's start woke it for)
        zones = self.registered_zones()
        try:
            layout = with_mode(self.spec, first_layout(self.spec, dict(zones)), self.membership.kv,
                               reader=self._event_reader)
        except RuntimeError as error:  # --resume without a good checkpoint
            from bamboo.launch.records import JobEnd

            if self.membership.decide("end", JobEnd(steps=0, error=f"--resume: {error}", node=self.node).to_dict()).won:
                self.say(f"the job cannot start: --resume: {error}")
            return
        if self._write_layout(layout, 0):
            self.say("first layout: " + "; ".join(f"pipeline {d}: {' '.join(row)}" for d, row in
                                                 enumerate(layout.owners))
                     + (f"; standby: {' '.join(layout.standby)}" if layout.standby else "")
                     + (f"; redundancy {layout.redundancy.reason}" if layout.redundancy is not None else ""))

    def _orphaned_layout(self) -> None:
        """Restart from the newest checkpoint when every holder of the current layout is gone."""
        from bamboo.launch.reconfigure import live_restore, nearest_restore, warm_standby

        layout = self._layout()
        if layout is None or (self._end_key is not None and self._end_key.value is not None):
            return
        registered = self.view().nodes
        if any(n in registered for n in layout.ranks) and not self._holders_gone_from_abandoned(layout, registered):
            return
        # A survivor left out of a start that went ahead is on standby: it must not hold the restart up.
        if any(n in registered for n in layout.survivors) and not self._went_ahead(layout):
            return
        # Gone together, some before any probe reported them: their leases expired.
        for node in sorted(n for n in layout.ranks if n not in registered):
            self._confirm_lost(node, "its lease expired")
        if not layout.survivors and self._trained_none(layout):  # nothing lost: its start is redone
            zones = {**layout.zones, **self.registered_zones()}
            redo = redo_start_layout(self.spec, live_restore(self.membership.kv, self.spec, layout, registered),
                                     warm_standby(self.membership, registered), zones)
            redo = None if redo is None else with_mode(self.spec, redo, self.membership.kv, reader=self._event_reader)
            current = self._layout_key.value if self._layout_key is not None else None
            if redo is not None and current is not None and self._write_layout(redo, current.mod_revision):
                self.say(f"every node of generation {layout.generation} is gone before its first step: its start "
                         f"is redone on {', '.join(redo.ranks)}")
            return  # (or not enough warm nodes for one pipeline yet: wait for more)
        stages = list(range(self.spec.stages))
        bounds = [tuple(bound) for bound in layout.stage_bounds]
        point = nearest_restore(self.membership.kv, self.spec, stages, bounds, registered, layout.history)
        step = point.step
        progress = self._progress(layout)
        restart = restart_layout(self.spec, layout, warm_standby(self.membership, registered),
                                 self.registered_zones(), step, point.path,
                                 reached=layout.start_step if progress is None else progress[0],
                                 memory=point.memory, initial=point.initial,
                                 stopped_unix=None if progress is None else progress[1])
        if restart is None:
            return  # not enough warm nodes for one pipeline yet: wait for the market to add some
        restart = with_mode(self.spec, restart, self.membership.kv, reader=self._event_reader)
        current = self._layout_key.value if self._layout_key is not None else None
        if current is not None and self._write_layout(restart, current.mod_revision):
            self.say(f"every node of generation {layout.generation} is gone: generation {restart.generation} "
                     f"restarts from the checkpoint of step {step} on {', '.join(restart.ranks)}")

    def _outcome(self, layout: JobLayout) -> AttemptOutcome | None:
        """The outcome of the start of ``layout`` (None while it is undecided)."""
        return read_record(AttemptOutcome, self.membership.get_decision(outcome_name(layout.generation)))

    def _went_ahead(self, layout: JobLayout) -> bool:
        """Whether the start of ``layout`` went ahead (outcome ``go``): then the survivors it left out hold nothing."""
        outcome = self._outcome(layout)
        return outcome is not None and outcome.go

    def _holders_gone_from_abandoned(self, layout: JobLayout, registered: Mapping[str, object]) -> bool:
        """Whether ``layout`` is a start from survivors' state (``layout.survivors``) that was abandoned (outcome
        ``abort``) and every survivor is gone: its other nodes, registered or not, hold nothing, and the decision
        of its next attempt, which only survivors take, never comes. Then it is orphaned as if every node of it
        were gone (measured under heavy churn: a live node of such a start, waiting for that decision, kept
        the restart from being written for 90 s while warm nodes waited)."""
        if not layout.survivors or any(n in registered for n in layout.survivors):
            return False
        outcome = self._outcome(layout)
        return outcome is not None and not outcome.go

    def _trained_none(self, layout: JobLayout) -> bool:
        """Whether ``layout`` trained no step (its event log has no step record of it); False when unknown."""
        progress = self._progress(layout)
        return progress is not None and progress[0] <= layout.start_step

    def _progress(self, layout: JobLayout) -> tuple[int, float | None] | None:
        """From the job's event log in etcd: the last step ``layout`` completed (:func:`steps_reached`) and when it
        ended (:func:`last_step_end_unix`); None (and a warning) when the log cannot be read (then its start step
        is assumed: the figure only says how many steps are trained again, and the pause counts from now)."""
        from bamboo.launch.events import EventLogError

        created = self.spec.created_unix
        try:
            events = self._event_reader.read(select=progress_records(layout, created))
        except (EventLogError, StoreError) as error:
            log.warning("the steps generation %d reached are unknown: %s", layout.generation, error)
            return None
        return steps_reached(events, layout, created), last_step_end_unix(events, layout, created)
