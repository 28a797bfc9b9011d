"""The coordinator's first duty: publish the confirmed failures of the current layout as failure events.

:class:`FailurePublisher` is a layer of :class:`~bamboo.launch.coordinator.Coordinator` (see its module docstring
for the duty as a whole). Each round that may have news reads the failure reports back; for each ranked node of
the layout whose death no published event names yet, it sweeps the victims' pipelines (kills that landed
together go into one event), publishes one event (first writer wins), then probes the waiting nodes of the
victims' zones (a zone's machines go together, and nobody else watches a standby node), and records one
preemption per lost node. The events of a generation are read from etcd once, ahead of its first failure.
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

__all__ = ["FailurePublisher"]

log = logging.getLogger(__name__)


class FailurePublisher:
    """The coordinator's publication of failures (P probes per pipeline that lost a node, one event per round)."""

    # Set by Coordinator's constructor: what the methods below read.
    membership: MembershipStore
    agent: NodeAgent
    node: str
    events: EventWriter
    say: Callable[[str], None]
    published: list[tuple[int, FailureEvent]]
    _preempted: set[str]
    _zones: dict[str, str]
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
        """Publish the failure events of the layout first (the runtime waits for them), then the preemption
        records of every confirmed node."""
        reports = self._failure_reports()
        layout = self._layout()  # (its zones remembered once per layout)
        if layout is not None:
            before = len(self.published)
            reports = self._publish_events(layout, reports)
            victims = [layout.node_of_rank[rank] for _, event in self.published[before:] for rank in event.victims]
            if victims:
                swept = self._sweep_struck_zones(layout, victims, reports)
                if swept.keys() - reports.keys():  # a node of the layout found dead there: its event now
                    swept = self._publish_events(layout, swept)
                reports = swept
        self.registered_zones()  # remembered while they are alive (before a departure's report is confirmed below)
        for node, report in sorted(reports.items()):
            self._confirm_lost(node, report.reason)

    def _sweep_struck_zones(self, layout: JobLayout, victims: list[str],
                            reports: dict[str, FailureReport]) -> dict[str, FailureReport]:
        """After publishing the failure of ``victims``, probe the other registered nodes of their zones that may
        have nobody to notice their death; returns the reports then known.

        Spot preemptions take a zone's machines together. A waiting (standby, joining) node has no pipeline
        neighbour: found only when its lease ran out, it held up the next reconfiguration, which counted it as a
        new owner, for up to the lease's TTL (8.2 s of a measured 8.8 s restore). So the waiting nodes of every
        victim's zone are probed. A node of the layout's other pipelines has neighbours, but not while the job
        is between two layouts (at a barrier, in a switch), when no data flows: a barrier waited 1.8 s for one
        killed with its zone, until its lease expired at a 2 s TTL. Those are probed in a zone that lost two
        nodes or more in these events (a zone-wide preemption), so that a single preemption costs no probe of a
        zone's hundreds of nodes at scale. Run after the event is published, so the failover does not wait;
        a node of the layout found dead here is in the next event."""
        registered = self.registered_zones()
        zones = {**layout.zones, **registered}
        lost = Counter(zones[node] for node in victims if zones.get(node))
        others = sorted(node for node, zone in registered.items()
                        if zone in lost and node not in reports and node != self.node
                        and (node not in layout.ranks or lost[zone] >= 2))
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
            self.events.write(Preemption(t=self.events.now(), node=node, zone=zone, notice_s=0.0))
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

        Before publishing, the pipelines of the pending victims are swept (`_sweep`) and the reports read again,
        until no victim of an unswept pipeline is left: failures confirmed meanwhile (kills that landed together,
        confirmed by other detectors a few milliseconds apart) go into the same event, so the runtime fails over
        once, and etcd sends every node one event instead of several (at 1,000 nodes, each event's delivery to
        every watcher took tens of milliseconds, and delayed the next round by as much)."""
        ranks, stages = layout.ranks, layout.stages
        swept_pipelines: set[int] = set()
        while True:
            published = self._events_of(layout.generation)
            covered = {rank for event in published.values() for rank in event.victims}
            pending = _pending(ranks, reports, covered)
            if not pending:
                return reports
            while unswept := sorted({rank // stages for rank in pending} - swept_pipelines):
                swept_pipelines.update(unswept)
                swept = _sweep(layout, [rank for rank in pending if rank // stages in unswept], reports, self.node)
                if self.agent.detector is not None and swept:  # kills that landed together: confirm them first
                    self.agent.detector.probe_all(swept, "swept after a confirmed failure in the layout",
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


def _pending(ranks: Mapping[str, int], reports: Mapping[str, FailureReport], covered: set[int]) -> list[int]:
    """The ranks of the reported nodes that no published event names yet."""
    return sorted(ranks[node] for node in reports if node in ranks and ranks[node] not in covered)


def _sweep(layout: JobLayout, pending: list[int], reports: dict[str, FailureReport], own: str) -> list[str]:
    """Whom to probe before publishing the failure of the ranks ``pending``: the other nodes of their
    pipelines (a kill there is a consecutive failure, which must be known in the same event), not every
    node of the layout, so that a sweep costs at most P probes per pipeline that lost a node."""
    stages = layout.stages
    pipelines = {rank // stages for rank in pending}
    return sorted(node for node, rank in layout.ranks.items()
                  if rank // stages in pipelines and node not in reports and node != own)
