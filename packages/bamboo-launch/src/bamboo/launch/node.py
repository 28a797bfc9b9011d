"""One emulated node of ``bamboo-launch run``: its agent, and the worker it spawns and watches.

The market starts ``python -m bamboo.launch.node ...`` as the leader of a new process group, with
``BAMBOO_NODE_ID`` and ``BAMBOO_ZONE`` set. The node:

1. installs the SIGTERM handler, then registers in etcd under a lease and serves the gRPC agent
   service (`bamboo.membership.NodeAgent`, with its failure detector): a SIGTERM or a notice
   becomes a preemption notice published in etcd;
2. waits for the layout in etcd (``/bamboo/<job>/layout``) to give it a rank; a node that has none
   waits on standby until the run ends;
3. spawns its worker (``python -m bamboo.launch.worker``) in the node's process group, so a market
   kill (SIGKILL of the group) takes both, and watches it;
4. when the worker exits, leaves the cluster on purpose (not a failure) and exits with the
   worker's status.

Timeouts (seconds, flags): ``--ttl`` lease TTL (2), ``--grace`` how long a suspect must stay
unresponsive before it is declared failed (2; an agent stopped for less is only slow),
``--poll`` how often the layout and the worker are checked (0.1).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time

__all__ = ["main"]


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bamboo.launch.node",
        description="One bamboo-launch node: agent (lease, gRPC, detector, notices) plus the worker it spawns.",
    )
    parser.add_argument("--spec", required=True, help="the run's RUN.json (written by bamboo-launch run)")
    parser.add_argument("--node", default=os.environ.get("BAMBOO_NODE_ID"), help="node id (default $BAMBOO_NODE_ID)")
    parser.add_argument("--zone", default=os.environ.get("BAMBOO_ZONE", ""), help="zone (default $BAMBOO_ZONE)")
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL, s (default 2)")
    parser.add_argument("--grace", type=float, default=2.0, help="detector grace period, s (default 2)")
    parser.add_argument("--poll", type=float, default=0.1, help="layout and worker poll interval, s (default 0.1)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    from pathlib import Path

    from bamboo.launch.worker import RunSpec
    from bamboo.membership import DetectorConfig, EtcdKV, EtcdOptions, MembershipStore, NodeAgent
    from bamboo.membership.kv import StoreError

    args = _parse(argv)
    if not args.node:
        print("bamboo node: error: no node id (--node or BAMBOO_NODE_ID)", file=sys.stderr)
        return 2
    spec_path = Path(args.spec)
    spec = RunSpec.from_json(spec_path.read_text())
    kv = EtcdKV(EtcdOptions(endpoints=spec.etcd, user=spec.etcd_user, password=spec.etcd_password,
                            ca_cert=spec.etcd_ca, cert_cert=spec.etcd_cert, cert_key=spec.etcd_key))
    membership = MembershipStore(kv, spec.job)
    agent = NodeAgent(membership, args.node, zone=args.zone, ttl=args.ttl,
                      detector_config=DetectorConfig(grace_period=args.grace))
    agent.install_sigterm_handler()  # before registering: a notice must never be a silent death
    agent.start()
    print(f"node {args.node} ({args.zone}) registered; agent at {agent.address}", flush=True)
    rank: int | None = None
    stop = threading.Event()
    while rank is None:
        try:
            layout = membership.get_layout()
        except StoreError as error:
            print(f"node {args.node}: etcd unreachable ({error}); waiting", flush=True)
            layout = None
        if layout is not None:
            if layout.value.get("state") == "finished":
                agent.stop(leave=True)
                kv.close()
                return 0
            rank = layout.value.get("ranks", {}).get(args.node)
        if agent.lease_lost.is_set():
            print(f"node {args.node}: lost its lease; exiting", file=sys.stderr, flush=True)
            return 3
        if rank is None:
            stop.wait(args.poll)
    print(f"node {args.node}: rank {rank}; spawning its worker", flush=True)
    spec_path = Path(args.spec)
    worker = subprocess.Popen(
        [sys.executable, "-m", "bamboo.launch.worker", "--spec", str(spec_path), "--rank", str(rank),
         "--agent", agent.address],
    )
    while worker.poll() is None:
        time.sleep(args.poll)
    code = worker.returncode
    print(f"node {args.node}: worker exited with status {code}", flush=True)
    agent.stop(leave=True)
    kv.close()
    return code if code >= 0 else 1


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
