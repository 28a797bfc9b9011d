"""The membership store against a real etcd: register and expire, watch, epoch, failure reports,
first-writer-wins decisions under 16 racing writers, layout compare-and-swap, malformed values, and fencing:
a node whose lease is gone (revoked, or taken over by a newer registration) can write nothing."""

from __future__ import annotations

import threading

import attrs
import pytest
from bamboo.membership.kv import EtcdKV, EtcdOptions, EventKind, FencedError, Guard, WatchEvent
from bamboo.membership.records import (
    DetectionPath,
    FailureReport,
    MalformedValueError,
    NodeRecord,
    NodeState,
    PreemptionNotice,
    decode_message,
)
from bamboo.membership.store import JobKeys, MembershipStore


def _node(node_id: str, **kw: object) -> NodeRecord:
    return NodeRecord(id=node_id, zone="z1", address="127.0.0.1", agent_port=1234, incarnation=1, **kw)


def test_register_lists_the_node_and_keeps_it_alive_past_the_ttl(store: MembershipStore, wait_until) -> None:
    reg = store.register(_node("a"), ttl=1, keepalive_interval=0.1)
    try:
        # 15 refreshes 0.1 s apart span more than the 1 s TTL: only the keepalive can have kept the record.
        wait_until(lambda: reg.refreshes >= 15, message="15 lease refreshes")
        assert store.list_nodes()["a"].incarnation == 1
        assert not reg.lost.is_set()
    finally:
        reg.leave()
    assert store.list_nodes() == {}


def test_registration_expires_after_the_ttl_when_keepalive_stops(store: MembershipStore, wait_until) -> None:
    reg = store.register(_node("b"), ttl=1)
    reg.stop_keepalive()
    wait_until(lambda: "b" not in store.list_nodes(), message="the lease to expire")


def test_update_rewrites_the_record_under_the_same_lease(store: MembershipStore) -> None:
    reg = store.register(_node("c"), ttl=30)  # not about expiry: a long lease survives a loaded machine
    try:
        reg.update(state=NodeState.NODE_STATE_ACTIVE)
        assert store.get_node("c").state == NodeState.NODE_STATE_ACTIVE
        assert store.kv.get(store.keys.node("c")).lease == reg.lease_id
    finally:
        reg.leave()


def test_register_rejects_bad_records(store: MembershipStore) -> None:
    with pytest.raises(ValueError, match="'a/b'"):
        store.register(NodeRecord(id="a/b"), ttl=1)
    with pytest.raises(ValueError, match="70000"):
        store.register(NodeRecord(id="x", address="h", agent_port=70000), ttl=1)
    with pytest.raises(ValueError, match="TTL"):
        store.register(NodeRecord(id="x"), ttl=0)


def test_watch_sees_join_update_and_leave_in_order(store: MembershipStore, wait_until) -> None:
    events: list[WatchEvent] = []
    handle = store.watch_nodes(events.append)
    try:
        reg = store.register(_node("w"), ttl=30)
        reg.update(state=NodeState.NODE_STATE_STANDBY)
        reg.leave()
        wait_until(lambda: any(e.kind is EventKind.DELETE for e in events), message="the delete event")
    finally:
        handle.cancel()
    kinds = [e.kind for e in events]
    assert kinds == [EventKind.PUT, EventKind.PUT, EventKind.PUT, EventKind.DELETE]
    states = [decode_message(e.key, e.value, NodeRecord).state for e in events[:3]]
    assert states == [NodeState.NODE_STATE_UNSPECIFIED, NodeState.NODE_STATE_STANDBY, NodeState.NODE_STATE_LEFT]
    # The delete carries the last record, so a watcher can tell a leave from a lease expiry.
    assert decode_message(events[3].key, events[3].prev_value, NodeRecord).state == NodeState.NODE_STATE_LEFT
    revisions = [e.revision for e in events]
    assert revisions == sorted(revisions)


def test_epoch_advances_by_compare_and_swap(store: MembershipStore) -> None:
    assert store.epoch() == (0, 0)
    assert store.advance_epoch(0) == 1
    assert store.advance_epoch(0) is None  # someone else already moved it
    assert store.advance_epoch(1) == 2
    assert store.epoch()[0] == 2


def test_failure_reports_are_idempotent_per_node_per_epoch(store: MembershipStore) -> None:
    first = FailureReport(node="n1", epoch=3, detected_by="d1", path=DetectionPath.DETECTION_PATH_LEASE_EXPIRY)
    second = FailureReport(node="n1", epoch=3, detected_by="d2", path=DetectionPath.DETECTION_PATH_NEIGHBOUR_REPORT)
    assert store.report_failure(first) == (True, first)
    won, stored = store.report_failure(second)
    assert not won and stored.detected_by == "d1"
    assert store.report_failure(FailureReport(node="n1", epoch=4, detected_by="d2"))[0]
    assert set(store.failures(3)) == {"n1"} and store.failures(4)["n1"].detected_by == "d2"


def test_read_decisions_reads_a_prefix_in_one_request_and_then_only_what_is_new(store: MembershipStore) -> None:
    store.decide("g3-up-a", {"node": "a"})
    store.decide("g3-up-b", {"node": "b"})
    store.decide("g3-upper", {"other": True})  # shares the letters, not the prefix
    store.decide("g4-up-a", {"node": "a"})
    found, revision = store.read_decisions("g3-up-")
    assert {name: d.value for name, d in found.items()} == {"g3-up-a": {"node": "a"}, "g3-up-b": {"node": "b"}}
    assert all(not d.won and 0 < d.revision <= revision for d in found.values())
    assert store.read_decisions("g3-up-", changed_after=revision) == ({}, revision)
    store.decide("g3-up-c", {"node": "c"})
    store.decide("g3-up-a", {"node": "a", "again": True})  # first writer won: nothing changes
    later, _ = store.read_decisions("g3-up-", changed_after=revision)
    assert list(later) == ["g3-up-c"]


def test_16_concurrent_writers_race_for_one_decision_with_exactly_one_winner(
    options: EtcdOptions, job: str
) -> None:
    clients = [EtcdKV(options) for _ in range(16)]
    stores = [MembershipStore(c, job) for c in clients]
    barrier = threading.Barrier(16)
    results: list[object] = [None] * 16

    def race(i: int) -> None:
        barrier.wait()
        results[i] = stores[i].decide("reconfig-epoch-7", {"writer": i})

    threads = [threading.Thread(target=race, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=30)
    for c in clients:
        c.close()
    winners = [r for r in results if r.won]
    assert len(winners) == 1
    winner = winners[0].value["writer"]
    assert all(r.value == {"writer": winner} for r in results)
    assert len({r.revision for r in results}) == 1


def test_layout_compare_and_swap_on_its_revision(store: MembershipStore) -> None:
    assert store.get_layout() is None
    first = store.put_layout({"pipelines": 2}, expected_revision=0)
    assert first is not None
    assert store.put_layout({"pipelines": 9}, expected_revision=0) is None
    second = store.put_layout({"pipelines": 3}, expected_revision=first.revision)
    assert second is not None and second.revision > first.revision
    assert store.put_layout({"pipelines": 4}, expected_revision=first.revision) is None  # stale
    assert store.get_layout().value == {"pipelines": 3}


@pytest.mark.parametrize(
    ("raw", "detail"),
    [
        (b"\x80\x81 not utf8", "not JSON"),
        (b"{truncated", "not JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (b'{"id": "m", "agent_port": "eighty"}', "agent_port"),
        (b'{"zone": "z"}', "required field 'id'"),
    ],
)
def test_malformed_node_record_gives_a_clear_error_and_no_crash(
    store: MembershipStore, raw: bytes, detail: str
) -> None:
    store.kv.put(store.keys.node("m"), raw)
    reg = store.register(_node("ok"), ttl=30)
    try:
        with pytest.raises(MalformedValueError, match=detail) as info:
            store.get_node("m")
        assert store.keys.node("m") in str(info.value) and "NodeRecord" in str(info.value)
        with pytest.raises(MalformedValueError):
            store.list_nodes()
        assert set(store.list_nodes(skip_malformed=True)) == {"ok"}
    finally:
        reg.leave()


def test_malformed_epoch_and_layout_give_clear_errors(store: MembershipStore) -> None:
    store.kv.put(store.keys.epoch, b'{"epoch": -1}')
    with pytest.raises(MalformedValueError, match=r"epoch.*-1"):
        store.epoch()
    store.kv.put(store.keys.layout, b"not json")
    with pytest.raises(MalformedValueError, match="layout"):
        store.get_layout()


def test_job_names_are_validated() -> None:
    with pytest.raises(ValueError, match="'a/b'"):
        JobKeys("a/b")
    assert JobKeys("j").failure(7, "n") == "/bamboo/j/failures/000000000007/n"


def test_etcd_options_validation_names_the_bad_value() -> None:
    with pytest.raises(ValueError, match="'nohost'"):
        EtcdOptions(endpoints=("nohost",))
    with pytest.raises(ValueError, match="user and password"):
        EtcdOptions(endpoints=("h:1",), user="u")
    with pytest.raises(ValueError, match="ca_cert"):
        EtcdOptions(endpoints=("h:1",), cert_cert="c", cert_key="k")
    with pytest.raises(ValueError, match="'timeout' must be > 0: -1"):
        EtcdOptions(endpoints=("h:1",), timeout=-1)


# -- fencing ----------------------------------------------------------------------------------------


def test_registration_exposes_its_guard(store: MembershipStore) -> None:
    reg = store.register(_node("g"), ttl=5)
    try:
        found = store.kv.get(store.keys.node("g"))
        assert reg.key == store.keys.node("g") and reg.create_revision == found.create_revision
        assert reg.guard == Guard(node="g", key=reg.key, create_revision=found.create_revision, lease=reg.lease_id)
        reg.update(state=NodeState.NODE_STATE_ACTIVE)  # an update keeps the create revision: still unfenced
        assert store.kv.get(reg.key).create_revision == reg.create_revision
        assert store.fenced(reg).decide("after-update", {"ok": 1}).won
    finally:
        reg.leave()


def test_a_node_whose_lease_was_revoked_is_fenced_on_every_write(store: MembershipStore, job: str) -> None:
    reg = store.register(_node("f"), ttl=30)
    fenced = store.fenced(reg)
    # While registered, every kind of write goes through.
    assert fenced.advance_epoch(0) == 1
    assert fenced.report_failure(FailureReport(node="x", epoch=1, detected_by="f"))[0]
    assert fenced.decide("d", {"by": "f"}).won
    layout = fenced.put_layout({"v": 1}, expected_revision=0)
    assert layout is not None
    fenced.publish_notice(PreemptionNotice(node="f", deadline=1.0))
    kv = store.kv
    kv.put(f"/bamboo/{job}/raw", b"1", guard=reg.guard)
    before = {item.key: item.value for item in kv.get_prefix(store.keys.root)}

    store.kv.revoke_lease(reg.lease_id)  # as a detector does on confirming the node dead
    assert "f" not in store.list_nodes()
    writes = {
        "advance_epoch": lambda: fenced.advance_epoch(1),
        "report_failure": lambda: fenced.report_failure(FailureReport(node="y", epoch=1, detected_by="f")),
        "decide (new)": lambda: fenced.decide("d2", {"by": "f"}),
        "decide (existing)": lambda: fenced.decide("d", {"by": "f again"}),
        "put_layout": lambda: fenced.put_layout({"v": 2}, expected_revision=layout.revision),
        "publish_notice": lambda: fenced.publish_notice(PreemptionNotice(node="f", deadline=2.0)),
        "kv.put": lambda: kv.put(f"/bamboo/{job}/raw", b"2", guard=reg.guard),
        "kv.create": lambda: kv.create(f"/bamboo/{job}/raw2", b"2", guard=reg.guard),
        "kv.compare_and_swap": lambda: kv.compare_and_swap(f"/bamboo/{job}/raw", b"3", 0, guard=reg.guard),
        "kv.delete": lambda: kv.delete(f"/bamboo/{job}/raw", guard=reg.guard),
        "registration.update": lambda: reg.update(state=NodeState.NODE_STATE_ACTIVE),
    }
    for name, write in writes.items():
        with pytest.raises(FencedError, match=r"node 'f' is fenced.*gone") as info:
            write()
        assert info.value.node == "f", name
    after = {item.key: item.value for item in kv.get_prefix(store.keys.root)}
    assert after == {k: v for k, v in before.items() if k != store.keys.node("f")}  # nothing else changed
    reg.leave()  # nothing left to leave: no error


def test_a_newer_registration_of_the_same_id_fences_the_old_one(store: MembershipStore) -> None:
    old = store.register(_node("n"), ttl=30)
    new = store.register(NodeRecord(id="n", address="127.0.0.1", agent_port=1235, incarnation=2), ttl=30)
    try:
        with pytest.raises(FencedError, match="newer registration"):
            store.fenced(old).decide("by-old", {})
        assert store.fenced(new).decide("by-new", {}).won
        assert store.get_decision("by-old") is None
    finally:
        new.leave()
        old.stop_keepalive()


def test_lost_is_noticed_by_the_keepalive_not_by_the_ttl(store: MembershipStore, wait_until) -> None:
    lost: list[int] = []
    reg = store.register(_node("l"), ttl=60, keepalive_interval=0.1, on_lost=lambda r: lost.append(r.lease_id))
    store.kv.revoke_lease(reg.lease_id)
    # The TTL is 60 s; the test's bound is far below it, so only the keepalive can have noticed.
    assert reg.lost.wait(20), "the keepalive did not notice the revoked lease"
    # on_lost is called just after `lost` is set, on the keepalive's thread: a loaded machine can run this
    # thread in between.
    wait_until(lambda: lost != [], timeout=5, message="on_lost")
    assert lost == [reg.lease_id]
    with pytest.raises(FencedError):
        reg.update(state=NodeState.NODE_STATE_ACTIVE)


def test_revoke_node_spares_another_incarnation(store: MembershipStore) -> None:
    reg = store.register(NodeRecord(id="r", incarnation=3), ttl=30)
    try:
        assert not store.revoke_node("r", incarnation=2)
        assert "r" in store.list_nodes()
        assert store.revoke_node("r", incarnation=3)
        assert "r" not in store.list_nodes()
        assert not store.revoke_node("r")  # nothing left to revoke
    finally:
        reg.stop_keepalive()


def test_a_fence_must_be_a_node_of_the_same_job(store: MembershipStore) -> None:
    guard = Guard(node="n", key="/bamboo/other-job/nodes/n", create_revision=1, lease=1)
    with pytest.raises(ValueError, match="other-job"):
        MembershipStore(store.kv, store.keys.job, fence=guard)
    with pytest.raises(ValueError, match="'create_revision' must be > 0: 0"):
        Guard(node="n", key="k", create_revision=0, lease=1)
    with pytest.raises(ValueError, match="bool"):
        Guard(node="n", key="k", create_revision=1, lease=True)
    with pytest.raises(TypeError, match="'lease' must be <class 'int'>"):
        Guard(node="n", key="k", create_revision=1, lease=1.0)


def test_a_client_whose_channel_cannot_close_is_left_after_the_close_timeout(
        options: EtcdOptions, caplog: pytest.LogCaptureFixture) -> None:
    # What a call cut short by a signal handler's KeyboardInterrupt leaves (grpc/grpc#19973): a channel whose close
    # waits forever. The launcher stopped by SIGTERM while it read etcd hung in that close instead of exiting.
    kv = EtcdKV(attrs.evolve(options, close_timeout=0.2))
    kv.put("/close-test/a", "1")
    real_close = kv.client.close
    release = threading.Event()
    kv.client.close = release.wait  # type: ignore[method-assign]
    try:
        closer = threading.Thread(target=kv.close, daemon=True)
        closer.start()
        closer.join(30)
        assert not closer.is_alive(), "close waited on the channel past its close_timeout"
        assert kv.closed
        assert "did not close within 0.2 s" in caplog.text
    finally:
        release.set()
        real_close()
