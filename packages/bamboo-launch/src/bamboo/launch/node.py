"""One emulated node of ``bamboo-launch run``: its agent, and the worker it spawns and watches.

The market starts ``python -m bamboo.launch.node ...`` as the leader of a new process group, with
``BAMBOO_NODE_ID`` and ``BAMBOO_ZONE`` set. The node:

1. installs the SIGTERM handler, then registers in etcd under a lease and serves the gRPC agent
   service (`bamboo.membership.NodeAgent`, with its failure detector): a SIGTERM or a notice
   becomes a preemption notice published in etcd;
2. waits for the layout in etcd (``/bamboo/<job>/layout``) to give it a rank; a node that has none
   waits on standby until a later layout gives it one, or the run ends;
3. spawns its worker in the node's process group, so a market kill (SIGKILL of the group) takes
   both, and watches it: ``python -m bamboo.launch.worker`` for the built-in example, or the run's
   user script, ``python SCRIPT ARGS``, with ``BAMBOO_RUN_SPEC``, ``BAMBOO_NODE_ID``, ``BAMBOO_AGENT``,
   ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` set (see
   :mod:`bamboo.launch.script`); a script that exits with status 0 without calling
   :func:`bamboo.launch.train_worker` is reported (exit status 1), not taken for a finished worker;
4. when the worker exits with ``STANDBY_EXIT`` (no role in the next layout), waits on standby
   again; otherwise leaves the cluster on purpose (not a failure) and exits with the worker's
   status.

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
from pathlib import Path
from typing import Any

__all__ = ["main", "worker_command"]


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
    from bamboo.launch.worker import STANDBY_EXIT, RunSpec
    from bamboo.membership import DetectorConfig, EtcdKV, EtcdOptions, MembershipStore, NodeAgent

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
    after = -1  # the generation this node last left (STANDBY_EXIT); -1: none yet
    log = spec_path.parent / "logs" / f"{args.node}.log"
    while True:
        layout = _wait_for_role(membership, agent, args.node, after, args.poll)
        if layout is None:
            agent.stop(leave=True)
            kv.close()
            return 0 if not agent.lease_lost.is_set() else 3
        generation = int(layout.get("generation", 0))
        print(f"node {args.node}: a role in generation {generation}; spawning its worker", flush=True)
        command, env, mark = worker_command(spec, spec_path, args.node, agent.address, layout)
        worker = subprocess.Popen(command, env=env)
        while worker.poll() is None:
            time.sleep(args.poll)
        code = worker.returncode
        print(f"node {args.node}: worker exited with status {code} (log: {log})", flush=True)
        if code == 0 and mark is not None and not mark.exists():
            print(f"node {args.node}: error: {spec.script[0]} exited with status 0 without calling "
                  f"bamboo.launch.train_worker (log: {log})", file=sys.stderr, flush=True)
            code = 1
        if code != STANDBY_EXIT:
            agent.stop(leave=True)
            kv.close()
            return code if code >= 0 else 1
        after = _current_generation(membership)
        print(f"node {args.node}: on standby after generation {after}", flush=True)


def worker_command(
    spec: Any, spec_path: Path, node: str, agent_address: str, layout: dict[str, Any]
) -> tuple[list[str], dict[str, str] | None, Path | None]:
    """The worker's command line, environment (None: this one) and entry mark (scripts only)."""
    if not spec.script:
        return ([sys.executable, "-m", "bamboo.launch.worker", "--spec", str(spec_path), "--node", node,
                 "--agent", agent_address], None, None)
    from bamboo.launch.script import worker_environment

    mark = spec_path.parent / "logs" / f"{node}.entered"
    mark.unlink(missing_ok=True)
    env = {**os.environ, **worker_environment(
        spec_path=spec_path, node=node, agent=agent_address, rank=int(layout["ranks"][node]),
        world_size=int(layout["stages"]) * int(layout["pipelines"]), entry_mark=mark)}
    return [sys.executable, *spec.script], env, mark


def _current_generation(membership: Any) -> int:
    while True:
        try:
            current = membership.get_layout()
            return int(current.value.get("generation", 0)) if current is not None else -1
        except Exception:
            time.sleep(0.1)


def _wait_for_role(membership: Any, agent: Any, node: str, after: int, poll: float) -> dict[str, Any] | None:
    """The layout of the first generation (> ``after``) that gives ``node`` a rank; None when the run is over."""
    stop = threading.Event()
    while True:
        try:
            layout = membership.get_layout()
        except Exception as error:
            print(f"node {node}: etcd unreachable ({error}); waiting", flush=True)
            layout = None
        if layout is not None:
            if layout.value.get("state") == "finished":
                return None
            generation = int(layout.value.get("generation", 0))
            if generation > after and node in layout.value.get("ranks", {}):
                return dict(layout.value)
        if agent.lease_lost.is_set():
            print(f"node {node}: lost its lease; exiting", file=sys.stderr, flush=True)
            return None
        stop.wait(poll)

if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
