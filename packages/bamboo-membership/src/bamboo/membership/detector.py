"""The failure detector: neighbour reports, lease expiry and gRPC probes (three signals, one outcome), turned into
`NodeFailed` events:

- **Neighbour report.** The runtime calls `report_peer_failure(node, reason)` when a P2P send or receive to `node`
  failed. That makes `node` a *suspect*. The detector probes it over gRPC with a deadline (`probe_timeout`):
  - connection refused (nothing listens on the agent port: the process is gone) confirms at once;
  - an answer with a different incarnation (the id was taken by a new process) confirms at once;
  - an answer with the same incarnation clears the suspicion: the node is slow, not dead;
  - an answer that refuses the prober's credentials (DENIED: wrong job token or client certificate) also clears it:
    something alive holds the port, and a misconfigured prober must never read as a dead node; it is logged;
  - a probe that times out is repeated every `probe_interval` until the node has been unresponsive for
    `grace_period` seconds since the report; then the failure is confirmed.
- **Lease expiry.** The node's record disappears from etcd without having been marked LEFT: its lease ran out (it
  stopped heartbeating for the TTL). Confirmed at once, by the detectors that follow every node record (below).
- **Sweep.** `probe_all(nodes)` probes many nodes at once (e.g. every node of the layout on the first confirmation,
  so kills that land together are found together): refused or another incarnation confirms at once; a timeout only
  makes the node a suspect, so its grace period starts.

A confirmed failure is written to etcd first-writer-wins, one per node per membership epoch
(`MembershipStore.report_failure`), and every detector emits `NodeFailed` from what it reads back, so each listener
of each detector sees exactly one `NodeFailed(node, epoch, detected_by, reason)` per node per epoch, whoever
detected it. The detector that wins the report revokes the failed node's lease at once
(`MembershipStore.revoke_node`, only for the incarnation it declared): the node leaves every lease-based view
(`list_nodes`) without waiting for its TTL, and its fenced writes fail from then on (that deletion is no new
failure, even delivered after the next epoch began). A detector whose own store is fenced
(`store.fenced(registration)`) and whose node was declared dead writes nothing: its reports raise `FencedError`,
which it logs and drops.

**Following the membership, or not.** A detector made with `follow_membership=True` (the default) lists every node
record at start and watches them all, and every failure report: it sees every lease expire, keeps every node's
address at hand, and emits every failure, whoever confirmed it. That is one watch event per change for each such
detector, so a job of N agents that all followed would carry N x N events (a thousand agents registering: a
million). So at scale only one agent follows (bamboo-launch's elected coordinator:
`follow_membership(since_revision)`, from the revision at which the previous coordinator's key went, so that no
expiry in between is missed). The others read the record of a node only when they must probe it
(`MembershipStore.get_node`, one read per suspicion; a read etcd does not answer keeps the suspicion, and is tried
again at the next probe), and emit only the failures they confirm themselves or find already reported when they
write theirs (first writer wins). `subscribe_membership(listener)` calls `listener()` after each change of the node
records followed; `membership_view()` hands them out as an immutable `MembershipView` with a version, rebuilt only
after they changed.

Time: all grace and probe scheduling reads the injected `clock` (monotonic seconds), so unit tests drive `tick()`
with a fake clock and a fake prober; `start()` runs `tick()` on a background thread. Defaults come from
`bamboo.membership.timeouts` (`GRACE_PERIOD_S`, `PROBE_TIMEOUT_S`, `PROBE_INTERVAL_S`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable

import attrs
from bamboo.membership import timeouts
from bamboo.membership.kv import EventKind, FencedError, StoreError, WatchEvent, WatchHandle
from bamboo.membership.members import MembershipView, NodeTable
from bamboo.membership.probing import (
    DetectorConfig,
    ProbeOutcome,
    Prober,
    ProbeResult,
    SweepResult,
    probe_many,
)
from bamboo.membership.records import (
    DetectionPath,
    FailureReport,
    MalformedValueError,
    NodeFailed,
    NodeRecord,
    NodeState,
    decode_message,
)
from bamboo.membership.store import MembershipStore
from bamboo.membership.watched import WatchedKey

__all__ = ["DetectorConfig", "FailureDetector", "ProbeOutcome", "ProbeResult", "Prober", "SweepResult"]

log = logging.getLogger(__name__)


@attrs.define
class _Suspicion:
    node: str
    since: float
    reason: str
    reporter: str
    next_probe_at: float
    probes: int = 0


class FailureDetector:
    """Confirms failures from neighbour reports, lease expiry and probes; emits `NodeFailed` once per node per epoch.

    `detector_id` is written as `detected_by` in the reports this detector wins (usually the node id of the
    agent that runs it).
    """

    def __init__(
        self,
        store: MembershipStore,
        detector_id: str,
        prober: Prober,
        config: DetectorConfig | None = None,
        *,
        clock: Callable[[], float] = time.monotonic,
        wall_clock: Callable[[], float] = time.time,
        follow_membership: bool = True,
    ) -> None:
        self.store = store
        self.detector_id = detector_id
        self.prober = prober
        self.config = config or DetectorConfig()
        self.clock = clock
        self.wall_clock = wall_clock
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._nodes = NodeTable()  # the followed records, versioned
        self._suspects: dict[str, _Suspicion] = {}
        # Confirmed failures whose report could not be written yet (etcd unreachable): retried by tick().
        self._unwritten: dict[str, tuple[NodeRecord, int, str, float]] = {}
        self._emitted: set[tuple[str, int]] = set()  # (node, epoch) of every failure emitted
        self._declared: set[tuple[str, int]] = set()  # (node, incarnation) of every failure emitted
        self._listeners: list[Callable[[NodeFailed], None]] = []
        self._membership_listeners: list[Callable[[], None]] = []
        self._watches: list[WatchHandle] = []
        self._epoch_key: WatchedKey | None = None  # the epoch record, followed once started
        self._following: list[WatchHandle] = []  # the watches of the node records and the failure reports
        self._follow_at_start = follow_membership
        self.probes_sent = 0
        """Probes this detector has sent (suspects and sweeps), for the benchmarks."""
        self._epoch = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None  # the probe loop, started at its first work (_kick)
        self._probe_loop = False

    # -- public API ------------------------------------------------------------------------------

    @property
    def epoch(self) -> int:
        """The membership epoch failures are currently declared in."""
        return self._epoch

    def subscribe(self, listener: Callable[[NodeFailed], None]) -> Callable[[], None]:
        """Call `listener(NodeFailed)` for every failure (once per node per epoch). Returns an unsubscribe function."""
        with self._lock:
            self._listeners.append(listener)

        def unsubscribe() -> None:
            with self._lock:
                if listener in self._listeners:
                    self._listeners.remove(listener)

        return unsubscribe

    def report_peer_failure(self, node: str, reason: str, reporter: str | None = None) -> None:
        """The runtime's P2P send or receive to `node` failed: suspect it and probe it soon."""
        with self._lock:
            if (node, self._epoch) in self._emitted or node in self._suspects:
                return
            now = self.clock()
            self._suspects[node] = _Suspicion(node, now, reason, reporter or self.detector_id, next_probe_at=now)
            self._kick()

    def subscribe_membership(self, listener: Callable[[], None]) -> None:
        """Call `listener()` after each change of the followed node records (on the watch's thread: no blocking)."""
        with self._lock:
            self._membership_listeners.append(listener)

    @property
    def following(self) -> bool:
        """Whether this detector follows the membership now (every node record and failure report)."""
        return bool(self._following)

    def follow_membership(self, since_revision: int | None = None) -> None:
        """Follow every node record and failure report from now on (a no-op when already following): list the
        records and this epoch's reports, then watch from `since_revision` (default: the revision of the list),
        so that a node whose lease expired since then is declared too (its deletion is replayed)."""
        if self._following:
            return
        revision = self.store.kv.revision()
        records = self.store.list_nodes(skip_malformed=True)
        with self._lock:
            self._nodes.update(records.values())
        start = revision + 1 if since_revision is None else min(since_revision, revision + 1)
        self._following = [self.store.watch_nodes(self._on_node_event, start_revision=start),
                           self.store.watch_failures(self._on_failure_event, start_revision=revision + 1)]
        for item in self.store.kv.get_prefix(self.store.keys.failures_in(self._epoch)):
            self._on_failure_event(WatchEvent(EventKind.PUT, item.key, item.value, item.mod_revision))

    def unfollow_membership(self) -> None:
        """Stop following the membership (the records known so far are forgotten)."""
        watches, self._following = self._following, []
        for watch in watches:
            watch.cancel()
        with self._lock:
            self._nodes.clear()

    def _record_of(self, node: str, *, unanswered: bool = False) -> NodeRecord | None:
        """`node`'s record: the followed one, or read from etcd now. None: it has none, it is malformed, or (with
        `unanswered`) etcd did not answer; without it, a read etcd did not answer raises `StoreError`."""
        with self._lock:
            record = self._nodes.get(node)
        if record is not None or self._following:
            return record
        try:
            return self.store.get_node(node)
        except (StoreError, MalformedValueError) as exc:
            if isinstance(exc, StoreError) and not unanswered:
                raise
            log.warning("cannot read the record of %s: %s", node, exc)
            return None

    def suspects(self) -> list[str]:
        with self._lock:
            return sorted(self._suspects)

    def known_nodes(self) -> dict[str, NodeRecord]:
        """A copy of the followed records; :meth:`membership_view` copies nothing."""
        return dict(self.membership_view().nodes)

    def membership_view(self) -> MembershipView:
        """The followed records at their current version: the same immutable object until one changes."""
        with self._lock:
            return self._nodes.view()

    def probe_all(self, nodes: Iterable[str], reason: str, *, max_parallel: int = 64,
                  prober: Prober | None = None) -> SweepResult:
        """Probe `nodes` concurrently (one probe each, `probe_timeout`), and confirm the dead ones at once.

        Refused probes and answers from another incarnation are declared failed (path `probe_sweep`);
        nodes that answer are left alone; nodes whose probe times out become suspects (their grace period
        starts now), since slow is not dead. `reason` says why the sweep ran (it goes into the failure
        reports). `prober` replaces this detector's own for the sweep (e.g. `probing.connect_probe`, which
        only looks for the dead). Returns what was found; blocks for about one probe timeout.
        """
        probe = prober or self.prober
        if max_parallel < 1:
            raise ValueError(f"probe_all: max_parallel must be >= 1, got {max_parallel!r}")
        wanted = sorted(set(nodes))
        with self._lock:
            epoch = self._epoch
            already = [n for n in wanted if (n, epoch) in self._emitted]
        records = {n: self._record_of(n, unanswered=True) for n in wanted if n not in already}
        unknown = sorted(n for n, record in records.items() if record is None)
        probed = {n: record for n, record in records.items() if record is not None}
        results: dict[str, ProbeResult] = {}
        with_port = {n: r for n, r in probed.items() if r.agent_port}
        if with_port:
            self.probes_sent += len(with_port)
            results.update(probe_many(probe, with_port, self.config.probe_timeout, max_parallel, self.detector_id))
        for node in probed.keys() - with_port.keys():
            results[node] = ProbeResult(ProbeOutcome.TIMEOUT, detail="node has no agent port to probe")
        confirmed, alive, slow = [], [], []
        base = f"{reason} (sweep by {self.detector_id})"
        for node in sorted(results):
            record, result = probed[node], results[node]
            dead = result.proves_dead(record)
            if dead is not None:
                confirmed.append(node)
                self._declare(record, DetectionPath.DETECTION_PATH_PROBE_SWEEP, f"{base}; {dead}")
            elif result.outcome in (ProbeOutcome.ALIVE, ProbeOutcome.DENIED):
                if result.outcome is ProbeOutcome.DENIED:
                    log.warning("sweep: %s refused the probe's credentials (%s); taken as alive", node, result.detail)
                alive.append(node)
                with self._lock:
                    self._suspects.pop(node, None)
            else:
                slow.append(node)
                with self._lock:
                    if node not in self._suspects and (node, self._epoch) not in self._emitted:
                        now = self.clock()
                        self._suspects[node] = _Suspicion(node, now, f"{base}; probe timed out", self.detector_id,
                                                          next_probe_at=now + self.config.probe_interval)
                        self._kick()
        return SweepResult(tuple(confirmed), tuple(alive), tuple(slow), tuple(unknown), tuple(already))

    def start(self, *, probe_loop: bool = True) -> FailureDetector:
        """Load the current nodes, epoch and failures, then watch them. With `probe_loop`, probe in the background
        (from the first suspect or unwritten report: `_kick`)."""
        self._epoch_key = self.store.follow_epoch(self._on_epoch)  # one read; shared by the client's followers
        try:
            self._on_epoch(self.store.epoch_of(self._epoch_key.value)[0])
        except MalformedValueError as exc:
            log.error("%s; declaring failures in epoch 0", exc)
        if self._follow_at_start:
            self.follow_membership()
        with self._lock:
            self._probe_loop = probe_loop
            self._kick()  # for suspects reported before the start
        return self

    def _kick(self) -> None:
        """Wake the probe loop (under the lock), started at its first work: most detectors never probe (a thread
        each cost a thousand agents starting at once a thousand waits for the interpreter lock)."""
        if self._thread is None and self._probe_loop and (self._suspects or self._unwritten) and not self._stopped.is_set():
            self._thread = threading.Thread(target=self._loop, name=f"bamboo-detector-{self.detector_id}", daemon=True)
            self._thread.start()
        self._wake.notify_all()

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            self._wake.notify_all()
        for watch in self._watches:
            watch.cancel()
        self._watches.clear()
        if self._epoch_key is not None:
            self._epoch_key.close()
            self._epoch_key = None
        self.unfollow_membership()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=timeouts.THREAD_JOIN_TIMEOUT_S)

    def tick(self) -> None:
        """Probe every suspect that is due, and confirm or clear it. Called by the background loop or by tests."""
        now = self.clock()
        with self._lock:
            due = [s for s in self._suspects.values() if s.next_probe_at <= now]
            retry = [(r, p, why) for r, p, why, at in self._unwritten.values() if at <= now]
        for record, path, reason in retry:
            self._declare(record, path, reason)
        for suspicion in due:
            self._probe(suspicion)

    # -- probe path ------------------------------------------------------------------------------

    def _probe(self, suspicion: _Suspicion) -> None:
        node = suspicion.node
        try:
            record = self._record_of(node)
        except StoreError as exc:
            # etcd is slow or away: the suspicion stands (dropped, it left a dead node to its lease), read again later
            log.warning("cannot read the record of suspect %s: %s; trying again", node, exc)
            suspicion.next_probe_at = self.clock() + self.config.probe_interval
            return
        if record is None:
            # Unknown or already gone: a lease expiry (already handled) or a node that never registered.
            log.warning("suspect %s has no node record; dropping the suspicion (lease expiry decides)", node)
            with self._lock:
                self._suspects.pop(node, None)
            return
        if record.agent_port:
            self.probes_sent += 1
            result = self.prober(record, self.config.probe_timeout)
        else:
            result = ProbeResult(ProbeOutcome.TIMEOUT, detail="node has no agent port to probe")
        now = self.clock()
        suspicion.probes += 1
        base = f"{suspicion.reason} (reported by {suspicion.reporter})"
        dead = result.proves_dead(record)
        if dead is not None:
            self._declare(record, DetectionPath.DETECTION_PATH_NEIGHBOUR_REPORT, f"{base}; {dead}")
        elif result.outcome is ProbeOutcome.ALIVE:
            log.info("suspect %s answered a probe after %.3f s: slow, not dead", node, now - suspicion.since)
            with self._lock:
                self._suspects.pop(node, None)
        elif result.outcome is ProbeOutcome.DENIED:
            log.warning("suspect %s refused this prober's credentials (%s): something alive holds its port, so it "
                        "is not declared; check the job token or the client certificate", node, result.detail)
            with self._lock:
                self._suspects.pop(node, None)
        elif now - suspicion.since >= self.config.grace_period:
            self._declare(record, DetectionPath.DETECTION_PATH_PROBE_TIMEOUT,
                          f"{base}; unresponsive for {now - suspicion.since:.2f} s "
                          f"(grace {self.config.grace_period} s, {suspicion.probes} probes)")
        else:
            suspicion.next_probe_at = now + self.config.probe_interval

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self.tick()
            with self._lock:
                if self._stopped.is_set():
                    return
                due = [s.next_probe_at for s in self._suspects.values()]
                due += [at for *_, at in self._unwritten.values()]
                wait = min(due) - self.clock() if due else None
                if wait is None or wait > 0:
                    self._wake.wait(timeout=wait)

    # -- lease path and bookkeeping --------------------------------------------------------------

    def _on_epoch(self, epoch: int) -> None:
        with self._lock:
            if epoch > self._epoch:
                self._epoch = epoch

    def _on_node_event(self, event: WatchEvent) -> None:
        self._node_changed(event)
        with self._lock:
            listeners = list(self._membership_listeners)
        for listener in listeners:
            try:
                listener()
            except Exception:
                log.exception("membership listener failed")

    def _node_changed(self, event: WatchEvent) -> None:
        if event.kind is EventKind.PUT:
            try:
                record = decode_message(event.key, event.value, NodeRecord)
            except MalformedValueError as exc:
                log.error("ignoring node event: %s", exc)
                return
            with self._lock:
                self._nodes.put(record)
            return
        node = event.key.removeprefix(self.store.keys.nodes)
        with self._lock:
            last, _ = self._nodes.pop(node), self._suspects.pop(node, None)
            if (node, self._epoch) in self._emitted:  # its lease went because its failure was declared: no report
                return
        if event.prev_value:
            try:
                last = decode_message(event.key, event.prev_value, NodeRecord)
            except MalformedValueError as exc:
                log.error("node %s deleted; its last record was malformed: %s", node, exc)
        if last is not None and last.state == NodeState.NODE_STATE_LEFT:
            log.info("node %s left on purpose", node)
            return
        with self._lock:  # declared before the epoch moved on: the deletion of its revoked lease came late
            if last is not None and (node, last.incarnation) in self._declared:
                return
        record = last if last is not None else NodeRecord(id=node)
        notice = " after a preemption notice" if record.state == NodeState.NODE_STATE_PREEMPTING else ""
        self._declare(record, DetectionPath.DETECTION_PATH_LEASE_EXPIRY, "lease expired" + notice)

    def _declare(self, record: NodeRecord, path: int, reason: str) -> None:
        report = FailureReport(
            node=record.id,
            epoch=self._epoch,
            incarnation=record.incarnation,
            detected_by=self.detector_id,
            path=path,
            reason=reason,
            detected_at=self.wall_clock(),
        )
        try:
            won, stored = self.store.report_failure(report)
        except FencedError as exc:
            # This detector's own node was declared dead: it must not write to the job any more.
            log.error("not recording the failure of %s: %s", record.id, exc)
            with self._lock:
                self._suspects.pop(record.id, None)
                self._unwritten.pop(record.id, None)
            return
        except (StoreError, MalformedValueError) as exc:
            # The failure is confirmed; only writing it failed. Retry the write on the next ticks.
            log.error("could not record the failure of %s: %s; will retry", record.id, exc)
            with self._lock:
                self._suspects.pop(record.id, None)
                self._unwritten[record.id] = (record, path, reason, self.clock() + self.config.probe_interval)
                self._kick()
            return
        with self._lock:
            self._unwritten.pop(record.id, None)
        if won:
            self._revoke(record)
        self._emit(stored)

    def _revoke(self, record: NodeRecord) -> None:
        """The failure of `record` is confirmed (by us): take its lease away, so it leaves every view now."""
        try:
            if self.store.revoke_node(record.id, record.incarnation or None):
                log.info("revoked the lease of %s (incarnation %d)", record.id, record.incarnation)
        except StoreError as exc:  # the lease still expires after its TTL
            log.warning("could not revoke the lease of failed node %s: %s", record.id, exc)

    def _on_failure_event(self, event: WatchEvent) -> None:
        if event.kind is not EventKind.PUT:
            return
        try:
            report = decode_message(event.key, event.value, FailureReport)
        except MalformedValueError as exc:
            log.error("ignoring failure record: %s", exc)
            return
        self._emit(report)

    def _emit(self, report: FailureReport) -> None:
        key = (report.node, int(report.epoch))
        with self._lock:
            if key in self._emitted:
                return
            self._emitted.add(key)
            self._declared.add((report.node, int(report.incarnation)))
            self._suspects.pop(report.node, None)
            self._unwritten.pop(report.node, None)
            listeners = list(self._listeners)
        event = NodeFailed.from_report(report)
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                log.exception("NodeFailed listener failed on %s", event)
