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
- **watches that lose nothing**: each prefix watch has its own gRPC stream. After the stream breaks (etcd
  restarted, the network cut) it resumes from the revision after the last one it delivered, so no event
  is lost or delivered twice. If etcd compacted its history past that revision meanwhile, the watch
  relists the prefix and reconciles it against its own snapshot (key -> last value seen), as Kubernetes
  informers do: the callback gets synthetic PUT events (`relisted=True`) for keys that appeared or
  changed, and DELETE events for keys that vanished, in revision order, then the watch resumes from the
  relist's revision. A watch's first registration is retried within `watch_start_timeout`.

Timeouts (seconds, in `EtcdOptions`, defaults in `bamboo.membership.timeouts`): `timeout` bounds every
unary RPC and each attempt to create a watch (`ETCD_RPC_TIMEOUT_S`); `reconnect_backoff_min` and
`reconnect_backoff_max` bound gRPC's reconnect backoff (`ETCD_RECONNECT_BACKOFF_MIN_S`, `..._MAX_S`); `watch_retry_interval` is the pause between attempts to
re-create a broken watch (`WATCH_RETRY_INTERVAL_S`); `watch_start_timeout` bounds a watch's first
registration (`WATCH_START_TIMEOUT_S`).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs
import grpc
import pyetcd
from bamboo.membership import timeouts
from pyetcd import etcdrpc
from pyetcd import exceptions as etcd_exceptions
from pyetcd import transactions as etcd_txn
from pyetcd import utils as etcd_utils
from pyetcd.etcdrpc import kv_pb2

__all__ = [
    "EtcdKV",
    "EtcdOptions",
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


class StoreError(RuntimeError):
    """An etcd request failed for a reason other than unavailability (e.g. permission denied)."""


class StoreUnavailableError(StoreError):
    """etcd could not be reached, or did not answer within the request timeout."""


class FencedError(StoreError):
    """A guarded write was refused: the writer's node record is gone or belongs to a newer registration.

    The node was declared failed (its lease revoked or expired), or another process registered the same
    id since. It must not write to the job again; a process that comes back rejoins as a fresh node.
    """

    def __init__(self, node: str, key: str, detail: str) -> None:
        self.node = node
        self.key = key
        super().__init__(f"node {node!r} is fenced: the write to {key} was refused ({detail})")


def _check_endpoint(_: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError("EtcdOptions.endpoints must name at least one host:port")
    for endpoint in value:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"EtcdOptions.endpoints: {endpoint!r} is not host:port")


def _positive(_: object, attribute: attrs.Attribute[Any], value: float) -> None:
    if not value > 0:
        raise ValueError(f"EtcdOptions.{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class EtcdOptions:
    """How to reach etcd. User/password auth and TLS files are passed through to the client.

    `ca_cert` alone gives server-verified TLS; add `cert_cert` and `cert_key` for client certificates.
    Timeouts in seconds; see `bamboo.membership.timeouts` for what each bounds.
    """

    endpoints: tuple[str, ...] = attrs.field(converter=tuple, validator=_check_endpoint)
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    ca_cert: str | None = None
    cert_cert: str | None = None
    cert_key: str | None = None
    timeout: float = attrs.field(default=timeouts.ETCD_RPC_TIMEOUT_S, validator=_positive)
    reconnect_backoff_min: float = attrs.field(default=timeouts.ETCD_RECONNECT_BACKOFF_MIN_S, validator=_positive)
    reconnect_backoff_max: float = attrs.field(default=timeouts.ETCD_RECONNECT_BACKOFF_MAX_S, validator=_positive)
    watch_retry_interval: float = attrs.field(default=timeouts.WATCH_RETRY_INTERVAL_S, validator=_positive)
    watch_start_timeout: float = attrs.field(default=timeouts.WATCH_START_TIMEOUT_S, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if (self.user is None) != (self.password is None):
            raise ValueError(f"EtcdOptions: user and password go together (user={self.user!r}, password set: "
                             f"{self.password is not None})")
        if (self.cert_cert is None) != (self.cert_key is None):
            raise ValueError(f"EtcdOptions: cert_cert and cert_key go together (cert_cert={self.cert_cert!r}, "
                             f"cert_key={self.cert_key!r})")
        if self.cert_cert is not None and self.ca_cert is None:
            raise ValueError(f"EtcdOptions: a client certificate ({self.cert_cert!r}) needs ca_cert as well")


@attrs.frozen
class KeyValue:
    """One key as read from etcd, with its revisions and lease (0 when it has none)."""

    key: str
    value: bytes
    create_revision: int
    mod_revision: int
    lease: int = 0


def _positive_int(_: object, attribute: attrs.Attribute[Any], value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"Guard.{attribute.name} must be a positive integer, got {value!r}")


@attrs.frozen
class Guard:
    """What a guarded write checks in its transaction: the writer's node record still exists at `key`,
    with the create revision and the lease of the writer's registration.

    A revoked or expired lease deletes the record, and a new registration of the same id has a new lease
    (and, once the old record is gone, a new create revision), so either makes the comparison fail.
    `MembershipStore.register` returns a `Registration` whose `guard` is this.
    """

    node: str
    key: str
    create_revision: int = attrs.field(validator=_positive_int)
    lease: int = attrs.field(validator=_positive_int)


class EventKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@attrs.frozen
class WatchEvent:
    """A change under a watched prefix. `prev_value` is the value before the change, when known.

    `relisted` marks an event made up by a relist after etcd compacted past the watch's revision: a PUT
    carries the key's current value and mod revision; a DELETE carries the relist's revision (or the
    re-created key's create revision), an upper bound of when the key went away.
    """

    kind: EventKind
    key: str
    value: bytes
    revision: int
    prev_value: bytes | None = None
    relisted: bool = False


class WatchHandle(Protocol):
    def cancel(self) -> None: ...


@runtime_checkable
class KeyValueStore(Protocol):
    """The operations bamboo.membership needs. Keys are str, values bytes, revisions etcd's.

    Writes take an optional `guard`: the write happens only if the guard holds, in the same transaction;
    otherwise `FencedError` is raised and nothing is written.
    """

    def get(self, key: str) -> KeyValue | None: ...

    def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    def put(self, key: str, value: bytes, lease: int = 0, *, guard: Guard | None = None) -> int:
        """Write unconditionally (but for the guard); returns the new revision."""
        ...

    def create(self, key: str, value: bytes, lease: int = 0, *, guard: Guard | None = None) -> tuple[bool, KeyValue]:
        """First writer wins: write only if the key does not exist (create revision 0).

        Returns (True, what was written) or (False, what was already there).
        """
        ...

    def compare_and_swap(
        self, key: str, value: bytes, expected_mod_revision: int, *, guard: Guard | None = None
    ) -> int | None:
        """Write only if the key's mod revision is `expected_mod_revision` (0: the key must not exist).

        Returns the new mod revision, or None when the comparison failed.
        """
        ...

    def delete(self, key: str, *, guard: Guard | None = None) -> bool: ...

    def delete_prefix(self, prefix: str) -> int: ...

    def grant_lease(self, ttl: int) -> int: ...

    def refresh_lease(self, lease_id: int) -> int:
        """Keep a lease alive; returns its remaining TTL in seconds, 0 when it has expired."""
        ...

    def revoke_lease(self, lease_id: int) -> None: ...

    def watch_prefix(
        self, prefix: str, callback: Callable[[WatchEvent], None], start_revision: int | None = None
    ) -> WatchHandle:
        """Call `callback` for every change under `prefix` from `start_revision` (default: now on)."""
        ...

    def revision(self) -> int:
        """The store's current revision."""
        ...

    def close(self) -> None: ...


_UNAVAILABLE = (
    etcd_exceptions.ConnectionFailedError,
    etcd_exceptions.ConnectionTimeoutError,
    etcd_exceptions.NoServerAvailableError,
    etcd_exceptions.InternalServerError,
    etcd_exceptions.WatchTimedOut,
)
_UNAVAILABLE_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.INTERNAL}


def _kv(kv: Any) -> KeyValue:
    return KeyValue(
        key=kv.key.decode(),
        value=bytes(kv.value),
        create_revision=int(kv.create_revision),
        mod_revision=int(kv.mod_revision),
        lease=int(kv.lease),
    )


class _LeaseIs(etcd_txn.BaseCompare):
    """Compare a key's lease id (pyetcd has no helper for etcd's LEASE compare target)."""

    def build_compare(self, compare: Any) -> None:
        compare.target = etcdrpc.Compare.LEASE
        compare.lease = int(self.value)


def _guard_compares(guard: Guard) -> list[Any]:
    return [etcd_txn.Create(guard.key) == guard.create_revision, _LeaseIs(guard.key) == guard.lease]


class _RevisionOutOfRange(Exception):
    """A read at a revision etcd no longer has (compacted) or does not have yet (future)."""

    def __init__(self, compacted: bool, detail: str) -> None:
        self.compacted = compacted
        super().__init__(detail)


class EtcdKV:
    """`KeyValueStore` over a real etcd v3 server, through `pyetcd`."""

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self.reauthentications = 0
        self._client = self._connect()
        self._closed = False

    @property
    def where(self) -> str:
        return ", ".join(self.options.endpoints)

    def _connect(self) -> pyetcd.MultiEndpointEtcd3Client:
        opts = self.options
        backoff_ms = int(opts.reconnect_backoff_max * 1000)
        first_ms = min(int(opts.reconnect_backoff_min * 1000), backoff_ms)
        grpc_options = [
            ("grpc.initial_reconnect_backoff_ms", first_ms),
            ("grpc.min_reconnect_backoff_ms", first_ms),
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

    def _reauthenticate(self, stale: pyetcd.MultiEndpointEtcd3Client) -> None:
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
                    self._reauthenticate(client)
                    continue
                raise self._translate(exc, what) from exc
            except (etcd_exceptions.Etcd3Exception, ValueError) as exc:
                raise self._translate(exc, what) from exc
        raise AssertionError("unreachable")

    # -- reads -----------------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        resp = self._call(f"get {key}", lambda: self._client.get_response(key))
        return _kv(resp.kvs[0]) if resp.count else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        resp = self._call(f"get prefix {prefix}", lambda: self._client.get_prefix_response(prefix))
        return [_kv(kv) for kv in resp.kvs]

    def _range(self, prefix: str, revision: int | None = None) -> tuple[list[KeyValue], int]:
        """Every key under `prefix` (at `revision`, default now) and the revision read at.

        Raises `_RevisionOutOfRange` when etcd compacted `revision` away or has not reached it yet.
        """

        def read() -> Any:
            kwargs = {} if revision is None else {"revision": revision}
            try:
                return self._client.get_prefix_response(prefix, **kwargs)
            except grpc.RpcError as exc:
                if exc.code() == grpc.StatusCode.OUT_OF_RANGE:
                    detail = exc.details() or ""
                    return _RevisionOutOfRange("compacted" in detail, detail)
                raise

        resp = self._call(f"list {prefix}" + ("" if revision is None else f" at revision {revision}"), read)
        if isinstance(resp, _RevisionOutOfRange):
            raise resp
        return [_kv(kv) for kv in resp.kvs], int(resp.header.revision)

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
        responses = self._call(f"refresh lease {lease_id:x}", lambda: list(self._client.refresh_lease(lease_id)))
        return max((int(r.TTL) for r in responses), default=0)

    def revoke_lease(self, lease_id: int) -> None:
        try:
            self._call(f"revoke lease {lease_id:x}", lambda: self._client.revoke_lease(lease_id))
        except StoreError as exc:
            if "not found" not in str(exc):
                raise

    # -- watches ---------------------------------------------------------------------------------

    def watch_prefix(
        self, prefix: str, callback: Callable[[WatchEvent], None], start_revision: int | None = None
    ) -> PrefixWatch:
        """Watch `prefix` (see `PrefixWatch`). Raises `StoreUnavailableError` if the watch cannot be set up
        within `options.watch_start_timeout`."""
        watch = PrefixWatch(self, prefix, callback, start_revision)
        watch.start()
        return watch

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self._client.close()

    def __enter__(self) -> EtcdKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PrefixWatch:
    """A prefix watch on its own gRPC stream that survives etcd restarts and compaction.

    Callbacks run on one thread per watch, in revision order. An exception in a callback is logged and the
    watch goes on. The watch keeps a snapshot of the keys under its prefix (key -> last `KeyValue` seen):
    after a broken stream it resumes from the revision after the last one delivered; if etcd compacted
    past that revision, it relists the prefix and delivers the difference against the snapshot as
    synthetic events (`WatchEvent.relisted`), then resumes from the relist's revision.

    Counters for tests and logs: `reconnects` (streams re-created after the first), `relists`,
    `list_failures` (failed attempts at the starting list), `create_timeouts` (attempts to create the
    stream that got no answer within the RPC timeout).
    """

    def __init__(
        self, kv: EtcdKV, prefix: str, callback: Callable[[WatchEvent], None], start_revision: int | None
    ) -> None:
        self._kv = kv
        self.prefix = prefix
        self._range_end = etcd_utils.prefix_range_end(prefix.encode())
        self._callback = callback
        self._start_revision = start_revision
        self._next_revision = 0
        self._snapshot: dict[str, KeyValue] | None = {}
        self._needs_relist = False
        self._lock = threading.Lock()
        self._call: Any = None
        self._cancelled = threading.Event()
        self._created = threading.Event()
        self._ever_created = False
        self._last_error = "no attempt finished yet"
        self._thread = threading.Thread(target=self._run, name=f"bamboo-watch{prefix}", daemon=True)
        self.reconnects = 0
        self.relists = 0
        self.list_failures = 0
        self.create_timeouts = 0

    # -- start -----------------------------------------------------------------------------------

    def start(self) -> None:
        """Read the starting snapshot and create the stream, retrying both within `watch_start_timeout`."""
        bound = self._kv.options.watch_start_timeout
        deadline = time.monotonic() + bound
        while True:
            try:
                self._load_snapshot()
                break
            except StoreUnavailableError as exc:
                self._last_error = str(exc)
                self.list_failures += 1
                if time.monotonic() + self._kv.options.watch_retry_interval >= deadline:
                    raise self._start_failed(bound) from exc
                log.debug("watch %s: initial list failed (%s); retrying", self.prefix, exc)
                time.sleep(self._kv.options.watch_retry_interval)
        self._thread.start()
        if not self._created.wait(max(0.0, deadline - time.monotonic())):
            self.cancel()
            raise self._start_failed(bound)

    def _start_failed(self, bound: float) -> StoreUnavailableError:
        return StoreUnavailableError(
            f"watch on {self.prefix} at etcd {self._kv.where} could not be set up within {bound} s "
            f"(watch_start_timeout; each attempt bounded by the {self._kv.options.timeout} s RPC timeout); "
            f"last error: {self._last_error}"
        )

    def _load_snapshot(self) -> None:
        if self._start_revision is None:
            kvs, revision = self._kv._range(self.prefix)
            self._snapshot = {kv.key: kv for kv in kvs}
            self._next_revision = revision + 1
            return
        self._next_revision = self._start_revision
        if self._start_revision <= 1:
            self._snapshot = {}
            return
        try:
            kvs, _ = self._kv._range(self.prefix, self._start_revision - 1)
        except _RevisionOutOfRange as exc:
            if exc.compacted:
                # The stream will be told it is compacted and relist; deletions before then cannot be known.
                self._snapshot = None
                return
            kvs, _ = self._kv._range(self.prefix)  # a start in the future: what exists now precedes it
        self._snapshot = {kv.key: kv for kv in kvs}

    # -- the stream ------------------------------------------------------------------------------

    def _run(self) -> None:
        retry = self._kv.options.watch_retry_interval
        while not self._cancelled.is_set() and not self._kv._closed:
            if self._needs_relist:
                try:
                    self._relist()
                except (StoreError, _RevisionOutOfRange) as exc:
                    self._last_error = str(exc)
                    log.debug("watch %s: relist failed (%s); retrying", self.prefix, exc)
                    self._cancelled.wait(retry)
                    continue
            if self._stream_once() == "compacted":
                self._needs_relist = True
                continue
            if self._cancelled.is_set() or self._kv._closed:
                break
            self._cancelled.wait(retry)
        log.debug("watch %s ends", self.prefix)

    def _stream_once(self) -> str:
        """One watch stream from `_next_revision`: 'compacted', or 'broken' when it ended for another reason."""
        client = self._kv._client
        try:
            stub = etcdrpc.WatchStub(client.channel)
        except (etcd_exceptions.Etcd3Exception, ValueError) as exc:
            self._last_error = f"no etcd endpoint: {exc}"
            return "broken"
        request = etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
            key=self.prefix.encode(), range_end=self._range_end, start_revision=self._next_revision, prev_kv=True))
        # One request, then the request side half-closes; etcd keeps the watch open until we cancel.
        try:
            call = stub.Watch(iter([request]), credentials=client.call_credentials, metadata=client.metadata)
        except (ValueError, grpc.RpcError) as exc:  # the channel was closed under us
            self._last_error = f"cannot open the watch stream: {exc}"
            return "broken"
        with self._lock:
            self._call = call
        if self._cancelled.is_set():
            call.cancel()
        created = threading.Event()
        timed_out = threading.Event()

        def create_timed_out() -> None:
            if not created.is_set():
                timed_out.set()
                call.cancel()

        timer = threading.Timer(self._kv.options.timeout, create_timed_out)
        timer.daemon = True
        timer.start()
        try:
            for response in call:
                if response.created and not created.is_set():
                    created.set()
                    timer.cancel()
                if response.compact_revision:
                    log.warning("watch %s: etcd compacted its history to revision %d, past revision %d that the "
                                "watch resumes from; relisting", self.prefix, response.compact_revision,
                                self._next_revision)
                    return "compacted"
                if response.canceled:
                    self._last_error = f"etcd cancelled the watch: {response.cancel_reason or 'no reason given'}"
                    log.warning("watch %s: %s", self.prefix, self._last_error)
                    if self._kv.options.user is not None:
                        self._kv._reauthenticate(client)  # a stale token makes etcd refuse the watch
                    return "broken"
                if response.created:
                    if self._ever_created:
                        self.reconnects += 1
                    self._ever_created = True
                    self._created.set()
                self._deliver(response.events)
            self._last_error = "the watch stream ended"
            return "broken"
        except grpc.RpcError as exc:
            if timed_out.is_set():
                self.create_timeouts += 1
                self._last_error = f"no answer to the watch request within {self._kv.options.timeout} s"
                log.warning("watch %s: %s; retrying", self.prefix, self._last_error)
            elif not self._cancelled.is_set() and not self._kv._closed:
                self._last_error = f"{exc.code()}: {exc.details()}"
                log.debug("watch %s: stream broke (%s); resuming from revision %d", self.prefix,
                          self._last_error, self._next_revision)
            return "broken"
        finally:
            timer.cancel()
            call.cancel()
            with self._lock:
                self._call = None

    def _deliver(self, raw_events: Any) -> None:
        last = None
        for raw in raw_events:
            revision = int(raw.kv.mod_revision)
            if revision < self._next_revision:
                continue  # already delivered before a reconnect
            last = revision if last is None else max(last, revision)
            key = raw.kv.key.decode()
            known = self._snapshot.get(key) if self._snapshot is not None else None
            prev = bytes(raw.prev_kv.value) if raw.HasField("prev_kv") else (known.value if known else None)
            if raw.type == kv_pb2.Event.DELETE:
                event = WatchEvent(EventKind.DELETE, key, bytes(raw.kv.value), revision, prev)
                if self._snapshot is not None:
                    self._snapshot.pop(key, None)
            else:
                event = WatchEvent(EventKind.PUT, key, bytes(raw.kv.value), revision, prev)
                if self._snapshot is not None:
                    self._snapshot[key] = _kv(raw.kv)
            self._safe_callback(event)
        if last is not None:
            self._next_revision = last + 1

    def _relist(self) -> None:
        """Reconcile the snapshot with the prefix as it is now, deliver the difference, resume after it."""
        kvs, revision = self._kv._range(self.prefix)
        current = {kv.key: kv for kv in kvs}
        old = self._snapshot
        events: list[WatchEvent] = []
        if old is None:
            log.warning("watch %s: the history before its start revision %d was compacted; keys deleted before "
                        "the relist at %d cannot be reported", self.prefix, self._next_revision, revision)
            old = {}
        for key, before in old.items():
            now = current.get(key)
            if now is None:
                events.append(WatchEvent(EventKind.DELETE, key, b"", revision, before.value, relisted=True))
            elif now.create_revision != before.create_revision:  # deleted, then created again
                events.append(WatchEvent(EventKind.DELETE, key, b"", now.create_revision, before.value,
                                         relisted=True))
        for key, now in current.items():
            if now.mod_revision < self._next_revision:
                continue  # unchanged since it was delivered (or since before the watch started)
            before = old.get(key)
            prev = before.value if before is not None and before.create_revision == now.create_revision else None
            events.append(WatchEvent(EventKind.PUT, key, now.value, now.mod_revision, prev, relisted=True))
        events.sort(key=lambda e: (e.revision, e.kind is EventKind.PUT, e.key))
        log.warning("watch %s: relisted at revision %d after missing revisions from %d: %d changes delivered",
                    self.prefix, revision, self._next_revision, len(events))
        self._snapshot = current
        self._next_revision = revision + 1
        self._needs_relist = False
        self.relists += 1
        for event in events:
            self._safe_callback(event)

    def _safe_callback(self, event: WatchEvent) -> None:
        if self._cancelled.is_set():
            return
        try:
            self._callback(event)
        except Exception:
            log.exception("watch callback for %s failed on %s", self.prefix, event)

    def cancel(self) -> None:
        self._cancelled.set()
        with self._lock:
            call = self._call
        if call is not None:
            call.cancel()
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout=timeouts.THREAD_JOIN_TIMEOUT_S)
