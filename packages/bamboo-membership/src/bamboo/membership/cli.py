"""`python -m bamboo.membership`: one node's membership agent as a process (`--help`).

It runs a `bamboo.membership.NodeAgent` (the gRPC agent service, the lease-held record, the failure
detector, preemption notices) until SIGINT (it leaves), a preemption deadline (it vanishes without leaving,
so its lease expiry reports it) or the loss of its lease (exit status 3).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
import time

from bamboo.membership import timeouts
from bamboo.membership.agent import NodeAgent
from bamboo.membership.auth import TOKEN_FILE_ENV, TlsFiles, load_token
from bamboo.membership.cloud import PREEMPTION_NOTICE_KINDS, preemption_hook
from bamboo.membership.detector import DetectorConfig
from bamboo.membership.kv import EtcdKV, EtcdOptions, StoreError
from bamboo.membership.store import MembershipStore

__all__ = ["main"]

def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bamboo.membership",
        description="Run one node's Bamboo agent: gRPC Agent service, lease-held node record in etcd, "
        "failure detector, preemption notices. Prints one JSON line {\"node\", \"address\", \"port\"} when ready. "
        "Beyond loopback (--host) callers must authenticate: give --token-file, or mutual TLS (--tls-cert, "
        "--tls-key and --tls-ca), or --insecure.",
        epilog="Exit status: 0 after SIGINT (left on purpose) or at a preemption deadline; 2 on bad input or "
        "when etcd cannot be reached at start; 3 when the node's lease expired or was revoked under it (it was "
        "declared failed; start again with a higher --incarnation).",
    )
    parser.add_argument("--etcd", required=True, action="append",
                        help="etcd client endpoint host:port (repeat for several)")
    parser.add_argument("--job", required=True, help="job name: keys live under /bamboo/<job>/")
    parser.add_argument("--node", required=True, help="this node's id (no '/')")
    parser.add_argument("--zone", default="", help="availability zone of this node (default: none)")
    parser.add_argument("--incarnation", type=int, default=1,
                        help="incarnation of this node id; bump it when a new process takes the id (default 1)")
    parser.add_argument("--host", default="127.0.0.1", help="address the gRPC server binds to (default loopback)")
    parser.add_argument("--port", type=int, default=0, help="gRPC port (default 0: a free port)")
    parser.add_argument("--ttl", type=int, default=timeouts.LEASE_TTL_S,
                        help=f"lease TTL in seconds (default {timeouts.LEASE_TTL_S})")
    parser.add_argument("--grace", type=float, default=timeouts.GRACE_PERIOD_S,
                        help="seconds a suspect must stay unresponsive before it is declared failed "
                        f"(default {timeouts.GRACE_PERIOD_S:g})")
    parser.add_argument("--probe-timeout", type=float, default=timeouts.PROBE_TIMEOUT_S,
                        help=f"deadline of one probe, s (default {timeouts.PROBE_TIMEOUT_S:g})")
    parser.add_argument("--probe-interval", type=float, default=timeouts.PROBE_INTERVAL_S,
                        help=f"pause between two probes of a suspect, s (default {timeouts.PROBE_INTERVAL_S:g})")
    parser.add_argument("--notice-window", type=float, default=timeouts.NOTICE_WINDOW_S,
                        help="seconds from SIGTERM to the preemption deadline; the agent exits then "
                        f"(default {timeouts.NOTICE_WINDOW_S:g})")
    parser.add_argument("--preemption-notices", choices=PREEMPTION_NOTICE_KINDS, default="none",
                        help="poll a cloud's metadata server for preemption notices: aws (IMDSv2 "
                        "spot/instance-action) or gce (instance/preempted, hanging GET) (default none)")
    parser.add_argument("--metadata-url", default=None,
                        help="base URL of the metadata server (default the cloud's own: http://169.254.169.254 "
                        "for aws, http://metadata.google.internal for gce)")
    parser.add_argument("--preemption-poll-interval", type=float, default=timeouts.PREEMPTION_POLL_INTERVAL_S,
                        help="seconds between two metadata polls "
                        f"(default {timeouts.PREEMPTION_POLL_INTERVAL_S:g})")
    parser.add_argument("--no-detector", action="store_true", help="do not run a failure detector in this agent")
    parser.add_argument("--tls-cert", help="PEM certificate of this agent (enables TLS with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key of this agent")
    parser.add_argument("--tls-ca", help="PEM CA of the job: peers' certificates are checked against it, and "
                        "callers must present a certificate it signed (mutual TLS)")
    parser.add_argument("--tls-server-name", help="name to check in peers' certificates instead of their address")
    parser.add_argument("--token-file",
                        default=os.environ.get(TOKEN_FILE_ENV),
                        help="file holding the job token (e.g. a mounted Secret): every call to this agent must "
                        f"carry it, and this agent sends it to its peers (default ${TOKEN_FILE_ENV})")
    parser.add_argument("--insecure", action="store_true",
                        help="allow listening beyond loopback with neither a token nor mutual TLS: any process "
                        "that reaches the port can then make this node leave")
    parser.add_argument("--etcd-user", help="etcd user name (with --etcd-password)")
    parser.add_argument("--etcd-password", help="etcd password")
    parser.add_argument("--etcd-ca", help="PEM CA of the etcd server (enables TLS to etcd)")
    parser.add_argument("--etcd-cert", help="PEM client certificate for etcd (with --etcd-key)")
    parser.add_argument("--etcd-key", help="PEM client key for etcd")
    parser.add_argument("--etcd-timeout", type=float, default=timeouts.ETCD_RPC_TIMEOUT_S,
                        help=f"deadline of each etcd request, s (default {timeouts.ETCD_RPC_TIMEOUT_S:g})")
    parser.add_argument("--watch-start-timeout", type=float, default=timeouts.WATCH_START_TIMEOUT_S,
                        help="how long setting up an etcd watch is retried before giving up, s "
                        f"(default {timeouts.WATCH_START_TIMEOUT_S:g})")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        options = EtcdOptions(endpoints=tuple(args.etcd), user=args.etcd_user, password=args.etcd_password,
                              ca_cert=args.etcd_ca, cert_cert=args.etcd_cert, cert_key=args.etcd_key,
                              timeout=args.etcd_timeout, watch_start_timeout=args.watch_start_timeout)
        config = DetectorConfig(grace_period=args.grace, probe_timeout=args.probe_timeout,
                                probe_interval=args.probe_interval)
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ValueError(f"--tls-cert and --tls-key go together (got cert={args.tls_cert!r}, key={args.tls_key!r})")
        tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca, args.tls_server_name) if args.tls_cert else None
        token = load_token(args.token_file) if args.token_file else None
        hook = preemption_hook(args.preemption_notices, args.metadata_url)
        if not args.preemption_poll_interval > 0:
            raise ValueError(f"--preemption-poll-interval must be > 0, got {args.preemption_poll_interval!r}")
        kv = EtcdKV(options)
        agent = NodeAgent(MembershipStore(kv, args.job), args.node, zone=args.zone, incarnation=args.incarnation,
                          host=args.host, port=args.port, ttl=args.ttl, tls=tls, token=token, insecure=args.insecure,
                          detector_config=config, run_detector=not args.no_detector,
                          notice_window=args.notice_window)
        # The handler goes in before the node registers: a SIGTERM that arrives once the node is
        # visible in etcd must become a preemption notice, never the default (silent) death.
        agent.install_sigterm_handler()
        agent.start()
    except (ValueError, OSError, StoreError) as exc:
        print(f"bamboo agent: error: {exc}", file=sys.stderr)
        return 2
    if hook is not None:
        agent.watch_preemption_hook(hook, args.preemption_poll_interval)
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"node": args.node, "address": agent.host, "port": agent.port}), flush=True)
    deadline: float | None = None
    while not stop.wait(timeouts.MAIN_LOOP_POLL_S):
        if agent.lease_lost.is_set():
            print(f"bamboo agent: error: node {args.node} lost its lease and was declared failed; "
                  "rejoin with a higher --incarnation", file=sys.stderr)
            agent.stop(leave=False)
            kv.close()
            return 3
        if agent.noticed.is_set() and deadline is None:
            # The notice's own deadline: now + --notice-window after SIGTERM, the cloud's after a metadata notice.
            due = agent.notice_deadline if agent.notice_deadline is not None else time.time() + args.notice_window
            deadline = time.monotonic() + max(0.0, due - time.time())
        if deadline is not None and time.monotonic() >= deadline:
            # Preempted: vanish without leaving, as the machine would; the lease expiry reports it.
            agent.stop(leave=False)
            kv.close()
            return 0
    agent.stop(leave=True)
    kv.close()
    return 0
