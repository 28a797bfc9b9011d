"""etcd's side of bench_scale.py: its request and byte counters, its CPU, and the database after an hour.

- `EtcdCounters.read(url)`: etcd's own Prometheus counters (`/metrics` on the client port): gRPC messages
  received (every unary request, every message on a stream: a lease refresh, a watch creation), and the
  bytes it received and sent to clients.
- `process_cpu_s(pid)`: a process's user + system CPU seconds, from `/proc`.
- `database_after(kv, revisions, value_bytes)`: writes `revisions` records the way the job's event log does
  (a new key per record, the oldest deleted once a writer keeps `keep` of them), then reads etcd's database
  size, compacts at the current revision, defragments, and reads it again.
"""

from __future__ import annotations

import os
import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import attrs

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{[^}]*\})?\s+([0-9.eE+-]+)$")


@attrs.frozen
class EtcdCounters:
    """Cumulative counters of one etcd member at one moment."""

    t: float
    messages: float
    received_bytes: float
    sent_bytes: float

    @classmethod
    def read(cls, url: str) -> EtcdCounters:
        with urllib.request.urlopen(f"{url}/metrics", timeout=10) as response:
            text = response.read().decode()
        totals: dict[str, float] = {}
        for line in text.splitlines():
            match = _SAMPLE.match(line)
            if match:
                totals[match.group(1)] = totals.get(match.group(1), 0.0) + float(match.group(3))
        return cls(t=time.monotonic(), messages=totals.get("grpc_server_msg_received_total", 0.0),
                   received_bytes=totals.get("etcd_network_client_grpc_received_bytes_total", 0.0),
                   sent_bytes=totals.get("etcd_network_client_grpc_sent_bytes_total", 0.0))


def process_cpu_s(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def database_after(kv: Any, job: str, revisions: int, value_bytes: int, keep: int) -> dict[str, Any]:
    """Write `revisions` event-log-like records; the database size then, and after compaction (see above)."""
    prefix = f"/bamboo/{job}/events/replay/"
    value = b"x" * max(1, value_bytes)
    written = 0
    sequence = 0
    started = time.monotonic()
    while written < revisions:
        kv.put(f"{prefix}{sequence:012d}", value)
        written += 1
        if sequence >= keep and written < revisions:
            kv.delete(f"{prefix}{sequence - keep:012d}")
            written += 1
        sequence += 1
    replay_s = time.monotonic() - started
    before = kv.status()
    kv.compact(before.revision)
    kv.defragment()
    after = kv.status()
    return {"revisions_replayed": written, "replay_s": round(replay_s, 1),
            "db_bytes_after_an_hour": before.db_size, "db_bytes_after_compaction": after.db_size}
