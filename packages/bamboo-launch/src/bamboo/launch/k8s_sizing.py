"""How ``bamboo-launch k8s render`` sizes etcd and the agents' leases for ``--nodes``: one rule,
:func:`size_for`, from the control plane's load per agent measured by ``tests/benchmarks/bench_scale.py``
(``docs/results/scale.json``) and etcd's published hardware classes (etcd's operations guide, "Hardware
recommendations": small, medium, large and xLarge clusters by clients, requests per second and data).
``docs/failure-model.md`` ("At scale") states the rule and its figures.
"""

from __future__ import annotations

import math

import attrs
from bamboo.launch import timeouts
from bamboo.membership import timeouts as membership_timeouts

__all__ = [
    "CLIENTS_PER_NODE",
    "ETCD_CLASSES",
    "ETCD_CPU_S_PER_REQUEST",
    "LAYOUT_BYTES_PER_NODE",
    "MAX_NODES",
    "EtcdClass",
    "Sizing",
    "size_for",
]

ETCD_CPU_S_PER_REQUEST = 0.11 / 300
"""etcd's CPU seconds per steady-state request, measured: 11% of a core for 1,000 agents at 0.30 requests a second
each (``bench_scale.py --agents 1000 --ttl 10``, ``docs/results/scale.json``)."""

LAYOUT_BYTES_PER_NODE = 83
"""Bytes of the job's layout per node (82,925 B at 1,000 nodes, measured): a new layout goes to every worker's
watch at once, so etcd buffers about this times N squared bytes at each reconfiguration."""

DB_BYTES_BASE = 1_300_000
DB_BYTES_PER_NODE = 1_100
"""etcd's database after an hour of steady state, fitted to the measured 1.35 MB (64 agents), 1.54 MB (256) and
2.38 MB (1,000): about 1.3 MB plus 1.1 KB per node."""

CLIENTS_PER_NODE = 2
"""etcd clients per node: its agent's and its worker's (each one connection, its watches on one stream)."""

HEADROOM = 4
"""Steady-state load times this is what etcd is given: the start-up burst (every agent's registration, join and
watches within seconds) and a reconfiguration's layout fan-out are several times the steady load."""

MAX_NODES = 2000
"""The largest ``--nodes`` the rule sizes an in-cluster etcd for: twice the largest job measured (1,000 agents).
Beyond it the per-agent figures are extrapolated further than measured: use an external etcd (``--etcd``) sized
by its operator, and measure with ``bench_scale.py`` first."""


@attrs.frozen
class EtcdClass:
    """One of etcd's published hardware classes: the bounds of its workload (fewer than ``clients`` clients and
    ``requests_per_s`` requests a second) and what Bamboo's StatefulSet asks for such a member: a quarter of the
    CPUs and an eighth of the memory of the dedicated machine etcd's guide gives the class (whose example workload
    is a Kubernetes control plane; Bamboo's agents cost it far less per client), memory limit twice the request."""

    name: str
    clients: int
    requests_per_s: int
    cpu_millis: int
    memory_mib: int


ETCD_CLASSES = (
    EtcdClass("small", 100, 200, 500, 1024),  # guide: 2 vCPUs, 8 GB
    EtcdClass("medium", 500, 1_000, 1000, 2048),  # 4 vCPUs, 16 GB
    EtcdClass("large", 1_500, 10_000, 2000, 4096),  # 8 vCPUs, 32 GB
    EtcdClass("xlarge", 10**9, 10**9, 4000, 8192),  # more than 1,500 clients: 16 vCPUs, 64 GB
)


@attrs.frozen
class Sizing:
    """What :func:`size_for` decides for a job of ``nodes``."""

    nodes: int
    lease_ttl_s: int
    """The agents' lease TTL (``--ttl``)."""
    requests_per_s: float
    """etcd's steady requests a second: every agent refreshes its lease three times per TTL."""
    clients: int
    etcd_class: str
    etcd_cpu: str
    etcd_memory_request: str
    etcd_memory_limit: str
    quota_backend_bytes: int
    etcd_storage: str
    """The volume per member: twice the quota (compaction and defragmentation need room)."""
    auto_compaction_retention: str = "1h"
    """etcd keeps one hour of revisions (the database projection below is for one hour)."""


def size_for(nodes: int, *, in_cluster_etcd: bool = True) -> Sizing:
    """Size etcd and the agents' leases for a job of ``nodes`` agents (one per Kubernetes node).

    Measured per agent (``docs/results/scale.json``; ``bench_scale.py``, 1,000 agents on one etcd): 0.30 etcd
    requests and 15 bytes a second at ``--ttl 10``, nearly all of it the lease refresh (three per TTL); 11% of a
    core of etcd for all 1,000; a start-up (first registration to a layout every agent read) of 4.2-5.5 s at p99;
    a layout of 83 bytes per node; 2.4 MB of database after an hour. The rule:

    - lease TTL: the default (``LEASE_TTL_S``), or longer where the start-up burst is longer (``N x
      K8S_LEASE_PER_NODE_S``, rounded up): a refresh that etcd answers later than the TTL loses the lease, and a
      live agent would be declared dead while a thousand others register;
    - steady requests R = 3 N / TTL; clients C = 2 N; etcd's class: the first whose bounds hold both;
    - etcd's CPU request: the class's, or ``R x ETCD_CPU_S_PER_REQUEST x HEADROOM`` if more (no CPU limit: a
      throttled etcd misses its heartbeats); memory: the class's, or 512 MiB plus twice a reconfiguration's
      layout fan-out (``LAYOUT_BYTES_PER_NODE x N^2``) if more, in 256 MiB steps, limit twice the request;
    - quota-backend-bytes: 1 GiB, or 100 times the projected hour of database if more; volume: twice the quota.

    The agents' failure-detector probes need no sizing: an agent probes only the peers it suspects, and a sweep
    at most the nodes of the pipelines that lost one (bounded by the pipeline depth, not by N). etcd's heartbeat
    and election timeouts stay at etcd's defaults: they depend on the round trip between members, not on clients.
    Raises ``ValueError`` (one line) above :data:`MAX_NODES` when etcd is to run in the cluster
    (``in_cluster_etcd``); an external etcd's size is its operator's (the lease TTL is still sized).
    """
    if in_cluster_etcd and nodes > MAX_NODES:
        raise ValueError(
            f"nodes={nodes} is more than the {MAX_NODES} an in-cluster etcd is sized for (twice the 1,000 agents "
            "measured by bench_scale.py): pass --etcd HOST:PORT of an etcd sized by its operator"
        )
    ttl = max(membership_timeouts.LEASE_TTL_S, math.ceil(nodes * timeouts.K8S_LEASE_PER_NODE_S))
    requests = 3 * nodes / ttl
    clients = CLIENTS_PER_NODE * nodes
    chosen = next(c for c in ETCD_CLASSES if clients < c.clients and requests < c.requests_per_s)
    cpu_millis = max(chosen.cpu_millis, _steps(requests * ETCD_CPU_S_PER_REQUEST * HEADROOM * 1000, 250))
    fan_out_mib = 2 * LAYOUT_BYTES_PER_NODE * nodes**2 / 2**20
    memory_mib = max(chosen.memory_mib, _steps(512 + fan_out_mib, 256))
    database = DB_BYTES_BASE + DB_BYTES_PER_NODE * nodes
    quota = max(2**30, _steps(100 * database, 2**28))
    return Sizing(
        nodes=nodes, lease_ttl_s=ttl, requests_per_s=requests, clients=clients, etcd_class=chosen.name,
        etcd_cpu=f"{cpu_millis}m", etcd_memory_request=f"{memory_mib}Mi", etcd_memory_limit=f"{2 * memory_mib}Mi",
        quota_backend_bytes=quota, etcd_storage=f"{math.ceil(2 * quota / 2**30)}Gi",
    )


def _steps(value: float, step: int) -> int:
    """``value`` rounded up to a whole number of ``step``."""
    return math.ceil(value / step) * step
