"""The small key-value interface that bamboo.membership needs from etcd, and its etcd v3 implementation.

Everything above this module talks to `KeyValueStore`, never to the etcd client library, so the client
(`etcd-sdk-python`, imported as `pyetcd`) could be swapped. `EtcdKV` implements it and adds what the
membership store relies on:

- every error from the client becomes `StoreUnavailableError` (etcd unreachable or timed out) or
  `StoreError`, so callers need not know pyetcd's exceptions;
- the endpoint is never blacklisted after a failure (pyetcd would refuse to use it for 300 s), and gRPC
  reconnects with a short backoff, so clients come back soon after etcd restarts;
- prefix watches resume from the last revision they delivered after the stream breaks (etcd restarted),
  so no event is lost or delivered twice.

Timeouts (seconds, in `EtcdOptions`): `timeout` bounds every unary RPC (default 5);
`reconnect_backoff_max` caps gRPC's reconnect backoff (default 1); `watch_retry_interval` is the pause
between attempts to re-create a broken watch (default 0.2).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any, Protocol, TypeVar, runtime_checkable

import attrs
import grpc
import pyetcd
from pyetcd import exceptions as etcd_exceptions
from pyetcd import transactions as etcd_txn

__all__ = [
    "EtcdKV",
    "EtcdOptions",
    "EventKind",
    "KeyValue",
    "KeyValueStore",
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
    """

    endpoints: tuple[str, ...] = attrs.field(converter=tuple, validator=_check_endpoint)
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    ca_cert: str | None = None
    cert_cert: str | None = None
    cert_key: str | None = None
    timeout: float = attrs.field(default=5.0, validator=_positive)
    reconnect_backoff_max: float = attrs.field(default=1.0, validator=_positive)
    watch_retry_interval: float = attrs.field(default=0.2, validator=_positive)

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


class EventKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@attrs.frozen
class WatchEvent:
    """A change under a watched prefix. `prev_value` is the value before the change, when etcd kept it."""

    kind: EventKind
    key: str
    value: bytes
    revision: int
    prev_value: bytes | None = None


class WatchHandle(Protocol):
    def cancel(self) -> None: ...


@runtime_checkable
class KeyValueStore(Protocol):
    """The operations bamboo.membership needs. Keys are str, values bytes, revisions etcd's."""

    def get(self, key: str) -> KeyValue | None: ...

    def get_prefix(self, prefix: str) -> list[KeyValue]: ...

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        """Write unconditionally; returns the new revision."""
        ...

    def create(self, key: str, value: bytes, lease: int = 0) -> tuple[bool, KeyValue]:
        """First writer wins: write only if the key does not exist (create revision 0).

        Returns (True, what was written) or (False, what was already there).
        """
        ...

    def compare_and_swap(self, key: str, value: bytes, expected_mod_revision: int) -> int | None:
        """Write only if the key's mod revision is `expected_mod_revision` (0: the key must not exist).

        Returns the new mod revision, or None when the comparison failed.
        """
        ...

    def delete(self, key: str) -> bool: ...

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


class EtcdKV:
    """`KeyValueStore` over a real etcd v3 server, through `pyetcd`."""

    def __init__(self, options: EtcdOptions) -> None:
        self.options = options
        self._lock = threading.Lock()
        self.reauthentications = 0
        self._client = self._connect()
        self._closed = False

    def _connect(self) -> pyetcd.MultiEndpointEtcd3Client:
        opts = self.options
        backoff_ms = int(opts.reconnect_backoff_max * 1000)
        grpc_options = [
            ("grpc.initial_reconnect_backoff_ms", min(100, backoff_ms)),
            ("grpc.min_reconnect_backoff_ms", min(100, backoff_ms)),
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
        where = ", ".join(self.options.endpoints)
        if isinstance(exc, _UNAVAILABLE):
            return StoreUnavailableError(f"etcd at {where} unavailable during {what}: {type(exc).__name__}")
        if isinstance(exc, grpc.RpcError):
            code = exc.code() if hasattr(exc, "code") else None
            detail = exc.details() if hasattr(exc, "details") else str(exc)
            if code in _UNAVAILABLE_CODES:
                return StoreUnavailableError(f"etcd at {where} unavailable during {what}: {code}: {detail}")
            return StoreError(f"etcd at {where} refused {what}: {code}: {detail}")
        return StoreError(f"etcd at {where} failed {what}: {type(exc).__name__}: {exc}")

    def _call(self, what: str, fn: Callable[[], T]) -> T:
        """Run one client call; reauthenticate once if etcd forgot our token (it does on restart)."""
        for attempt in (0, 1):
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
                    with self._lock:
                        old, self._client = self._client, self._connect()
                        self.reauthentications += 1
                    with contextlib.suppress(Exception):
                        old.close()  # its watch stream ends; PrefixWatch re-watches on the new client
                    continue
                raise self._translate(exc, what) from exc
            except etcd_exceptions.RevisionCompactedError:
                raise
            except (etcd_exceptions.Etcd3Exception, ValueError) as exc:
                raise self._translate(exc, what) from exc
        raise AssertionError("unreachable")

    # -- reads and writes ------------------------------------------------------------------------

    def get(self, key: str) -> KeyValue | None:
        resp = self._call(f"get {key}", lambda: self._client.get_response(key))
        return _kv(resp.kvs[0]) if resp.count else None

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        resp = self._call(f"get prefix {prefix}", lambda: self._client.get_prefix_response(prefix))
        return [_kv(kv) for kv in resp.kvs]

    def put(self, key: str, value: bytes, lease: int = 0) -> int:
        resp = self._call(f"put {key}", lambda: self._client.put(key, value, lease=lease or None))
        return int(resp.header.revision)

    def create(self, key: str, value: bytes, lease: int = 0) -> tuple[bool, KeyValue]:
        ok, responses = self._call(
            f"create {key}",
            lambda: self._client.transaction(
                compare=[etcd_txn.Create(key) == 0],
                success=[etcd_txn.Put(key, value, lease=lease or None), etcd_txn.Get(key)],
                failure=[etcd_txn.Get(key)],
            ),
        )
        rows = responses[-1]
        if not rows:  # deleted between the compare and the read (cannot happen inside one txn)
            raise StoreError(f"create {key}: the transaction returned no value")
        stored, meta = rows[0]
        return bool(ok), KeyValue(
            key=key,
            value=bytes(stored),
            create_revision=int(meta.create_revision),
            mod_revision=int(meta.mod_revision),
            lease=int(meta.lease_id),
        )

    def compare_and_swap(self, key: str, value: bytes, expected_mod_revision: int) -> int | None:
        compare = (
            etcd_txn.Create(key) == 0 if expected_mod_revision == 0 else etcd_txn.Mod(key) == expected_mod_revision
        )
        ok, responses = self._call(
            f"compare-and-swap {key}",
            lambda: self._client.transaction(compare=[compare], success=[etcd_txn.Put(key, value)], failure=[]),
        )
        if not ok:
            return None
        return int(responses[0].response_put.header.revision)

    def delete(self, key: str) -> bool:
        return bool(self._call(f"delete {key}", lambda: self._client.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        resp = self._call(f"delete prefix {prefix}", lambda: self._client.delete_prefix(prefix))
        return int(resp.deleted)

    def revision(self) -> int:
        resp = self._call("status", lambda: self._client.get_response("/"))
        return int(resp.header.revision)

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
        watch = PrefixWatch(self, prefix, callback, start_revision)
        watch.start()
        return watch

    def _add_watch(self, prefix: str, on_response: Callable[[Any], None], start_revision: int) -> int:
        return self._call(
            f"watch {prefix}",
            lambda: self._client.add_watch_prefix_callback(
                prefix, on_response, start_revision=start_revision, prev_kv=True
            ),
        )

    def _cancel_watch(self, watch_id: int) -> None:
        with contextlib.suppress(StoreError):
            self._call("cancel watch", lambda: self._client.cancel_watch(watch_id))

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(Exception):
            self._client.close()

    def __enter__(self) -> EtcdKV:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class PrefixWatch:
    """A prefix watch that survives etcd restarts: it resumes from the revision after the last one delivered.

    Callbacks run on one thread per watch, in revision order. An exception in a callback is logged and the
    watch goes on.
    """

    def __init__(
        self, kv: EtcdKV, prefix: str, callback: Callable[[WatchEvent], None], start_revision: int | None
    ) -> None:
        self._kv = kv
        self.prefix = prefix
        self._callback = callback
        self._next_revision = start_revision
        self._cond = threading.Condition()
        self._pending: list[Any] = []
        self._broken = False
        self._cancelled = False
        self._watch_id: int | None = None
        self._thread = threading.Thread(target=self._run, name=f"bamboo-watch{prefix}", daemon=True)
        self.reconnects = 0

    def start(self) -> None:
        if self._next_revision is None:
            self._next_revision = self._kv.revision() + 1
        self._watch_id = self._kv._add_watch(self.prefix, self._on_response, self._next_revision)
        self._thread.start()

    def _on_response(self, response: Any) -> None:
        # Runs on pyetcd's shared watch thread: only queue, never call back into the client here.
        with self._cond:
            if response is None or isinstance(response, BaseException):
                self._broken = True  # the stream ended (etcd went away, or the client closed)
            else:
                self._pending.append(response)
            self._cond.notify_all()

    def _events(self, response: Any) -> Iterator[WatchEvent]:
        for event in response.events:
            kind = EventKind.DELETE if isinstance(event, pyetcd.events.DeleteEvent) else EventKind.PUT
            prev = bytes(event.prev_value) if event._event.HasField("prev_kv") else None
            yield WatchEvent(
                kind=kind,
                key=event.key.decode(),
                value=bytes(event.value),
                revision=int(event.mod_revision),
                prev_value=prev,
            )

    def _run(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._broken or self._cancelled):
                    self._cond.wait()
                if self._cancelled:
                    return
                pending, self._pending = self._pending, []
                broken = self._broken
            for response in pending:
                for event in self._events(response):
                    if self._next_revision is not None and event.revision < self._next_revision:
                        continue  # already delivered before a reconnect
                    self._next_revision = event.revision + 1
                    try:
                        self._callback(event)
                    except Exception:
                        log.exception("watch callback for %s failed on %s", self.prefix, event)
            if broken:
                self._rewatch()
                if self._kv._closed:
                    return

    def _rewatch(self) -> None:
        while not self._cancelled:
            if self._kv._closed:
                log.debug("watch %s: the client was closed; the watch ends", self.prefix)
                return
            try:
                assert self._next_revision is not None
                watch_id = self._kv._add_watch(self.prefix, self._on_response, self._next_revision)
            except etcd_exceptions.RevisionCompactedError as exc:
                log.warning("watch %s: revision %d compacted; resuming at %d, events between are lost",
                            self.prefix, self._next_revision, exc.compacted_revision)
                self._next_revision = exc.compacted_revision
                continue
            except StoreError as exc:
                log.debug("watch %s: re-watch failed (%s); retrying", self.prefix, exc)
                time.sleep(self._kv.options.watch_retry_interval)
                continue
            with self._cond:
                self._watch_id = watch_id
                self._broken = False
                self.reconnects += 1
            return

    def cancel(self) -> None:
        with self._cond:
            self._cancelled = True
            watch_id = self._watch_id
            self._cond.notify_all()
        if watch_id is not None and not self._kv._closed:
            self._kv._cancel_watch(watch_id)
        if threading.current_thread() is not self._thread and self._thread.is_alive():
            self._thread.join(timeout=5)
