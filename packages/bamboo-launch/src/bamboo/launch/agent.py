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
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from bamboo.launch import timeouts
from bamboo.launch.forkserver import ForkedProcess, run_to_end, spawn
from bamboo.launch.records import JobEnd, WorkerError, WorkerWarm, read_record
from bamboo.launch.spec import (
    AGENT_DONE,
    AGENT_JOB_FAILED,
    AGENT_USAGE,
    ENV_CONTEXT,
    EtcdAccess,
    JobSpec,
    WorkerContext,
)
from bamboo.launch.worker_records import SPAWNED_ENV
from bamboo.membership import timeouts as membership_timeouts

__all__ = [
    "AGENT_PREEMPTED",
    "MAX_WORKER_FAILURES",
    "WORKER_NICENESS",
    "AgentError",
    "AgentOptions",
    "describe_model",
    "ensure_spec",
    "new_spec",
    "run_agent",
    "worker_command",
    "zone_of_k8s_node",
]

WORKER_NICENESS = 5
"""How much lower than its agent's the worker's CPU priority is (niceness added with ``nice``). A worker can
keep every core busy (a data loader; the emulated cluster's workers on a small machine), and the agent must
still refresh its lease every TTL/3 and answer probes within 0.25 s: a starved agent loses its lease and is
declared dead while it is alive. With the CPU otherwise idle, the worker runs at full speed."""
MAX_WORKER_FAILURES = 3
"""Worker failures in a row (without the job ending) after which an agent gives up."""
AGENT_PREEMPTED = 3
"""Exit status of an agent whose preemption notice's deadline passed."""


class AgentError(Exception):
    """Bad input for the agent (a flag, or a conflict with the job's stored spec): one line, exit status 2."""


@attrs.frozen
class AgentOptions:
    """Everything ``bamboo-launch agent`` takes (see ``bamboo-launch agent --help``).

    ``spec`` holds the job-spec fields this agent was given explicitly (field -> value, see
    :data:`bamboo.launch.spec.FLAG_OF`): the first agent writes them (with the defaults for the rest),
    later agents check them against the stored spec.
    """

    job: str
    etcd: EtcdAccess
    node: str
    zone: str = ""
    k8s_node: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    run_dir: str = "."
    events: str | None = None
    spec: Mapping[str, Any] = attrs.field(factory=dict)
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None
    """The name peers check in this agent's certificate (one certificate for every pod of the job)."""
    insecure: bool = False
    notice_window_s: float = membership_timeouts.NOTICE_WINDOW_S
    """Seconds from SIGTERM (a preemption notice) to the machine's end (``--notice-window``)."""
    preemption_notices: str = "none"
    """Also poll the cloud's metadata server for preemption notices: ``none``, ``aws`` or ``gce``."""
    metadata_url: str | None = None
    """The metadata server's base URL (default: the cloud's own)."""
    spec_timeout_s: float = timeouts.SPEC_WAIT_S
    device: str | None = None
    """The worker's device (``--device``, given to it as ``BAMBOO_DEVICE``); None: its own default."""

    def __attrs_post_init__(self) -> None:
        if not self.node or "/" in self.node:
            raise AgentError(f"--node must be a non-empty id without '/', got {self.node!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise AgentError(f"--tls-cert and --tls-key go together (got cert={self.tls_cert!r}, key={self.tls_key!r})")


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


def describe_model(fields: Mapping[str, Any], log: Path, *, in_process: bool = False) -> dict[str, Any]:
    """The model's description for the job's spec fields ``fields``: ``{"layers", "config", "micro_batches"}``.

    A script is run in ``describe`` mode in a child process (its output goes to ``log``). The built-in
    example is described in a child process too, so that an agent never imports torch, unless
    ``in_process`` (the emulated cluster's launcher, which imports torch anyway).
    """
    from bamboo.launch.script import ScriptError, describe_script

    pipelines = int(fields["pipelines"])
    script = tuple(fields.get("script", ()))
    if script:
        try:
            return describe_script(script, log, pipelines=pipelines,
                                   timeout_s=timeouts.SCRIPT_DESCRIBE_TIMEOUT_S)
        except ScriptError as error:
            raise AgentError(str(error)) from None
    layers = int(fields.get("size", {}).get("layers", 4))
    if in_process:
        from bamboo.launch.example import EXAMPLE_CONFIG, describe_program, example_program

        return describe_program(example_program({"layers": layers}, dict(EXAMPLE_CONFIG), 0), pipelines)
    out = log.with_suffix(".json")
    with open(log, "wb") as sink:
        status = run_to_end([sys.executable, "-m", "bamboo.launch.example", "--layers", str(layers),
                             "--pipelines", str(pipelines), "--out", str(out)],
                            env=os.environ, stdout=sink, timeout_s=timeouts.SCRIPT_DESCRIBE_TIMEOUT_S)
    if status != 0:
        raise AgentError(f"the built-in example could not be described (status {status}, log: {log})")
    return json.loads(out.read_text())


def new_spec(job: str, fields: Mapping[str, Any], description: Mapping[str, Any]) -> JobSpec:
    """The spec of a new job from its fields and its model's description (:class:`AgentError` when invalid)."""
    try:
        return JobSpec(job=job, layers=description["layers"], config=description["config"],
                       micro_batches=int(description["micro_batches"]), created_unix=time.time(), **fields)
    except (TypeError, ValueError) as error:
        raise AgentError(str(error)) from None


def ensure_spec(membership: Any, options: AgentOptions, say: Callable[[str], None]) -> tuple[JobSpec, bool]:
    """The job's spec from etcd, written by this agent when there is none yet; returns (spec, written here).

    Raises :class:`AgentError` when this agent's flags conflict with the stored spec.
    """
    kv, key = membership.kv, membership.keys.root + "spec"
    deadline = time.monotonic() + options.spec_timeout_s
    while True:
        found = kv.get(key)
        if found is not None:
            spec = JobSpec.from_json(found.value)
            conflicts = spec.conflicts(options.spec)
            if conflicts:
                raise AgentError(f"job {options.job}: " + "; ".join(conflicts))
            return spec, False
        if "stages" not in options.spec or "pipelines" not in options.spec:
            raise AgentError(f"job {options.job} has no spec in etcd yet: the first agent needs --stages and "
                             "--pipelines to create it")
        lease = kv.grant_lease(max(1, int(options.spec.get("ttl", 2))) + 8)
        won, holder = kv.create(membership.keys.root + "spec-writer", options.node.encode(), lease=lease)
        if not won:
            kv.revoke_lease(lease)
            if time.monotonic() > deadline:
                raise AgentError(f"job {options.job}: no spec within {options.spec_timeout_s:g} s (agent "
                                 f"{holder.value.decode(errors='replace')} was writing it)")
            time.sleep(timeouts.SPEC_POLL_S)
            continue
        try:
            refuse_used_checkpoint_dir(options.spec.get("checkpoint_dir"), bool(options.spec.get("resume")))
            say(f"writing the spec of job {options.job}: reading the model")
            fields = dict(options.spec)
            log = Path(options.run_dir) / "logs" / f"describe-{options.node}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            spec = new_spec(options.job, fields, describe_model(fields, log))
            won, stored = kv.create(key, spec.to_json().encode())
            return (spec, True) if won else (JobSpec.from_json(stored.value), False)
        finally:
            kv.revoke_lease(lease)


def refuse_used_checkpoint_dir(directory: str | None, resume: bool) -> None:
    """A new job never overwrites the checkpoints of another run: a checkpoint directory that holds some is
    refused unless the job resumes from them (:class:`AgentError`, one line)."""
    if directory is None or resume:
        return
    from bamboo.launch.checkpoint import list_checkpoints

    found = list_checkpoints(directory)
    if found:
        raise AgentError(f"--checkpoint-dir {directory} holds the checkpoints of another run (steps "
                         f"{', '.join(str(step) for step, _ in found[:3])}{', ...' if len(found) > 3 else ''}): pass "
                         "--resume to continue from the newest, or give an empty directory")


class _Supervisor:
    """One incarnation of the agent: its registration, coordinator and worker."""

    def __init__(self, options: AgentOptions, spec: JobSpec, membership: Any, node: str, zone: str,
                 say: Callable[[str], None], wake: threading.Event, returns: str | None = None) -> None:
        self.options, self.wake = options, wake  # wake: look again (the job's end, the worker's exit, SIGTERM)
        self.spec = spec
        self.membership = membership
        self.node = node
        self.returns = returns  # the previous incarnation's identity (this machine was not preempted)
        self.zone = zone
        self.say = say

    def start(self, announce: bool, wrote_spec: bool) -> None:
        from bamboo.launch.coordinator import Coordinator
        from bamboo.launch.events import EtcdEventLog, Join, RunStart
        from bamboo.membership import DetectorConfig, NodeAgent, WatchedKey, preemption_hook

        options, spec = self.options, self.spec
        # Only the elected coordinator's detector follows the membership (bamboo.membership.detector).
        self.agent = NodeAgent(self.membership, self.node, zone=self.zone, host=options.host, port=options.port,
                               ttl=spec.ttl, tls=_tls(options), detector_config=DetectorConfig(grace_period=spec.grace_s),
                               notice_window=options.notice_window_s, follow_membership=False, **_agent_auth(options))
        self.agent.start()
        end = self.membership.keys.decision("end")
        self.end = WatchedKey(self.membership.kv, end, on_change=lambda _: self.wake.set())
        self.fenced = self.membership.fenced(self.agent.registration)
        self.say(f"node {self.node} ({self.zone or 'no zone'}) registered; agent at {self.agent.address}")
        self.events = EtcdEventLog(self.fenced.kv, spec.job, f"{self.node}.agent.{os.getpid()}", spec.created_unix,
                                   local=options.events, guard=self.fenced.guard)
        if wrote_spec:
            self.events.write(RunStart(t=self.events.now(), job=spec.job, unix_time=spec.created_unix,
                                       target_nodes=spec.first_layout_nodes, stages=spec.stages,
                                       pipelines=spec.pipelines))
        if announce:
            self.events.write(Join(t=self.events.now(), node=self.node, zone=self.zone or "default",
                                   returns=self.returns))
        self.coordinator = Coordinator(self.fenced, self.agent, spec, self.events, say=self.say).start()
        hook = preemption_hook(options.preemption_notices, options.metadata_url)
        if hook is not None:  # the cloud's notice becomes this node's preemption notice, as SIGTERM does
            self.agent.watch_preemption_hook(hook)

    def context(self) -> WorkerContext:
        options, registration = self.options, self.agent.registration
        return WorkerContext(job=self.spec.job, node=self.node, zone=self.zone, agent_address=self.agent.address,
                             etcd=options.etcd, run_dir=options.run_dir, fence_key=registration.key,
                             fence_revision=registration.create_revision, fence_lease=registration.lease_id,
                             agent_token_file=options.token_file,
                             agent_tls_ca=options.tls_ca, agent_tls_cert=options.tls_cert,
                             agent_tls_key=options.tls_key, agent_tls_server_name=options.tls_server_name)

    def spawn(self) -> subprocess.Popen[bytes] | ForkedProcess:
        folder = Path(self.options.run_dir) / "workers"
        folder.mkdir(parents=True, exist_ok=True)
        path = folder / f"{self.node}.json"
        self.context().write(path)
        command, variables = worker_command(self.spec, path, self.node)
        variables[SPAWNED_ENV] = repr(time.time())  # the worker's start-up record counts from here
        if self.options.host not in ("0.0.0.0", "::"):  # gloo listens where the agent does (the pod IP)
            variables["BAMBOO_GLOO_HOST"] = self.options.host
        if self.options.device is not None:  # bamboo.rc.device.DEVICE_ENV: the worker's initialize reads it
            variables["BAMBOO_DEVICE"] = self.options.device
        self.say(f"node {self.node}: spawning its worker")
        # The worker stays in this process group: a kill of the machine (or of the emulated node) takes both.
        # On an emulated cluster's node, it is forked from the cluster's preloaded interpreter.
        return spawn(command, env={**os.environ, **variables},
                     niceness=WORKER_NICENESS if shutil.which("nice") is not None else 0)

    def ended(self, *, fresh: bool = False) -> JobEnd | None:
        """The job's end record, once written (followed by a watch: no request; ``fresh`` reads etcd now)."""
        try:
            if fresh:
                return read_record(JobEnd, self.membership.get_decision("end"))
            found = self.end.value
            return None if found is None else JobEnd.from_dict(json.loads(found.value))
        except Exception:  # etcd restarting, or a record this reader cannot read: the job's writer decides
            return None

    def worker_error(self) -> str | None:
        try:
            found = read_record(WorkerError, self.membership.get_decision(f"error-{self.node}"))
        except Exception:
            return None
        return None if found is None else found.error

    def handed_over(self) -> bool:
        try:
            return self.membership.get_decision(f"handover-{self.node}") is not None
        except Exception:
            return False

    def was_warm(self) -> bool:
        try:
            return read_record(WorkerWarm, self.membership.get_decision(f"warm-{self.node}")) is not None
        except Exception:
            return True

    def stop(self, *, leave: bool) -> None:
        self.coordinator.stop()
        self.end.close()
        self.events.close()
        if leave:
            self.agent.stop(leave=True)
            return
        # This identity is dead from now on: revoke its lease, so every view drops it at once and every
        # write it (or its worker) might still attempt is fenced.
        self.agent.stop(leave=False)
        try:
            self.membership.kv.revoke_lease(self.agent.registration.lease_id)
        except Exception as error:
            self.say(f"node {self.node}: could not revoke its lease ({error}); it expires after {self.spec.ttl} s")


def worker_command(spec: JobSpec, context_path: Path, node: str) -> tuple[list[str], dict[str, str]]:
    """The worker's command line and the variables added to the agent's environment for it."""
    if spec.script:
        from bamboo.launch.script import worker_environment

        return [sys.executable, *spec.script], worker_environment(context_path=context_path, node=node)
    return [sys.executable, "-m", "bamboo.launch.worker"], {ENV_CONTEXT: str(context_path)}


def _tls(options: AgentOptions) -> Any:
    if options.tls_cert is None:
        return None
    from bamboo.membership import TlsFiles

    return TlsFiles(options.tls_cert, options.tls_key or "", options.tls_ca, options.tls_server_name)


def _agent_auth(options: AgentOptions) -> dict[str, Any]:
    auth: dict[str, Any] = {"insecure": options.insecure}
    if options.token_file:
        auth["token"] = Path(options.token_file).read_text().strip()
    return auth


def _kill(worker: subprocess.Popen[bytes] | ForkedProcess) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGKILL)
        worker.wait()


def run_agent(options: AgentOptions, say: Callable[[str], None] | None = None) -> int:
    """Run the agent to the end of the job (see the module docstring); returns the exit status."""
    from bamboo.launch.notices import PatientKV
    from bamboo.membership import EtcdKV, MembershipStore

    say = say or (lambda line: print(f"bamboo-launch agent: {line}", flush=True))
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
            supervisor = _Supervisor(options, spec, membership, node, zone, say, wake, returns=previous)
            # every incarnation joins (its old identity's preemption record stops that one's billing): a report must
            # never meet the preemption of a node that never joined
            supervisor.start(announce=True, wrote_spec=wrote and incarnation == 1)
            if noticed.is_set():
                supervisor.agent.notify(time.time() + options.notice_window_s, "sigterm")
            status, why = _supervise(supervisor, noticed, options.notice_window_s)
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


def _supervise(supervisor: _Supervisor, noticed: threading.Event, window_s: float) -> tuple[int | None, str]:
    """Run the worker of one incarnation: (exit status, "") when the agent is done, or (None, why) when it
    must come back as a fresh node."""
    say, node = supervisor.say, supervisor.node
    worker = supervisor.spawn()
    threading.Thread(target=lambda: (worker.wait(), supervisor.wake.set()), daemon=True).start()
    deadline: float | None = None
    while True:
        supervisor.wake.clear()
        end = supervisor.ended()
        if end is not None:
            try:
                worker.wait(timeouts.WORKER_EXIT_GRACE_S)
            except subprocess.TimeoutExpired:
                say(f"node {node}: the worker did not exit {timeouts.WORKER_EXIT_GRACE_S:g} s after the job "
                    "ended; killing it")
                _kill(worker)
            supervisor.stop(leave=True)
            if end.error is not None:
                say(f"error: the job ended with an error (from {end.node}): {end.error}")
                return AGENT_JOB_FAILED, ""
            say(f"the job ended after {end.steps} steps")
            return AGENT_DONE, ""
        if noticed.is_set() and not supervisor.agent.noticed.is_set():
            supervisor.agent.notify(time.time() + window_s, "sigterm")
        if supervisor.agent.noticed.is_set() and deadline is None:
            due = supervisor.agent.notice_deadline or time.time() + window_s
            deadline = time.monotonic() + max(0.0, due - time.time())
            say(f"node {node}: preemption notice; the machine goes away in {due - time.time():.1f} s")
        if deadline is not None and time.monotonic() >= deadline:
            _kill(worker)
            supervisor.agent.stop(leave=False)
            return AGENT_PREEMPTED, ""
        if supervisor.agent.lease_lost.is_set():
            _kill(worker)
            return None, "this node was declared dead (its lease is gone)"
        code = worker.poll()
        if code is not None and supervisor.ended(fresh=True) is None:
            if code == 0 and supervisor.handed_over():  # it left at a step boundary after its notice
                say(f"node {node}: handed its stage over after the preemption notice; leaving")
                supervisor.stop(leave=True)
                return AGENT_PREEMPTED, ""
            if code == 0 and not supervisor.was_warm():
                return None, (f"worker exited with status 0 without calling bamboo.launch.train_worker "
                              f"({' '.join(supervisor.spec.script)})")
            if code == 0:
                time.sleep(timeouts.AGENT_POLL_S)  # it wrote the job's end just before it exited
                if supervisor.ended(fresh=True) is not None:
                    continue
            return None, f"worker exited with status {code}"
        supervisor.wake.wait(timeouts.AGENT_POLL_S)  # no polling: the worker's exit and the job's end wake it


def default_run_dir(job: str) -> str:
    """Where an agent keeps its files when ``--run-dir`` is not given."""
    return str(Path(tempfile.gettempdir()) / f"bamboo-{job}")


def split_flags(values: Mapping[str, Any], names: Sequence[str]) -> dict[str, Any]:
    """The job-spec fields among ``values`` (the flags that were given: not None)."""
    return {name: values[name] for name in names if values.get(name) is not None}
