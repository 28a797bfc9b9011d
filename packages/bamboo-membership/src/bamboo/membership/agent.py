"""The per-node agent: the gRPC `Agent` service, its registration in etcd, and preemption notices.

One `NodeAgent` runs on each node. It

- serves `bamboo.membership.v1.Agent` (Probe, Notify, ReportPeerFailure, Subscribe), bound to loopback
  by default, with optional TLS (`TlsFiles`); `AgentClient` is the worker's side of it;
- lets only the job's own processes call it, once it listens beyond loopback: with `TlsFiles.ca` the
  server asks every client for a certificate signed by that CA (mutual TLS), and with a job `token`
  every call must carry `authorization: Bearer <token>` in its metadata (checked in constant time);
  anything else is answered UNAUTHENTICATED (or fails the TLS handshake). An agent that would bind a
  non-loopback address with neither refuses to start, unless `insecure=True` (`--insecure`);
- registers the node's record in etcd under a lease (TTL `ttl`) that it keeps alive, and from then on
  writes to the job only through a store fenced by that registration (`NodeAgent.membership`): once the
  node is declared dead, its writes fail (`FencedError`) and `lease_lost` is set;
- runs a `FailureDetector` (its probes use `GrpcProber`, with the same credentials) and streams its
  `NodeFailed` events, and every preemption notice of the job, to local subscribers (the worker);
- turns SIGTERM (`install_sigterm_handler`) and an optional cloud preemption-notice hook
  (`watch_preemption_hook`, e.g. `bamboo.membership.cloud.AwsSpotNotice`) into a `Notify`: a
  `PreemptionNotice` published to etcd, with the record's state set to PREEMPTING.

A probe that the target refuses for credentials (UNAUTHENTICATED, or a failed TLS handshake on a port that
accepts connections) reads as DENIED: something alive is there, so it is never taken for a dead node.

Run one as a process with `python -m bamboo.membership --help` (`bamboo.membership.cli`); who may call
it is `bamboo.membership.auth`.

Timeouts (seconds, defaults in `bamboo.membership.timeouts`): `ttl` (`LEASE_TTL_S`); `notice_window`
(`NOTICE_WINDOW_S`); the hook's `interval` (`PREEMPTION_POLL_INTERVAL_S`); `stream_poll` (`STREAM_POLL_S`);
`AgentClient.timeout` (`AGENT_RPC_TIMEOUT_S`); `stop(grace=...)` (`SERVER_STOP_GRACE_S`); the detector's own
timings are in `DetectorConfig`.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from typing import Any

import grpc
from bamboo.membership import timeouts
from bamboo.membership.auth import (
    TOKEN_METADATA_KEY,
    TlsFiles,
    TokenCheck,
    is_loopback,
    load_token,
    token_metadata,
)
from bamboo.membership.cloud import MetadataError
from bamboo.membership.detector import DetectorConfig, FailureDetector
from bamboo.membership.kv import EventKind, Guard, StoreError, WatchEvent, WatchHandle
from bamboo.membership.probing import GrpcProber
from bamboo.membership.records import (
    FailureReport,
    MalformedValueError,
    NodeFailed,
    NodeRecord,
    NodeState,
    PreemptionNotice,
    decode_message,
)
from bamboo.membership.store import JobKeys, MembershipStore, Registration
from bamboo.membership.v1 import membership_pb2 as pb
from bamboo.membership.v1 import membership_pb2_grpc as pb_grpc

__all__ = ["TOKEN_METADATA_KEY", "AgentClient", "GrpcProber", "NodeAgent", "TlsFiles", "load_token"]

log = logging.getLogger(__name__)

def _report_of(event: NodeFailed) -> FailureReport:
    return FailureReport(
        node=event.node,
        epoch=event.epoch,
        incarnation=event.incarnation,
        detected_by=event.detected_by,
        path=pb.DetectionPath.Value(f"DETECTION_PATH_{event.path.upper()}"),
        reason=event.reason,
        detected_at=event.detected_at,
    )


class _Servicer(pb_grpc.AgentServicer):
    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    def Probe(self, request: pb.ProbeRequest, context: grpc.ServicerContext) -> pb.ProbeResponse:
        self.agent.probes_answered += 1
        record = self.agent.record
        registration = self.agent.registration
        return pb.ProbeResponse(
            node=record.id, incarnation=record.incarnation, progress=self.agent.progress(), state=record.state,
            lease=registration.lease_id if registration is not None else 0,
            record_create_revision=registration.create_revision if registration is not None else 0,
        )

    def Notify(self, request: pb.NotifyRequest, context: grpc.ServicerContext) -> pb.NotifyResponse:
        notice = request.notice
        if notice.node and notice.node != self.agent.node_id:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                          f"notice for node {notice.node!r} sent to the agent of {self.agent.node_id!r}")
        published = self.agent.notify(notice.deadline or time.time() + self.agent.notice_window,
                                      notice.source or "grpc")
        return pb.NotifyResponse(published=published)

    def ReportPeerFailure(
        self, request: pb.PeerFailureRequest, context: grpc.ServicerContext
    ) -> pb.PeerFailureResponse:
        if not request.node:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "ReportPeerFailure needs the failed node's id")
        detector = self.agent.detector
        if detector is None:
            return pb.PeerFailureResponse(accepted=False)
        detector.report_peer_failure(request.node, request.reason or "peer failure reported",
                                     reporter=request.reporter or self.agent.node_id)
        return pb.PeerFailureResponse(accepted=True)

    def Subscribe(self, request: pb.SubscribeRequest, context: grpc.ServicerContext) -> Iterator[pb.ClusterEvent]:
        events: queue.Queue[pb.ClusterEvent | None] = queue.Queue()
        self.agent._subscribers.append(events)
        context.add_callback(lambda: events.put(None))
        try:
            while context.is_active() and not self.agent._stopping.is_set():
                try:
                    event = events.get(timeout=self.agent.stream_poll)
                except queue.Empty:
                    continue
                if event is None:
                    return
                yield event
        finally:
            with contextlib.suppress(ValueError):
                self.agent._subscribers.remove(events)


class AgentClient:
    """What a local worker (the runtime) uses to talk to its node's agent over gRPC.

    `report_peer_failure(node, reason)` says "my P2P to `node` failed"; `failures()` yields
    `NodeFailed` ("`node` failed in epoch E") and `notices()` preemption notices, from one Subscribe
    stream. `timeout` (seconds, `AGENT_RPC_TIMEOUT_S`) bounds each unary call. `credentials` (e.g.
    `TlsFiles.channel_credentials()`) and `token` authenticate to an agent that requires them.
    """

    def __init__(self, address: str, *, credentials: grpc.ChannelCredentials | None = None,
                 timeout: float = timeouts.AGENT_RPC_TIMEOUT_S, name: str = "worker", token: str | None = None,
                 channel_options: Sequence[tuple[str, Any]] = ()) -> None:
        self.address = address
        self.timeout = timeout
        self.name = name
        self._metadata = token_metadata(token)
        options = list(channel_options)
        self._channel = (grpc.secure_channel(address, credentials, options=options) if credentials is not None
                         else grpc.insecure_channel(address, options=options))
        self._stub = pb_grpc.AgentStub(self._channel)

    def probe(self) -> pb.ProbeResponse:
        return self._stub.Probe(pb.ProbeRequest(from_node=self.name), timeout=self.timeout, metadata=self._metadata)

    def fence(self, job: str) -> Guard | None:
        """The agent's registration as a `Guard`, for `MembershipStore(kv, job, fence=...)` in the worker:
        the worker's writes then fail once its node is declared dead. None before the agent registered."""
        reply = self.probe()
        if not reply.lease or not reply.record_create_revision:
            return None
        return Guard(node=reply.node, key=JobKeys(job).node(reply.node),
                     create_revision=int(reply.record_create_revision), lease=int(reply.lease))

    def report_peer_failure(self, node: str, reason: str) -> bool:
        """Returns whether the agent's detector took the report (False: the agent runs no detector)."""
        request = pb.PeerFailureRequest(node=node, reason=reason)
        return self._stub.ReportPeerFailure(request, timeout=self.timeout, metadata=self._metadata).accepted

    def notify(self, notice: PreemptionNotice) -> bool:
        return self._stub.Notify(pb.NotifyRequest(notice=notice), timeout=self.timeout,
                                 metadata=self._metadata).published

    def events(self) -> Iterator[NodeFailed | PreemptionNotice]:
        """Cluster events as they happen: `NodeFailed` or `PreemptionNotice`. Ends when the agent stops
        or `close()` is called; `grpc.RpcError` if the agent goes away."""
        stream = self._stub.Subscribe(pb.SubscribeRequest(subscriber=self.name), metadata=self._metadata)
        self._stream = stream
        try:
            for event in stream:
                if event.HasField("node_failed"):
                    yield NodeFailed.from_report(event.node_failed)
                elif event.HasField("preemption"):
                    yield event.preemption
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                raise

    def close(self) -> None:
        stream = getattr(self, "_stream", None)
        if stream is not None:
            stream.cancel()
        self._channel.close()


class NodeAgent:
    """One node's agent: gRPC server, lease-held record, failure detector, preemption notices.

    The lease (`ttl` s) is refreshed every `keepalive_interval` s (default TTL/3). `token` (the job token)
    and `tls` (with a `ca`: mutual TLS) authenticate callers; binding a
    non-loopback `host` with neither raises ValueError unless `insecure=True`. `membership` is the store
    fenced by this node's registration (after `start()`): every write the agent makes goes through it.
    `follow_membership=False` makes its detector read a node's record only when it probes it, instead of
    watching every node record and failure report of the job (`bamboo.membership.detector`: at scale, one
    agent follows).
    """

    def __init__(
        self,
        store: MembershipStore,
        node_id: str,
        *,
        zone: str = "",
        incarnation: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        ttl: int = timeouts.LEASE_TTL_S,
        keepalive_interval: float | None = None,
        tls: TlsFiles | None = None,
        token: str | None = None,
        insecure: bool = False,
        detector_config: DetectorConfig | None = None,
        run_detector: bool = True,
        progress: Callable[[], int] = lambda: 0,
        notice_window: float = timeouts.NOTICE_WINDOW_S,
        stream_poll: float = timeouts.STREAM_POLL_S,
        max_workers: int = 8,
        follow_membership: bool = True,
    ) -> None:
        if token is not None and (not token or any(c.isspace() for c in token)):
            raise ValueError("NodeAgent: the job token must be a non-empty word without spaces")
        if not is_loopback(host) and not insecure and token is None and not (tls is not None and tls.mutual):
            raise ValueError(
                f"agent {node_id}: refusing to listen on {host}:{port or '<any port>'} (beyond loopback) without "
                "authentication: any process that reaches it could make this node leave. Give a job token "
                "(--token-file) or mutual TLS (--tls-cert/--tls-key with --tls-ca), or pass --insecure "
                "(insecure=True) to accept any caller"
            )
        self.store = store
        self.membership = store
        self.node_id = node_id
        self.zone = zone
        self.incarnation = incarnation
        self.host = host
        self.port = port
        self.ttl = ttl
        self.keepalive_interval = keepalive_interval
        self.tls = tls
        self.token = token
        self.insecure = insecure
        self.progress = progress
        self.notice_window = notice_window
        self.stream_poll = stream_poll
        self._max_workers = max_workers
        self.probes_answered = 0
        """Probes this agent's service has answered, for the benchmarks."""
        self._server: grpc.Server | None = None
        self.registration: Registration | None = None
        self.detector: FailureDetector | None = None
        if run_detector:
            self.detector = FailureDetector(store, node_id, self.prober(), detector_config,
                                            follow_membership=follow_membership)
        self._subscribers: list[queue.Queue[pb.ClusterEvent | None]] = []
        self._notice_watch: WatchHandle | None = None
        self._stopping = threading.Event()
        self._noticed = threading.Event()
        self.notice_deadline: float | None = None
        """The deadline (unix seconds) of the first preemption notice this node received, None before."""
        self.lease_lost = threading.Event()
        """Set when this node's lease is gone under it (it was stopped longer than the TTL, or a detector
        confirmed it dead and revoked the lease): the cluster has declared it failed, so this process must
        not carry on as that node. Set within one keepalive interval (TTL/3) of the lease going away."""

    def prober(self) -> GrpcProber:
        """A `GrpcProber` that authenticates as this agent's clients must (same TLS files and token)."""
        return GrpcProber(self.node_id, self.tls.channel_credentials() if self.tls else None, token=self.token,
                          channel_options=self.tls.channel_options() if self.tls else ())

    def client(self, *, name: str = "worker", timeout: float = timeouts.AGENT_RPC_TIMEOUT_S) -> AgentClient:
        """An `AgentClient` to this agent with the credentials it requires."""
        return AgentClient(self.address, credentials=self.tls.channel_credentials() if self.tls else None,
                           timeout=timeout, name=name, token=self.token,
                           channel_options=self.tls.channel_options() if self.tls else ())

    @property
    def record(self) -> NodeRecord:
        if self.registration is not None:
            return self.registration.record
        return NodeRecord(id=self.node_id, zone=self.zone, address=self.host, agent_port=self.port,
                          incarnation=self.incarnation)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def subscriber_count(self) -> int:
        """How many Subscribe streams are open (workers listening for cluster events)."""
        return len(self._subscribers)

    def bind(self) -> NodeAgent:
        """Bind and start the gRPC server (its port is then `port`), without registering yet; `start` does it
        when it was not done."""
        if self._server is not None:
            return self
        interceptors = [TokenCheck(self.token)] if self.token is not None else []
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                                        thread_name_prefix=f"bamboo-agent-{self.node_id}"),
                             interceptors=interceptors)
        pb_grpc.add_AgentServicer_to_server(_Servicer(self), server)
        bind = f"{self.host}:{self.port}"
        bound = (server.add_secure_port(bind, self.tls.server_credentials()) if self.tls
                 else server.add_insecure_port(bind))
        if bound == 0:
            raise OSError(f"agent {self.node_id}: cannot bind {bind}")
        self.port = bound
        server.start()
        self._server = server
        return self

    def start(self) -> NodeAgent:
        """Bind the gRPC server (unless `bind` did), register the node, start the detector and the notice watch."""
        self.bind()
        record = NodeRecord(id=self.node_id, zone=self.zone, address=self.host, agent_port=self.port,
                            incarnation=self.incarnation, state=NodeState.NODE_STATE_JOINING)
        try:
            self.registration = self.store.register(record, self.ttl, keepalive_interval=self.keepalive_interval,
                                                    on_lost=self._on_lease_lost)
            self.membership = self.store.fenced(self.registration)
            if self.detector is not None:
                self.detector.store = self.membership
                self.detector.subscribe(self._on_node_failed)
                self.detector.start()
            self._notice_watch = self.store.watch_notices(self._on_notice_event)
        except BaseException:
            self.stop(leave=True, grace=0)
            raise
        return self

    def report_peer_failure(self, node: str, reason: str) -> None:
        """The local runtime's P2P to `node` failed (forwarded to the detector)."""
        if self.detector is None:
            raise RuntimeError(f"agent {self.node_id} runs no failure detector")
        self.detector.report_peer_failure(node, reason, reporter=self.node_id)

    def notify(self, deadline: float, source: str) -> bool:
        """This node will be preempted by `deadline` (unix seconds): mark the record, then publish the notice.

        Returns False when etcd could not be reached, or this node is fenced (the lease path will still
        catch the departure).
        """
        notice = PreemptionNotice(node=self.node_id, incarnation=self.incarnation, deadline=deadline, source=source)
        if self.notice_deadline is None:
            self.notice_deadline = deadline
        self._noticed.set()
        try:
            # The record first: whoever sees the notice then finds the node PREEMPTING.
            if self.registration is not None:
                self.registration.update(state=NodeState.NODE_STATE_PREEMPTING)
            self.membership.publish_notice(notice)
        except StoreError as exc:
            log.error("agent %s: could not publish the preemption notice: %s", self.node_id, exc)
            return False
        return True

    def install_sigterm_handler(self) -> None:
        """On SIGTERM (the cloud's or Kubernetes' preemption signal), publish a notice due in `notice_window` s."""

        def handler(signum: int, frame: object) -> None:
            deadline = time.time() + self.notice_window
            threading.Thread(target=self.notify, args=(deadline, "sigterm"), daemon=True).start()

        signal.signal(signal.SIGTERM, handler)

    def watch_preemption_hook(
        self,
        hook: Callable[[], float | None],
        interval: float = timeouts.PREEMPTION_POLL_INTERVAL_S,
        *,
        source: str | None = None,
    ) -> threading.Thread:
        """Call `hook()` every `interval` s (e.g. a cloud metadata query, `bamboo.membership.cloud`); when it
        returns a deadline, notify once (with `source`, default the hook's `source` or "cloud-hook").

        The first call is made at once. A hook may block (GCE's hanging GET); one that raises is logged and
        called again after `interval`.
        """
        if not interval > 0:
            raise ValueError(f"preemption hook interval must be > 0, got {interval!r}")
        name = source or getattr(hook, "source", None) or "cloud-hook"

        def poll() -> None:
            while not self._stopping.is_set():
                try:
                    deadline = hook()
                except MetadataError as exc:
                    log.warning("agent %s: preemption hook %s: %s", self.node_id, name, exc)
                    deadline = None
                except Exception:
                    log.exception("agent %s: preemption hook %s failed", self.node_id, name)
                    deadline = None
                if deadline is not None and not self._stopping.is_set():
                    self.notify(deadline, name)
                    return
                self._stopping.wait(interval)

        thread = threading.Thread(target=poll, name=f"bamboo-preempt-hook-{self.node_id}", daemon=True)
        thread.start()
        return thread

    def _on_lease_lost(self, registration: Registration) -> None:
        log.error("agent %s: lease %x is gone; this node has been declared failed", self.node_id,
                  registration.lease_id)
        self.lease_lost.set()

    @property
    def noticed(self) -> threading.Event:
        """Set once this node received a preemption notice."""
        return self._noticed

    def _broadcast(self, event: pb.ClusterEvent) -> None:
        for subscriber in list(self._subscribers):
            subscriber.put(event)

    def _on_node_failed(self, event: NodeFailed) -> None:
        self._broadcast(pb.ClusterEvent(node_failed=_report_of(event)))

    def _on_notice_event(self, event: WatchEvent) -> None:
        if event.kind is not EventKind.PUT:
            return
        try:
            notice = decode_message(event.key, event.value, PreemptionNotice)
        except MalformedValueError as exc:
            log.error("ignoring preemption notice: %s", exc)
            return
        self._broadcast(pb.ClusterEvent(preemption=notice))

    def stop(self, *, leave: bool = True, grace: float = timeouts.SERVER_STOP_GRACE_S) -> None:
        """Stop serving. `leave=True` marks the record LEFT and revokes the lease (not a failure), then closes
        the port; `leave=False` vanishes as a crash would: the port closes first (probes are refused from then
        on), and the lease is left to expire."""
        self._stopping.set()
        if not leave and self._server is not None:
            self._server.stop(0)
        if self._notice_watch is not None:
            self._notice_watch.cancel()
        if self.detector is not None:
            self.detector.stop()
        if self.registration is not None:
            if leave:
                self.registration.leave()
            else:
                self.registration.stop_keepalive()
        for subscriber in list(self._subscribers):
            subscriber.put(None)
        if self._server is not None:
            self._server.stop(grace).wait()
