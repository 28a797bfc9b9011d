"""Every timeout and poll interval of bamboo.membership, in one place (all in seconds).

Each constant is the default of one parameter somewhere in the package (an `EtcdOptions` or
`DetectorConfig` field, a `NodeAgent`/`Registration`/`AgentClient` argument, a flag of
`python -m bamboo.membership`); the parameter takes its default from here and can be set per call.
The comment above each constant says what it bounds, what happens when it fires, and which flag
sets it. `docs/failure-model.md` lists them in a table; a test compares that table with this module.

Names end in `_S` (seconds). Nothing else lives here.
"""

from __future__ import annotations

__all__ = [
    "AGENT_RPC_TIMEOUT_S",
    "AWS_TOKEN_TTL_S",
    "C10D_POLL_MAX_S",
    "C10D_POLL_MIN_S",
    "C10D_STORE_TIMEOUT_S",
    "ETCD_CLOSE_TIMEOUT_S",
    "ETCD_HEALTH_POLL_S",
    "ETCD_HEALTH_TIMEOUT_S",
    "ETCD_RECONNECT_BACKOFF_MAX_S",
    "ETCD_RECONNECT_BACKOFF_MIN_S",
    "ETCD_RPC_TIMEOUT_S",
    "ETCD_START_TIMEOUT_S",
    "ETCD_STOP_TIMEOUT_S",
    "GCE_HANGING_GET_S",
    "GCE_NOTICE_S",
    "GRACE_PERIOD_S",
    "GRPC_WAIT_SLICE_S",
    "KEEPALIVE_RETRY_INTERVAL_S",
    "LEASE_TTL_S",
    "MAIN_LOOP_POLL_S",
    "METADATA_HTTP_TIMEOUT_S",
    "NOTICE_WINDOW_S",
    "PREEMPTION_POLL_INTERVAL_S",
    "PROBE_INTERVAL_S",
    "PROBE_TIMEOUT_S",
    "SERVER_STOP_GRACE_S",
    "STREAM_POLL_S",
    "THREAD_JOIN_TIMEOUT_S",
    "WATCH_RETRY_INTERVAL_S",
    "WATCH_START_TIMEOUT_S",
]

# -- etcd client (EtcdOptions) ---------------------------------------------------------------------

ETCD_RPC_TIMEOUT_S = 5.0
"""Deadline of every unary etcd request (get, put, transaction, lease grant/refresh/revoke) and of one
attempt to create a watch (`EtcdOptions.timeout`, flag `--etcd-timeout`). When it fires the call raises
`StoreUnavailableError`; a keepalive, a watch or a detector's report retries, other callers see the error."""

ETCD_RECONNECT_BACKOFF_MAX_S = 1.0
"""Cap on gRPC's reconnect backoff to etcd (`EtcdOptions.reconnect_backoff_max`): after etcd comes back,
clients reconnect within this long. Nothing fails when it elapses; it only spaces reconnect attempts."""

ETCD_RECONNECT_BACKOFF_MIN_S = 0.1
"""First (and shortest) gRPC reconnect backoff to etcd (`EtcdOptions.reconnect_backoff_min`): a client whose
connection broke tries again after this long, then backs off up to `ETCD_RECONNECT_BACKOFF_MAX_S`."""

ETCD_CLOSE_TIMEOUT_S = 5.0
"""Bound on closing a client's gRPC channel (`EtcdOptions.close_timeout`). A channel whose call was cut short by an
exception from a signal handler (Ctrl-C's KeyboardInterrupt raised inside the call) can wait forever in its close
(grpc/grpc#19973; reproduced with grpcio 1.85): past this, `EtcdKV.close` logs a warning and leaves the channel
to a daemon thread, and the program exits anyway."""

WATCH_RETRY_INTERVAL_S = 0.2
"""Pause between two attempts to (re)create a broken watch stream (`EtcdOptions.watch_retry_interval`).
The watch keeps retrying (resuming from its last revision, or relisting if etcd compacted past it)."""

WATCH_START_TIMEOUT_S = 30.0
"""Bound on a watch's first registration (`EtcdOptions.watch_start_timeout`, flag
`--watch-start-timeout`): the initial list and the watch creation are retried (each attempt bounded by
`ETCD_RPC_TIMEOUT_S`) until this passes, then `watch_prefix` raises `StoreUnavailableError` naming the prefix.
While etcd keeps answering the watch stream (a backlog of creations, a thousand agents starting), the bound is
extended one RPC timeout at a time: slow under load is not unavailable."""

# -- leases and registration ----------------------------------------------------------------------

LEASE_TTL_S = 2
"""TTL of a node's etcd lease (`NodeAgent(ttl=...)`, flag `--ttl`; integer seconds, etcd's unit). The lease
is refreshed every TTL/3. When it expires (the node stopped heartbeating) etcd deletes the node record,
every detector declares the node failed (lease-expiry path), and the node's own `Registration.lost` is set."""

KEEPALIVE_RETRY_INTERVAL_S = 0.1
"""Pause between lease-refresh attempts while etcd is unreachable (`Registration(retry_interval=...)`).
Nothing fires: the keepalive keeps retrying until it refreshes, or finds the lease gone (then `lost`)."""

# -- failure detector (DetectorConfig) ------------------------------------------------------------

GRACE_PERIOD_S = 2.0
"""How long a suspect may stay unresponsive to probes before it is declared failed
(`DetectorConfig.grace_period`, flag `--grace`). Counted from the neighbour's report (or from the sweep
that found the node slow); when it passes, the failure is confirmed on the probe-timeout path. Keep it at
or below the lease TTL."""

PROBE_TIMEOUT_S = 0.25
"""Deadline of one gRPC probe of a suspect's agent (`DetectorConfig.probe_timeout`, flag
`--probe-timeout`). A probe that misses it counts as TIMEOUT: the node is slow, not dead, and is probed
again until the grace period ends."""

PROBE_INTERVAL_S = 0.1
"""Pause between two probes of the same suspect, and between retries of a failure report that could not
be written (`DetectorConfig.probe_interval`, flag `--probe-interval`)."""

# -- agent ----------------------------------------------------------------------------------------

NOTICE_WINDOW_S = 30.0
"""Time from SIGTERM (or a `Notify` without a deadline) to the preemption deadline it publishes
(`NodeAgent(notice_window=...)`, flag `--notice-window`; 30 s is GCE's notice). The agent process exits at
the deadline without leaving, so its lease expiry reports the departure."""

PREEMPTION_POLL_INTERVAL_S = 1.0
"""Pause between two calls of a preemption-notice hook (`NodeAgent.watch_preemption_hook(interval=...)`,
flag `--preemption-poll-interval`): AWS's `spot/instance-action` is polled this often (AWS suggests every
5 s; the notice comes 2 minutes ahead), GCE's hanging GET is re-issued after this pause."""

STREAM_POLL_S = 0.5
"""How often a `Subscribe` stream checks that its client is still there and the agent still running
(`NodeAgent(stream_poll=...)`); a stream whose client left ends within this long."""

GRPC_WAIT_SLICE_S = 60.0
"""The longest a thread blocked in a gRPC call sleeps before it wakes to check again (gRPC's own slice is 0.1 s;
`bamboo.membership.streams` lengthens it when imported). Not a deadline: every call keeps its own, and a message,
the call's end or a signal wakes the thread at once. Every process that follows etcd holds a watch stream whose
reading thread waits for the next message; at gRPC's 0.1 s it woke ten times a second for nothing, about 5 CPU-s an
hour in every agent and every waiting worker (measured: an idle watch stream cost its process 8.5 CPU-s per hour,
3.4 with this slice)."""

AGENT_RPC_TIMEOUT_S = 5.0
"""Deadline of each unary call from `AgentClient` to its agent (Probe, Notify, ReportPeerFailure)
(`AgentClient(timeout=...)`); the call raises `grpc.RpcError` (DEADLINE_EXCEEDED) when it fires."""

SERVER_STOP_GRACE_S = 0.5
"""How long `NodeAgent.stop()` lets in-flight RPCs finish before the gRPC server cancels them
(`NodeAgent.stop(grace=...)`)."""

THREAD_JOIN_TIMEOUT_S = 5.0
"""How long stopping waits for a background thread (a watch, the detector loop, a keepalive) to end
before it gives up waiting; the thread is a daemon and ends with the process."""

MAIN_LOOP_POLL_S = 0.1
"""How often the agent process (`python -m bamboo.membership`) checks for a lost lease, SIGINT and the
preemption deadline; it exits within this long of any of them."""

# -- cloud preemption notices (bamboo.membership.cloud) -------------------------------------------

METADATA_HTTP_TIMEOUT_S = 2.0
"""Deadline of one request to a cloud metadata server (AWS token and `spot/instance-action`, GCE's
first read). A request that misses it fails this poll; the hook is called again after
`PREEMPTION_POLL_INTERVAL_S`."""

AWS_TOKEN_TTL_S = 21600
"""Lifetime asked for an IMDSv2 session token (header `X-aws-ec2-metadata-token-ttl-seconds`; 21600 is
AWS's maximum). The token is renewed before it expires, and at once when AWS answers 401."""

GCE_HANGING_GET_S = 60.0
"""How long one GCE `wait_for_change` request may hang (`timeout_sec`); when it passes with no change the
metadata server answers the current value and the watcher asks again."""

GCE_NOTICE_S = 30.0
"""Time GCE gives a preempted VM from the notice (`instance/preempted` turning TRUE) to its stop; the
published deadline is the notice time plus this."""

# -- embedded etcd (tests and the launcher) -------------------------------------------------------

ETCD_START_TIMEOUT_S = 20.0
"""How long `EmbeddedEtcd.start()` waits for `/health` before killing the server and raising
`EtcdStartError` (`EmbeddedEtcd(start_timeout=...)`)."""

ETCD_STOP_TIMEOUT_S = 10.0
"""How long `EmbeddedEtcd.stop()` waits after SIGTERM before it sends SIGKILL (`EmbeddedEtcd(stop_timeout=...)`)."""

ETCD_HEALTH_TIMEOUT_S = 0.5
"""Deadline of one `/health` request (`EmbeddedEtcd.healthy(timeout=...)`); a miss reads as unhealthy."""

ETCD_HEALTH_POLL_S = 0.05
"""Pause between two `/health` checks while `EmbeddedEtcd.start()` waits for the server."""

# -- c10d store over etcd -------------------------------------------------------------------------

C10D_STORE_TIMEOUT_S = 300.0
"""How long `EtcdStore.get`/`wait` wait for their keys (`EtcdStore(timeout=...)`, c10d's `set_timeout`);
when it passes they raise c10d's `DistStoreError` naming the missing keys."""

C10D_POLL_MIN_S = 0.001
"""First pause between two etcd reads while `EtcdStore.get`/`wait` wait for a key (`EtcdStore(poll_min=...)`);
the pause doubles up to `C10D_POLL_MAX_S`."""

C10D_POLL_MAX_S = 0.02
"""Longest pause between two etcd reads while `EtcdStore.get`/`wait` wait for a key (`EtcdStore(poll_max=...)`)."""
