"""The small key-value interface that bamboo.membership needs from etcd, and its etcd v3 implementation.

Everything above this module talks to `KeyValueStore`, never to the etcd client library, so the client
(`etcd-sdk-python`, imported as `pyetcd`) could be swapped. `EtcdKV` implements it and adds what the
membership store relies on:

- every error from the client becomes `StoreUnavailableError` (etcd unreachable or timed out) or
  `StoreError`, so callers need not know pyetcd's exceptions;
- the endpoint is never blacklisted after a failure (pyetcd would refuse to use it for 300 s), and gRPC
  reconnects with a short backoff, so clients come back soon after etcd restarts;
- **guarded writes**: `put`, `create`, `compare_and_swap` and `delete` take a `Guard` (the writer's own
  node record: its key, the create revision and the lease of its registration), checked in the same
  etcd transaction as the write. A writer whose record is gone (its lease revoked or expired) or was
  replaced by a newer registration gets `FencedError`, and nothing is written;
- **watches that lose nothing** (`bamboo.membership.watch`): every watch of one client shares one gRPC
  stream (`bamboo.membership.watch_stream`); after it breaks each resumes from the revision after the last one it delivered, and one whose
  revision etcd compacted meanwhile relists its prefix and delivers the difference (`relisted=True`).
  A watch's first registration is retried within `watch_start_timeout`; a puts-only watch gets no deletions;
- **paged reads**: a prefix is read in pages of `range_page` keys, all at one revision, so no answer passes
  gRPC's 4 MB limit;
- **one keepalive stream**: every lease refresh of the client goes over one long-lived stream
  (`bamboo.membership.streams`), not a stream per refresh.

The value types, errors and the `KeyValueStore` protocol are in `bamboo.membership.kv_base` (re-exported
here).

Timeouts (seconds, in `EtcdOptions`, defaults in `bamboo.membership.timeouts`): `timeout` bounds every
unary RPC and each attempt to create a watch (`ETCD_RPC_TIMEOUT_S`); `reconnect_backoff_min` and
`reconnect_backoff_max` bound gRPC's reconnect backoff (`ETCD_RECONNECT_BACKOFF_MIN_S`, `..._MAX_S`);
`watch_retry_interval` is the pause between attempts to re-create a broken watch (`WATCH_RETRY_INTERVAL_S`); `watch_start_timeout` bounds a watch's first
registration (`WATCH_START_TIMEOUT_S`).
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections.abc import Callable
from typing import Any, TypeVar

import attrs
import grpc
import pyetcd
from bamboo.membership.kv_base import (
    EtcdOptions,
    EventKind,
    FencedError,
    Guard,
    KeyValue,
    KeyValueStore,
    RevisionOutOfRange,
    StoreError,
    StoreUnavailableError,
    WatchEvent,
    WatchHandle,
    key_value,
)
from bamboo.membership.streams import KeepAliveStream
from bamboo.membership.watch import PrefixWatch
from bamboo.membership.watch_stream import WatchStream
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exceptions
from pyetcd import transactions as etcd_txn
from pyetcd import utils as etcd_utils

__all__ = [
    "EtcdKV",
    "EtcdOptions",
    "EtcdStatus",
    "EventKind",
    "FencedError",
    "Guard",
    "KeyValue",
    "KeyValueStore",
    "PrefixWatch",
    "StoreError",
    "StoreUnavailableError",
    "WatchEvent",
    "WatchHandle",
]

log = logging.getLogger(__name__)
T = TypeVar("T")


@attrs.frozen
class EtcdStatus:
    """What `EtcdKV.status()` reports of the etcd member it reached: its version, the store's revision, and
    the size of its database file (bytes; it shrinks only after a compaction and a defragmentation)."""

    version: str
    revision: int
    db_size: int


_UNAVAILABLE = (
    etcd_exceptions.ConnectionFailedError,
    etcd_exceptions.ConnectionTimeoutError,
    etcd_exceptions.NoServerAvailableError,
    etcd_exceptions.InternalServerError,
    etcd_exceptions.WatchTimedOut,
)
_UNAVAILABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}


class _LeaseIs(etcd_txn.BaseCompare):
    """Compare a key's lease id (pyetcd has no helper for etcd's LEASE compare target)."""

    def build_compare(self, compare: Any) -> None:
        compare.target = etcdrpc.Compare.LEASE
        compare.lease = int(self.value)


def _guard_compares(guard: Guard) -> list[Any]:
    return [etcd_txn.Create(guard.key) == guard.create_revision, _LeaseIs(guard.key) == guard.lease]


def _prefix_range(prefix: str) -> tuple[bytes, bytes]:
    """The first key and the range end of every key under ``prefix``."""
    return prefix.encode(), etcd_utils.prefix_range_end(prefix.encode())


class EtcdKV:
    """`KeyValueStore` over a real etcd v3 server, through `pyetcd`."""

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self.reauthentications = 0
        self._client = self._connect()
        self._closed = False
        self._keepalive = KeepAliveStream(self)
        self._watches: WatchStream | None = None

    @property
    def client(self) -> pyetcd.MultiEndpointEtcd3Client:
        """The etcd client library's client in use (replaced when etcd forgot our auth token)."""
        return self._client

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def where(self) -> str:
        return ", ".join(self.options.endpoints)

    def _connect(self) -> pyetcd.MultiEndpointEtcd3Client:
        opts = self.options
        backoff_ms = int(opts.reconnect_backoff_max * 1000)
        first_ms = min(int(opts.reconnect_backoff_min * 1000), backoff_ms)
        # Not grpc.min_reconnect_backoff_ms: gRPC also takes it as the deadline of one connection attempt, and
        # at 0.1 s a loaded etcd that answers its HTTP/2 handshake later fails every connection ("connection
        # attempt timed out before receiving SETTINGS frame"); the attempt keeps gRPC's own 20 s bound.
        grpc_options = [
            ("grpc.initial_reconnect_backoff_ms", first_ms),
            ("grpc.max_reconnect_backoff_ms", backoff_ms),
        ]
        creds = None
        if opts.ca_cert is not None:
            creds = pyetcd.MultiEndpointEtcd3Client.get_secure_creds(opts.ca_cert, opts.cert_key, opts.cert_cert)
        endpoints = []
        for endpoint in opts.endpoints:
            host, _, port = endpoint.rpartition(":")
            # time_retry=0: never blacklist the endpoint after a failed call (etcd may just be restarting).
            endpoints.append(
                pyetcd.Endpoint(host, int(port), secure=creds is not None, creds=creds, time_retry=0.0,
                                opts=grpc_options)
            )
        try:
            client = pyetcd.MultiEndpointEtcd3Client(
                endpoints=endpoints,
                timeout=opts.timeout,
                user=opts.user,
                password=opts.password,
                failover=len(endpoints) > 1,
            )
        except grpc.RpcError as exc:
            raise self._translate(exc, "authenticate") from exc
        except _UNAVAILABLE as exc:
            raise StoreUnavailableError(f"etcd at {', '.join(opts.endpoints)} is unavailable: {exc}") from exc
        if creds is None:
            # pyetcd sends the auth token both as call credentials and as metadata; gRPC refuses call
            # credentials on a plaintext channel, so keep only the metadata there.
            client.call_credentials = None
        return client

    def _translate(self, exc: BaseException, what: str) -> StoreError:
        where = self.where
        if isinstance(exc, _UNAVAILABLE):
            return StoreUnavailableError(f"etcd at {where} unavailable during {what}: {type(exc).__name__}")
        if isinstance(exc, grpc.RpcError):
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            if code in _UNAVAILABLE_CODES:
                return StoreUnavailableError(f"etcd at {where} unavailable during {what}: {code}: {detail}")
            return StoreError(f"etcd at {where} refused {what}: {code}: {detail}")
        return StoreError(f"etcd at {where} failed {what}: {type(exc).__name__}: {exc}")

    def reauthenticate(self, stale: pyetcd.MultiEndpointEtcd3Client) -> None:
        """Replace `stale` by a freshly authenticated client (etcd forgets its tokens on restart)."""
        with self._lock:
            if self._client is not stale:
                return  # another thread did it already
            old, self._client = self._client, self._connect()
            self.reauthentications += 1
        with contextlib.suppress(Exception):
            old.close()

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one client call; reauthenticate once if etcd forgot our token (it does on restart)."""
        for attempt in (0, 1):
            client = self._client
            try:
                return fn()
            except grpc.RpcError as exc:
                stale_token = (
                    self.options.user is not None
                    and attempt == 0
                    and hasattr(exc, "details")
                    and "token" in (exc.details() or "")
                )
                if stale_token:
                    self.reauthenticate(client)
                    continue
                raise self._translate(exc, what) from exc
            except (etcd_exceptions.Etcd3Exception, ValueError) as exc:
                raise self._translate(exc, what) from exc
        raise AssertionError("unreachable")

    # -- reads -----------------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        resp = self._call(f"get {key}", lambda: self._client.get_response(key))
        return key_value(resp.kvs[0]) if resp.count else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return self.range_at(prefix)[0]

    def range_at(self, prefix: str, revision: int | None = None, *,
                 changed_after: int = 0) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` (at `revision`, default now) and the revision read at; with `changed_after`,
        only the keys written after that revision (etcd's `min_mod_revision`: a reader that keeps what it read
        before takes only what is new).

        Raises `RevisionOutOfRange` when etcd compacted `revision` away or has not reached it yet. Without
        `revision`, a compaction between two pages of the read makes it read again, at the newest revision.
        """
        what = f"list {prefix}" + ("" if revision is None else f" at revision {revision}")
        while True:
            try:
                return self._read_prefix(what, prefix, revision, changed_after)
            except RevisionOutOfRange as exc:
                if revision is not None:
                    raise
                log.debug("%s: %s; reading it again", what, exc)

    def _read_prefix(self, what: str, prefix: str, revision: int | None,
                     changed_after: int = 0) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` and the revision read at, in pages of `options.range_page` keys, each page at
        the revision of the first (or at `revision`), so that the pages make one consistent read."""
        start, end = _prefix_range(prefix)
        out: list[KeyValue] = []

        def read(first: bytes, at: int | None) -> Any:
            try:
                return self._client.get_range_response(first, end, limit=self.options.range_page, revision=at,
                                                       min_mod_revision=changed_after + 1 if changed_after else None)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                    detail = exc.details() or ""
                    return RevisionOutOfRange("compacted" in detail, detail)
                raise

        while True:
            resp = self._call(what, lambda first=start, at=revision: read(first, at))
            if isinstance(resp, RevisionOutOfRange):
                raise resp
            out.extend(key_value(kv) for kv in resp.kvs)
            if revision is None:
                revision = int(resp.header.revision)
            if not resp.more or not resp.kvs:
                return out, revision
            start = bytes(resp.kvs[-1].key) + b"\0"  # the next key after the last one read

    def count_prefix(self, prefix: str, revision: int) -> int:
        """How many keys are under `prefix` at `revision` (etcd counts them; no value is sent)."""
        start, end = _prefix_range(prefix)
        resp = self._call(f"count {prefix}", lambda: self._client.get_range_response(start, end, count_only=True,
                                                                                     revision=revision))
        return int(resp.count)

    def revision(self) -> int:
        resp = self._call("status", lambda: self._client.get_response("/"))
        return int(resp.header.revision)

    # -- writes ----------------------------------------------------------------------------------

    def _fenced(self, guard: Guard, key: str, rows: list[Any]) -> FencedError | None:
        """The FencedError for `guard` given what a transaction read at its key; None if the guard holds."""
        if not rows:
            return FencedError(guard.node, key, f"its record {guard.key} is gone: its lease {guard.lease:x} "
                                                 "was revoked or expired")
        _, meta = rows[0]
        if int(meta.create_revision) == guard.create_revision and int(meta.lease_id) == guard.lease:
            return None
        return FencedError(guard.node, key, f"its record {guard.key} belongs to a newer registration (create "
                                             f"revision {int(meta.create_revision)}, lease {int(meta.lease_id):x}; "
                                             f"ours: {guard.create_revision}, {guard.lease:x})")

    def _txn(self, what: str, compare: list[Any], success: list[Any], failure: list[Any]) -> tuple[bool, list[Any]]:
        return self._call(what, lambda: self._client.transaction(compare=compare, success=success, failure=failure))

    def put(self, key: str, value: bytes, lease: int = 0, *, guard: Guard | None = None) -> int:
        if guard is None:
            resp = self._call(f"put {key}", lambda: self._client.put(key, value, lease=lease or None))
            return int(resp.header.revision)
        ok, responses = self._txn(f"guarded put {key}", _guard_compares(guard),
                                  [etcd_txn.Put(key, value, lease=lease or None)], [etcd_txn.Get(guard.key)])
        if not ok:
            raise self._fenced(guard, key, responses[0]) or FencedError(guard.node, key, "the guard failed")
        return int(responses[0].response_put.header.revision)

    def create(self, key: str, value: bytes, lease: int = 0, *, guard: Guard | None = None) -> tuple[bool, KeyValue]:
        compare = [etcd_txn.Create(key) == 0, *(_guard_compares(guard) if guard is not None else [])]
        failure = [etcd_txn.Get(key)] + ([etcd_txn.Get(guard.key)] if guard is not None else [])
        ok, responses = self._txn(f"create {key}", compare,
                                  [etcd_txn.Put(key, value, lease=lease or None), etcd_txn.Get(key)], failure)
        if not ok and guard is not None:
            fenced = self._fenced(guard, key, responses[1])
            if fenced is not None:
                raise fenced
        rows = responses[-1] if ok else responses[0]
        if not rows:  # the compare failed on a key that does not exist: only a failed guard can do that
            raise StoreError(f"create {key}: the transaction failed and returned no value")
        stored, meta = rows[0]
        return bool(ok), KeyValue(
            key=key,
            value=bytes(stored),
            create_revision=int(meta.create_revision),
            mod_revision=int(meta.mod_revision),
            lease=int(meta.lease_id),
        )

    def put_and_get(self, key: str, value: bytes, lease: int = 0) -> KeyValue | None:
        """Put `value` at `key` and read it back in one transaction (one request: a registration's write and
        the create revision it fences with); None only if the key is gone in the same revision (never)."""
        ok, responses = self._txn(f"put {key}", [], [etcd_txn.Put(key, value, lease=lease or None),
                                                    etcd_txn.Get(key)], [])
        rows = responses[-1] if ok else []
        if not rows:
            return None
        stored, meta = rows[0]
        return KeyValue(key=key, value=bytes(stored), create_revision=int(meta.create_revision),
                        mod_revision=int(meta.mod_revision), lease=int(meta.lease_id))

    def compare_and_swap(
        self, key: str, value: bytes, expected_mod_revision: int, *, guard: Guard | None = None
    ) -> int | None:
        compare = [
            etcd_txn.Create(key) == 0 if expected_mod_revision == 0 else etcd_txn.Mod(key) == expected_mod_revision,
            *(_guard_compares(guard) if guard is not None else []),
        ]
        failure = [etcd_txn.Get(guard.key)] if guard is not None else []
        ok, responses = self._txn(f"compare-and-swap {key}", compare, [etcd_txn.Put(key, value)], failure)
        if not ok:
            if guard is not None:
                fenced = self._fenced(guard, key, responses[0])
                if fenced is not None:
                    raise fenced
            return None
        return int(responses[0].response_put.header.revision)

    def delete(self, key: str, *, guard: Guard | None = None) -> bool:
        if guard is None:
            return bool(self._call(f"delete {key}", lambda: self._client.delete(key)))
        ok, responses = self._txn(f"guarded delete {key}", _guard_compares(guard), [etcd_txn.Delete(key)],
                                  [etcd_txn.Get(guard.key)])
        if not ok:
            raise self._fenced(guard, key, responses[0]) or FencedError(guard.node, key, "the guard failed")
        return int(responses[0].response_delete_range.deleted) > 0

    def delete_prefix(self, prefix: str) -> int:
        resp = self._call(f"delete prefix {prefix}", lambda: self._client.delete_prefix(prefix))
        return int(resp.deleted)

    def compact(self, revision: int) -> None:
        """Drop etcd's history before `revision` (physically). Watches older than it relist (see `PrefixWatch`)."""
        self._call(f"compact {revision}", lambda: self._client.compact(revision, physical=True))

    # -- leases ----------------------------------------------------------------------------------

    def grant_lease(self, ttl: int) -> int:
        if ttl < 1:
            raise ValueError(f"lease TTL must be at least 1 s, got {ttl!r}")
        lease = self._call(f"grant lease ttl={ttl}", lambda: self._client.lease(ttl))
        return int(lease.id)

    def refresh_lease(self, lease_id: int) -> int:
        """Refresh on the client's one keepalive stream (`bamboo.membership.streams.KeepAliveStream`)."""
        return self._call(f"refresh lease {lease_id:x}", lambda: self._keepalive.refresh(lease_id))

    def revoke_lease(self, lease_id: int) -> None:
        try:
            self._call(f"revoke lease {lease_id:x}", lambda: self._client.revoke_lease(lease_id))
        except StoreError as exc:
            if "not found" not in str(exc):
                raise

    # -- watches ---------------------------------------------------------------------------------

    def watch_prefix(
        self, prefix: str, callback: Callable[[WatchEvent], None], start_revision: int | None = None, *,
        snapshot: list[KeyValue] | None = None, puts_only: bool = False,
    ) -> PrefixWatch:
        """Watch `prefix` (see `PrefixWatch`). Raises `StoreUnavailableError` if the watch cannot be set up
        within `options.watch_start_timeout`. `snapshot`, with `start_revision`, is what the caller read of the
        prefix at `start_revision - 1` (`range_at`): the watch then does not read it again. `puts_only`: etcd
        sends writes only, never deletions (see `bamboo.membership.watch`)."""
        watch = PrefixWatch(self, prefix, callback, start_revision, snapshot=snapshot, puts_only=puts_only)
        watch.start()
        return watch

    def watch_stream(self) -> WatchStream:
        """The one stream every watch of this client shares (made on first use)."""
        with self._lock:
            if self._watches is None:
                self._watches = WatchStream(self)
            return self._watches

    def status(self) -> EtcdStatus:
        """The version, revision and database size of the etcd member this client reaches."""
        def status() -> Any:
            client = self._client
            return client.maintenancestub.Status(etcdrpc.StatusRequest(), self.options.timeout,
                                                 credentials=client.call_credentials, metadata=client.metadata)

        resp = self._call("status", status)
        return EtcdStatus(version=str(resp.version), revision=int(resp.header.revision), db_size=int(resp.dbSize))

    def defragment(self) -> None:
        """Give the space that compaction freed in etcd's database file back to the file system."""
        self._call("defragment", lambda: self._client.defragment())

    def close(self) -> None:
        self._closed = True
        if self._watches is not None:
            self._watches.close()
        self._keepalive.close()
        # On a thread of its own, bounded: a channel whose call a signal handler's exception cut short can wait
        # forever in its close (ETCD_CLOSE_TIMEOUT_S); the daemon thread then does not keep the program alive.
        closer = threading.Thread(target=self._close_client, name="bamboo-etcd-close", daemon=True)
        closer.start()
        closer.join(self.options.close_timeout)
        if closer.is_alive():
            log.warning("the etcd client's channel did not close within %.1f s (a call interrupted by a signal, "
                        "grpc/grpc#19973); left open", self.options.close_timeout)

    def _close_client(self) -> None:
        with contextlib.suppress(Exception):
            self._client.close()

    def __enter__(self) -> EtcdKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
