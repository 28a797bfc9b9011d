"""The vocabulary of bamboo.membership's etcd interface: errors, options, values, events and the protocol.

`KeyValueStore` is what everything above `bamboo.membership.kv` talks to; `EtcdKV` (in `kv`) implements it
over etcd v3, and `bamboo.membership.watch` implements its watches. This module holds what they share, so
that neither imports the other's internals: the errors (`StoreError`, `StoreUnavailableError`,
`FencedError`), `EtcdOptions` (endpoints, auth, TLS files, timeouts), the values (`KeyValue`, `Guard`,
`WatchEvent`, `EventKind`) and the protocols (`KeyValueStore`, `WatchHandle`).
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from typing import Any, Protocol, runtime_checkable

import attrs
from bamboo.membership import timeouts

__all__ = [
    "RANGE_PAGE_KEYS",
    "EtcdConnection",
    "EtcdOptions",
    "EventKind",
    "FencedError",
    "Guard",
    "KeyValue",
    "KeyValueStore",
    "RevisionOutOfRange",
    "StoreError",
    "StoreUnavailableError",
    "WatchEvent",
    "WatchHandle",
    "key_value",
]


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


_POSITIVE = attrs.validators.gt(0)


def _check_endpoint(_: object, attribute: attrs.Attribute[Any], value: tuple[str, ...]) -> None:
    if not value:
        raise ValueError("EtcdOptions.endpoints must name at least one host:port")
    for endpoint in value:
        host, sep, port = endpoint.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"EtcdOptions.endpoints: {endpoint!r} is not host:port")


RANGE_PAGE_KEYS = 1000
"""How many keys one answer of a prefix read holds at most (`EtcdOptions.range_page`). gRPC refuses an answer over
4 MB: an event log of 30,000 step records was 5.3 MB in one answer, and its reader failed with
`RESOURCE_EXHAUSTED`. A thousand such records are about 180 kB."""


@attrs.frozen
class EtcdOptions:
    """How to reach etcd. User/password auth and TLS files are passed through to the client.

    `ca_cert` alone gives server-verified TLS; add `cert_cert` and `cert_key` for client certificates.
    Timeouts in seconds; see `bamboo.membership.timeouts` for what each bounds. `range_page`: how many keys one
    answer of a prefix read holds at most; a longer prefix is read in pages, all at one revision (see
    `RANGE_PAGE_KEYS`).
    """

    endpoints: tuple[str, ...] = attrs.field(converter=tuple, validator=_check_endpoint)
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    ca_cert: str | None = None
    cert_cert: str | None = None
    cert_key: str | None = None
    timeout: float = attrs.field(default=timeouts.ETCD_RPC_TIMEOUT_S, validator=_POSITIVE)
    reconnect_backoff_min: float = attrs.field(default=timeouts.ETCD_RECONNECT_BACKOFF_MIN_S, validator=_POSITIVE)
    reconnect_backoff_max: float = attrs.field(default=timeouts.ETCD_RECONNECT_BACKOFF_MAX_S, validator=_POSITIVE)
    watch_retry_interval: float = attrs.field(default=timeouts.WATCH_RETRY_INTERVAL_S, validator=_POSITIVE)
    watch_start_timeout: float = attrs.field(default=timeouts.WATCH_START_TIMEOUT_S, validator=_POSITIVE)
    close_timeout: float = attrs.field(default=timeouts.ETCD_CLOSE_TIMEOUT_S, validator=_POSITIVE)
    range_page: int = attrs.field(default=RANGE_PAGE_KEYS, validator=[attrs.validators.instance_of(int),
                                                                      attrs.validators.ge(1)])

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


_REVISION = attrs.validators.and_(attrs.validators.instance_of(int),
                                  attrs.validators.not_(attrs.validators.instance_of(bool)), attrs.validators.gt(0))
"""An etcd revision or lease id: an int (not a bool) > 0."""


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
    create_revision: int = attrs.field(validator=_REVISION)
    lease: int = attrs.field(validator=_REVISION)


class EventKind(enum.Enum):
    PUT = "put"
    DELETE = "delete"


@attrs.frozen
class WatchEvent:
    """A change under a watched prefix. `prev_value` is the value before the change, when known.

    `relisted` marks an event made up by a relist after etcd compacted past the watch's revision: a PUT
    carries the key's current value and mod revision; a DELETE carries the relist's revision (or the
    re-created key's create revision), an upper bound of when the key went away.
    A PUT also carries the key's `create_revision` and `lease` (0 on a DELETE).
    """

    kind: EventKind
    key: str
    value: bytes
    revision: int
    prev_value: bytes | None = None
    relisted: bool = False
    create_revision: int = 0
    lease: int = 0


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
        self, prefix: str, callback: Callable[[WatchEvent], None], start_revision: int | None = None, *,
        puts_only: bool = False,
    ) -> WatchHandle:
        """Call `callback` for every change under `prefix` from `start_revision` (default: now on); with
        `puts_only`, for every write and never for a deletion."""
        ...

    def revision(self) -> int:
        """The store's current revision."""
        ...

    def close(self) -> None: ...


def key_value(kv: Any) -> KeyValue:
    """A `KeyValue` from etcd's protobuf `KeyValue` message."""
    return KeyValue(
        key=kv.key.decode(),
        value=bytes(kv.value),
        create_revision=int(kv.create_revision),
        mod_revision=int(kv.mod_revision),
        lease=int(kv.lease),
    )


class RevisionOutOfRange(Exception):
    """A read at a revision etcd no longer has (compacted) or does not have yet (future)."""

    def __init__(self, compacted: bool, detail: str) -> None:
        self.compacted = compacted
        super().__init__(detail)


class EtcdConnection(Protocol):
    """What the stream modules (`bamboo.membership.watch`, `bamboo.membership.streams`) use of an `EtcdKV`,
    so that they need not import it: its options, its current etcd client and whether it is closed, its
    ranged read at a revision and its current revision, re-authentication, and its shared watch stream."""

    options: EtcdOptions

    @property
    def where(self) -> str: ...

    @property
    def client(self) -> Any: ...

    @property
    def closed(self) -> bool: ...

    def range_at(self, prefix: str, revision: int | None = None) -> tuple[list[KeyValue], int]: ...

    def revision(self) -> int: ...

    def reauthenticate(self, stale: Any) -> None: ...

    def watch_stream(self) -> Any: ...
