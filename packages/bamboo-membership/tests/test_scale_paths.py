"""What keeps one etcd client cheap at scale: every watch of a client on one stream, every lease refresh on
one keepalive stream, a key read once and then followed (`WatchedKey`), and a detector that does not follow
every node record but reads a suspect's record when it must probe it (and one that follows from a past
revision, so that a lease expiry in between is still declared); a prefix longer than one answer may hold is read
in pages at one revision.

Real etcd; no test asserts how fast anything happened (tests/benchmarks/bench_scale.py measures that).
"""

from __future__ import annotations

import socket
import threading

import attrs
from bamboo.membership.agent import NodeAgent
from bamboo.membership.detector import DetectorConfig, FailureDetector, ProbeOutcome, ProbeResult
from bamboo.membership.kv import EtcdKV, EtcdOptions, EventKind, WatchEvent
from bamboo.membership.probing import connect_probe, probe_many
from bamboo.membership.records import FailureReport, NodeFailed, NodeRecord, NodeState
from bamboo.membership.store import MembershipStore
from bamboo.membership.watched import WatchedKey, WatchedPrefix

REFUSED = ProbeResult(ProbeOutcome.REFUSED, detail="connection refused")


class Seen:
    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self.cond = threading.Condition()

    def __call__(self, event: WatchEvent) -> None:
        with self.cond:
            self.events.append(event)
            self.cond.notify_all()

    def wait(self, count: int) -> list[WatchEvent]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.events) >= count, 20), f"only {self.events}"
            return list(self.events)


def test_every_watch_of_a_client_shares_one_stream_and_a_cancel_ends_only_its_own(kv: EtcdKV, job: str) -> None:
    seen = [Seen() for _ in range(5)]
    watches = [kv.watch_prefix(f"/bamboo/{job}/w{i}/", s) for i, s in enumerate(seen)]
    try:
        for i in range(5):
            kv.put(f"/bamboo/{job}/w{i}/k", str(i).encode())
        for i, s in enumerate(seen):
            assert [(e.kind, e.value) for e in s.wait(1)] == [(EventKind.PUT, str(i).encode())]
        assert kv.watch_stream().streams == 1
        watches[0].cancel()
        kv.put(f"/bamboo/{job}/w0/k", b"after")
        kv.put(f"/bamboo/{job}/w1/k", b"after")
        assert [e.value for e in seen[1].wait(2)] == [b"1", b"after"]
        assert [e.value for e in seen[0].events] == [b"0"]
    finally:
        for watch in watches[1:]:
            watch.cancel()


def test_lease_refreshes_go_over_one_stream_and_a_gone_lease_reads_zero(kv: EtcdKV) -> None:
    leases = [kv.grant_lease(5) for _ in range(3)]
    for _ in range(4):
        assert all(kv.refresh_lease(lease) > 0 for lease in leases)
    assert kv._keepalive.streams == 1
    kv.revoke_lease(leases[0])
    assert kv.refresh_lease(leases[0]) == 0
    assert kv.refresh_lease(leases[1]) > 0


def test_refreshes_that_wait_for_a_batch_in_flight_go_out_together_in_the_next(kv: EtcdKV, wait_until) -> None:
    leases = [kv.grant_lease(5) for _ in range(20)]
    assert kv.refresh_lease(leases[0]) > 0
    stream = kv._keepalive
    ttls: list[int] = []
    with stream._lock:  # a batch in flight: every caller meanwhile waits for the next one
        threads = [threading.Thread(target=lambda lease=lease: ttls.append(kv.refresh_lease(lease)))
                   for lease in leases]
        for thread in threads:
            thread.start()
        wait_until(lambda: len(stream._waiting) == len(leases), timeout=20, message="every caller waiting")
        batches = stream.batches
    for thread in threads:
        thread.join(30)
    assert len(ttls) == 20 and all(ttl > 0 for ttl in ttls)
    assert stream.batches == batches + 1  # twenty refreshes, one batch


def test_a_watched_key_is_read_once_then_followed(kv: EtcdKV, job: str) -> None:
    key = f"/bamboo/{job}/decisions/end"
    kv.put(key, b"first")
    changes: list[bytes | None] = []
    watched = WatchedKey(kv, key, on_change=lambda found: changes.append(None if found is None else found.value))
    try:
        assert watched.value is not None and watched.value.value == b"first"
        kv.put(key + "-other", b"a longer key under the same prefix")
        kv.put(key, b"second")
        found = watched.wait(lambda v: v is not None and v.value == b"second", 20)
        assert found is not None and found.value == b"second"
        kv.delete(key)
        assert watched.wait(lambda v: v is None, 20) is None
        assert changes == [b"second", None]
    finally:
        watched.close()


def _watches_of(kv: EtcdKV, prefix: str) -> int:
    """How many watches of ``prefix`` the client's stream holds (its private list: what etcd is asked for)."""
    return sum(1 for watch in kv.watch_stream()._active if watch.prefix == prefix)


def test_the_followers_of_one_key_on_one_client_share_one_watch(kv: EtcdKV, job: str) -> None:
    key = f"/bamboo/{job}/layout"
    kv.put(key, b"v1")
    first = WatchedKey(kv, key)
    kv.put(key, b"v2")
    assert first.wait(lambda v: v is not None and v.value == b"v2", 20) is not None
    second = WatchedKey(kv, key)  # starts from what the shared watch delivered: no read
    try:
        assert second.value is not None and second.value.value == b"v2"
        assert _watches_of(kv, key) == 1
        first.close()
        kv.put(key, b"v3")  # the one left is still followed
        assert second.wait(lambda v: v is not None and v.value == b"v3", 20) is not None
        assert first.value is not None and first.value.value == b"v2"  # a closed follower gets nothing more
    finally:
        second.close()
    assert _watches_of(kv, key) == 0  # the last one out ends the watch
    third = WatchedKey(kv, key)  # and a new follower starts a new one, from a new read
    try:
        assert third.value is not None and third.value.value == b"v3" and _watches_of(kv, key) == 1
    finally:
        third.close()


def test_a_watched_prefix_starts_from_the_shared_keys_and_a_failing_follower_spoils_no_other(
        kv: EtcdKV, job: str) -> None:
    prefix = f"/bamboo/{job}/decisions/g0-epoch-"
    kv.put(prefix + "1", b"one")
    first_seen, second_seen = Seen(), Seen()

    def failing(event: WatchEvent) -> None:
        first_seen(event)
        raise RuntimeError("a follower's bug")

    first = WatchedPrefix(kv, prefix, failing)
    assert [item.value for item in first.items()] == [b"one"]
    kv.put(prefix + "2", b"two")
    first_seen.wait(1)
    second = WatchedPrefix(kv, prefix, second_seen)
    try:
        assert [item.value for item in second.items()] == [b"one", b"two"]  # what the shared watch holds now
        kv.delete(prefix + "1")
        kv.put(prefix + "3", b"three")
        events = second_seen.wait(2)
        assert [(e.kind, e.key.removeprefix(prefix)) for e in events] == [(EventKind.DELETE, "1"), (EventKind.PUT, "3")]
        assert [e.key.removeprefix(prefix) for e in first_seen.wait(3)] == ["2", "1", "3"]
        assert _watches_of(kv, prefix) == 1
    finally:
        first.cancel()
        second.cancel()
    assert _watches_of(kv, prefix) == 0


def test_a_detector_that_follows_no_node_reads_the_suspects_record_to_probe_it(store: MembershipStore) -> None:
    victim = store.register(NodeRecord(id="victim", address="127.0.0.1", agent_port=9, incarnation=1), ttl=5)
    detector = FailureDetector(store, "d1", lambda record, timeout: REFUSED, DetectorConfig(),
                               follow_membership=False)
    seen: list[NodeFailed] = []
    detector.subscribe(seen.append)
    detector.start(probe_loop=False)
    try:
        assert not detector.following and detector.known_nodes() == {}
        detector.report_peer_failure("victim", "send failed")
        detector.tick()
        assert [(e.node, e.path) for e in seen] == [("victim", "neighbour_report")]
        assert detector.probes_sent == 1
        # a failure another detector confirmed is not watched for here: the follower (the coordinator) sees it
        store.report_failure(FailureReport(node="elsewhere", epoch=0, detected_by="d2"))
        detector.report_peer_failure("victim", "send failed again")  # already declared: nothing more
        detector.tick()
        assert [e.node for e in seen] == ["victim"] and detector.probes_sent == 1
    finally:
        detector.stop()
        victim.stop_keepalive()


def test_a_detector_that_starts_following_from_a_past_revision_declares_an_expiry_in_between(
    store: MembershipStore, wait_until
) -> None:
    since = store.kv.revision() + 1
    gone = store.register(NodeRecord(id="gone", address="127.0.0.1", agent_port=9, incarnation=1), ttl=1)
    gone.stop_keepalive()
    wait_until(lambda: store.get_node("gone") is None, timeout=20, message="the lease to expire")
    left = store.register(NodeRecord(id="left", incarnation=1), ttl=5)
    left.update(state=NodeState.NODE_STATE_LEFT)
    left.leave()
    detector = FailureDetector(store, "d1", lambda record, timeout: REFUSED, DetectorConfig(),
                               follow_membership=False)
    seen: list[NodeFailed] = []
    changed = threading.Event()
    detector.subscribe(seen.append)
    detector.subscribe_membership(changed.set)
    detector.start(probe_loop=False)
    try:
        detector.follow_membership(since_revision=since)
        wait_until(lambda: seen, timeout=20, message="the expiry before the follow to be declared")
        assert [(e.node, e.path) for e in seen] == [("gone", "lease_expiry")]  # the one that left is no failure
        assert changed.is_set() and detector.following
        detector.unfollow_membership()
        assert not detector.following and detector.known_nodes() == {}
    finally:
        detector.stop()


def test_a_connect_probe_tells_a_closed_port_from_an_open_one(store: MembershipStore) -> None:
    agent = NodeAgent(store, "live", follow_membership=False).start()
    try:
        record = agent.record
        alive = connect_probe(record, 1.0)
        assert (alive.outcome, alive.incarnation) == (ProbeOutcome.ALIVE, record.incarnation)
        agent.stop(leave=False, grace=0)  # vanishes as a crash would: the port closes first
        assert connect_probe(record, 1.0).outcome is ProbeOutcome.REFUSED
    finally:
        agent.stop(leave=True, grace=0)


def test_a_sweep_of_connects_probes_every_node_from_one_thread(store: MembershipStore) -> None:
    """`probe_many` with the connect prober: each node's own outcome, all at once, and no thread started (a
    thread's start waits for the interpreter lock on a loaded process, on the path of a failure's publication)."""
    agents = [NodeAgent(store, f"n{i}", follow_membership=False).start() for i in range(3)]
    try:
        records = {agent.node_id: agent.record for agent in agents}
        records["never"] = NodeRecord(id="never", address="127.0.0.1", agent_port=closed_port())
        agents[1].stop(leave=False, grace=0)  # a crash: its port closes
        threads = threading.active_count()
        results = probe_many(connect_probe, records, 1.0, max_parallel=64)
        assert threading.active_count() <= threads
        assert {node: result.outcome for node, result in results.items()} == {
            "n0": ProbeOutcome.ALIVE, "n1": ProbeOutcome.REFUSED, "n2": ProbeOutcome.ALIVE, "never": ProbeOutcome.REFUSED}
        assert results["n0"].incarnation == records["n0"].incarnation
        slow = {"n0": records["n0"]}  # any other prober runs on threads, and one that raises reads as slow

        def raising(record: NodeRecord, timeout: float) -> ProbeResult:
            raise RuntimeError(f"cannot probe {record.id}")

        assert probe_many(raising, slow, 1.0, max_parallel=4)["n0"].outcome is ProbeOutcome.TIMEOUT
    finally:
        for agent in agents:
            agent.stop(leave=True, grace=0)


def test_the_grpc_prober_reads_a_refused_connect_as_refused_before_any_channel(store: MembershipStore) -> None:
    agent = NodeAgent(store, "short-lived", follow_membership=False).start()
    record = agent.record
    prober = agent.prober()
    assert prober(record, 2.0).outcome is ProbeOutcome.ALIVE
    agent.stop(leave=False, grace=0)
    gone = prober(record, 2.0)
    assert (gone.outcome, gone.detail) == (ProbeOutcome.REFUSED, "connection refused")  # the connect's answer
    agent.stop(leave=True, grace=0)


def closed_port() -> int:
    """A port nothing listens on (bound, then closed)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def test_a_prefix_longer_than_a_page_is_read_whole_in_key_order_and_at_one_revision(options: EtcdOptions,
                                                                                      job: str) -> None:
    """An event log of a long run outgrows one gRPC answer (4 MB): reads come in pages of `range_page` keys, and
    every page is read at the first page's revision, so a write between two pages is not half seen."""
    prefix = f"/bamboo/{job}/pages/"
    paged = EtcdKV(attrs.evolve(options, range_page=3))
    try:
        for index in range(10):
            paged.put(f"{prefix}{index:02d}", str(index).encode())
        pages: list[object] = []
        client = paged.client
        read_range = client.get_range_response
        client.get_range_response = lambda *a, **k: pages.append(a[0]) or read_range(*a, **k)  # type: ignore[method-assign]
        assert [(kv.key.removeprefix(prefix), kv.value) for kv in paged.get_prefix(prefix)] == [
            (f"{index:02d}", str(index).encode()) for index in range(10)]
        assert len(pages) == 4  # 3 + 3 + 3 + 1
        before, revision = paged.range_at(prefix)
        paged.put(f"{prefix}03", b"changed")
        paged.delete(f"{prefix}08")
        paged.put(f"{prefix}10", b"10")
        again, at = paged.range_at(prefix, revision)
        assert at == revision and again == before  # the old view, across every page
        now = {kv.key.removeprefix(prefix): kv.value for kv in paged.get_prefix(prefix)}
        assert len(now) == 10 and now["03"] == b"changed" and "08" not in now and now["10"] == b"10"
    finally:
        paged.close()


def test_a_paged_read_that_etcd_compacts_under_it_is_read_again_at_the_newest_revision(options: EtcdOptions,
                                                                                        job: str) -> None:
    prefix = f"/bamboo/{job}/compacted/"
    paged = EtcdKV(attrs.evolve(options, range_page=3))
    try:
        for index in range(10):
            paged.put(f"{prefix}{index:02d}", b"x")
        client = paged.client
        read_range = client.get_range_response
        calls: list[int | None] = []

        def read_then_compact(*args: object, **kwargs: object) -> object:
            calls.append(kwargs.get("revision"))  # type: ignore[arg-type]
            answer = read_range(*args, **kwargs)
            if len(calls) == 1:  # between the first page and the second: a write, then a compaction past it
                paged.put(f"{prefix}10", b"late")
                paged.compact(paged.revision())
            return answer

        client.get_range_response = read_then_compact  # type: ignore[method-assign]
        keys, revision = paged.range_at(prefix)
        assert [kv.key.removeprefix(prefix) for kv in keys] == [f"{index:02d}" for index in range(11)]
        assert calls[0] is None and calls[1] is not None and calls[1] < revision  # the second page hit the compaction
        assert calls[2] is None  # read again from the first page, at the newest revision
    finally:
        paged.close()


def test_a_read_of_what_changed_after_a_revision_takes_only_the_new_keys_across_pages(options: EtcdOptions,
                                                                                      job: str) -> None:
    """`range_at(prefix, changed_after=R)`: the keys written after revision R (etcd's `min_mod_revision`), in
    pages as a whole read; `count_prefix` counts the keys at a revision without their values."""
    prefix = f"/bamboo/{job}/since/"
    paged = EtcdKV(attrs.evolve(options, range_page=2))
    try:
        for index in range(5):
            paged.put(f"{prefix}{index:02d}", b"old")
        _, revision = paged.range_at(prefix)
        assert paged.count_prefix(prefix, revision) == 5
        for index in (1, 5, 6, 7):
            paged.put(f"{prefix}{index:02d}", b"new")
        paged.delete(f"{prefix}03")
        changed, at = paged.range_at(prefix, changed_after=revision)
        assert [(kv.key.removeprefix(prefix), kv.value) for kv in changed] == [
            ("01", b"new"), ("05", b"new"), ("06", b"new"), ("07", b"new")]
        assert paged.count_prefix(prefix, at) == 7 and paged.count_prefix(prefix, revision) == 5
        assert paged.range_at(prefix, changed_after=at) == ([], at)
    finally:
        paged.close()
