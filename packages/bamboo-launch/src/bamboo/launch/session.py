"""A worker's session with its job: its connections (etcd, the c10d store, its agent), the job's spec, its
preemption notice, the job's end, and the waits every part of the worker shares.

:class:`WorkerSession` lives as long as the worker process, across every layout the node has a role in
(:mod:`bamboo.launch.worker` runs it). Every write it makes to etcd is fenced by the agent's registration.
"""

from __future__ import annotations

import datetime
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from bamboo.launch import timeouts
from bamboo.launch.json_types import JSONObject
from bamboo.launch.records import JobEnd, RecordError
from bamboo.launch.role_watch import RoleWatch
from bamboo.launch.spec import WORKER_ERROR, JobSpec, Program, WorkerContext

if TYPE_CHECKING:
    import grpc
    from bamboo.launch.copy_service import CopyService
    from bamboo.membership import MembershipStore, WatchEvent
    from bamboo.rc import StageExecutor
    from bamboo.reconfig import JobLayout

__all__ = ["AgentAuth", "JobCannotContinue", "NotEnoughNodes", "WorkerSession", "agent_auth", "decision_prefix",
           "fenced", "read_spec"]


class JobCannotContinue(RuntimeError):
    """The job cannot go on (say, no number of pipelines left can split its global batch): the worker
    ends the job with this error."""


class NotEnoughNodes(RuntimeError):
    """Too few live nodes for one pipeline: the holders wait at the barrier for more."""


def read_spec(membership: MembershipStore) -> JobSpec:
    """The job's spec from etcd (a clear error when there is none)."""
    found = membership.kv.get(membership.keys.root + "spec")
    if found is None:
        raise RuntimeError(f"job {membership.keys.job} has no spec in etcd (its agents write it)")
    return JobSpec.from_json(found.value)


class WorkerSession:
    """One worker's connections and view of the job across layouts."""

    def __init__(self, context: WorkerContext, program: Program) -> None:
        from bamboo.launch.events import EtcdEventLog, EtcdEventReader
        from bamboo.launch.notices import PatientKV
        from bamboo.launch.step_records import worker_writer
        from bamboo.membership import AgentClient, EtcdKV, EtcdStore, MembershipStore, c10d_prefix
        from bamboo.rc import CommTimeouts

        self.context = context
        self.program = program
        self.node = context.node
        self.kv = EtcdKV(context.etcd.options())
        patient = PatientKV(self.kv)  # an etcd restart pauses this worker instead of failing it
        self.membership = fenced(MembershipStore(patient, context.job), context)  # type: ignore[arg-type]
        self.spec = read_spec(self.membership)
        self.timeouts = CommTimeouts(group=self.spec.group_timeout_s, confirm=self.spec.confirm_timeout_s)
        self.store = EtcdStore(patient, c10d_prefix(context.job, "rc"),  # type: ignore[arg-type]
                               timeout=datetime.timedelta(seconds=self.timeouts.build))
        self.agent = AgentClient(context.agent_address, name=f"worker-{self.node}", **agent_auth(context))
        self.log = EtcdEventLog(self.membership.kv, context.job, worker_writer(self.node, os.getpid()),
                                self.spec.created_unix, guard=self.membership.guard)
        self.event_reader = EtcdEventReader(self.membership.kv, context.job)
        """The job's event log, read for each layout this worker decides (only what is new at each read)."""
        self.layers = self.spec.reconfig_layers()
        self.copies: CopyService | None = None
        """This worker's in-memory copies (None: it keeps none)."""
        self.warm_at: float | None = None
        """When this worker became warm (its model built, waiting for a role; wall clock), once it has."""
        self.notice_deadline: float | None = None  # this node's preemption deadline, once its agent was told
        self._notice_watch = self.membership.watch_notices(self._on_notice)
        found = self.kv.get(self.membership.keys.notice(self.node))
        if found is not None:
            self._on_notice_value(found.value)
        self._end_watch = self.kv.watch_prefix(self.membership.keys.decision("end"), self._on_end)
        self.roles = RoleWatch(self.membership, self.node, follow_decisions=True)
        """The job's layout and end, followed by watches (no etcd read per look)."""

    def report_suspect(self, node: str, reason: str) -> None:
        """Tell this node's agent that ``node`` failed an operation (its detector probes it, and a confirmed failure
        revokes that node's lease at once). Best effort: when the agent is gone too, the node's lease tells the job."""
        try:
            self.agent.report_peer_failure(node, reason)
        except Exception as error:
            print(f"node {self.node}: could not report {node} to the agent: {error}", file=sys.stderr, flush=True)

    def _on_end(self, event: WatchEvent) -> None:
        """A job that ended with an error needs nothing more of this worker: it exits at once, wherever it is
        (waiting for a role, at a barrier, blocked on a peer), instead of being killed by its agent later."""
        if event.key != self.membership.keys.decision("end") or not event.value:
            return
        try:
            end = JobEnd.from_dict(json.loads(event.value))
        except (ValueError, RecordError):
            return
        if end.error is None:
            return
        print(f"node {self.node}: the job ended with an error (from {end.node}): {end.error}; exiting",
              file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(WORKER_ERROR)

    def _on_notice(self, event: WatchEvent) -> None:
        if event.value and event.key == self.membership.keys.notice(self.node):
            self._on_notice_value(event.value)

    def _on_notice_value(self, value: bytes) -> None:
        from bamboo.membership.records import PreemptionNotice, decode_message

        notice = decode_message(self.membership.keys.notice(self.node), value, PreemptionNotice)
        if self.notice_deadline is None:
            print(f"node {self.node}: preemption notice: the machine goes away at {notice.deadline:.1f} "
                  f"(in {notice.deadline - time.time():.1f} s)", flush=True)
            self.notice_deadline = float(notice.deadline)

    def ended(self) -> JobEnd | None:
        return self.roles.ended()

    def layout(self) -> JobLayout | None:
        return self.roles.layout()

    def wait_decision(self, name: str, timeout: float) -> JSONObject:
        deadline = time.monotonic() + timeout
        while True:
            try:
                found = self.membership.get_decision(name)
            except Exception:
                found = None
            if found is not None:
                return found.value
            if time.monotonic() > deadline:
                raise RuntimeError(f"decision {name} not taken within {timeout:g} s")
            time.sleep(timeouts.DECISION_POLL_S)

    def tell_runtime_of_notice(self, executor: StageExecutor, told: set[int]) -> None:
        """Hand this node's preemption deadline to the runtime (once per executor): at the start of its next
        step it hands its stage over after that step if the deadline leaves time, else it keeps going and
        its death at the deadline is an ordinary failure."""
        if self.notice_deadline is None or id(executor) in told:
            return
        executor.coordinator.tell_notice(self.notice_deadline)
        told.add(id(executor))

    def close(self) -> None:
        self._notice_watch.cancel()
        self._end_watch.cancel()
        self.roles.close()
        if self.copies is not None:
            self.copies.close()
        self.log.close()


def fenced(membership: MembershipStore, context: WorkerContext) -> MembershipStore:
    """``membership`` with every write guarded by the agent's registration (when the agent gave one)."""
    if not context.fence_key:
        return membership
    from bamboo.membership import Guard

    return membership.fenced(Guard(node=context.node, key=context.fence_key, create_revision=context.fence_revision,
                                   lease=context.fence_lease))


class AgentAuth(TypedDict, total=False):
    """How to call the agent's gRPC service (``AgentClient``'s keyword arguments): its job token, or the channel
    credentials and options of its TLS files; none of them for an agent that checks neither."""

    token: str
    credentials: grpc.ChannelCredentials
    channel_options: list[tuple[str, str]]


def agent_auth(context: WorkerContext) -> AgentAuth:
    """How to call the agent's gRPC service: its job token or its TLS files."""
    options: AgentAuth = {}
    if context.agent_token_file:
        options["token"] = Path(context.agent_token_file).read_text().strip()
    if context.agent_tls_ca:
        from bamboo.membership import TlsFiles

        files = TlsFiles(context.agent_tls_cert or "", context.agent_tls_key or "", context.agent_tls_ca,
                         context.agent_tls_server_name)
        options["credentials"] = files.channel_credentials()
        options["channel_options"] = files.channel_options()
    return options


def decision_prefix(generation: int, attempt: int) -> str:
    """Decision names of the barrier of ``generation``: ``g<g>-`` for its first attempt, ``g<g>-a<k>-`` after."""
    return f"g{generation}-" if attempt == 0 else f"g{generation}-a{attempt}-"
