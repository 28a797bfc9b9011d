"""The coordinator's first duty: publish the confirmed failures of the current layout as failure events.

:class:`FailurePublisher` is a layer of :class:`~bamboo.launch.coordinator.Coordinator` (see its module docstring
for the duty as a whole). Each round that may have news reads the failure reports back; for each ranked node of
the layout whose death no published event names yet, it probes the victims' ring neighbours in their pipelines,
and the neighbours of any found dead there (a consecutive failure is known in the same event), publishes one
event (first writer wins), then probes the waiting nodes of the victims' zones (a zone's machines go together,
and nobody else watches a standby node), and records one preemption per lost node. A failure that the detector
confirms while the round writes an event or those records is read back and published at once, not after the
round. The events of a generation are read from etcd once, ahead of its first failure.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from bamboo.launch.events import Preemption
from bamboo.launch.notices import publish_failure_event, published_events
from bamboo.launch.records import Preempted
from bamboo.membership.probing import connect_probe
from bamboo.membership.records import FailureReport, MalformedValueError, decode_message
from bamboo.rc import FailureEvent

if TYPE_CHECKING:
    from bamboo.launch.events import EventWriter
    from bamboo.membership import MembershipStore, NodeAgent
    from bamboo.reconfig import JobLayout

__all__ = ["ZONE_SWEEP_MIN_SHARE", "FailurePublisher"]

ZONE_SWEEP_MIN_SHARE = 0.1
"""The share of a zone's layout nodes that must be lost together (besides two at least) before the coordinator
probes the zone's other layout nodes: a zone-wide preemption, not scattered kills."""

log = logging.getLogger(__name__)


class FailurePublisher:
    """The coordinator's publication of failures (two probes per victim, one event per round, and one more at
    once for a failure heard while it was written)."""

    # Set by Coordinator's constructor: what the methods below read.
    membership: MembershipStore
    agent: NodeAgent
    node: str
    events: EventWriter
    say: Callable[[str], None]
    published: list[tuple[int, FailureEvent]]
    _preempted: set[str]
    _zones: dict[str, str]
    _failures_heard: int  # failures the detector confirmed (a NodeFailed each), counted by Coordinator
    _reports_read_at: int  # that count when the reports were last read (_failure_reports)
    # The failure events of the current generation known here, by epoch: read once per generation (ahead of any
    # failure, at the first round that sees its layout), then kept up to date from this coordinator's own writes.
    # One another writer published (a leaver's hand-over) takes the epoch this one tries next, so a stale copy
    # only loses that race and learns the winner; no read of the prefix on the failover's path.
    _known_events: tuple[int, dict[int, FailureEvent]]

    if TYPE_CHECKING:

        def _layout(self) -> JobLayout | None:
            """Defined by `Coordinator`: the current layout."""

        def registered_zones(self) -> Mapping[str, str]:
            """Defined by `Coordinator`: each registered node's zone."""

    def _failure_reports(self) -> dict[str, FailureReport]:
        """Each node's first failure report, read from etcd. Not from the following detector's watch: with 1% of
        1,000 agents killed at once, a read waits behind the detectors' writes (12 to 16 ms), and that wait is
        what gathers kills confirmed milliseconds apart into one event; read from memory, the same kills went
        out in two or three events, and the last one reached every node later (p99 96 to 161 ms, against 95 to
        118 ms)."""
        self._reports_read_at = self._failures_heard  # a failure heard from now on may be missing from this read
        reports: dict[str, FailureReport] = {}
        for item in self.membership.kv.get_prefix(self.membership.keys.failures):
            try:
                report = decode_message(item.key, item.value, FailureReport)
            except MalformedValueError as error:
                log.error("%s", error)
                continue
            reports.setdefault(report.node, report)
        return reports

    def _heard_since_read(self) -> bool:
        """Whether the detector confirmed a failure since the reports were last read: one the round has not seen."""
        return self._failures_heard != self._reports_read_at

    def _publish_failures(self) -> None:
        """Publish the failure events of the layout first (the runtime waits for them), then the preemption
        records of every confirmed node. A failure confirmed while the round writes those records (kills that
        landed together, their reports milliseconds apart under load) gets its event before the next record:
        at 1,000 nodes the records of ten victims took tens of milliseconds, and a late victim's event waited
        for all of them and for the next round."""
        reports = self._failure_reports()
        layout = self._layout()  # (its zones remembered once per layout)
        if layout is not None:
            reports = self._publish_and_sweep(layout, reports)
        self.registered_zones()  # remembered while they are alive (before a departure's report is confirmed below)
        for node, report in sorted(reports.items()):
            if layout is not None and self._heard_since_read():
                self._publish_and_sweep(layout, self._failure_reports())  # their records: the next round's
            self._confirm_lost(node, report.reason)

    def _publish_and_sweep(self, layout: JobLayout, reports: dict[str, FailureReport]) -> dict[str, FailureReport]:
        """Publish the event of the layout's reported nodes that none names yet, then sweep the zones of its
        victims (and publish what that finds); returns the reports then known."""
        before = len(self.published)
        reports = self._publish_events(layout, reports)
        victims = [layout.node_of_rank[rank] for _, event in self.published[before:] for rank in event.victims]
        if victims:
            swept = self._sweep_struck_zones(layout, victims, reports)
            if swept.keys() - reports.keys():  # a node of the layout found dead there: its event now
                swept = self._publish_events(layout, swept)
            reports = swept
        return reports

    def _sweep_struck_zones(self, layout: JobLayout, victims: list[str],
                            reports: dict[str, FailureReport]) -> dict[str, FailureReport]:
        """After publishing the failure of ``victims``, probe the other registered nodes of their zones that may
        have nobody to notice their death; returns the reports then known.

        Spot preemptions take a zone's machines together. A waiting (standby, joining) node has no pipeline
        neighbour: found only when its lease ran out, it held up the next reconfiguration, which counted it as a
        new owner, for up to the lease's TTL (8.2 s of a measured 8.8 s restore). So the waiting nodes of every
        victim's zone are probed. A node of the layout's other pipelines has neighbours, but not while the job
        is between two layouts (at a barrier, in a switch), when no data flows: a barrier waited 1.8 s for one
        killed with its zone, until its lease expired at a 2 s TTL. Those are probed in a zone struck as a
        whole: one that lost two nodes or more in these events, and at least :data:`ZONE_SWEEP_MIN_SHARE` of its
        layout's nodes. A single preemption, or a few scattered over a zone of hundreds of nodes, costs no probe
        of that zone's nodes (1% of 1,000 nodes killed at random swept 512 live nodes while the event was
        delivered). Run after the event is published, so the failover does not wait;
        a node of the layout found dead here is in the next event."""
        registered = self.registered_zones()
        zones = {**layout.zones, **registered}
        lost = Counter(zones[node] for node in victims if zones.get(node))
        in_layout = Counter(zones.get(node) for node in layout.ranks)
        struck = {zone for zone, count in lost.items() if count >= max(2, ZONE_SWEEP_MIN_SHARE * in_layout[zone])}
        others = sorted(node for node, zone in registered.items()
                        if zone in lost and node not in reports and node != self.node
                        and (node not in layout.ranks or zone in struck))
        if not others or self.agent.detector is None:
            return reports
        self.agent.detector.probe_all(others, "swept: in the zone of a failure", prober=connect_probe)
        return self._failure_reports()

    def _confirm_lost(self, node: str, reason: str) -> None:
        """Record ``node``'s loss once for the job (the ``preempted-<node>`` decision, and one preemption event)."""
        if node in self._preempted:
            return
        zone = self._zones.get(node) or "unknown"
        decision = self.membership.decide(f"preempted-{node}", Preempted(node, zone, reason).to_dict())
        if decision.won:
            self.events.write(Preemption(t=self.events.now(), node=node, zone=zone, notice_s=0.0, reason=reason or None))
            self.say(f"confirmed failure of {node}: {reason}")
        self._preempted.add(node)

    def _events_of(self, generation: int) -> dict[int, FailureEvent]:
        """The failure events of ``generation`` known here, by epoch (read from etcd the first time; the caller
        adds the ones it publishes or loses a race to)."""
        if self._known_events[0] != generation:
            self._known_events = (generation, published_events(self.membership, generation))
        return self._known_events[1]

    def _publish_events(self, layout: JobLayout,
                        reports: dict[str, FailureReport]) -> dict[str, FailureReport]:
        """One failure event per round of confirmed ranked nodes not yet in one; returns the reports then known.

        Before publishing, the ring neighbours of the pending victims in their pipelines are probed
        (`_neighbours_to_probe`) and the reports read again, until no victim has a neighbour left unprobed: a
        neighbour found dead is a consecutive failure, known in the same event, and its own neighbours are probed
        in turn. Failures confirmed meanwhile (kills that landed together, confirmed by other detectors a few
        milliseconds apart) go into the same event too, so the runtime fails over once, and etcd sends every
        node one event instead of several (at 1,000 nodes, each event's delivery to every watcher took tens of
        milliseconds, and delayed the next round by as much)."""
        ranks = layout.ranks
        probed: set[str] = set()
        while True:
            published = self._events_of(layout.generation)
            covered = {rank for event in published.values() for rank in event.victims}
            pending = _pending(ranks, reports, covered)
            if not pending:
                return reports
            while near := _neighbours_to_probe(layout, pending, reports, probed | _alive(reports) | {self.node}):
                probed.update(near)
                if self.agent.detector is not None:  # kills that landed together: confirm them first
                    self.agent.detector.probe_all(near, "swept after a confirmed failure in the layout",
                                                  prober=connect_probe)  # a connect: it only looks for the dead
                reports = self._failure_reports()  # with what the sweep and the other detectors confirmed meanwhile
                pending = _pending(ranks, reports, covered)
            epoch = max(published, default=0) + 1
            won, event = publish_failure_event(self.membership, layout.generation, FailureEvent(epoch, pending))
            published[event.epoch] = event  # ours, or the winner of that epoch: then try again with what it covers
            if won:
                self.published.append((layout.generation, event))
                victims = [layout.node_of_rank[rank] for rank in event.victims]
                self.say(f"published the failure of {', '.join(victims)}: ranks {list(event.victims)} "
                         f"(generation {layout.generation}, runtime epoch {epoch})")
                if self._heard_since_read():  # confirmed while this event was prepared: the next event, now
                    reports = self._failure_reports()


def _pending(ranks: Mapping[str, int], reports: Mapping[str, FailureReport], covered: set[int]) -> list[int]:
    """The ranks of the reported nodes that no published event names yet."""
    return sorted(ranks[node] for node in reports if node in ranks and ranks[node] not in covered)


def _alive(reports: Mapping[str, FailureReport]) -> set[str]:
    """The nodes that wrote one of ``reports`` (a detector is its node's id): alive a moment ago, so a sweep
    leaves them alone (a victim's neighbour that reported it is half of the victim's sweep)."""
    return {report.detected_by for report in reports.values() if report.detected_by}


def _neighbours_to_probe(layout: JobLayout, pending: list[int], reports: Mapping[str, FailureReport],
                         skip: set[str]) -> list[str]:
    """Whom to probe before publishing the failure of the ranks ``pending``: their ring neighbours in their
    pipelines (the previous stage holds a stage's replica, the last stage stage 0's), unless reported or in
    ``skip``. A neighbour found dead is pending next time, so a run of consecutive failures is followed to its
    end; a sweep costs at most two probes per victim, not the pipeline's P."""
    stages, node_of_rank = layout.stages, layout.node_of_rank
    near: set[str] = set()
    for rank in pending:
        first = rank - rank % stages
        for stage in ((rank - first - 1) % stages, (rank - first + 1) % stages):
            node = node_of_rank.get(first + stage)
            if node is not None and node not in reports and node not in skip:
                near.add(node)
    return sorted(near)
