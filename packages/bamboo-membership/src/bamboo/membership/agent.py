"""The per-node agent: the gRPC `Agent` service, its registration in etcd, and preemption notices.

One `NodeAgent` runs on each node. It

- serves `bamboo.membership.v1.Agent` (Probe, Notify, ReportPeerFailure, Subscribe), bound to loopback
  by default, with optional TLS (`TlsFiles`); `AgentClient` is the worker's side of it;
- registers the node's record in etcd under a lease (TTL `ttl`) that it keeps alive;
- runs a `FailureDetector` (its probes use `GrpcProber`) and streams its `NodeFailed` events, and every
  preemption notice of the job, to local subscribers (the worker);
- turns SIGTERM (`install_sigterm_handler`) and an optional cloud preemption-notice hook
  (`watch_preemption_hook`) into a `Notify`: a `PreemptionNotice` published to etcd, with the record's
  state set to PREEMPTING.

Run one as a process with `python -m bamboo.membership --help`.

Timeouts (seconds): `ttl` (lease, default 2); `notice_window` (how far in the future a SIGTERM notice
puts the deadline, default 30, the GCP spot notice); `hook_interval` (how often the preemption hook is
polled, default 1); `stream_poll` (how often a Subscribe stream checks that its client is still there,
default 0.5); the detector's own timings are in `DetectorConfig`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import attrs
import grpc
from bamboo.membership.detector import DetectorConfig, FailureDetector, ProbeOutcome, ProbeResult
from bamboo.membership.kv import EtcdKV, EtcdOptions, EventKind, StoreError, WatchEvent, WatchHandle
from bamboo.membership.records import (
    FailureReport,
    MalformedValueError,
    NodeFailed,
    NodeRecord,
    NodeState,
    PreemptionNotice,
    decode_message,
)
from bamboo.membership.store import MembershipStore, Registration
from bamboo.membership.v1 import membership_pb2 as pb
from bamboo.membership.v1 import membership_pb2_grpc as pb_grpc

__all__ = ["AgentClient", "GrpcProber", "NodeAgent", "TlsFiles", "main"]

log = logging.getLogger(__name__)


def _check_file(name: str, path: str) -> None:
    if not Path(path).is_file():
        raise ValueError(f"TlsFiles.{name}: no such file {path!r}")


@attrs.frozen
class TlsFiles:
    """PEM files for the agent's TLS. The server uses `cert` and `key`; clients verify against `ca`."""

    cert: str = attrs.field(validator=lambda _, a, v: _check_file(a.name, v))
    key: str = attrs.field(validator=lambda _, a, v: _check_file(a.name, v))
    ca: str | None = attrs.field(default=None, validator=lambda _, a, v: v is None or _check_file(a.name, v))

    def server_credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials([(Path(self.key).read_bytes(), Path(self.cert).read_bytes())])

    def channel_credentials(self) -> grpc.ChannelCredentials:
        ca = Path(self.ca or self.cert).read_bytes()
        return grpc.ssl_channel_credentials(root_certificates=ca)


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


class GrpcProber:
    """Probes an agent over gRPC on a fresh channel each time, so an earlier failure cannot mask a recovery.

    Connection refused maps to REFUSED, a missed deadline to TIMEOUT. `credentials` enables TLS.
    """

    def __init__(self, from_node: str = "", credentials: grpc.ChannelCredentials | None = None) -> None:
        self.from_node = from_node
        self.credentials = credentials

    def __call__(self, record: NodeRecord, timeout: float) -> ProbeResult:
        target = f"{record.address}:{record.agent_port}"
        channel = (
            grpc.secure_channel(target, self.credentials)
            if self.credentials is not None
            else grpc.insecure_channel(target)
        )
        try:
            reply = pb_grpc.AgentStub(channel).Probe(pb.ProbeRequest(from_node=self.from_node), timeout=timeout)
            return ProbeResult(ProbeOutcome.ALIVE, incarnation=reply.incarnation, progress=reply.progress)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            detail = f"{code}: {exc.details() if hasattr(exc, 'details') else exc}"
            if code == grpc.StatusCode.UNAVAILABLE:
                return ProbeResult(ProbeOutcome.REFUSED, detail=detail)
            return ProbeResult(ProbeOutcome.TIMEOUT, detail=detail)
        finally:
            channel.close()


class _Servicer(pb_grpc.AgentServicer):
    def __init__(self, agent: NodeAgent) -> None:
        self.agent = agent

    def Probe(self, request: pb.ProbeRequest, context: grpc.ServicerContext) -> pb.ProbeResponse:
        record = self.agent.record
        return pb.ProbeResponse(
            node=record.id, incarnation=record.incarnation, progress=self.agent.progress(), state=record.state
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
    stream. `timeout` (seconds, default 5) bounds each unary call.
    """

    def __init__(self, address: str, *, credentials: grpc.ChannelCredentials | None = None,
                 timeout: float = 5.0, name: str = "worker") -> None:
        self.address = address
        self.timeout = timeout
        self.name = name
        self._channel = (grpc.secure_channel(address, credentials) if credentials is not None
                         else grpc.insecure_channel(address))
        self._stub = pb_grpc.AgentStub(self._channel)

    def probe(self) -> pb.ProbeResponse:
        return self._stub.Probe(pb.ProbeRequest(from_node=self.name), timeout=self.timeout)

    def report_peer_failure(self, node: str, reason: str) -> bool:
        """Returns whether the agent's detector took the report (False: the agent runs no detector)."""
        request = pb.PeerFailureRequest(node=node, reason=reason)
        return self._stub.ReportPeerFailure(request, timeout=self.timeout).accepted

    def notify(self, notice: PreemptionNotice) -> bool:
        return self._stub.Notify(pb.NotifyRequest(notice=notice), timeout=self.timeout).published

    def events(self) -> Iterator[NodeFailed | PreemptionNotice]:
        """Cluster events as they happen: `NodeFailed` or `PreemptionNotice`. Ends when the agent stops
        or `close()` is called; `grpc.RpcError` if the agent goes away."""
        stream = self._stub.Subscribe(pb.SubscribeRequest(subscriber=self.name))
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
    """One node's agent: gRPC server, lease-held record, failure detector, preemption notices."""

    def __init__(
        self,
        store: MembershipStore,
        node_id: str,
        *,
        zone: str = "",
        incarnation: int = 1,
        host: str = "127.0.0.1",
        port: int = 0,
        ttl: int = 2,
        tls: TlsFiles | None = None,
        detector_config: DetectorConfig | None = None,
        run_detector: bool = True,
        progress: Callable[[], int] = lambda: 0,
        notice_window: float = 30.0,
        stream_poll: float = 0.5,
        max_workers: int = 8,
    ) -> None:
        self.store = store
        self.node_id = node_id
        self.zone = zone
        self.incarnation = incarnation
        self.host = host
        self.port = port
        self.ttl = ttl
        self.tls = tls
        self.progress = progress
        self.notice_window = notice_window
        self.stream_poll = stream_poll
        self._max_workers = max_workers
        self._server: grpc.Server | None = None
        self.registration: Registration | None = None
        self.detector: FailureDetector | None = None
        if run_detector:
            prober = GrpcProber(node_id, tls.channel_credentials() if tls else None)
            self.detector = FailureDetector(store, node_id, prober, detector_config)
        self._subscribers: list[queue.Queue[pb.ClusterEvent | None]] = []
        self._notice_watch: WatchHandle | None = None
        self._stopping = threading.Event()
        self._noticed = threading.Event()
        self.lease_lost = threading.Event()
        """Set when this node's lease expired under it (e.g. it was stopped longer than the TTL): the cluster
        has declared it failed, so this process must not carry on as that node."""

    @property
    def record(self) -> NodeRecord:
        if self.registration is not None:
            return self.registration.record
        return NodeRecord(id=self.node_id, zone=self.zone, address=self.host, agent_port=self.port,
                          incarnation=self.incarnation)

    @property
    def address(self) -> str:
        return f"{self.host}:{self.port}"

    def start(self) -> NodeAgent:
        """Bind the gRPC server, register the node, start the detector and the notice watch."""
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=self._max_workers,
                                                        thread_name_prefix=f"bamboo-agent-{self.node_id}"))
        pb_grpc.add_AgentServicer_to_server(_Servicer(self), server)
        bind = f"{self.host}:{self.port}"
        bound = (server.add_secure_port(bind, self.tls.server_credentials()) if self.tls
                 else server.add_insecure_port(bind))
        if bound == 0:
            raise OSError(f"agent {self.node_id}: cannot bind {bind}")
        self.port = bound
        server.start()
        self._server = server
        record = NodeRecord(id=self.node_id, zone=self.zone, address=self.host, agent_port=self.port,
                            incarnation=self.incarnation, state=NodeState.NODE_STATE_JOINING)
        try:
            self.registration = self.store.register(record, self.ttl, on_lost=self._on_lease_lost)
        except BaseException:
            server.stop(0)
            self._server = None
            raise
        if self.detector is not None:
            self.detector.subscribe(self._on_node_failed)
            self.detector.start()
        self._notice_watch = self.store.watch_notices(self._on_notice_event)
        return self

    def report_peer_failure(self, node: str, reason: str) -> None:
        """The local runtime's P2P to `node` failed (forwarded to the detector)."""
        if self.detector is None:
            raise RuntimeError(f"agent {self.node_id} runs no failure detector")
        self.detector.report_peer_failure(node, reason, reporter=self.node_id)

    def notify(self, deadline: float, source: str) -> bool:
        """This node will be preempted by `deadline` (unix seconds): publish the notice, mark the record.

        Returns False when etcd could not be reached (the lease path will still catch the departure).
        """
        notice = PreemptionNotice(node=self.node_id, incarnation=self.incarnation, deadline=deadline, source=source)
        self._noticed.set()
        try:
            self.store.publish_notice(notice)
            if self.registration is not None:
                self.registration.update(state=NodeState.NODE_STATE_PREEMPTING)
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

    def watch_preemption_hook(self, hook: Callable[[], float | None], interval: float = 1.0) -> threading.Thread:
        """Poll `hook()` every `interval` s (e.g. a cloud metadata query); when it returns a deadline, notify once."""

        def poll() -> None:
            while not self._stopping.wait(interval):
                try:
                    deadline = hook()
                except Exception:
                    log.exception("agent %s: preemption hook failed", self.node_id)
                    continue
                if deadline is not None:
                    self.notify(deadline, "cloud-hook")
                    return

        thread = threading.Thread(target=poll, name=f"bamboo-preempt-hook-{self.node_id}", daemon=True)
        thread.start()
        return thread

    def _on_lease_lost(self, registration: Registration) -> None:
        log.error("agent %s: lease %x expired; this node has been declared failed", self.node_id,
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

    def stop(self, *, leave: bool = True, grace: float = 0.5) -> None:
        """Stop serving. `leave=True` marks the record LEFT and revokes the lease (not a failure)."""
        self._stopping.set()
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


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m bamboo.membership",
        description="Run one node's Bamboo agent: gRPC Agent service, lease-held node record in etcd, "
        "failure detector, preemption notices. Prints one JSON line {\"node\", \"address\", \"port\"} when ready.",
        epilog="Exit status: 0 after SIGINT (left on purpose) or at a preemption deadline; 2 on bad input or "
        "when etcd cannot be reached at start; 3 when the node's lease expired under it (it was declared "
        "failed; start again with a higher --incarnation).",
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
    parser.add_argument("--ttl", type=int, default=2, help="lease TTL in seconds (default 2)")
    parser.add_argument("--grace", type=float, default=2.0,
                        help="seconds a suspect must stay unresponsive before it is declared failed (default 2)")
    parser.add_argument("--probe-timeout", type=float, default=0.25, help="deadline of one probe, s (default 0.25)")
    parser.add_argument("--notice-window", type=float, default=30.0,
                        help="seconds from SIGTERM to the preemption deadline; the agent exits then (default 30)")
    parser.add_argument("--no-detector", action="store_true", help="do not run a failure detector in this agent")
    parser.add_argument("--tls-cert", help="PEM certificate for the gRPC server (enables TLS with --tls-key)")
    parser.add_argument("--tls-key", help="PEM private key for the gRPC server")
    parser.add_argument("--tls-ca", help="PEM CA that peers' agent certificates are checked against")
    parser.add_argument("--etcd-user", help="etcd user name (with --etcd-password)")
    parser.add_argument("--etcd-password", help="etcd password")
    parser.add_argument("--etcd-ca", help="PEM CA of the etcd server (enables TLS to etcd)")
    parser.add_argument("--etcd-cert", help="PEM client certificate for etcd (with --etcd-key)")
    parser.add_argument("--etcd-key", help="PEM client key for etcd")
    parser.add_argument("--log-level", default="WARNING", help="logging level (default WARNING)")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    try:
        options = EtcdOptions(endpoints=tuple(args.etcd), user=args.etcd_user, password=args.etcd_password,
                              ca_cert=args.etcd_ca, cert_cert=args.etcd_cert, cert_key=args.etcd_key)
        config = DetectorConfig(grace_period=args.grace, probe_timeout=args.probe_timeout)
        if (args.tls_cert is None) != (args.tls_key is None):
            raise ValueError(f"--tls-cert and --tls-key go together (got cert={args.tls_cert!r}, key={args.tls_key!r})")
        tls = TlsFiles(args.tls_cert, args.tls_key, args.tls_ca) if args.tls_cert else None
        kv = EtcdKV(options)
        agent = NodeAgent(MembershipStore(kv, args.job), args.node, zone=args.zone, incarnation=args.incarnation,
                          host=args.host, port=args.port, ttl=args.ttl, tls=tls, detector_config=config,
                          run_detector=not args.no_detector, notice_window=args.notice_window)
        # The handler goes in before the node registers: a SIGTERM that arrives once the node is
        # visible in etcd must become a preemption notice, never the default (silent) death.
        agent.install_sigterm_handler()
        agent.start()
    except (ValueError, OSError, StoreError) as exc:
        print(f"bamboo agent: error: {exc}", file=sys.stderr)
        return 2
    stop = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    print(json.dumps({"node": args.node, "address": agent.host, "port": agent.port}), flush=True)
    deadline: float | None = None
    while not stop.wait(0.1):
        if agent.lease_lost.is_set():
            print(f"bamboo agent: error: node {args.node} lost its lease and was declared failed; "
                  "rejoin with a higher --incarnation", file=sys.stderr)
            agent.stop(leave=False)
            kv.close()
            return 3
        if agent.noticed.is_set() and deadline is None:
            deadline = time.monotonic() + args.notice_window
        if deadline is not None and time.monotonic() >= deadline:
            # Preempted: vanish without leaving, as the machine would; the lease expiry reports it.
            agent.stop(leave=False)
            kv.close()
            return 0
    agent.stop(leave=True)
    kv.close()
    return 0
