"""``bamboo-launch agent``: one per machine, and the whole system; no launcher process in the loop.

On a cluster every machine runs one agent (the Kubernetes manifests of :mod:`bamboo.launch.k8s` start
exactly this command); ``bamboo-launch run`` starts the same agents as local processes. An agent

1. **agrees on the job's spec.** It reads ``/bamboo/<job>/spec`` from etcd. When there is none, one agent
   (the holder of the short-lived ``spec-writer`` key) reads the model's description (the built-in
   example, or ``SCRIPT`` in ``describe`` mode, in a child process so that the agent never imports
   torch) and writes the spec first-writer-wins. Every other agent checks the flags it was given
   against the stored spec: a conflict is a one-line error naming both values (exit status 2);
2. **registers** under a lease (``--ttl``) and serves the gRPC agent service (probes, preemption notices,
   peer-failure reports) with its failure detector (``--grace``), behind a job token or mutual TLS
   when it listens beyond loopback (:class:`bamboo.membership.NodeAgent`);
3. **takes part in the job-wide duties** (:class:`bamboo.launch.coordinator.Coordinator`): the agent
   elected through etcd publishes confirmed failures and writes the first layout;
4. **spawns its worker at once** (:mod:`bamboo.launch.worker`): the worker imports torch and the model
   and waits, warm, for a role in a layout;
5. **supervises it.** When the job's end record appears, the agent waits for its worker and exits 0 (or
   1 with the job's error). When its worker dies while the agent lives, or the agent learns that it was
   declared dead (its lease is gone: a partition longer than the TTL), it kills its worker and comes
   back as a *fresh node* (``<node>.<n>``): the old identity stays dead and fenced, nothing of its state
   is used again. A worker that fails :data:`MAX_WORKER_FAILURES` times in a row without the job ending
   makes the agent give up with the worker's last error (exit status 1).

Every etcd write of an agent and of its worker is fenced by the agent's registration: once the node is
declared dead, nothing it writes reaches the job.

Exit status: 0 the job ended; 1 the job cannot go on (its end record names the error), or the worker keeps
failing; 2 bad input (a flag, or a conflict with the stored spec); 3 a preemption notice's deadline passed.

Its parts: :mod:`bamboo.launch.agent_options` (what it takes), :mod:`bamboo.launch.agent_spec` (step 1),
:mod:`bamboo.launch.supervisor` (steps 2 to 5, one incarnation at a time); this module runs the incarnations.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

from bamboo.launch import timeouts
from bamboo.launch.agent_options import AgentError, AgentOptions

# The agent's parts live in their own modules; their public names stay importable from here too.
from bamboo.launch.agent_options import default_run_dir as default_run_dir
from bamboo.launch.agent_options import split_flags as split_flags
from bamboo.launch.agent_spec import describe_model, ensure_spec, new_spec
from bamboo.launch.agent_spec import refuse_used_checkpoint_dir as refuse_used_checkpoint_dir
from bamboo.launch.spec import AGENT_JOB_FAILED, AGENT_USAGE
from bamboo.launch.supervisor import AGENT_PREEMPTED, WORKER_NICENESS, Supervisor, supervise, worker_command

__all__ = [
    "AGENT_PREEMPTED",
    "MAX_WORKER_FAILURES",
    "WORKER_NICENESS",
    "AgentError",
    "AgentOptions",
    "agent_argv",
    "describe_model",
    "ensure_spec",
    "new_spec",
    "run_agent",
    "say_line",
    "worker_command",
    "zone_of_k8s_node",
]

MAX_WORKER_FAILURES = 3
"""Worker failures in a row (without the job ending) after which an agent gives up."""


def agent_argv() -> list[str]:
    """The command line that starts an agent in this interpreter, before its flags (``python -m bamboo.launch
    agent``): what the nodes of an emulated cluster run, so that it need not write out this package's module."""
    return [sys.executable, "-m", "bamboo.launch", "agent"]


def say_line(line: str) -> None:
    """Print one line of the agent's, stamped with the wall clock to the millisecond (``bamboo-launch agent
    07:12:01.123: ...``), so that its log lines line up with the event log's Unix times and other nodes' logs."""
    now = time.time()
    stamp = time.strftime("%H:%M:%S", time.localtime(now)) + f".{int(now * 1000) % 1000:03d}"
    print(f"bamboo-launch agent {stamp}: {line}", flush=True)


def zone_of_k8s_node(name: str) -> str:
    """The ``topology.kubernetes.io/zone`` label of Kubernetes node ``name``, read from the API server with
    the pod's service account ("" when the node has no such label).

    The API server is ``https://$KUBERNETES_SERVICE_HOST:$KUBERNETES_SERVICE_PORT`` with the service
    account's token and CA; ``BAMBOO_K8S_API`` (a URL) and ``BAMBOO_K8S_TOKEN_FILE`` override them (tests).
    """
    import ssl
    import urllib.request

    account = Path("/var/run/secrets/kubernetes.io/serviceaccount")
    api = os.environ.get("BAMBOO_K8S_API")
    context = None
    if api is None:
        host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
        if not host:
            raise AgentError(f"--k8s-node {name}: not inside Kubernetes (KUBERNETES_SERVICE_HOST is not set); "
                             "give --zone instead")
        api = f"https://{host}:{port}"
        context = ssl.create_default_context(cafile=str(account / "ca.crt"))
    token = Path(os.environ.get("BAMBOO_K8S_TOKEN_FILE", str(account / "token"))).read_text().strip()
    request = urllib.request.Request(f"{api.rstrip('/')}/api/v1/nodes/{name}",
                                     headers={"Authorization": f"Bearer {token}", "Accept": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeouts.K8S_API_TIMEOUT_S, context=context) as response:
            node = json.loads(response.read())
    except OSError as error:
        raise AgentError(f"--k8s-node {name}: cannot read the node from {api}: {error}") from None
    return str(node.get("metadata", {}).get("labels", {}).get("topology.kubernetes.io/zone", ""))


def run_agent(options: AgentOptions, say: Callable[[str], None] | None = None) -> int:
    """Run the agent to the end of the job (see the module docstring); returns the exit status."""
    from bamboo.launch.notices import PatientKV
    from bamboo.membership import EtcdKV, MembershipStore

    say = say or say_line
    Path(options.run_dir).mkdir(parents=True, exist_ok=True)
    kv = EtcdKV(options.etcd.options())
    membership = MembershipStore(kv, options.job)
    try:
        # An agent may start before etcd answers (a pod scheduled first, a loaded machine): agreeing on the
        # spec waits out ETCD_OUTAGE_S of unavailability instead of exiting.
        spec, wrote = ensure_spec(MembershipStore(PatientKV(kv), options.job), options, say)  # type: ignore[arg-type]
        zone = options.zone or (zone_of_k8s_node(options.k8s_node) if options.k8s_node else "")
        noticed, wake = threading.Event(), threading.Event()
        signal.signal(signal.SIGTERM, lambda *_: (noticed.set(), wake.set()))
        failures = 0
        incarnation, previous = 1, None
        while True:
            node = options.node if incarnation == 1 else f"{options.node}.{incarnation}"
            supervisor = Supervisor(options, spec, membership, node, zone, say, wake, returns=previous)
            # every incarnation joins (its old identity's preemption record stops that one's billing): a report must
            # never meet the preemption of a node that never joined
            supervisor.start(announce=True, wrote_spec=wrote and incarnation == 1)
            if noticed.is_set():
                supervisor.agent.notify(time.time() + options.notice_window_s, "sigterm")
            status, why = supervise(supervisor, noticed, options.notice_window_s)
            if status is not None:
                return status
            failures = failures + 1 if why.startswith("worker") else 0
            error = supervisor.worker_error()
            if failures >= MAX_WORKER_FAILURES:
                supervisor.stop(leave=True)
                say(f"error: node {node}: the worker failed {failures} times in a row; giving up"
                    + (f": {error}" if error else ""))
                return AGENT_JOB_FAILED
            say(f"node {node}: {why}{': ' + error if error else ''}; coming back as a fresh node")
            supervisor.stop(leave=False)
            incarnation, previous = incarnation + 1, node
    except AgentError as error:
        print(f"bamboo-launch agent: error: {error}", file=sys.stderr, flush=True)
        return AGENT_USAGE
    finally:
        kv.close()
