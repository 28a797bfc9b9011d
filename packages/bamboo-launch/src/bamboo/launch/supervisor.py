"""One incarnation of an agent (:class:`Supervisor`: its registration, its share of the job-wide duties, its
worker) and the loop that supervises its worker until the job ends, the machine goes, or the agent must come
back as a fresh node (:func:`supervise`)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from bamboo.launch import timeouts
from bamboo.launch.agent_options import AgentOptions
from bamboo.launch.agent_watch import AGENT_PID_ENV
from bamboo.launch.forkserver import ForkedProcess, spawn
from bamboo.launch.records import JobEnd, NodeJoined, WorkerError, WorkerWarm, read_record
from bamboo.launch.spec import AGENT_DONE, AGENT_JOB_FAILED, ENV_CONTEXT, JobSpec, WorkerContext
from bamboo.launch.worker_records import SPAWNED_ENV

if TYPE_CHECKING:
    from bamboo.membership import MembershipStore, TlsFiles

__all__ = ["AGENT_PREEMPTED", "WORKER_NICENESS", "Supervisor", "kill_worker", "supervise", "worker_command"]

WORKER_NICENESS = 5
"""How much lower than its agent's the worker's CPU priority is (niceness added with ``nice``). A worker can
keep every core busy (a data loader; the emulated cluster's workers on a small machine), and the agent must
still refresh its lease every TTL/3 and answer probes within 0.25 s: a starved agent loses its lease and is
declared dead while it is alive. With the CPU otherwise idle, the worker runs at full speed."""
AGENT_PREEMPTED = 3
"""Exit status of an agent whose preemption notice's deadline passed."""


class Supervisor:
    """One incarnation of the agent: its registration, coordinator and worker."""

    def __init__(self, options: AgentOptions, spec: JobSpec, membership: MembershipStore, node: str,
                 zone: str, say: Callable[[str], None], wake: threading.Event, returns: str | None = None) -> None:
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
                               ttl=spec.ttl, tls=agent_tls(options), detector_config=DetectorConfig(grace_period=spec.grace_s),
                               notice_window=options.notice_window_s, follow_membership=False,
                               insecure=options.insecure, token=agent_token(options))
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
            self.fenced.decide(f"joined-{self.node}", NodeJoined(self.node, time.time(), self.zone or None).to_dict())
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
        variables[AGENT_PID_ENV] = str(os.getpid())  # the worker ends with this agent, whoever forks it
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


def agent_tls(options: AgentOptions) -> TlsFiles | None:
    if options.tls_cert is None:
        return None
    from bamboo.membership import TlsFiles

    return TlsFiles(options.tls_cert, options.tls_key or "", options.tls_ca, options.tls_server_name)


def agent_token(options: AgentOptions) -> str | None:
    """The job token the agent's gRPC service asks its callers for (``--token-file``; None: it asks for none)."""
    return Path(options.token_file).read_text().strip() if options.token_file else None


def kill_worker(worker: subprocess.Popen[bytes] | ForkedProcess) -> None:
    if worker.poll() is None:
        worker.send_signal(signal.SIGKILL)
        worker.wait()


def supervise(supervisor: Supervisor, noticed: threading.Event, window_s: float) -> tuple[int | None, str]:
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
                kill_worker(worker)
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
            kill_worker(worker)
            supervisor.agent.stop(leave=False)
            return AGENT_PREEMPTED, ""
        if supervisor.agent.lease_lost.is_set():
            kill_worker(worker)
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
