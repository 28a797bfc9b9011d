"""The membership store: nodes, epoch, failure reports, decisions and layout of one job, in etcd.

Keys (the job-wide records of docs/architecture.md, "The processes"), all under `/bamboo/<job>/`:

| key | value | written |
|---|---|---|
| `nodes/<id>` | `NodeRecord` JSON | under the node's lease, kept alive in the background |
| `epoch` | `{"epoch": N}` | compare-and-swap on its revision |
| `layout` | any JSON object | compare-and-swap on its revision |
| `failures/<epoch:012d>/<node>` | `FailureReport` JSON | first writer wins: one report per node per epoch |
| `decisions/<name>` | any JSON object | first writer wins (transaction on create revision 0) |
| `notices/<node>` | `PreemptionNotice` JSON | by the node's agent |

**Fencing.** A `Registration` knows its record's key, create revision and lease (`Registration.guard`).
`store.fenced(registration)` (or `MembershipStore(kv, job, fence=registration)`) is a view of the store
whose every write (`advance_epoch`, `report_failure`, `decide`, `put_layout`, `publish_notice`) carries
that guard in the same etcd transaction: once the node's lease is revoked (a detector confirmed it dead,
see `revoke_node`) or expired, or a newer registration took its id, each of those writes raises
`FencedError` and writes nothing. A process that comes back registers again, as a fresh node.

Timeouts (defaults in `bamboo.membership.timeouts`): a `Registration` refreshes its lease every `ttl / 3`
seconds (`keepalive_interval` overrides it), so it notices its lease is gone (`lost`) within one such
interval; it retries every `retry_interval` (`KEEPALIVE_RETRY_INTERVAL_S`) while etcd is unreachable.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any

import attrs
from bamboo.membership import timeouts
from bamboo.membership.kv import Guard, KeyValue, KeyValueStore, StoreError, WatchEvent, WatchHandle
from bamboo.membership.records import (
    FailureReport,
    MalformedValueError,
    NodeRecord,
    NodeState,
    PreemptionNotice,
    decode_json,
    decode_message,
    encode_json,
    encode_message,
    validate_node_record,
)
from bamboo.membership.watched import WatchedKey, WatchedPrefix

__all__ = ["Decision", "JobKeys", "Layout", "MembershipStore", "Registration"]

log = logging.getLogger(__name__)


@attrs.frozen
class JobKeys:
    """The etcd key layout of one job."""

    job: str = attrs.field()

    @job.validator
    def _check(self, attribute: attrs.Attribute[str], value: str) -> None:
        if not value or "/" in value or value != value.strip():
            raise ValueError(f"job name must be non-empty, without '/' or surrounding spaces, got {value!r}")

    @property
    def root(self) -> str:
        return f"/bamboo/{self.job}/"

    @property
    def nodes(self) -> str:
        return f"{self.root}nodes/"

    def node(self, node_id: str) -> str:
        return f"{self.nodes}{node_id}"

    @property
    def epoch(self) -> str:
        return f"{self.root}epoch"

    @property
    def layout(self) -> str:
        return f"{self.root}layout"

    @property
    def failures(self) -> str:
        return f"{self.root}failures/"

    def failures_in(self, epoch: int) -> str:
        return f"{self.failures}{epoch:012d}/"

    def failure(self, epoch: int, node_id: str) -> str:
        return f"{self.failures_in(epoch)}{node_id}"

    @property
    def decisions(self) -> str:
        return f"{self.root}decisions/"

    def decision(self, name: str) -> str:
        return f"{self.decisions}{name}"

    @property
    def notices(self) -> str:
        return f"{self.root}notices/"

    def notice(self, node_id: str) -> str:
        return f"{self.notices}{node_id}"


@attrs.frozen
class Decision:
    """The outcome of a first-writer-wins decision: the value that won, and whether we wrote it."""

    name: str
    value: dict[str, Any]
    won: bool
    revision: int


@attrs.frozen
class Layout:
    """The current layout (an opaque JSON object to this package) and the etcd revision it was read at."""

    value: dict[str, Any]
    revision: int


class Registration:
    """A node record held in etcd by a lease that a background thread keeps alive.

    If the lease is lost (the process was stopped longer than the TTL, etcd lost it, or a detector revoked
    it on confirming the node dead), `lost` is set and `on_lost` is called once, at the first refresh that
    finds the lease gone: within one `keepalive_interval`. The record is gone and the node has been, or
    will be, declared failed; every write guarded by `guard` now raises `FencedError`. A new process must
    register again with a higher incarnation.

    `guard` (key, create revision and lease of the record as registered) is what fenced writes check.
    `refreshes` and `refresh_failures` count the keepalive's successful and failed refreshes.
    """

    def __init__(
        self,
        store: MembershipStore,
        record: NodeRecord,
        ttl: int,
        keepalive_interval: float | None = None,
        retry_interval: float = timeouts.KEEPALIVE_RETRY_INTERVAL_S,
        on_lost: Callable[[Registration], None] | None = None,
    ) -> None:
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 s, got {ttl!r}")
        if keepalive_interval is not None and not keepalive_interval > 0:
            raise ValueError(f"keepalive_interval must be > 0, got {keepalive_interval!r}")
        self.store = store
        self.ttl = ttl
        self.keepalive_interval = keepalive_interval if keepalive_interval is not None else ttl / 3
        self.retry_interval = retry_interval
        self._on_lost = on_lost
        self._record = record
        self._stop = threading.Event()
        self.lost = threading.Event()
        self.refreshes = 0
        self.refresh_failures = 0
        self.lease_id = store.kv.grant_lease(ttl)
        key = store.keys.node(record.id)
        put_and_get = getattr(store.kv, "put_and_get", None)  # one request (EtcdKV), else a put and a read
        if put_and_get is not None:
            written = put_and_get(key, encode_message(record), lease=self.lease_id)
        else:
            store.kv.put(key, encode_message(record), lease=self.lease_id)
            written = store.kv.get(key)
        if written is None or written.lease != self.lease_id:
            store.kv.revoke_lease(self.lease_id)
            raise StoreError(f"registering node {record.id!r}: its record {key} was replaced or removed while it "
                             "was written (another process registering the same id?)")
        self.guard = Guard(node=record.id, key=key, create_revision=written.create_revision, lease=self.lease_id)
        self._thread = threading.Thread(target=self._keepalive, name=f"bamboo-lease-{record.id}", daemon=True)
        self._thread.start()

    @property
    def record(self) -> NodeRecord:
        return self._record

    @property
    def key(self) -> str:
        """The etcd key of this node's record."""
        return self.guard.key

    @property
    def create_revision(self) -> int:
        """The create revision of the record as registered (what fenced writes compare)."""
        return self.guard.create_revision

    def _keepalive(self) -> None:
        wait = self.keepalive_interval
        while not self._stop.wait(wait):
            try:
                remaining = self.store.kv.refresh_lease(self.lease_id)
            except StoreError as exc:
                log.debug("lease %x of %s: refresh failed (%s); retrying", self.lease_id, self._record.id, exc)
                self.refresh_failures += 1
                wait = self.retry_interval
                continue
            if remaining <= 0:
                log.warning("node %s lost its lease %x: its record is gone", self._record.id, self.lease_id)
                self.lost.set()
                if self._on_lost is not None:
                    self._on_lost(self)
                return
            self.refreshes += 1
            wait = self.keepalive_interval

    def update(self, **changes: Any) -> NodeRecord:
        """Rewrite the record (e.g. `state=NodeState.NODE_STATE_ACTIVE`) under the same lease."""
        record = NodeRecord()
        record.CopyFrom(self._record)
        for name, value in changes.items():
            setattr(record, name, value)
        validate_node_record(record)
        self.store.kv.put(self.guard.key, encode_message(record), lease=self.lease_id, guard=self.guard)
        self._record = record
        return record

    def leave(self) -> None:
        """Leave on purpose: mark the record LEFT, then revoke the lease. Detectors do not call this a failure.

        A node already fenced (its lease is gone) has nothing left to leave: this does nothing then."""
        self._stop.set()
        with contextlib.suppress(StoreError):
            self.update(state=NodeState.NODE_STATE_LEFT)
            self.store.kv.revoke_lease(self.lease_id)

    def stop_keepalive(self) -> None:
        """Stop refreshing the lease without revoking it: the record expires after the TTL (as on a crash)."""
        self._stop.set()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout=timeouts.THREAD_JOIN_TIMEOUT_S)


class MembershipStore:
    """One job's membership state in etcd, through a `KeyValueStore`.

    With `fence` (a `Registration`, or its `Guard`), every write is guarded by that node's registration:
    see the module docstring. `fenced(registration)` returns such a view of an unfenced store.
    """

    def __init__(self, kv: KeyValueStore, job: str, *, fence: Registration | Guard | None = None) -> None:
        self.kv = kv
        self.keys = JobKeys(job)
        self.guard: Guard | None = fence.guard if isinstance(fence, Registration) else fence
        if self.guard is not None and not self.guard.key.startswith(self.keys.nodes):
            raise ValueError(f"fence {self.guard.key!r} is not a node record of job {job!r}")

    def fenced(self, fence: Registration | Guard) -> MembershipStore:
        """This store, with every write guarded by `fence` (a node's registration)."""
        return MembershipStore(self.kv, self.keys.job, fence=fence)

    def _guarded(self) -> dict[str, Any]:
        # Only pass `guard` when there is one, so unfenced stores work over any older KeyValueStore.
        return {} if self.guard is None else {"guard": self.guard}

    # -- nodes -----------------------------------------------------------------------------------

    def register(
        self,
        record: NodeRecord,
        ttl: int,
        *,
        keepalive_interval: float | None = None,
        retry_interval: float = timeouts.KEEPALIVE_RETRY_INTERVAL_S,
        on_lost: Callable[[Registration], None] | None = None,
    ) -> Registration:
        """Put `record` under a new lease of `ttl` seconds and keep the lease alive in the background."""
        validate_node_record(record)
        return Registration(self, record, ttl, keepalive_interval=keepalive_interval,
                            retry_interval=retry_interval, on_lost=on_lost)

    def revoke_node(self, node_id: str, incarnation: int | None = None) -> bool:
        """Revoke the lease that holds `node_id`'s record, so it leaves every view at once (and is fenced).

        With `incarnation`, only a record of that incarnation is revoked (never a newer process that took
        the id). Returns whether a lease was revoked. Used when a failure is confirmed.
        """
        key = self.keys.node(node_id)
        found = self.kv.get(key)
        if found is None or not found.lease:
            return False
        if incarnation is not None:
            try:
                record = decode_message(key, found.value, NodeRecord)
            except MalformedValueError:
                record = None
            if record is not None and record.incarnation != incarnation:
                return False
        self.kv.revoke_lease(found.lease)
        return True

    def get_node(self, node_id: str) -> NodeRecord | None:
        """The node's record, None when absent; MalformedValueError when it does not decode."""
        key = self.keys.node(node_id)
        found = self.kv.get(key)
        return None if found is None else decode_message(key, found.value, NodeRecord)

    def list_nodes(self, *, skip_malformed: bool = False) -> dict[str, NodeRecord]:
        """All registered nodes by id. A malformed record raises, or is logged and left out with `skip_malformed`."""
        nodes: dict[str, NodeRecord] = {}
        for item in self.kv.get_prefix(self.keys.nodes):
            try:
                record = decode_message(item.key, item.value, NodeRecord)
            except MalformedValueError as exc:
                if not skip_malformed:
                    raise
                log.error("%s", exc)
                continue
            nodes[record.id] = record
        return nodes

    def watch_nodes(self, callback: Callable[[WatchEvent], None], start_revision: int | None = None) -> WatchHandle:
        """Raw changes under `nodes/`; decode with `decode_message(event.key, event.value, NodeRecord)`."""
        return self.kv.watch_prefix(self.keys.nodes, callback, start_revision)

    # -- epoch -----------------------------------------------------------------------------------

    def epoch(self) -> tuple[int, int]:
        """(current membership epoch, its revision). Epoch 0 with revision 0 before anyone advanced it."""
        return self.epoch_of(self.kv.get(self.keys.epoch))

    def epoch_of(self, found: KeyValue | None) -> tuple[int, int]:
        """(epoch, revision) of the epoch record `found` (as read, or as a `WatchedKey` of it holds it)."""
        if found is None:
            return 0, 0
        data = decode_json(self.keys.epoch, found.value, "epoch record")
        value = data.get("epoch")
        if not isinstance(value, int) or isinstance(value, bool) or value < 0:
            raise MalformedValueError(self.keys.epoch, "epoch record", found.value,
                                      f"'epoch' must be a non-negative integer, got {value!r}")
        return value, found.mod_revision

    def advance_epoch(self, expected: int) -> int | None:
        """Move the epoch from `expected` to `expected + 1`. Returns the new epoch, None if it was not `expected`."""
        current, revision = self.epoch()
        if current != expected:
            return None
        new = self.kv.compare_and_swap(self.keys.epoch, encode_json({"epoch": expected + 1}), revision,
                                       **self._guarded())
        return None if new is None else expected + 1

    def follow_epoch(self, callback: Callable[[int], None]) -> WatchedKey:
        """The epoch record, read once and followed (`WatchedKey`: shared by every follower of it on this
        client); `callback(epoch)` whenever it changes. A malformed value is logged and skipped."""

        def on_change(found: KeyValue | None) -> None:
            if found is None:
                return
            try:
                callback(self.epoch_of(found)[0])
            except MalformedValueError as exc:
                log.error("%s", exc)

        return WatchedKey(self.kv, self.keys.epoch, on_change=on_change)

    def watch_epoch(self, callback: Callable[[int], None], start_revision: int | None = None) -> WatchHandle:
        """Call `callback(epoch)` whenever the epoch changes. A malformed value is logged and skipped."""

        def on_event(event: WatchEvent) -> None:
            if event.key != self.keys.epoch or not event.value:
                return
            try:
                value = decode_json(event.key, event.value, "epoch record").get("epoch")
            except MalformedValueError as exc:
                log.error("%s", exc)
                return
            if isinstance(value, int):
                callback(value)

        return self.kv.watch_prefix(self.keys.epoch, on_event, start_revision)

    # -- failures --------------------------------------------------------------------------------

    def report_failure(self, report: FailureReport) -> tuple[bool, FailureReport]:
        """Record that `report.node` failed in `report.epoch`; idempotent per node per epoch.

        Returns (True, report) for the first writer, else (False, the report that was there first).
        """
        if not report.node:
            raise ValueError(f"failure report without a node id: {report}")
        key = self.keys.failure(report.epoch, report.node)
        won, stored = self.kv.create(key, encode_message(report), **self._guarded())
        return won, (report if won else decode_message(key, stored.value, FailureReport))

    def failures(self, epoch: int) -> dict[str, FailureReport]:
        """Failure reports of one epoch by node id."""
        return {
            report.node: report
            for item in self.kv.get_prefix(self.keys.failures_in(epoch))
            for report in [decode_message(item.key, item.value, FailureReport)]
        }

    def watch_failures(self, callback: Callable[[WatchEvent], None], start_revision: int | None = None) -> WatchHandle:
        return self.kv.watch_prefix(self.keys.failures, callback, start_revision)

    # -- decisions and layout --------------------------------------------------------------------

    def decide(self, name: str, value: dict[str, Any]) -> Decision:
        """First writer wins: store `value` as decision `name` unless one exists; everyone gets the winner."""
        if not name or name != name.strip():
            raise ValueError(f"decision name must be non-empty without surrounding spaces, got {name!r}")
        key = self.keys.decision(name)
        won, stored = self.kv.create(key, encode_json(value), **self._guarded())
        return Decision(name=name, value=decode_json(key, stored.value, "decision"), won=won,
                        revision=stored.mod_revision)

    def get_decision(self, name: str) -> Decision | None:
        key = self.keys.decision(name)
        found = self.kv.get(key)
        if found is None:
            return None
        return Decision(name=name, value=decode_json(key, found.value, "decision"), won=False,
                        revision=found.mod_revision)

    def read_decisions(self, prefix: str, changed_after: int = 0) -> tuple[dict[str, Decision], int]:
        """Every decision whose name starts with `prefix` (name -> `Decision`) in one read, and the revision read at;
        with `changed_after`, only those written after that revision (a reader that keeps what it read passes the
        revision it got last). A reader waiting for one record of each of many nodes (their `up` records of a
        reconfiguration, their `ready` records at a barrier) reads them this way: with a request for each node
        not heard from yet, a thousand-node job sent a thousand requests every poll from every node."""
        base = self.keys.decision(prefix)
        range_at = getattr(self.kv, "range_at", None)
        if range_at is not None:
            found, revision = range_at(base, changed_after=changed_after)
        else:  # a store without revisioned ranges: the whole prefix, filtered here
            revision = self.kv.revision()
            found = [item for item in self.kv.get_prefix(base) if item.mod_revision > changed_after]
        decisions = {}
        for item in found:
            name = item.key.removeprefix(self.keys.decisions)
            decisions[name] = Decision(name=name, value=decode_json(item.key, item.value, "decision"), won=False,
                                       revision=item.mod_revision)
        return decisions, revision

    def get_layout(self) -> Layout | None:
        found = self.kv.get(self.keys.layout)
        if found is None:
            return None
        return Layout(value=decode_json(self.keys.layout, found.value, "layout"), revision=found.mod_revision)

    def put_layout(self, value: dict[str, Any], expected_revision: int) -> Layout | None:
        """Replace the layout if it is still at `expected_revision` (0: no layout yet). None on conflict."""
        revision = self.kv.compare_and_swap(self.keys.layout, encode_json(value), expected_revision,
                                            **self._guarded())
        return None if revision is None else Layout(value=value, revision=revision)

    # -- preemption notices ----------------------------------------------------------------------

    def publish_notice(self, notice: PreemptionNotice) -> int:
        if not notice.node:
            raise ValueError(f"preemption notice without a node id: {notice}")
        return self.kv.put(self.keys.notice(notice.node), encode_message(notice), **self._guarded())

    def watch_notices(self, callback: Callable[[WatchEvent], None], start_revision: int | None = None) -> WatchHandle:
        """`callback` for each preemption notice from `start_revision` (default: from now on, through the
        client's shared watch of the notices, `WatchedPrefix`: no request when it is already followed)."""
        if start_revision is None:
            return WatchedPrefix(self.kv, self.keys.notices, callback)
        return self.kv.watch_prefix(self.keys.notices, callback, start_revision)
