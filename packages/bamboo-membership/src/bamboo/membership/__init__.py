"""bamboo.membership: who is alive, who failed, and what the cluster decided, kept in a real etcd v3.

- `EtcdKV` / `KeyValueStore`: our small interface to etcd (the client library can be swapped);
  `EtcdOptions` carries endpoints, user/password auth, TLS files and timeouts. Writes can carry a
  `Guard` (the writer's registration), checked in the same transaction (`FencedError` when it fails);
  watches resume after etcd restarts and relist after compaction, so no change is lost; every watch of
  a client shares one etcd stream, every lease refresh one keepalive stream. `WatchedKey`: one key read
  once, then followed by a watch (no request per read); `WatchedPrefix` the same for a prefix; every
  follower of one key or prefix on a client shares one read and one watch.
- `EmbeddedEtcd`: a real etcd on free loopback ports with its own data dir, stopped by PID,
  restartable on the same data dir (tests and the launcher use it).
- `MembershipStore`: node records under leases kept alive in the background (`Registration`),
  watches, the membership epoch, failure reports (one per node per epoch), first-writer-wins
  decisions, and the layout with compare-and-swap on its revision. Keys live under `/bamboo/<job>/`.
  `store.fenced(registration)` guards every write by the node's registration.
- `FailureDetector`: neighbour reports confirmed by gRPC probes (with a grace period for slow nodes),
  parallel probe sweeps (`probe_all`) and lease expiry, emitted as `NodeFailed(node, epoch,
  detected_by, reason)` once per node per epoch; the winner of a report revokes the node's lease. The records it
  follows are handed out as an immutable, versioned `MembershipView` (rebuilt only after a change).
- `NodeAgent`: one per node, the gRPC `Agent` service (Probe, Notify, ReportPeerFailure, Subscribe),
  mutual TLS or a job token beyond loopback, SIGTERM and cloud preemption notices (`bamboo.membership.cloud`:
  `AwsSpotNotice`, `GcePreemptionNotice`). `python -m bamboo.membership --help`.
  `AgentClient` is the worker's side: report a peer's failure, receive `NodeFailed` and notices.
- `bamboo.membership.timeouts`: every timeout and poll interval of the package, documented.
- `EtcdStore`: a `torch.distributed.Store` over etcd (loaded lazily; needs the `torch` extra).

Nothing here imports torch at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bamboo.membership import timeouts
from bamboo.membership.agent import (
    TOKEN_METADATA_KEY,
    AgentClient,
    GrpcProber,
    NodeAgent,
    TlsFiles,
    load_token,
)
from bamboo.membership.cloud import AwsSpotNotice, GcePreemptionNotice, MetadataError, preemption_hook
from bamboo.membership.detector import DetectorConfig, FailureDetector, ProbeOutcome, ProbeResult, SweepResult
from bamboo.membership.embedded import EmbeddedEtcd, EtcdStartError
from bamboo.membership.kv import (
    EtcdKV,
    EtcdOptions,
    EtcdStatus,
    EventKind,
    FencedError,
    Guard,
    KeyValue,
    KeyValueStore,
    StoreError,
    StoreUnavailableError,
    WatchEvent,
)
from bamboo.membership.members import MembershipView
from bamboo.membership.records import (
    FailureReport,
    MalformedValueError,
    NodeFailed,
    NodeRecord,
    NodeState,
    PreemptionNotice,
)
from bamboo.membership.store import Decision, JobKeys, Layout, MembershipStore, Registration
from bamboo.membership.watched import WatchedKey, WatchedPrefix

if TYPE_CHECKING:
    from bamboo.membership.c10d_store import EtcdStore, c10d_prefix

__all__ = [
    "TOKEN_METADATA_KEY",
    "AgentClient",
    "AwsSpotNotice",
    "Decision",
    "DetectorConfig",
    "EmbeddedEtcd",
    "EtcdKV",
    "EtcdOptions",
    "EtcdStartError",
    "EtcdStatus",
    "EtcdStore",
    "EventKind",
    "FailureDetector",
    "FailureReport",
    "FencedError",
    "GcePreemptionNotice",
    "GrpcProber",
    "Guard",
    "JobKeys",
    "KeyValue",
    "KeyValueStore",
    "Layout",
    "MalformedValueError",
    "MembershipStore",
    "MembershipView",
    "MetadataError",
    "NodeAgent",
    "NodeFailed",
    "NodeRecord",
    "NodeState",
    "PreemptionNotice",
    "ProbeOutcome",
    "ProbeResult",
    "Registration",
    "StoreError",
    "StoreUnavailableError",
    "SweepResult",
    "TlsFiles",
    "WatchEvent",
    "WatchedKey",
    "WatchedPrefix",
    "c10d_prefix",
    "load_token",
    "preemption_hook",
    "timeouts",
]

_LAZY_TORCH = {"EtcdStore", "c10d_prefix"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_TORCH:
        from bamboo.membership import c10d_store

        return getattr(c10d_store, name)
    raise AttributeError(f"module 'bamboo.membership' has no attribute {name!r}")
