"""etcd stopped and restarted on the same data dir mid-run: clients reconnect, membership survives,
watches resume without losing or repeating events, and nobody is declared failed."""

from __future__ import annotations

import pytest
from bamboo.membership.detector import DetectorConfig, FailureDetector, ProbeOutcome, ProbeResult
from bamboo.membership.kv import EtcdKV, EtcdOptions, EventKind, StoreUnavailableError, WatchEvent
from bamboo.membership.records import NodeFailed, NodeRecord
from bamboo.membership.store import MembershipStore


def test_clients_reconnect_and_membership_survives_an_etcd_restart(etcd_factory, wait_until) -> None:
    server = etcd_factory()
    kv = EtcdKV(EtcdOptions(endpoints=(server.endpoint,), timeout=1.0))
    store = MembershipStore(kv, "restart")
    regs = [store.register(NodeRecord(id=f"n{i}", incarnation=1), ttl=2) for i in range(3)]
    detector = FailureDetector(store, "d", lambda record, timeout: ProbeResult(ProbeOutcome.ALIVE, 1),
                               DetectorConfig(grace_period=1.0, probe_timeout=0.1))
    failed: list[NodeFailed] = []
    detector.subscribe(failed.append)
    detector.start()
    events: list[WatchEvent] = []
    watch = store.watch_nodes(events.append)
    layout = store.put_layout({"pipelines": 1}, expected_revision=0)
    try:
        old_pid = server.pid
        server.stop()  # SIGTERM by PID; the data dir stays
        assert not server.running
        with pytest.raises(StoreUnavailableError, match=server.endpoint):
            store.list_nodes()
        wait_until(lambda: all(r.refresh_failures for r in regs), timeout=30, message="keepalives failing")
        server.start()  # same data dir, same ports
        assert server.pid != old_pid
        refreshed = [r.refreshes for r in regs]
        wait_until(lambda: all(r.refreshes > n for r, n in zip(regs, refreshed, strict=True)), timeout=30,
                   message="every keepalive to refresh after the restart")
        assert _lists(store) == {"n0", "n1", "n2"}
        assert not any(r.lost.is_set() for r in regs)
        assert store.get_layout() == layout
        # The watch resumed: a change after the restart arrives, once.
        late = store.register(NodeRecord(id="late", incarnation=1), ttl=2)
        wait_until(lambda: any(e.key.endswith("/late") for e in events), timeout=10, message="the late join")
        late.leave()
        wait_until(lambda: any(e.kind is EventKind.DELETE for e in events), timeout=10, message="the late leave")
        revisions = [e.revision for e in events]
        assert revisions == sorted(set(revisions))
        assert failed == []
        assert watch.reconnects >= 1
        assert store.decide("after-restart", {"ok": True}).won
    finally:
        watch.cancel()
        detector.stop()
        for reg in regs:
            reg.leave()
        kv.close()


def _lists(store: MembershipStore) -> set[str]:
    try:
        return set(store.list_nodes())
    except StoreUnavailableError:
        return set()
