"""Watches that lose nothing: a watcher cut off (through a TCP proxy) while etcd compacts its history
relists and reconciles, so a failure record written in the gap is seen; a watch's first registration under
a hung etcd is retried within its bound, then fails with a clear error."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest
from bamboo.membership.detector import DetectorConfig, FailureDetector, ProbeOutcome, ProbeResult
from bamboo.membership.kv import (
    EtcdKV,
    EtcdOptions,
    EventKind,
    PrefixWatch,
    StoreUnavailableError,
    WatchEvent,
)
from bamboo.membership.records import FailureReport, NodeFailed
from bamboo.membership.store import MembershipStore


class Recorder:
    """Collects watch events; `wait_for(predicate)` blocks until the events satisfy it."""

    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self._cond = threading.Condition()

    def __call__(self, event: WatchEvent) -> None:
        with self._cond:
            self.events.append(event)
            self._cond.notify_all()

    def wait_for(self, predicate, what: str, timeout: float = 20.0) -> None:
        with self._cond:
            if not self._cond.wait_for(lambda: predicate(self.events), timeout):
                pytest.fail(f"timed out after {timeout} s waiting for {what}; events: {self.events}")


@pytest.fixture
def cut_off_kv(proxy) -> Iterator[EtcdKV]:
    """A client that reaches etcd only through the proxy."""
    client = EtcdKV(EtcdOptions(endpoints=(proxy.endpoint,), timeout=1.0, watch_retry_interval=0.05))
    yield client
    client.close()


def _compact(kv: EtcdKV) -> int:
    revision = kv.revision()
    kv.compact(revision)
    return revision


def test_a_watch_cut_off_while_etcd_compacts_relists_and_delivers_the_gap(
    kv: EtcdKV, cut_off_kv: EtcdKV, proxy, job: str
) -> None:
    prefix = f"/bamboo/{job}/w/"
    kv.put(f"{prefix}kept", b"1")
    kv.put(f"{prefix}changed", b"old")
    kv.put(f"{prefix}removed", b"bye")
    kv.put(f"{prefix}recreated", b"first")
    seen = Recorder()
    watch = cut_off_kv.watch_prefix(prefix, seen)
    try:
        kv.put(f"{prefix}before-cut", b"x")
        seen.wait_for(lambda ev: any(e.key.endswith("before-cut") for e in ev), "the event before the cut")
        proxy.cut()
        # The gap: changes the watcher cannot see, then their history is compacted away.
        kv.put(f"{prefix}changed", b"new")
        kv.delete(f"{prefix}removed")
        kv.delete(f"{prefix}recreated")
        kv.put(f"{prefix}recreated", b"second")
        kv.put(f"{prefix}appeared", b"hello")
        kv.put(f"{prefix}changed", b"newer")
        compacted_at = _compact(kv)
        proxy.open()
        seen.wait_for(lambda ev: any(e.relisted for e in ev), "the relist")
        kv.put(f"{prefix}after", b"y")
        seen.wait_for(lambda ev: any(e.key.endswith("after") for e in ev), "an event after the relist")
    finally:
        watch.cancel()
    relisted = [(e.kind, e.key.removeprefix(prefix), e.value, e.prev_value) for e in seen.events if e.relisted]
    assert sorted(relisted, key=repr) == sorted([
        (EventKind.PUT, "changed", b"newer", b"old"),
        (EventKind.DELETE, "removed", b"", b"bye"),
        (EventKind.DELETE, "recreated", b"", b"first"),
        (EventKind.PUT, "recreated", b"second", None),
        (EventKind.PUT, "appeared", b"hello", None),
    ], key=repr)
    revisions = [e.revision for e in seen.events]
    assert revisions == sorted(revisions)  # synthetic events too come in revision order
    recreated = [e.kind for e in seen.events if e.key.endswith("recreated")]
    assert recreated == [EventKind.DELETE, EventKind.PUT]
    last = seen.events[-1]
    assert (last.key, last.relisted) == (f"{prefix}after", False) and last.revision > compacted_at
    assert not any(e.key.endswith("kept") for e in seen.events)  # unchanged: nothing to deliver
    assert watch.relists == 1


def test_a_puts_only_watch_gets_every_write_and_no_deletion_live_and_across_a_compacted_gap(
    kv: EtcdKV, cut_off_kv: EtcdKV, proxy, job: str
) -> None:
    """What an event log's reader asks: each writer deletes its oldest record as it writes a new one; the reader
    gets the writes only, before a cut, in the relist after a compacted gap (nothing for keys gone meanwhile),
    and after it."""
    prefix = f"/bamboo/{job}/log/"
    start = kv.put(f"{prefix}0", b"r0")
    seen = Recorder()
    watch = cut_off_kv.watch_prefix(prefix, seen, start_revision=start + 1, puts_only=True)
    try:
        kv.put(f"{prefix}1", b"r1")
        kv.delete(f"{prefix}0")
        kv.put(f"{prefix}2", b"r2")
        seen.wait_for(lambda ev: any(e.key.endswith("2") for e in ev), "the writes before the cut")
        proxy.cut()
        kv.put(f"{prefix}3", b"r3")
        kv.delete(f"{prefix}1")
        kv.put(f"{prefix}4", b"r4")
        kv.delete(f"{prefix}3")  # written and deleted in the gap: nothing of it is left to relist
        _compact(kv)
        proxy.open()
        seen.wait_for(lambda ev: any(e.relisted for e in ev), "the relist")
        kv.delete(f"{prefix}2")
        kv.put(f"{prefix}5", b"r5")
        seen.wait_for(lambda ev: any(e.key.endswith("5") for e in ev), "a write after the relist")
    finally:
        watch.cancel()
    assert [(e.kind, e.key.removeprefix(prefix), e.value, e.relisted) for e in seen.events] == [
        (EventKind.PUT, "1", b"r1", False),
        (EventKind.PUT, "2", b"r2", False),
        (EventKind.PUT, "4", b"r4", True),
        (EventKind.PUT, "5", b"r5", False),
    ]
    assert all(e.prev_value is None for e in seen.events)  # no previous values asked of etcd either
    assert watch.relists == 1


def test_a_failure_record_written_while_a_detector_was_cut_off_and_compacted_is_seen(
    store: MembershipStore, cut_off_kv: EtcdKV, proxy, job: str
) -> None:
    detector = FailureDetector(MembershipStore(cut_off_kv, job), "cut-off",
                               lambda record, timeout: ProbeResult(ProbeOutcome.ALIVE, 1), DetectorConfig())
    failed: list[NodeFailed] = []
    arrived = threading.Event()
    detector.subscribe(lambda event: (failed.append(event), arrived.set()))
    detector.start(probe_loop=False)
    try:
        proxy.cut()
        won, _ = store.report_failure(FailureReport(node="gone", epoch=0, detected_by="elsewhere"))
        assert won
        _compact(store.kv)
        proxy.open()
        assert arrived.wait(20), "the failure written in the gap never reached the detector"
    finally:
        detector.stop()
    assert [(e.node, e.epoch, e.detected_by) for e in failed] == [("gone", 0, "elsewhere")]


def test_a_watch_that_starts_at_a_compacted_revision_relists(kv: EtcdKV, job: str) -> None:
    prefix = f"/bamboo/{job}/old/"
    start = kv.put(f"{prefix}a", b"1")
    kv.put(f"{prefix}a", b"2")
    _compact(kv)
    seen = Recorder()
    watch = kv.watch_prefix(prefix, seen, start_revision=start)
    try:
        seen.wait_for(lambda ev: ev, "the relisted key")
    finally:
        watch.cancel()
    assert [(e.kind, e.value, e.relisted) for e in seen.events] == [(EventKind.PUT, b"2", True)]


def test_a_watch_start_under_a_hung_etcd_is_retried_then_succeeds(proxy, kv: EtcdKV, job: str, wait_until) -> None:
    """etcd stops answering (every byte held back: a hung server) while a watch starts, then recovers. (A server
    that never answers on the connection the client opened, `proxy.blackhole()`, is left by gRPC only when that
    connection attempt times out, after 20 s; the start would still succeed then, within its bound.)"""
    prefix = f"/bamboo/{job}/slow/"
    client = EtcdKV(EtcdOptions(endpoints=(proxy.endpoint,), timeout=0.3, watch_retry_interval=0.05,
                                watch_start_timeout=60))
    seen = Recorder()
    watch = PrefixWatch(client, prefix, seen, None)
    retried = threading.Event()
    outcome: list[BaseException | None] = []

    def start() -> None:
        try:
            watch.start()
            outcome.append(None)
        except BaseException as exc:  # reported to the test thread
            outcome.append(exc)
        retried.set()

    proxy.stall()
    starter = threading.Thread(target=start, daemon=True)
    starter.start()
    try:
        # Released only after the starting list timed out at least twice: the start must have retried.
        wait_until(lambda: watch.list_failures >= 2 or retried.is_set(), timeout=30, message="two failed lists")
        assert not retried.is_set(), f"watch start gave up: {outcome}"
        proxy.open()
        starter.join(30)
        assert outcome == [None]
        kv.put(f"{prefix}k", b"v")
        seen.wait_for(lambda ev: ev, "an event on the watch that started late")
    finally:
        watch.cancel()
        client.close()


def test_a_stuck_watch_creation_is_retried(proxy, kv: EtcdKV, job: str, monkeypatch, wait_until) -> None:
    """The list answers (straight from etcd), but the stream's creation gets no answer: retried, not fatal.

    This is what 500 agents on one etcd saw: a WatchTimedOut on the first registration."""
    prefix = f"/bamboo/{job}/stuck/"
    client = EtcdKV(EtcdOptions(endpoints=(proxy.endpoint,), timeout=0.3, watch_retry_interval=0.05,
                                watch_start_timeout=60))
    client.revision()  # the connection to etcd is up...
    monkeypatch.setattr(client, "range_at", kv.range_at)
    seen = Recorder()
    watch = PrefixWatch(client, prefix, seen, None)
    proxy.stall()  # ...and then etcd stops answering on it
    starter = threading.Thread(target=watch.start, daemon=True)
    starter.start()
    try:
        wait_until(lambda: watch.create_timeouts >= 2 or not starter.is_alive(), timeout=30,
                   message="two timed-out creations")
        assert starter.is_alive() and watch.create_timeouts >= 2
        proxy.open()
        starter.join(30)
        assert not starter.is_alive()
        kv.put(f"{prefix}k", b"v")
        seen.wait_for(lambda ev: ev, "an event once the stream was created")
    finally:
        watch.cancel()
        client.close()


def test_a_watch_that_cannot_start_within_its_bound_raises_a_clear_error(proxy, job: str) -> None:
    client = EtcdKV(EtcdOptions(endpoints=(proxy.endpoint,), timeout=0.2, watch_retry_interval=0.05,
                                watch_start_timeout=1.0))
    proxy.blackhole()
    try:
        with pytest.raises(StoreUnavailableError, match=rf"watch on /bamboo/{job}/never/ .* within 1.0 s"):
            client.watch_prefix(f"/bamboo/{job}/never/", lambda event: None)
    finally:
        client.close()
