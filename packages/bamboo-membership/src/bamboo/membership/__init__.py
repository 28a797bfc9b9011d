"""bamboo.membership: who is alive, who failed, and what the cluster decided, kept in a real etcd v3.

- `EtcdKV` / `KeyValueStore`: our small interface to etcd (the client library can be swapped);
  `EtcdOptions` carries endpoints, user/password auth and TLS files.
- `EmbeddedEtcd`: a real etcd on free loopback ports with its own data dir, stopped by PID,
  restartable on the same data dir (tests and the launcher use it).
- `MembershipStore`: node records under leases kept alive in the background (`Registration`),
  watches, the membership epoch, failure reports (one per node per epoch), first-writer-wins
  decisions, and the layout with compare-and-swap on its revision. Keys live under `/bamboo/<job>/`.
- `FailureDetector`: neighbour reports confirmed by gRPC probes (with a grace period for slow nodes)
  and lease expiry, emitted as `NodeFailed(node, epoch, detected_by, reason)` once per node per epoch.
- `NodeAgent`: one per node, the gRPC `Agent` service (Probe, Notify, ReportPeerFailure, Subscribe),
  optional TLS, SIGTERM and cloud-hook preemption notices. `python -m bamboo.membership --help`.
  `AgentClient` is the worker's side: report a peer's failure, receive `NodeFailed` and notices.
- `EtcdStore`: a `torch.distributed.Store` over etcd (loaded lazily; needs the `torch` extra).

Nothing here imports torch at import time.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from bamboo.membership.agent import AgentClient, GrpcProber, NodeAgent, TlsFiles
from bamboo.membership.detector import DetectorConfig, FailureDetector, ProbeOutcome, ProbeResult
from bamboo.membership.embedded import EmbeddedEtcd, EtcdStartError
from bamboo.membership.kv import (
    EtcdKV,
    EtcdOptions,
    EventKind,
    KeyValue,
    KeyValueStore,
    StoreError,
    StoreUnavailableError,
    WatchEvent,
)
from bamboo.membership.records import (
    FailureReport,
    MalformedValueError,
    NodeFailed,
    NodeRecord,
    NodeState,
    PreemptionNotice,
)
from bamboo.membership.store import Decision, JobKeys, Layout, MembershipStore, Registration

if TYPE_CHECKING:
    from bamboo.membership.c10d_store import EtcdStore, c10d_prefix

__all__ = [
    "AgentClient",
    "Decision",
    "DetectorConfig",
    "EmbeddedEtcd",
    "EtcdKV",
    "EtcdOptions",
    "EtcdStartError",
    "EtcdStore",
    "EventKind",
    "FailureDetector",
    "FailureReport",
    "GrpcProber",
    "JobKeys",
    "KeyValue",
    "KeyValueStore",
    "Layout",
    "MalformedValueError",
    "MembershipStore",
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
    "TlsFiles",
    "WatchEvent",
    "c10d_prefix",
]

_LAZY_TORCH = {"EtcdStore", "c10d_prefix"}


def __getattr__(name: str) -> Any:
    if name in _LAZY_TORCH:
        from bamboo.membership import c10d_store

        return getattr(c10d_store, name)
    raise AttributeError(f"module 'bamboo.membership' has no attribute {name!r}")
