"""The job's elected coordinator (`bamboo.launch.coordinator`), in process against a real etcd.

Each test drives :meth:`Coordinator.round` itself (no background thread), with fake agents whose
registrations are real leases and whose detectors record the sweeps they are asked for.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from types import MappingProxyType, SimpleNamespace
from typing import Any

import attrs
import pytest
from bamboo.launch.accounting import last_step_end_unix, progress_records, steps_reached
from bamboo.launch.agent_options import AgentOptions
from bamboo.launch.coordinator import Coordinator, published_events, read_layout
from bamboo.launch.coordinator_failures import ZONE_SWEEP_MIN_SHARE
from bamboo.launch.coordinator_layouts import first_layout, redo_start_layout, restart_layout
from bamboo.launch.events import Checkpoint, EtcdEventLog, Step, event_to_dict, read_etcd_events
from bamboo.launch.notices import publish_failure_event
from bamboo.launch.records import NodeJoined, Preempted, WorkerWarm
from bamboo.launch.spec import EtcdAccess, JobSpec
from bamboo.launch.supervisor import Supervisor
from bamboo.membership import MembershipStore, MembershipView, SweepResult
from bamboo.membership.records import FailureReport, NodeFailed, NodeRecord, NodeState
from bamboo.rc import FailureEvent

LAYER = {"param_bytes": 400, "optimizer_bytes": 800, "compute_cost": 100.0}


class FakeDetector:
    """What the coordinator asks of a detector: its listeners, to follow the membership while elected (the
    records it knows then are the registered ones: read here from etcd, so that a round sees a registration
    at once), and sweeps."""

    def __init__(self) -> None:
        self.sweeps: list[tuple[list[str], str]] = []
        self.confirm_on_sweep: list[str] = []
        self.others_confirm_on_sweep: list[str] = []  # confirmed by other detectors while the sweep ran
        self.dead: set[str] = set()  # confirmed by a sweep that probes them, and only then
        self.membership: MembershipStore | None = None
        self.following: list[int | None] = []  # the since_revision of each follow_membership
        self.listeners: list[Any] = []  # of the failures it confirms
        self.view = MembershipView(0)
        self.views_read = 0

    def subscribe(self, listener: Any) -> None:
        self.listeners.append(listener)

    def subscribe_membership(self, listener: Any) -> None:
        pass

    def follow_membership(self, since_revision: int | None = None) -> None:
        self.following.append(since_revision)

    def unfollow_membership(self) -> None:
        self.following.append(-1)

    def membership_view(self) -> MembershipView:
        """Like the real detector's: a new view (its version one higher) only when the records changed."""
        assert self.membership is not None
        nodes = self.membership.list_nodes() if self.following and self.following[-1] != -1 else {}
        self.views_read += 1
        if nodes != dict(self.view.nodes):
            self.view = MembershipView(self.view.version + 1, MappingProxyType(nodes))
        return self.view

    def probe_all(self, nodes: list[str], reason: str, **options: Any) -> SweepResult:
        self.sweeps.append((sorted(nodes), reason))
        assert self.membership is not None
        for node in self.confirm_on_sweep:  # the sweep found these dead too
            self.membership.report_failure(FailureReport(node=node, epoch=0, reason="swept"))
        for node in self.others_confirm_on_sweep:
            self.membership.report_failure(FailureReport(node=node, epoch=0, reason="probe refused"))
        found = self.dead & set(nodes)
        for node in sorted(found):
            self.membership.report_failure(FailureReport(node=node, epoch=0, reason="probe refused"))
        confirmed = set(self.confirm_on_sweep) | found
        return SweepResult(confirmed=tuple(sorted(confirmed)), alive=tuple(sorted(set(nodes) - confirmed)))


class FakeAgent:
    def __init__(self, membership: MembershipStore, node: str, zone: str) -> None:
        self.node_id = node
        self.registration = membership.register(NodeRecord(id=node, zone=zone, state=NodeState.NODE_STATE_ACTIVE),
                                                ttl=30)
        self.detector = FakeDetector()
        self.detector.membership = membership


class Events:
    def __init__(self) -> None:
        self.written: list[Any] = []
        self._lock = threading.Lock()

    def now(self) -> float:
        return 1.0

    def write(self, event: Any) -> None:
        with self._lock:
            self.written.append(event)


def _spec(job: str, **changes: Any) -> JobSpec:
    fields: dict[str, Any] = {"job": job, "stages": 2, "pipelines": 2, "steps": 10, "micro_batches": 4,
                              "created_unix": 1.0, "layers": [LAYER] * 4, "config": {}, "redundancy": "eflb",
                              "checkpoint_every": 10, "memory_copy_every": 10}
    fields.update(changes)
    return JobSpec(**fields)


def _coordinator(membership: MembershipStore, node: str, zone: str, spec: JobSpec,
                 clock: list[float] | None = None) -> tuple[Coordinator, FakeAgent, Events]:
    agent = FakeAgent(membership, node, zone)
    events = Events()
    ticks = clock if clock is not None else [0.0]
    coordinator = Coordinator(membership.fenced(agent.registration), agent, spec, events, clock=lambda: ticks[0])
    return coordinator, agent, events


def test_one_agent_is_elected_and_another_takes_over_when_its_lease_goes(membership: MembershipStore) -> None:
    spec = _spec(membership.keys.job, min_nodes=9)  # never enough nodes: no first layout in this test
    first, first_agent, _ = _coordinator(membership, "n0", "a", spec)
    second, _, _ = _coordinator(membership, "n1", "b", spec)
    assert first.round() and not second.round()
    assert first.leader and not second.leader
    membership.kv.revoke_lease(first_agent.registration.lease_id)  # n0 declared dead: its key goes with it
    assert second.round() and second.leader
    assert not first.round() and not first.leader


def test_the_first_layout_is_written_as_soon_as_min_nodes_registered(membership: MembershipStore) -> None:
    spec = _spec(membership.keys.job, min_nodes=4)
    coordinator, agent, _ = _coordinator(membership, "n0", "a", spec)
    assert coordinator.round() and read_layout(membership) is None  # 1 of 4 registered
    assert agent.detector.following == [None]  # elected: it follows the membership (from now: no one held it)
    agents = [FakeAgent(membership, f"n{i}", zone) for i, zone in ((1, "b"), (2, "c"))]
    assert coordinator.round() and read_layout(membership) is None  # 3 of 4
    agents.append(FakeAgent(membership, "n3", "a"))
    coordinator.round()
    layout = read_layout(membership)
    assert layout is not None and layout.generation == 0 and sorted(layout.ranks) == ["n0", "n1", "n2", "n3"]
    assert layout == first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    late = FakeAgent(membership, "n4", "b")
    coordinator.round()
    assert read_layout(membership) == layout  # a node that registers later waits on standby
    assert agents and late  # kept registered


def test_a_round_after_no_membership_change_derives_nothing_again_and_a_change_is_seen(
    membership: MembershipStore,
) -> None:
    spec = _spec(membership.keys.job, min_nodes=9)  # never enough nodes: every round looks at the membership
    coordinator, agent, _ = _coordinator(membership, "n0", "a", spec)
    assert coordinator.round()
    zones = coordinator.registered_zones()
    assert dict(zones) == {"n0": "a"} and coordinator.view().version == 1
    reads = agent.detector.views_read
    for _ in range(3):  # rounds woken by a failure notice or a leader-key change: the same view, nothing derived
        assert coordinator.round()
    assert agent.detector.views_read > reads and coordinator.view() is agent.detector.view
    assert coordinator.registered_zones() is zones
    late = FakeAgent(membership, "n1", "b")
    assert coordinator.round() and coordinator.view().version == 2
    assert coordinator.registered_zones() is not zones and dict(coordinator.registered_zones()) == {"n0": "a", "n1": "b"}
    late.registration.leave()
    assert coordinator.round() and dict(coordinator.registered_zones()) == {"n0": "a"}


def _two_pipelines(membership: MembershipStore, standby: tuple[str, str] | None = None,
                   ) -> tuple[Coordinator, FakeAgent, Events, dict[str, int]]:
    """The coordinator n0 of a first layout of two pipelines, (n0, n1) and (n3, n2), and ``standby`` (node, zone)
    registered too: the coordinator, its agent, its events and the layout's ranks."""
    spec = _spec(membership.keys.job)
    coordinator, agent, events = _coordinator(membership, "n0", "a", spec)
    for node, zone in (("n1", "b"), ("n2", "c"), ("n3", "a"), *([standby] if standby else [])):
        FakeAgent(membership, node, zone)
    layout = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    assert membership.put_layout(layout.to_dict(), 0) is not None
    assert layout.owners == (("n0", "n1"), ("n3", "n2"))
    return coordinator, agent, events, dict(layout.ranks)


def test_confirmed_failures_of_ranked_nodes_are_published_once_with_what_the_sweep_finds(
    membership: MembershipStore,
) -> None:
    coordinator, agent, events, ranks = _two_pipelines(membership, standby=("s4", "b"))
    membership.report_failure(FailureReport(node="n3", epoch=0, reason="probe refused"))
    agent.detector.confirm_on_sweep = ["n2"]  # killed at the same instant: found by the sweep
    coordinator.round()
    # the sweep probes the victim's pipeline only (at most P nodes, whatever the job's size)
    assert agent.detector.sweeps == [(["n2"], "swept after a confirmed failure in the layout")]
    assert published_events(membership, 0) == {1: FailureEvent(1, sorted([ranks["n3"], ranks["n2"]]))}
    coordinator.round()  # nothing new: nothing published again
    assert list(published_events(membership, 0)) == [1]
    membership.report_failure(FailureReport(node="s4", epoch=0, reason="lease expired"))  # a standby node
    membership.report_failure(FailureReport(node="n1", epoch=0, reason="probe refused"))
    agent.detector.confirm_on_sweep = []
    coordinator.round()
    assert published_events(membership, 0)[2] == FailureEvent(2, [ranks["n1"]])
    assert len(agent.detector.sweeps) == 1  # n1's pipeline holds only the coordinator itself: nothing to sweep
    assert sorted(e.node for e in events.written) == ["n1", "n2", "n3", "s4"]  # one preemption record each
    assert {e.zone for e in events.written if e.node == "s4"} == {"b"}


def test_failures_confirmed_in_another_pipeline_during_the_sweep_go_into_the_same_event(
    membership: MembershipStore,
) -> None:
    """Kills that land together are confirmed by several detectors milliseconds apart: one confirmed while the
    coordinator swept the first victim's pipeline is published with it (one event, one failover), after its own
    pipeline is swept too."""
    coordinator, agent, _events, ranks = _two_pipelines(membership)
    membership.report_failure(FailureReport(node="n3", epoch=0, reason="probe refused"))
    agent.detector.others_confirm_on_sweep = ["n1"]  # another detector confirms n1 (pipeline 0) during the sweep
    coordinator.round()
    assert published_events(membership, 0) == {1: FailureEvent(1, sorted([ranks["n3"], ranks["n1"]]))}
    # pipeline 1 was swept for n3 (n2 alive); pipeline 0 holds only the coordinator besides n1: nothing to probe
    assert agent.detector.sweeps == [(["n2"], "swept after a confirmed failure in the layout")]


def test_a_failure_confirmed_while_an_event_is_published_gets_its_own_event_in_the_same_round(
    membership: MembershipStore, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A report that lands while the coordinator writes an event (heard through the detector's watch) is read
    back and published at once, before the round's preemption records, not in the next round."""
    from bamboo.launch import coordinator_failures

    coordinator, _agent, events, ranks = _two_pipelines(membership)
    publish = coordinator_failures.publish_failure_event

    def publish_then_hear_n1(*args: Any) -> Any:
        outcome = publish(*args)
        if not published_events(membership, 0).get(2):  # while the first event is written, n1 is confirmed
            report = FailureReport(node="n1", epoch=0, reason="probe refused")
            membership.report_failure(report)
            coordinator._on_failure(NodeFailed.from_report(report))
        return outcome

    monkeypatch.setattr(coordinator_failures, "publish_failure_event", publish_then_hear_n1)
    membership.report_failure(FailureReport(node="n3", epoch=0, reason="probe refused"))
    coordinator.round()
    assert published_events(membership, 0) == {1: FailureEvent(1, [ranks["n3"]]), 2: FailureEvent(2, [ranks["n1"]])}
    assert sorted(e.node for e in events.written) == ["n1", "n3"]  # one preemption record each


def test_a_failure_heard_while_the_preemption_records_are_written_is_published_before_the_next_record(
    membership: MembershipStore,
) -> None:
    """Ten kills at once at 1,000 nodes: the records of the first event's victims took tens of milliseconds, and
    a victim confirmed meanwhile waited for all of them. Its event now goes out before the next record."""
    coordinator, agent, events, ranks = _two_pipelines(membership)
    published_when: list[dict[int, FailureEvent]] = []
    write = events.write

    def write_then_hear_n1(event: Any) -> None:
        published_when.append(published_events(membership, 0))
        write(event)
        if len(published_when) == 1:  # during the first record, n1 is confirmed
            report = FailureReport(node="n1", epoch=0, reason="probe refused")
            membership.report_failure(report)
            coordinator._on_failure(NodeFailed.from_report(report))

    events.write = write_then_hear_n1  # type: ignore[method-assign]
    membership.report_failure(FailureReport(node="n3", epoch=0, reason="probe refused"))
    agent.detector.confirm_on_sweep = ["n2"]  # n3 and n2: one event, two records to write
    coordinator.round()
    assert published_events(membership, 0) == {1: FailureEvent(1, sorted([ranks["n2"], ranks["n3"]])),
                                               2: FailureEvent(2, [ranks["n1"]])}
    assert [sorted(found) for found in published_when] == [[1], [1, 2]]  # n1's event before the second record
    coordinator.round()  # the next round writes n1's record, and publishes nothing again
    assert sorted(e.node for e in events.written) == ["n1", "n2", "n3"]
    assert list(published_events(membership, 0)) == [1, 2]


def test_after_a_failure_is_published_the_waiting_nodes_of_its_zone_are_swept(membership: MembershipStore) -> None:
    """A zone's machines go together, and a standby node has no pipeline neighbour to notice: it is probed once
    the event is out (before, its lease's expiry found it, and held up the next reconfiguration meanwhile)."""
    coordinator, agent, _events, ranks = _two_pipelines(membership, standby=("s4", "a"))
    FakeAgent(membership, "s5", "b")  # waiting in another zone: left alone
    membership.report_failure(FailureReport(node="n3", epoch=0, reason="probe refused"))  # zone a
    coordinator.round()
    assert published_events(membership, 0) == {1: FailureEvent(1, [ranks["n3"]])}
    assert agent.detector.sweeps == [
        (["n2"], "swept after a confirmed failure in the layout"),  # its pipeline, before the event
        (["s4"], "swept: in the zone of a failure"),  # after it
    ]
    coordinator.round()  # nothing new: no sweep again
    assert len(agent.detector.sweeps) == 2


def test_a_node_of_another_pipeline_in_a_zone_that_lost_two_is_swept_and_its_failure_published_at_once(
    membership: MembershipStore,
) -> None:
    """Between two layouts no data flows, so a node of the other pipeline killed with its zone has nobody to
    notice it: once two nodes of a zone are in an event, the zone's sweep after it finds it (the coordinator,
    s9, is outside the layout). A zone that lost one node has its layout's nodes left alone."""
    spec = _spec(membership.keys.job)
    coordinator, agent, _events = _coordinator(membership, "s9", "d", spec)
    zones = {"n0": "a", "n1": "a", "n2": "c", "n3": "a"}
    for node, zone in zones.items():
        FakeAgent(membership, node, zone)
    layout = first_layout(spec, zones)
    assert membership.put_layout(layout.to_dict(), 0) is not None
    assert layout.owners == (("n0", "n1"), ("n3", "n2"))
    ranks = dict(layout.ranks)
    membership.report_failure(FailureReport(node="n0", epoch=0, reason="probe refused"))  # zone a, pipeline 0
    agent.detector.dead = {"n1", "n3"}  # the rest of zone a, in both pipelines, killed with it
    coordinator.round()
    assert agent.detector.sweeps == [
        (["n1"], "swept after a confirmed failure in the layout"),  # its pipeline, before the event
        (["n3"], "swept: in the zone of a failure"),  # zone a lost two: its other pipeline, after the event
        (["n2"], "swept after a confirmed failure in the layout"),  # n3's pipeline, before n3's event
    ]
    assert published_events(membership, 0) == {1: FailureEvent(1, [ranks["n0"], ranks["n1"]]),
                                              2: FailureEvent(2, [ranks["n3"]])}


def test_the_sweep_before_an_event_probes_the_victims_ring_neighbours_and_follows_a_consecutive_failure(
    membership: MembershipStore,
) -> None:
    """In a pipeline of four, the failure of stage 1 probes its ring neighbours only, not stage 3 (at most two
    probes per victim, whatever P), and of them not stage 0, which reported it (alive a moment ago); stage 2
    found dead there is a consecutive failure: its own neighbour, stage 3, is probed next, and both go into one
    event."""
    spec = _spec(membership.keys.job, stages=4, pipelines=1, layers=[LAYER] * 4)
    coordinator, agent, _events = _coordinator(membership, "s9", "d", spec)
    zones = {f"n{i}": "abcd"[i] for i in range(4)}
    for node, zone in zones.items():
        FakeAgent(membership, node, zone)
    layout = first_layout(spec, zones)
    assert membership.put_layout(layout.to_dict(), 0) is not None
    stage_of = {node: stage for stage, node in enumerate(layout.owners[0])}
    by_stage = {stage: node for node, stage in stage_of.items()}
    membership.report_failure(FailureReport(node=by_stage[1], epoch=0, reason="probe refused",
                                            detected_by=by_stage[0]))
    agent.detector.dead = {by_stage[2]}
    coordinator.round()
    assert agent.detector.sweeps == [
        ([by_stage[2]], "swept after a confirmed failure in the layout"),
        ([by_stage[3]], "swept after a confirmed failure in the layout"),  # the neighbour of the one found dead
    ]
    assert published_events(membership, 0) == {1: FailureEvent(1, [1, 2])}


def test_a_few_losses_scattered_over_a_large_zone_do_not_sweep_its_layout_nodes(membership: MembershipStore) -> None:
    """A zone's layout nodes are probed after an event only when the zone was struck as a whole: two losses
    together among its 24 layout nodes are scattered kills (under ZONE_SWEEP_MIN_SHARE), three are a zone-wide
    preemption."""
    spec = _spec(membership.keys.job, stages=2, pipelines=12, layers=[LAYER] * 2)
    coordinator, agent, _events = _coordinator(membership, "s99", "z", spec)
    zones = {f"n{i:02d}": "a" for i in range(24)}
    for node, zone in zones.items():
        FakeAgent(membership, node, zone)
    layout = first_layout(spec, zones)
    assert membership.put_layout(layout.to_dict(), 0) is not None
    assert 2 < ZONE_SWEEP_MIN_SHARE * 24 < 3
    heads = [row[0] for row in layout.owners]
    for node in heads[:2]:
        membership.report_failure(FailureReport(node=node, epoch=0, reason="probe refused"))
    coordinator.round()
    assert [reason for _, reason in agent.detector.sweeps] == ["swept after a confirmed failure in the layout"]
    for node in heads[2:5]:
        membership.report_failure(FailureReport(node=node, epoch=0, reason="probe refused"))
    coordinator.round()
    zone_sweeps = [nodes for nodes, reason in agent.detector.sweeps if reason == "swept: in the zone of a failure"]
    assert zone_sweeps == [sorted(set(zones) - set(heads[:5]))]


class CountingPrefixReads:
    """Wraps a key-value store and counts the reads of prefixes that hold ``part``."""

    def __init__(self, inner: object, part: str) -> None:
        self.inner, self.part, self.reads = inner, part, 0

    def get_prefix(self, prefix: str):  # type: ignore[no-untyped-def]
        self.reads += self.part in prefix
        return self.inner.get_prefix(prefix)  # type: ignore[attr-defined]

    def __getattr__(self, name: str) -> object:
        return getattr(self.inner, name)


def test_published_events_are_read_once_ahead_of_a_failure_and_an_event_written_meanwhile_is_not_overwritten(
    membership: MembershipStore,
) -> None:
    coordinator, _agent, _events, ranks = _two_pipelines(membership)
    reads = CountingPrefixReads(coordinator.membership.kv, "-epoch-")
    coordinator.membership.kv = reads  # type: ignore[assignment]
    assert coordinator.round() and reads.reads == 1  # the layout's events, read before any failure
    # A leaver publishes its own hand-over (epoch 1) behind the coordinator's back; then n3 fails.
    handover = FailureEvent(1, [ranks["n1"]], handover=True)
    assert publish_failure_event(membership, 0, handover) == (True, handover)
    membership.report_failure(FailureReport(node="n3", epoch=0, reason="probe refused"))
    membership.report_failure(FailureReport(node="n1", epoch=0, reason="lease revoked"))  # gone after it left
    assert coordinator.round()
    # epoch 1 was taken: the coordinator lost that race, learned the hand-over (n1 covered) and took epoch 2
    assert published_events(membership, 0) == {1: handover, 2: FailureEvent(2, [ranks["n3"]])}
    assert reads.reads == 1  # no read of the events on the failover's path
    assert coordinator.round() and len(published_events(membership, 0)) == 2  # nothing published twice


def test_a_new_coordinator_carries_on_without_publishing_twice(membership: MembershipStore) -> None:
    spec = _spec(membership.keys.job)
    old, old_agent, _ = _coordinator(membership, "n0", "a", spec)
    new, new_agent, new_events = _coordinator(membership, "n1", "b", spec)
    for node, zone in (("n2", "c"), ("n3", "a")):
        FakeAgent(membership, node, zone)
    layout = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    membership.put_layout(layout.to_dict(), 0)
    membership.report_failure(FailureReport(node="n2", epoch=0, reason="probe refused"))
    assert old.round()
    membership.kv.revoke_lease(old_agent.registration.lease_id)
    membership.report_failure(FailureReport(node="n0", epoch=0, reason="lease revoked"))
    assert new.round()
    events = published_events(membership, 0)
    assert [event.victims for _, event in sorted(events.items())] == [(layout.ranks["n2"],), (layout.ranks["n0"],)]
    assert [e.node for e in new_events.written] == ["n0"]  # n2's preemption was recorded by the old one
    assert new_agent.detector.sweeps == []  # n0's pipeline holds only the new coordinator itself; zone a lost one


def test_a_new_coordinator_records_the_layout_s_nodes_lost_before_it_followed_the_membership(
    membership: MembershipStore,
) -> None:
    """A bulk kill took the coordinator and n2 (whose lease expired before the next coordinator followed the
    membership, and with no neighbour left to report it) and n3, which had handed its stage over after a notice:
    the next coordinator records n2's loss once, and neither n3's (it recorded its own) nor a live node's."""
    spec = _spec(membership.keys.job)
    old, old_agent, old_events = _coordinator(membership, "n0", "a", spec)
    new, _new_agent, new_events = _coordinator(membership, "n1", "b", spec)
    others = {node: FakeAgent(membership, node, zone) for node, zone in (("n2", "c"), ("n3", "a"))}
    layout = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    membership.put_layout(layout.to_dict(), 0)
    assert old.round() and not new.round()
    membership.decide("handover-n3", {"v": 1, "node": "n3"})
    for agent in (others["n2"], others["n3"]):
        membership.kv.revoke_lease(agent.registration.lease_id)
    membership.kv.revoke_lease(old_agent.registration.lease_id)  # the coordinator too, never reported
    assert new.round()
    assert [(e.node, e.zone) for e in new_events.written] == [("n0", "a"), ("n2", "c")]
    assert membership.get_decision("preempted-n2").value["reason"] == (
        "its lease expired before this coordinator took over")
    assert new_events.written[1].reason == "its lease expired before this coordinator took over"  # in the log too
    assert new.round() and len(new_events.written) == 2  # once per election
    assert old_events.written == []


def test_a_new_coordinator_records_the_warm_standby_nodes_lost_before_it_followed_the_membership(
    membership: MembershipStore,
) -> None:
    """Measured in a churn run: a standby node killed 1.3 s before the coordinator had no preemption record at all
    (it is in no layout, and its lease expired before the next coordinator followed the membership). A node whose
    worker became warm is known by its ``warm-`` record, and a joiner still starting (n7: killed 2 s after it
    registered, its worker importing; two of eight harsh churn runs billed such a node to the run's end) by its
    ``joined-`` record: the next coordinator records each lost one once, and neither one recorded before (by the
    old coordinator) nor a live one."""
    spec = _spec(membership.keys.job)
    old, old_agent, _old_events = _coordinator(membership, "n0", "a", spec)
    new, _new_agent, new_events = _coordinator(membership, "n1", "b", spec)
    others = {node: FakeAgent(membership, node, zone)
              for node, zone in (("n2", "c"), ("n3", "a"), ("n4", "b"), ("n5", "c"), ("n6", "a"), ("n7", "c"))}
    layout = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    membership.put_layout(layout.to_dict(), 0)
    for node in ("n4", "n5", "n6"):
        membership.decide(f"warm-{node}", WorkerWarm(node, 1.0, zone=others[node].registration.record.zone).to_dict())
    membership.decide("joined-n7", NodeJoined("n7", 1.0, zone="c").to_dict())  # no warm- record yet
    membership.decide("preempted-n5", Preempted("n5", "c", "lease expired").to_dict())  # the old one recorded it
    assert old.round() and not new.round()
    for node in ("n4", "n5", "n7"):
        membership.kv.revoke_lease(others[node].registration.lease_id)
    membership.kv.revoke_lease(old_agent.registration.lease_id)
    assert new.round()
    assert [(e.node, e.zone) for e in new_events.written] == [("n0", "a"), ("n4", "b"), ("n7", "c")]
    assert membership.get_decision("preempted-n7").value["reason"] == (
        "its lease expired before this coordinator took over")
    assert new.round() and len(new_events.written) == 3  # once per election


def test_an_agent_records_that_it_joined_beside_its_join_event(membership: MembershipStore, tmp_path: Path) -> None:
    """The ``joined-`` record is written with the ``join`` event, by the agent, before any worker starts."""
    from bamboo.launch.records import read_record

    options = AgentOptions(job=membership.keys.job, etcd=EtcdAccess(endpoints=("127.0.0.1:1",)), node="j1",
                           zone="b", run_dir=str(tmp_path))
    supervisor = Supervisor(options, _spec(membership.keys.job), membership, "j1", "b", say=lambda _: None,
                            wake=threading.Event())
    supervisor.start(announce=True, wrote_spec=False)
    try:
        joined = read_record(NodeJoined, membership.get_decision("joined-j1"))
        assert joined is not None and (joined.node, joined.zone) == ("j1", "b")
    finally:
        supervisor.coordinator.stop()
        supervisor.agent.stop(leave=True, grace=0)


def test_a_node_that_handed_over_and_then_was_confirmed_dead_has_one_preemption_record(
        membership: MembershipStore) -> None:
    """n1 handed its stage over after its notice and left; a peer whose operation with it failed as it left
    reported it, and the coordinator confirmed it dead. Its preemption is recorded once, by the hand-over (a loaded
    make test met two records, and the report counts a node preempted twice as an error)."""
    from bamboo.launch.worker import _hand_over

    spec = _spec(membership.keys.job)
    coordinator, _, coordinator_events = _coordinator(membership, "n0", "a", spec)
    layout = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    worker_events = Events()
    run = SimpleNamespace(membership=membership, node="n1", log=worker_events, notice_deadline=None,
                          context=SimpleNamespace(zone="b"))
    _hand_over(run, layout, SimpleNamespace(step=10, stage=1, pipeline=0))  # type: ignore[arg-type]
    coordinator._confirm_lost("n1", "rank 3: 1AR failed in epoch 0 (reported by n2); probe refused")
    assert [(e.node, e.zone) for e in worker_events.written] == [("n1", "b")]
    assert coordinator_events.written == []
    assert membership.get_decision("handover-n1") is not None


def test_a_layout_nobody_holds_starts_over_on_warm_nodes_without_any_copy(membership: MembershipStore) -> None:
    """Every node of the layout gone, no in-memory copy and no checkpoint: the job does not end; once warm nodes
    can form a pipeline, the coordinator starts it over from its seeded initial state (step 0)."""
    from bamboo.launch.coordinator import read_layout

    spec = _spec(membership.keys.job)
    coordinator, _, events = _coordinator(membership, "s9", "a", spec)
    layout = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})  # none of them registered
    membership.put_layout(layout.to_dict(), 0)
    log = EtcdEventLog(membership.kv, spec.job, "n3.worker.1", spec.created_unix)
    log.write(Step(t=5.0, step=3, samples=8, loss=1.0, nodes_active=4, duration_s=0.1, generation=0))
    assert log.flush()  # it trained: its state is lost with its nodes (a layout that trained nothing is redone)
    coordinator.round()  # s9 is the only node, and it is not warm: nothing to start on yet
    assert membership.get_decision("end") is None and read_layout(membership).generation == 0
    FakeAgent(membership, "s8", "b")
    for node in ("s8", "s9"):
        membership.decide(f"warm-{node}", {"v": 1, "node": node, "at": 1.0})
    coordinator.round()
    restart = read_layout(membership)
    assert restart.generation == 1 and restart.start_step == 0 and set(restart.ranks) == {"s8", "s9"}
    assert restart.restore is not None and restart.restore.initial and membership.get_decision("end") is None
    # no probe reported them (their leases expired together): each loss is still recorded, once
    assert sorted((e.node, e.zone) for e in events.written) == [("n0", "a"), ("n1", "b"), ("n2", "c"), ("n3", "a")]
    assert membership.get_decision("preempted-n1") is not None


def test_the_elected_coordinator_is_woken_when_a_worker_becomes_warm(membership: MembershipStore) -> None:
    """A restart waits for warm workers; the one that became warm last wakes the coordinator (a measured
    heavy-churn restart had waited for the next poll, LEADER_POLL_S, 5 s). Only while elected and once a layout
    exists (the first places registered nodes whatever their workers, and a job's start would otherwise wake it
    once per node): stepping down stops following the warm records."""
    spec = _spec(membership.keys.job, min_nodes=9)
    coordinator, _, _ = _coordinator(membership, "s9", "a", spec)
    assert coordinator.round()
    assert coordinator._warm_records is None  # the job waits for its first layout
    membership.put_layout(first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"}).to_dict(), 0)
    assert coordinator._layout_key is not None
    assert coordinator._layout_key.wait(lambda found: found is not None, 30)
    assert coordinator.round()
    woken = threading.Event()
    coordinator.wake = lambda *, reports=True: woken.set() if not reports else None  # type: ignore[method-assign]
    membership.decide("warm-s8", {"v": 1, "node": "s8", "at": 1.0})
    assert woken.wait(30), "a warm record did not wake the elected coordinator"
    coordinator._step_down()
    assert coordinator._warm_records is None


def test_a_layout_that_trained_nothing_and_nobody_holds_is_started_again_on_warm_nodes(
    membership: MembershipStore,
) -> None:
    spec = _spec(membership.keys.job)
    coordinator, _, _ = _coordinator(membership, "s9", "a", spec)
    layout = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})  # lost while it started
    membership.put_layout(layout.to_dict(), 0)
    coordinator.round()
    assert membership.get_decision("end") is None and read_layout(membership) == layout  # nothing lost: it waits
    for node, zone in (("s9", "a"), ("w1", "b"), ("w2", "c"), ("w3", "a")):
        if node != "s9":
            FakeAgent(membership, node, zone)
        membership.decide(f"warm-{node}", {"node": node, "at": 1.0})
    coordinator.round()
    redo = read_layout(membership)
    assert redo is not None and redo.generation == 1 and sorted(redo.ranks) == ["s9", "w1", "w2", "w3"]
    assert redo.reason == "a node lost before the first step" and membership.get_decision("end") is None


def test_a_redone_start_whose_memory_keepers_died_restores_from_the_nearest_copy_left(
    membership: MembershipStore, tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    """A restart from in-memory copies abandoned before its first step is redone as it was while every stage keeps a
    live keeper; once a stage has none, from the nearest copy left (here none: the initial state). Redone as it
    was, a measured run failed the same start a thousand times."""
    from bamboo.launch.reconfigure import live_restore
    from bamboo.reconfig import RestorePoint

    spec = _spec(membership.keys.job)
    first = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    memory = {0: ("k0",), 1: ("k1", "k2")}
    restart = restart_layout(spec, first, ["w1", "w2"], {"w1": "a", "w2": "b"}, 60, "", reached=64, memory=memory)
    assert restart is not None and restart.restore is not None and restart.restore.source == "memory"
    assert live_restore(membership.kv, spec, restart, ["w1", "w2", "k0", "k2"]) is restart  # every stage kept
    redone = live_restore(membership.kv, spec, restart, ["w1", "w2", "k1", "k2"])  # stage 0's keeper is gone
    assert redone.restore is not None and redone.restore.initial and redone.start_step == 0
    assert redone.barrier_step == 64  # the steps up to it are trained again
    assert "the in-memory copies of step 60 are gone with their keepers" in capsys.readouterr().err
    again = redo_start_layout(spec, redone, ["w1", "w2"], {"w1": "a", "w2": "b"})
    assert again is not None and again.start_step == 0 and again.restore == RestorePoint(0, "", (0, 1), initial=True)


def test_restart_layout_restores_every_stage_on_the_warm_nodes(tmp_path: Path) -> None:
    spec = _spec("j")
    lost = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    assert restart_layout(spec, lost, ["w1"], {"w1": "a"}, 5, str(tmp_path)) is None  # one node: no pipeline
    restart = restart_layout(spec, lost, ["w1", "w2", "w3"], {"w1": "a", "w2": "b", "w3": "c"}, 5, str(tmp_path))
    assert restart is not None and restart.generation == 1 and restart.pipelines == 1
    assert restart.restore is not None and restart.restore.lost_stages == (0, 1) and restart.start_step == 5
    assert restart.global_batch == lost.global_batch and restart.micro_batches == 8
    assert restart.history == ((0, 2), (5, 1))


def test_the_steps_a_lost_generation_reached_are_its_step_records_after_its_barrier(tmp_path: Path) -> None:
    spec = _spec("j")
    created = 1000.0
    first = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})

    def step(t: float, number: int) -> Step:
        return Step(t=t, step=number, samples=8, loss=1.0, nodes_active=4, duration_s=0.1)

    assert steps_reached([], first, created) == 0  # no record: its start step
    events = [step(1.0, 1), step(2.0, 2), Checkpoint(t=2.1, step=2, path="p", bytes=1, duration_s=0.1), step(3.0, 3)]
    assert steps_reached(events, first, created) == 3  # the first layout has no barrier: every record counts
    # generation 1 restarted from step 2 at t = 10 (barrier_unix 1010): the earlier step 3 was not its own
    restarted = restart_layout(spec, first, ["w1", "w2"], {"w1": "a", "w2": "b"}, 2, str(tmp_path), reached=3)
    assert restarted is not None and restarted.barrier_step == 3  # step 3 is trained again
    restarted = attrs.evolve(restarted, barrier_unix=created + 10.0)
    assert steps_reached(events, restarted, created) == 2  # nothing after its barrier: its start step
    assert steps_reached([*events, step(11.0, 3), step(12.0, 4)], restarted, created) == 4
    assert restart_layout(spec, first, ["w1", "w2"], {"w1": "a", "w2": "b"}, 2, str(tmp_path)).barrier_step == 0


def test_a_restart_s_read_of_the_log_types_three_step_records_at_most_and_finds_the_same_progress(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from bamboo.launch import events as events_module

    spec = _spec("j")
    created = 1000.0
    first = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    restarted = restart_layout(spec, first, ["w1", "w2"], {"w1": "a", "w2": "b"}, 2, str(tmp_path), reached=3)
    assert restarted is not None
    restarted = attrs.evolve(restarted, barrier_unix=created + 10.0)
    records = [Step(t=1.0 + i, step=i + 1, samples=8, loss=1.0, nodes_active=4, duration_s=0.1) for i in range(9)]
    records += [Step(t=12.0 + i, step=3 + i, samples=8, loss=1.0, nodes_active=2, duration_s=0.1, generation=1)
                for i in range(40)]  # generation 1's own (its clock behind: t below the others' once)
    records += [Step(t=11.5, step=40, samples=8, loss=1.0, nodes_active=2, duration_s=0.1, generation=1),
                Checkpoint(t=2.1, step=2, path="p", bytes=1, duration_s=0.1)]
    items = [SimpleNamespace(key=f"/bamboo/j/events/w/{i:010d}", value=json.dumps(event_to_dict(e)).encode())
             for i, e in enumerate(records)]
    typed: list[object] = []
    real = events_module.event_from_dict
    monkeypatch.setattr(events_module, "event_from_dict", lambda record: typed.append(record) or real(record))
    kv = SimpleNamespace(get_prefix=lambda prefix: items)
    for layout in (first, restarted):
        typed.clear()
        read = read_etcd_events(kv, "j", select=progress_records(layout, created))  # type: ignore[arg-type]
        assert len(typed) <= 3  # its own highest and last steps, and the last step before it
        assert steps_reached(read, layout, created) == steps_reached(records, layout, created)
        assert last_step_end_unix(read, layout, created) == last_step_end_unix(records, layout, created)
    assert steps_reached(read, restarted, created) == 42


def test_records_that_name_their_generation_are_counted_whatever_the_writers_clocks(tmp_path: Path) -> None:
    spec = _spec("j")
    created = 1000.0
    first = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    restarted = restart_layout(spec, first, ["w1", "w2"], {"w1": "a", "w2": "b"}, 2, str(tmp_path), reached=5)
    assert restarted is not None and restarted.generation == 1
    restarted = attrs.evolve(restarted, barrier_unix=created + 10.0)

    def step(t: float, number: int, generation: int) -> Step:
        return Step(t=t, step=number, samples=8, loss=1.0, nodes_active=2, duration_s=0.1, generation=generation)

    # Generation 0's step 5 was written by a clock running ahead (after the barrier by the log's t), and
    # generation 1's step 4 by one running behind (before it): by time, 5; by generation, 4.
    skewed = [step(3.0, 3, 0), step(11.0, 5, 0), step(9.0, 3, 1), step(9.5, 4, 1)]
    assert steps_reached(skewed, restarted, created) == 4
    assert steps_reached(skewed, first, created) == 5
    assert steps_reached(skewed[:2], restarted, created) == 2  # none of its own: its start step


def test_a_restart_after_every_holder_was_lost_counts_its_pause_from_the_lost_generation_s_last_step(
    tmp_path: Path,
) -> None:
    """No holder lived to say when it stopped: the restart's ``barrier_unix`` (its pause's start) is the end of the
    lost generation's last step, not when the coordinator, elected after the loss, wrote the restart."""
    spec = _spec("j")
    created = 1000.0
    first = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})

    def step(t: float, number: int, generation: int) -> Step:
        return Step(t=t, step=number, samples=8, loss=1.0, nodes_active=4, duration_s=0.1, generation=generation)

    events = [step(1.0, 1, 0), step(2.5, 2, 0), step(2.0, 7, 3)]  # generation 3's record is another's
    assert last_step_end_unix(events, first, created) == 1002.5
    assert last_step_end_unix([], first, created) is None
    stopped = last_step_end_unix(events, first, created)
    restarted = restart_layout(spec, first, ["w1", "w2"], {"w1": "a", "w2": "b"}, 2, str(tmp_path), reached=2,
                               stopped_unix=stopped)
    assert restarted is not None and restarted.barrier_unix == 1002.5
    assert steps_reached(events, restarted, created) == 2  # the lost generation's last step is not the restart's
    unknown = restart_layout(spec, first, ["w1", "w2"], {"w1": "a", "w2": "b"}, 2, str(tmp_path))
    assert unknown is not None and unknown.barrier_unix is not None and unknown.barrier_unix > 1002.5  # now
    # An attempt lost before its first step (every node of it killed while it started) trained nothing since the
    # generation it came from: the restart after it counts from that generation's last step, not from its decision.
    attempt = attrs.evolve(restarted, barrier_unix=created + 3.0)  # generation 1, started from generation 0
    assert last_step_end_unix(events, attempt, created) == 1002.5
    assert last_step_end_unix([step(2.0, 7, 3)], attempt, created) is None  # only a later generation's record


def test_redo_start_layout_repeats_an_abandoned_first_start_on_the_nodes_left(tmp_path: Path) -> None:
    spec = _spec("j")
    zones = {"n0": "a", "n1": "b", "n2": "c", "n3": "a", "n4": "b"}
    lost = first_layout(spec, zones)
    assert lost.generation == 0 and lost.pipelines == 2
    assert redo_start_layout(spec, lost, ["n0"], zones) is None  # one node: no pipeline
    redo = redo_start_layout(spec, lost, ["n0", "n2", "n3", "n4"], zones)
    assert redo is not None and redo.generation == 1 and redo.pipelines == 2 and "n1" not in redo.ranks
    assert redo.mode is lost.mode and redo.restore is None and redo.start_step == 0
    assert redo.base_generation == 0 and redo.attempt == 1 and redo.survivors == ()
    assert redo.reason == "a node lost before the first step" and redo.history == ((0, 2),)
    three = redo_start_layout(spec, lost, ["n0", "n2", "n3"], zones)  # one pipeline keeps the global batch
    assert three is not None and three.pipelines == 1 and three.global_batch == lost.global_batch
    again = redo_start_layout(spec, redo, ["n0", "n3", "n4", "n2"], zones)  # the redo lost a node too
    assert again is not None and again.generation == 2 and again.base_generation == 0 and again.attempt == 2
    # a restart of every stage from a checkpoint is redone from the same checkpoint
    restart = restart_layout(spec, lost, ["w1", "w2"], {"w1": "a", "w2": "b"}, 5, str(tmp_path))
    assert restart is not None
    redone = redo_start_layout(spec, restart, ["w1", "w3"], {"w1": "a", "w3": "c"})
    assert redone is not None and redone.restore == restart.restore and redone.start_step == 5
    assert redone.history == restart.history and redone.generation == restart.generation + 1


def test_redo_start_layout_refuses_a_start_that_holders_decide(tmp_path: Path) -> None:
    spec = _spec("j")
    lost = attrs.evolve(first_layout(spec, {"n0": "a", "n1": "b"}), survivors=("n0",), base_generation=0,
                        generation=1)
    with pytest.raises(ValueError, match=r"starts from the state of \['n0'\]"):
        redo_start_layout(spec, lost, ["n0", "n1"], {"n0": "a", "n1": "b"})


def test_a_node_left_waiting_for_dead_survivors_goes_on_with_the_job_s_newer_layout(
    membership: MembershipStore, tmp_path: Path,
) -> None:
    """A node that held nothing in an abandoned start from survivors' state waits for the survivors' decision of
    the next attempt, and takes it when it comes; once the job publishes a newer layout without that decision
    (every survivor lost, the coordinator restarted every stage), it goes on with that layout at once instead of
    waiting out the build timeout."""
    from bamboo.launch.barrier import next_attempt_layout
    from bamboo.launch.session import decision_prefix

    spec = _spec(membership.keys.job)
    zones = {"n0": "a", "n1": "b", "s8": "b", "s9": "a"}
    lost = attrs.evolve(first_layout(spec, zones), generation=1, survivors=("n0", "n1"), base_generation=0)
    current: dict[str, Any] = {"layout": lost}
    changes = threading.Event()

    def wait_decision(name: str, timeout: float) -> Any:  # WorkerSession's: a poll of the decision alone
        while (found := membership.get_decision(name)) is None:
            changes.wait(0.02)
        return found.value

    roles = SimpleNamespace(changes=lambda: 0, wait_change=lambda seen, timeout: changes.wait(timeout))
    run = SimpleNamespace(membership=membership, ended=lambda: None, layout=lambda: current["layout"],
                          timeouts=SimpleNamespace(build=60.0), wait_decision=wait_decision, roles=roles)
    decided = attrs.evolve(lost, generation=2, attempt=1, survivors=("n0",))
    membership.decide(f"{decision_prefix(0, 1)}next", decided.to_dict())
    assert next_attempt_layout(run, lost) == decided  # type: ignore[arg-type]
    lost_again = attrs.evolve(decided, generation=2)
    restart = restart_layout(spec, lost_again, ["s8", "s9"], zones, 4, str(tmp_path))
    assert restart is not None
    got: dict[str, Any] = {}
    waiter = threading.Thread(target=lambda: got.update(layout=next_attempt_layout(run, lost_again)), daemon=True)
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive(), "it went on before the job did"
    current["layout"] = restart
    changes.set()
    waiter.join(10.0)
    assert not waiter.is_alive() and got["layout"] == restart


def test_an_auto_jobs_first_layout_names_the_mode_its_rate_pays_for(membership: MembershipStore) -> None:
    """P = 2, D = 1 (two nodes on standby), M = 4, 1,000 steps without checkpoints or in-memory copies: no
    preemption expected, nothing pays for redundancy; at the rate the job was given (no history of its own yet) a
    lazy copy pays, since without it a loss (no other pipeline holds the stage) would redo half the job."""
    for rate, mode in ((0.0, "none"), (1.0, "lflb")):
        spec = _spec(f"{membership.keys.job}-{mode}", redundancy="auto", preemptions_per_node_hour=rate, steps=1000,
                     memory_copy_every=0, pipelines=1, min_nodes=4)
        store = MembershipStore(membership.kv, spec.job)
        coordinator, _, _ = _coordinator(store, "n0", "a", spec)
        agents = [FakeAgent(store, f"n{i}", zone) for i, zone in ((1, "b"), (2, "c"), (3, "a"))]
        coordinator.round()
        layout = read_layout(store)
        assert layout is not None and layout.redundancy is not None and agents
        assert layout.redundancy.mode == mode, layout.redundancy.reason
        assert layout.redundancy.preemptions_per_node_hour == pytest.approx(rate)


def test_a_survivor_left_out_of_a_layout_that_went_ahead_does_not_hold_up_its_restart(
    membership: MembershipStore,
) -> None:
    """Generation 1 came from a barrier held by n0..n3 and s9 and went ahead on n0..n3; s9, left out, went to
    standby and let its state go. When every rank of generation 1 is gone, s9 (still registered) holds nothing
    it needs: the coordinator restarts at once instead of waiting for s9 to be lost too. Before the start went
    ahead, the same survivor still holds the barrier's state, and the coordinator waits."""
    from bamboo.launch.coordinator import read_layout
    from bamboo.launch.records import AttemptOutcome, outcome_name

    spec = _spec(membership.keys.job)
    coordinator, _, _ = _coordinator(membership, "s9", "a", spec)
    first = first_layout(spec, {"n0": "a", "n1": "b", "n2": "c", "n3": "a"})
    layout = attrs.evolve(first, generation=1, survivors=("n0", "n1", "n2", "n3", "s9"), base_generation=0,
                          history=((0, 2), (4, 2)), start_step=4, barrier_step=4)
    membership.put_layout(layout.to_dict(), 0)
    FakeAgent(membership, "s8", "b")
    for node in ("s8", "s9"):
        membership.decide(f"warm-{node}", {"v": 1, "node": node, "at": 1.0})
    coordinator.round()
    assert read_layout(membership).generation == 1  # the start has not gone ahead: s9 may still be needed
    membership.decide(outcome_name(1), AttemptOutcome(True, "every node is up", at=1.0).to_dict())
    coordinator.round()
    restart = read_layout(membership)
    assert restart.generation == 2 and set(restart.ranks) == {"s8", "s9"} and restart.restore is not None


def _abandoned_start_of_survivors(membership: MembershipStore, alive: tuple[str, ...]) -> tuple[Coordinator, Events]:
    """Generation 1, started from the state of survivors n0 and n1, with joiners s8 and s9 among its ranks; the
    coordinator runs on s9, and the nodes ``alive`` are registered too; every live node is warm. Returns the
    coordinator and its event writer."""
    spec = _spec(membership.keys.job)
    coordinator, _, events = _coordinator(membership, "s9", "a", spec)
    first = first_layout(spec, {"n0": "a", "n1": "b", "s8": "b", "s9": "a"})
    layout = attrs.evolve(first, generation=1, survivors=("n0", "n1"), base_generation=0,
                          history=((0, 2), (4, 2)), start_step=4, barrier_step=4)
    membership.put_layout(layout.to_dict(), 0)
    for node in alive:
        FakeAgent(membership, node, "b")
    for node in ("s9", *alive):
        membership.decide(f"warm-{node}", {"v": 1, "node": node, "at": 1.0})
    return coordinator, events


def test_an_abandoned_start_whose_survivors_are_all_gone_is_restarted_though_its_joiners_live(
    membership: MembershipStore,
) -> None:
    """Generation 1 starts from the state that survivors n0 and n1 held at the barrier, with joiners s8 and s9 in
    its ranks; its start is abandoned, then both survivors are lost. s8 and s9 hold nothing and the decision of
    the next attempt, which only survivors take, never comes: the coordinator restarts every stage on the warm
    nodes, s8 and s9 among them, instead of waiting for them to be lost too. While the outcome is not decided,
    or a survivor lives, it waits; the live joiners' losses are never recorded."""
    from bamboo.launch.coordinator import read_layout
    from bamboo.launch.records import AttemptOutcome, outcome_name

    coordinator, events = _abandoned_start_of_survivors(membership, alive=("s8",))
    coordinator.round()
    assert read_layout(membership).generation == 1  # no outcome yet: the start may still go ahead
    membership.decide(outcome_name(1), AttemptOutcome(False, "n1 left the membership", at=1.0).to_dict())
    coordinator.round()
    restart = read_layout(membership)
    assert restart.generation == 2 and set(restart.ranks) == {"s8", "s9"} and restart.restore is not None
    assert restart.reason == "every holder lost"
    assert sorted(e.node for e in events.written) == ["n0", "n1"]  # the joiners live: no loss of theirs


def test_an_abandoned_start_with_a_survivor_alive_waits_for_its_next_attempt(membership: MembershipStore) -> None:
    """The same abandoned start, one survivor (n0) still registered: it decides the next attempt, and the
    coordinator writes nothing."""
    from bamboo.launch.coordinator import read_layout
    from bamboo.launch.records import AttemptOutcome, outcome_name

    coordinator, _ = _abandoned_start_of_survivors(membership, alive=("s8", "n0"))
    membership.decide(outcome_name(1), AttemptOutcome(False, "n1 left the membership", at=1.0).to_dict())
    coordinator.round()
    assert read_layout(membership).generation == 1


def test_an_agent_that_confirms_a_failure_probes_the_coordinator_that_must_publish_it(
    membership: MembershipStore,
) -> None:
    """Killed in the same bulk preemption as the nodes it must publish, with no neighbour left to report it (a
    standby node), the coordinator held its key until its lease expired: 9 s of a measured run's failover."""
    spec = _spec(membership.keys.job)
    elected, elected_agent, _ = _coordinator(membership, "a", "z1", spec)
    other, other_agent, _ = _coordinator(membership, "b", "z2", spec)
    assert elected.round() and not other.round()
    assert other_agent.detector.sweeps == []  # no failure confirmed here: nothing to check
    event = NodeFailed(node="c", epoch=0, detected_by="b", reason="refused", path="neighbour_report")
    for listener in other_agent.detector.listeners + elected_agent.detector.listeners:
        listener(event)
    assert not other.round() and other_agent.detector.sweeps == [
        (["a"], "the coordinator, checked after a confirmed failure")]
    assert elected.round() and elected_agent.detector.sweeps == []  # it does not probe itself
    assert not other.round() and len(other_agent.detector.sweeps) == 1  # once per failure


def test_a_round_after_registrations_only_does_not_read_the_reports_back(membership: MembershipStore) -> None:
    """The loop's rounds that only registrations woke (`wake(reports=False)`) skip the read of the failure reports
    (one per registration while a thousand nodes start); a failure, the leader key or the layout wakes a full one."""
    spec = _spec(membership.keys.job)
    coordinator, _, events = _coordinator(membership, "n0", "a", spec)
    for node, zone in (("n1", "b"), ("n2", "c"), ("n3", "a")):
        FakeAgent(membership, node, zone)
    assert coordinator.round()  # elected, and the first layout written
    reads: list[str] = []
    real = coordinator.membership.kv.get_prefix

    def counted(prefix: str) -> Any:
        reads.append(prefix)
        return real(prefix)

    coordinator.membership.kv.get_prefix = counted  # type: ignore[method-assign]
    membership.report_failure(FailureReport(node="n3", epoch=0, reason="probe refused"))
    assert coordinator.round(reports=False) and published_events(membership, 0) == {}
    assert not any(prefix.startswith(membership.keys.failures) for prefix in reads) and events.written == []
    assert coordinator.round()
    assert list(published_events(membership, 0)) == [1] and [e.node for e in events.written] == ["n3"]


def test_layouts_split_the_global_batch_unevenly_whatever_the_stages() -> None:
    """16 microbatches (D = 4, 4 each) on nodes for 3 pipelines: 3 pipelines of 6, 5 and 5 (each runs its own
    share), with two stages and with one (the shadow ring), and no node left on standby. Not a job that dies for a
    global batch it cannot split, nor one that idles a node that could train."""
    for stages in (2, 1):
        spec = _spec("uneven", stages=stages, pipelines=4, micro_batches=4)
        zones = {f"n{i}": "ab"[i % 2] for i in range(3 * stages)}
        first = first_layout(spec, zones)
        assert first.plan.microbatches == (6, 5, 5) and not first.plan.standby, stages
        again = restart_layout(spec, first, sorted(zones), zones, step=3, path="/ckpt/step-3")
        assert again is not None and again.plan.microbatches == (6, 5, 5), stages


def test_the_first_agent_writes_the_spec_and_the_next_one_reads_it(membership: MembershipStore, tmp_path: Path) -> None:
    """`ensure_spec`: the first agent of a job (the built-in example at P = 1, 4 microbatches a pipeline at D = 4) writes
    the spec; an agent that finds the spec stored takes it as it is."""
    from bamboo.launch.agent_options import AgentOptions
    from bamboo.launch.agent_spec import ensure_spec
    from bamboo.launch.spec import EtcdAccess, SpecFields

    def options(node: str) -> AgentOptions:
        return AgentOptions(job=membership.keys.job, etcd=EtcdAccess(endpoints=("unused:0",)), node=node,
                            run_dir=str(tmp_path), spec=SpecFields(stages=1, pipelines=4))

    said: dict[str, list[str]] = {"n0": [], "n1": []}
    first, written = ensure_spec(membership, options("n0"), said["n0"].append)
    again, written_again = ensure_spec(membership, options("n1"), said["n1"].append)
    assert written and not written_again and again == first
    assert first.micro_batches * first.pipelines == 16
    assert JobSpec.from_json(membership.kv.get(membership.keys.root + "spec").value) == first
