"""FailureDetector logic with an injected clock and a scripted prober (real etcd holds the records).

The probe path's timing (grace period, probe interval) is driven by a fake clock through `tick()`:
no sleeping to test timing. Only the lease-expiry test waits, for etcd's real TTL. Also: the winner of a
report revokes the failed node's lease; a parallel sweep (`probe_all`) confirms only the dead; a probe
refused for credentials (DENIED) never confirms; a fenced detector writes nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest
from bamboo.membership.detector import DetectorConfig, FailureDetector, ProbeOutcome, ProbeResult, SweepResult
from bamboo.membership.kv import StoreUnavailableError
from bamboo.membership.kv_base import EventKind, WatchEvent
from bamboo.membership.members import EMPTY_VIEW, MembershipView, NodeTable
from bamboo.membership.records import NodeFailed, NodeRecord, NodeState, encode_message
from bamboo.membership.store import MembershipStore, Registration

if TYPE_CHECKING:
    from conftest import FakeClock


class ScriptedProber:
    """Answers probes from a script of outcomes; the last one repeats."""

    def __init__(self, *outcomes: ProbeResult) -> None:
        self.outcomes = list(outcomes)
        self.calls: list[tuple[str, float]] = []

    def __call__(self, record: NodeRecord, timeout: float) -> ProbeResult:
        self.calls.append((record.id, timeout))
        return self.outcomes.pop(0) if len(self.outcomes) > 1 else self.outcomes[0]


ALIVE = ProbeResult(ProbeOutcome.ALIVE, incarnation=1)
TIMEOUT = ProbeResult(ProbeOutcome.TIMEOUT, detail="deadline exceeded")
REFUSED = ProbeResult(ProbeOutcome.REFUSED, detail="connection refused")
CONFIG = DetectorConfig(grace_period=2.0, probe_timeout=0.25, probe_interval=0.5)


@pytest.fixture
def victim(store: MembershipStore) -> Iterator[Registration]:
    reg = store.register(NodeRecord(id="victim", address="127.0.0.1", agent_port=9, incarnation=1), ttl=5)
    yield reg
    reg.leave()


def _detector(store: MembershipStore, prober: ScriptedProber, clock: FakeClock) -> tuple[FailureDetector, list]:
    detector = FailureDetector(store, "d1", prober, CONFIG, clock=clock, wall_clock=lambda: 1.7e9)
    seen: list[NodeFailed] = []
    detector.subscribe(seen.append)
    detector.start(probe_loop=False)
    return detector, seen


def test_refused_probe_confirms_a_neighbour_report_at_once(
    store, victim, wait_until, fake_clock: FakeClock
) -> None:
    clock, prober = fake_clock, ScriptedProber(REFUSED)
    detector, seen = _detector(store, prober, clock)
    try:
        detector.report_peer_failure("victim", "recv from victim: connection closed by peer", reporter="n0")
        detector.tick()
        assert prober.calls == [("victim", 0.25)]
        assert len(seen) == 1
        event = seen[0]
        assert (event.node, event.epoch, event.detected_by, event.path) == ("victim", 0, "d1", "neighbour_report")
        assert "connection closed by peer" in event.reason and "n0" in event.reason
        assert store.failures(0)["victim"].detected_by == "d1"
        detector.report_peer_failure("victim", "again")  # already failed in this epoch: ignored
        assert detector.suspects() == []
    finally:
        detector.stop()


def test_slow_node_answering_within_the_grace_period_is_not_declared(
    store, victim, fake_clock: FakeClock
) -> None:
    clock, prober = fake_clock, ScriptedProber(TIMEOUT, TIMEOUT, ALIVE)
    detector, seen = _detector(store, prober, clock)
    try:
        detector.report_peer_failure("victim", "send timed out")
        detector.tick()  # t=0: timeout
        clock.advance(0.2)
        detector.tick()  # not due yet (interval 0.5)
        assert len(prober.calls) == 1
        clock.advance(0.3)
        detector.tick()  # t=0.5: timeout again
        clock.advance(0.5)
        detector.tick()  # t=1.0: answers with the same incarnation
        assert len(prober.calls) == 3 and detector.suspects() == []
        clock.advance(10)
        detector.tick()
        assert seen == [] and store.failures(0) == {}
    finally:
        detector.stop()


def test_node_unresponsive_for_the_grace_period_is_declared_once(
    store, victim, fake_clock: FakeClock
) -> None:
    clock, prober = fake_clock, ScriptedProber(TIMEOUT)
    detector, seen = _detector(store, prober, clock)
    try:
        detector.report_peer_failure("victim", "recv timed out")
        for _ in range(4):  # t = 0, 0.5, 1.0, 1.5: still inside the grace period
            detector.tick()
            clock.advance(0.5)
        assert seen == [] and detector.suspects() == ["victim"]
        detector.tick()  # t = 2.0
        assert [e.path for e in seen] == ["probe_timeout"]
        assert "unresponsive for 2.00 s" in seen[0].reason
        clock.advance(5)
        detector.tick()
        detector.report_peer_failure("victim", "still broken")
        detector.tick()
        assert len(seen) == 1
    finally:
        detector.stop()


def test_new_incarnation_answering_confirms_the_old_one_failed(store, victim, fake_clock: FakeClock) -> None:
    clock, prober = fake_clock, ScriptedProber(ProbeResult(ProbeOutcome.ALIVE, incarnation=2))
    detector, seen = _detector(store, prober, clock)
    try:
        detector.report_peer_failure("victim", "recv failed")
        detector.tick()
        assert len(seen) == 1 and "incarnation 2, not 1" in seen[0].reason
        assert seen[0].incarnation == 1
    finally:
        detector.stop()


def test_lease_expiry_declares_and_every_detector_emits_exactly_once(
    store, wait_until, fake_clock: FakeClock
) -> None:
    reg = store.register(NodeRecord(id="gone", address="127.0.0.1", agent_port=9, incarnation=4), ttl=1)
    clock = fake_clock
    detectors = [_detector(store, ScriptedProber(ALIVE), clock) for _ in range(3)]
    try:
        reg.stop_keepalive()  # as if the process died: the lease runs out after 1 s
        wait_until(lambda: all(seen for _, seen in detectors), timeout=5, message="NodeFailed at every detector")
        for detector, _ in detectors:
            detector.report_peer_failure("gone", "late report")  # a late neighbour report adds nothing
            detector.tick()
        for _, seen in detectors:
            assert len(seen) == 1
            assert (seen[0].node, seen[0].path, seen[0].incarnation) == ("gone", "lease_expiry", 4)
        assert len({seen[0] for _, seen in detectors}) == 1  # identical events, one writer
    finally:
        for detector, _ in detectors:
            detector.stop()


def test_leaving_on_purpose_is_not_a_failure(store, wait_until, fake_clock: FakeClock) -> None:
    clock = fake_clock
    detector, seen = _detector(store, ScriptedProber(ALIVE), clock)
    events: list = []
    handle = store.watch_nodes(events.append)
    try:
        reg = store.register(NodeRecord(id="polite", incarnation=1), ttl=1)
        reg.leave()
        wait_until(lambda: len(events) == 3, message="put, LEFT, delete")
        wait_until(lambda: "polite" not in detector.known_nodes(), message="the detector to see the delete")
        assert seen == []
    finally:
        handle.cancel()
        detector.stop()


def test_failures_are_per_epoch(store, victim, wait_until, fake_clock: FakeClock) -> None:
    clock, prober = fake_clock, ScriptedProber(REFUSED)
    detector, seen = _detector(store, prober, clock)
    again = None
    try:
        detector.report_peer_failure("victim", "first")
        detector.tick()
        assert store.advance_epoch(0) == 1
        wait_until(lambda: detector.epoch == 1, message="the new epoch to arrive through the watch")
        # The first confirmation revoked the victim's lease; it comes back as a fresh node, and fails again.
        again = store.register(NodeRecord(id="victim", address="127.0.0.1", agent_port=9, incarnation=2), ttl=5)
        wait_until(lambda: detector.known_nodes().get("victim", NodeRecord()).incarnation == 2,
                   message="the victim's new incarnation")
        detector.report_peer_failure("victim", "second")
        detector.tick()
        assert [(e.node, e.epoch, e.incarnation) for e in seen] == [("victim", 0, 1), ("victim", 1, 2)]
    finally:
        detector.stop()
        if again is not None:
            again.leave()


def test_a_declared_node_s_record_deleted_after_the_epoch_moved_on_is_not_reported_again(
    store, victim, wait_until, fake_clock: FakeClock
) -> None:
    """The lease this detector revoked goes with the node's record; when that deletion is delivered only after the
    next epoch began (a loaded machine), it is the same failure, not a new one in the new epoch."""
    clock, prober = fake_clock, ScriptedProber(REFUSED)
    detector, seen = _detector(store, prober, clock)
    try:
        record = detector.known_nodes()["victim"]
        detector.report_peer_failure("victim", "first")
        detector.tick()
        assert store.advance_epoch(0) == 1
        wait_until(lambda: detector.epoch == 1, message="the new epoch to arrive through the watch")
        late = WatchEvent(EventKind.DELETE, store.keys.node("victim"), b"", store.kv.revision(),
                          prev_value=encode_message(record))
        detector._on_node_event(late)  # the deletion, delivered late
        assert [(e.node, e.epoch, e.incarnation) for e in seen] == [("victim", 0, record.incarnation)]
    finally:
        detector.stop()


def test_malformed_node_value_in_a_watch_is_logged_not_fatal(
    store, wait_until, caplog, fake_clock: FakeClock
) -> None:
    clock = fake_clock
    detector, seen = _detector(store, ScriptedProber(REFUSED), clock)
    try:
        store.kv.put(store.keys.node("bad"), b"\x00garbage")
        reg = store.register(NodeRecord(id="good", address="127.0.0.1", agent_port=9, incarnation=1), ttl=5)
        wait_until(lambda: "good" in detector.known_nodes(), message="the good node")
        assert "bad" not in detector.known_nodes()
        assert any("malformed NodeRecord" in r.getMessage() for r in caplog.records)
        detector.report_peer_failure("good", "p2p failed")
        detector.tick()
        assert [e.node for e in seen] == ["good"]
        reg.leave()
    finally:
        detector.stop()


def test_the_membership_view_is_one_immutable_object_until_a_record_changes(
    store, wait_until, fake_clock: FakeClock
) -> None:
    detector, _ = _detector(store, ScriptedProber(ALIVE), fake_clock)
    try:
        empty = detector.membership_view()
        assert empty is detector.membership_view() and dict(empty.nodes) == {}
        reg = store.register(NodeRecord(id="a", address="127.0.0.1", agent_port=9, incarnation=1), ttl=5)
        wait_until(lambda: "a" in detector.membership_view().nodes, message="the new node in the view")
        joined = detector.membership_view()
        assert joined.version > empty.version and dict(empty.nodes) == {}  # an old view never changes
        with pytest.raises(TypeError):
            joined.nodes["b"] = NodeRecord(id="b")  # type: ignore[index]
        detector.report_peer_failure("a", "recv failed")  # a notice that changes no record: the same view
        detector.tick()
        assert detector.membership_view() is joined and detector.known_nodes() == dict(joined.nodes)
        reg.leave()
        wait_until(lambda: "a" not in detector.membership_view().nodes, message="the departure in the view")
        assert detector.membership_view().version > joined.version and "a" in joined.nodes
    finally:
        detector.stop()


def test_a_node_table_counts_only_the_changes_and_builds_a_view_once_per_version() -> None:
    table = NodeTable()
    assert table.view() is EMPTY_VIEW
    assert table.put(NodeRecord(id="a", zone="z")) and table.version == 1
    assert not table.put(NodeRecord(id="a", zone="z")) and table.version == 1  # the same record again
    one = table.view()
    assert one is table.view() and one.version == 1 and dict(one.nodes) == {"a": NodeRecord(id="a", zone="z")}
    assert table.pop("b") is None and table.version == 1
    table.update([NodeRecord(id="a", zone="y"), NodeRecord(id="b")])
    three = table.view()
    assert three.version == 3 and three.nodes["a"].zone == "y" and one.nodes["a"].zone == "z"
    table.clear()
    table.clear()  # nothing left to forget: no change
    assert table.version == 4 and dict(table.view().nodes) == {}
    with pytest.raises(ValueError, match="version"):
        MembershipView(-1)


def test_detector_config_validation_names_the_bad_value() -> None:
    with pytest.raises(ValueError, match="'grace_period' must be > 0: -1"):
        DetectorConfig(grace_period=-1)
    with pytest.raises(ValueError, match="probe_timeout 3"):
        DetectorConfig(grace_period=2, probe_timeout=3)


def test_node_state_default_is_unspecified() -> None:
    assert NodeRecord(id="x").state == NodeState.NODE_STATE_UNSPECIFIED


class FlakyKV:
    """The real client behind the KeyValueStore interface, except that the first `create` fails."""

    def __init__(self, kv: object) -> None:
        self.kv = kv
        self.failures = 1

    def create(self, key: str, value: bytes, lease: int = 0) -> object:
        if self.failures:
            self.failures -= 1
            raise StoreUnavailableError("etcd at test unavailable during create")
        return self.kv.create(key, value, lease)

    def __getattr__(self, name: str) -> object:
        return getattr(self.kv, name)


def test_a_confirmed_failure_that_cannot_be_written_is_retried(store, victim, fake_clock: FakeClock) -> None:
    clock, prober = fake_clock, ScriptedProber(REFUSED)
    flaky = MembershipStore(FlakyKV(store.kv), store.keys.job)
    detector, seen = _detector(flaky, prober, clock)
    try:
        detector.report_peer_failure("victim", "recv failed")
        detector.tick()
        assert seen == [] and store.failures(0) == {}
        clock.advance(CONFIG.probe_interval)
        detector.tick()
        assert [e.node for e in seen] == ["victim"] and len(prober.calls) == 1  # written, not re-probed
        assert store.failures(0)["victim"].detected_by == "d1"
    finally:
        detector.stop()


class SlowReadsKV(FlakyKV):
    """The real client, except that the first read of a node record times out (etcd loaded by a thousand agents)."""

    def get(self, key: str) -> object:
        if self.failures and "/nodes/" in key:
            self.failures -= 1
            raise StoreUnavailableError(f"etcd at test did not answer get {key} within 5 s")
        return self.kv.get(key)


def test_a_suspect_whose_record_etcd_did_not_return_stays_suspect_until_it_is_read(
    store, victim, fake_clock: FakeClock
) -> None:
    """A detector that does not follow the membership reads a suspect's record before it probes it. A read that
    times out says nothing of the node: the suspicion used to be dropped, leaving a dead node to its lease."""
    clock, prober = fake_clock, ScriptedProber(REFUSED)
    detector = FailureDetector(MembershipStore(SlowReadsKV(store.kv), store.keys.job), "d1", prober, CONFIG,
                               clock=clock, wall_clock=lambda: 1.7e9, follow_membership=False)
    seen: list[NodeFailed] = []
    detector.subscribe(seen.append)
    detector.start(probe_loop=False)
    try:
        detector.report_peer_failure("victim", "recv failed")
        detector.tick()
        assert prober.calls == [] and detector.suspects() == ["victim"] and seen == []
        clock.advance(CONFIG.probe_interval)
        detector.tick()
        assert prober.calls == [("victim", 0.25)] and [e.node for e in seen] == ["victim"]
        assert store.failures(0)["victim"].detected_by == "d1"
    finally:
        detector.stop()


def test_the_winner_revokes_the_failed_nodes_lease_at_once(store, victim, fake_clock: FakeClock) -> None:
    clock, prober = fake_clock, ScriptedProber(REFUSED)
    detector, seen = _detector(store, prober, clock)
    try:
        detector.report_peer_failure("victim", "recv failed")
        detector.tick()
        assert [e.node for e in seen] == ["victim"]
        assert "victim" not in store.list_nodes()  # gone from the lease-based view now, not after the TTL
        assert victim.lost.wait(20), "the victim's keepalive did not notice its revoked lease"
    finally:
        detector.stop()


def test_revocation_spares_a_newer_incarnation(store, victim, fake_clock: FakeClock) -> None:
    newer: list[Registration] = []

    def new_process_takes_the_id(record: NodeRecord, timeout: float) -> ProbeResult:
        # While incarnation 1 is probed, a new process registers the id and answers the probe.
        newer.append(store.register(NodeRecord(id="victim", address="127.0.0.1", agent_port=9, incarnation=2),
                                    ttl=5))
        return ProbeResult(ProbeOutcome.ALIVE, incarnation=2)

    detector = FailureDetector(store, "d1", new_process_takes_the_id, CONFIG, clock=fake_clock)
    seen: list[NodeFailed] = []
    detector.subscribe(seen.append)
    detector.start(probe_loop=False)
    try:
        detector.report_peer_failure("victim", "recv failed")
        detector.tick()
        assert [(e.node, e.incarnation) for e in seen] == [("victim", 1)]
        assert store.list_nodes()["victim"].incarnation == 2  # incarnation 2's lease was not revoked
    finally:
        detector.stop()
        for reg in newer:
            reg.leave()


def test_a_probe_refused_for_credentials_is_never_a_failure(
    store, victim, caplog, fake_clock: FakeClock
) -> None:
    clock = fake_clock
    denied = ProbeResult(ProbeOutcome.DENIED, detail="StatusCode.UNAUTHENTICATED: this agent requires the job token")
    detector, seen = _detector(store, ScriptedProber(denied), clock)
    try:
        detector.report_peer_failure("victim", "recv failed")
        detector.tick()
        assert detector.suspects() == [] and seen == []
        assert any("credentials" in r.getMessage() for r in caplog.records)
        clock.advance(10 * CONFIG.grace_period)
        detector.tick()
        assert seen == [] and "victim" in store.list_nodes()
    finally:
        detector.stop()


class SweepProber:
    """Answers by node id; every probe waits at a barrier of all probes, so a sequential sweep would fail."""

    def __init__(self, answers: dict[str, ProbeResult]) -> None:
        self.answers = answers
        self.barrier = threading.Barrier(len(answers), timeout=20)
        self.calls: list[str] = []

    def __call__(self, record: NodeRecord, timeout: float) -> ProbeResult:
        self.calls.append(record.id)
        self.barrier.wait()  # raises BrokenBarrierError unless every probe is in flight at once
        return self.answers[record.id]


def test_probe_all_confirms_only_the_dead_and_starts_the_grace_period_of_the_slow(
    store, wait_until, fake_clock: FakeClock
) -> None:
    answers = {
        "refused": REFUSED,
        "alive": ALIVE,
        "slow": TIMEOUT,
        "reborn": ProbeResult(ProbeOutcome.ALIVE, incarnation=9),
        "denied": ProbeResult(ProbeOutcome.DENIED, detail="UNAUTHENTICATED"),
    }
    regs = [store.register(NodeRecord(id=n, address="127.0.0.1", agent_port=9, incarnation=1), ttl=30)
            for n in answers]
    clock, prober = fake_clock, SweepProber(answers)
    detector = FailureDetector(store, "d1", prober, CONFIG, clock=clock, wall_clock=lambda: 1.7e9)
    seen: list[NodeFailed] = []
    detector.subscribe(seen.append)
    detector.start(probe_loop=False)
    try:
        result = detector.probe_all([*answers, "ghost"], "first confirmation: node0 failed")
        assert result == SweepResult(confirmed=("reborn", "refused"), alive=("alive", "denied"), slow=("slow",),
                                     unknown=("ghost",))
        assert sorted(prober.calls) == sorted(answers)
        assert sorted((e.node, e.path) for e in seen) == [("reborn", "probe_sweep"), ("refused", "probe_sweep")]
        assert "node0 failed" in seen[0].reason
        assert {"reborn", "refused"}.isdisjoint(store.list_nodes())  # revoked at once
        assert detector.suspects() == ["slow"]
        # Slow is not dead: the slow node is declared only once its grace period has passed.
        prober.barrier = threading.Barrier(1)
        clock.advance(CONFIG.grace_period - 0.01)
        detector.tick()
        assert [e.node for e in seen if e.node == "slow"] == []
        clock.advance(CONFIG.probe_interval)  # the next probe, past the grace period
        detector.tick()
        assert [(e.node, e.path) for e in seen if e.node == "slow"] == [("slow", "probe_timeout")]
        again = detector.probe_all(["refused", "alive"], "second sweep")
        assert again.already_failed == ("refused",) and again.alive == ("alive",)
    finally:
        detector.stop()
        for reg in regs:
            reg.leave()


def test_a_fenced_detector_writes_nothing_and_does_not_retry(
    store, victim, caplog, fake_clock: FakeClock
) -> None:
    me = store.register(NodeRecord(id="d1", address="127.0.0.1", agent_port=9, incarnation=1), ttl=30)
    store.kv.revoke_lease(me.lease_id)  # this detector's own node was declared dead
    clock, prober = fake_clock, ScriptedProber(REFUSED)
    detector, seen = _detector(store.fenced(me), prober, clock)
    try:
        detector.report_peer_failure("victim", "recv failed")
        detector.tick()
        assert seen == [] and store.failures(0) == {}
        assert "victim" in store.list_nodes()
        assert any("is fenced" in r.getMessage() for r in caplog.records)
        clock.advance(CONFIG.probe_interval)
        detector.tick()
        assert len(prober.calls) == 1 and store.failures(0) == {}  # dropped, not retried
    finally:
        detector.stop()
        me.stop_keepalive()
