"""The failure detector: neighbour reports, lease expiry and gRPC probes, turned into `NodeFailed` events.

Three signals, one outcome:

- **Neighbour report.** The runtime calls `report_peer_failure(node, reason)` when a P2P send or
  receive to `node` failed. That makes `node` a *suspect*. The detector probes it over gRPC with a
  deadline (`probe_timeout`):
  - connection refused (nothing listens on the agent port: the process is gone) confirms at once;
  - an answer with a different incarnation (the id was taken by a new process) confirms at once;
  - an answer with the same incarnation clears the suspicion: the node is slow, not dead;
  - a probe that times out is repeated every `probe_interval` until the node has been unresponsive
    for `grace_period` seconds since the report; then the failure is confirmed.
- **Lease expiry.** The node's record disappears from etcd without having been marked LEFT: its
  lease ran out (it stopped heartbeating for the TTL). Confirmed at once.

A confirmed failure is written to etcd first-writer-wins, one per node per membership epoch
(`MembershipStore.report_failure`), and every detector emits `NodeFailed` from what it reads back, so
each listener of each detector sees exactly one `NodeFailed(node, epoch, detected_by, reason)` per node
per epoch, whoever detected it.

Time: all grace and probe scheduling reads the injected `clock` (monotonic seconds), so unit tests drive
`tick()` with a fake clock and a fake prober; `start()` runs `tick()` on a background thread.
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import attrs
from bamboo.membership.kv import EventKind, StoreError, WatchEvent, WatchHandle
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

__all__ = ["DetectorConfig", "FailureDetector", "ProbeOutcome", "ProbeResult", "Prober"]

log = logging.getLogger(__name__)


class ProbeOutcome(enum.Enum):
    ALIVE = "alive"  # the agent answered
    REFUSED = "refused"  # nothing listens: the process is gone
    TIMEOUT = "timeout"  # no answer within the deadline: slow, stopped, or partitioned


@attrs.frozen
class ProbeResult:
    outcome: ProbeOutcome
    incarnation: int = 0
    progress: int = 0
    detail: str = ""


Prober = Callable[[NodeRecord, float], ProbeResult]
"""Probe a node's agent with a deadline in seconds. Must not raise; must return within about the deadline."""


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"DetectorConfig.{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class DetectorConfig:
    """Timing of the probe path (seconds).

    - `grace_period`: how long a suspect must stay unresponsive before it is declared failed; a node
      stopped for less is only slow. Keep it at or below the lease TTL.
    - `probe_timeout`: deadline of one gRPC probe.
    - `probe_interval`: pause between two probes of the same suspect.
    """

    grace_period: float = attrs.field(default=2.0, validator=_positive)
    probe_timeout: float = attrs.field(default=0.25, validator=_positive)
    probe_interval: float = attrs.field(default=0.1, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.probe_timeout > self.grace_period:
            raise ValueError(
                f"DetectorConfig: probe_timeout {self.probe_timeout} must not exceed grace_period {self.grace_period}"
            )


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
    ) -> None:
        self.store = store
        self.detector_id = detector_id
        self.prober = prober
        self.config = config or DetectorConfig()
        self.clock = clock
        self.wall_clock = wall_clock
        self._lock = threading.RLock()
        self._wake = threading.Condition(self._lock)
        self._nodes: dict[str, NodeRecord] = {}
        self._suspects: dict[str, _Suspicion] = {}
        # Confirmed failures whose report could not be written yet (etcd unreachable): retried by tick().
        self._unwritten: dict[str, tuple[NodeRecord, int, str, float]] = {}
        self._emitted: set[tuple[str, int]] = set()
        self._listeners: list[Callable[[NodeFailed], None]] = []
        self._watches: list[WatchHandle] = []
        self._epoch = 0
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None

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
            self._wake.notify_all()

    def suspects(self) -> list[str]:
        with self._lock:
            return sorted(self._suspects)

    def known_nodes(self) -> dict[str, NodeRecord]:
        with self._lock:
            return dict(self._nodes)

    def start(self, *, probe_loop: bool = True) -> FailureDetector:
        """Load the current nodes, epoch and failures, then watch them. With `probe_loop`, probe in the background."""
        kv = self.store.kv
        revision = kv.revision()
        try:
            self._epoch = self.store.epoch()[0]
        except MalformedValueError as exc:
            log.error("%s; declaring failures in epoch 0", exc)
        for record in self.store.list_nodes(skip_malformed=True).values():
            self._nodes[record.id] = record
        self._watches.append(self.store.watch_epoch(self._on_epoch, start_revision=revision + 1))
        self._watches.append(self.store.watch_nodes(self._on_node_event, start_revision=revision + 1))
        self._watches.append(self.store.watch_failures(self._on_failure_event, start_revision=revision + 1))
        for item in kv.get_prefix(self.store.keys.failures_in(self._epoch)):
            self._on_failure_event(WatchEvent(EventKind.PUT, item.key, item.value, item.mod_revision))
        if probe_loop:
            self._thread = threading.Thread(target=self._loop, name=f"bamboo-detector-{self.detector_id}",
                                            daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()
        with self._lock:
            self._wake.notify_all()
        for watch in self._watches:
            watch.cancel()
        self._watches.clear()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)

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
        with self._lock:
            record = self._nodes.get(node)
        if record is None:
            # Unknown or already gone: a lease expiry (already handled) or a node that never registered.
            log.warning("suspect %s has no node record; dropping the suspicion (lease expiry decides)", node)
            with self._lock:
                self._suspects.pop(node, None)
            return
        if record.agent_port:
            result = self.prober(record, self.config.probe_timeout)
        else:
            result = ProbeResult(ProbeOutcome.TIMEOUT, detail="node has no agent port to probe")
        now = self.clock()
        suspicion.probes += 1
        base = f"{suspicion.reason} (reported by {suspicion.reporter})"
        if result.outcome is ProbeOutcome.REFUSED:
            self._declare(record, DetectionPath.DETECTION_PATH_NEIGHBOUR_REPORT,
                          f"{base}; probe refused: {result.detail}".rstrip(": "))
        elif result.outcome is ProbeOutcome.ALIVE and result.incarnation != record.incarnation:
            self._declare(record, DetectionPath.DETECTION_PATH_NEIGHBOUR_REPORT,
                          f"{base}; probe answered by incarnation {result.incarnation}, "
                          f"not {record.incarnation}")
        elif result.outcome is ProbeOutcome.ALIVE:
            log.info("suspect %s answered a probe after %.3f s: slow, not dead", node, now - suspicion.since)
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
        if event.kind is EventKind.PUT:
            try:
                record = decode_message(event.key, event.value, NodeRecord)
            except MalformedValueError as exc:
                log.error("ignoring node event: %s", exc)
                return
            with self._lock:
                self._nodes[record.id] = record
            return
        node = event.key.removeprefix(self.store.keys.nodes)
        with self._lock:
            last = self._nodes.pop(node, None)
            self._suspects.pop(node, None)
        if event.prev_value:
            try:
                last = decode_message(event.key, event.prev_value, NodeRecord)
            except MalformedValueError as exc:
                log.error("node %s deleted; its last record was malformed: %s", node, exc)
        if last is not None and last.state == NodeState.NODE_STATE_LEFT:
            log.info("node %s left on purpose", node)
            return
        record = last if last is not None else NodeRecord(id=node)
        why = "lease expired"
        if record.state == NodeState.NODE_STATE_PREEMPTING:
            why = "lease expired after a preemption notice"
        self._declare(record, DetectionPath.DETECTION_PATH_LEASE_EXPIRY, why)

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
            _, stored = self.store.report_failure(report)
        except (StoreError, MalformedValueError) as exc:
            # The failure is confirmed; only writing it failed. Retry the write on the next ticks.
            log.error("could not record the failure of %s: %s; will retry", record.id, exc)
            with self._lock:
                self._suspects.pop(record.id, None)
                self._unwritten[record.id] = (record, path, reason, self.clock() + self.config.probe_interval)
                self._wake.notify_all()
            return
        with self._lock:
            self._unwritten.pop(record.id, None)
        self._emit(stored)

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
            self._suspects.pop(report.node, None)
            self._unwritten.pop(report.node, None)
            listeners = list(self._listeners)
        event = NodeFailed.from_report(report)
        for listener in listeners:
            try:
                listener(event)
            except Exception:
                log.exception("NodeFailed listener failed on %s", event)
