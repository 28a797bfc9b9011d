"""Probes: what they answer, how the detector is configured, and the gRPC prober.

`ProbeOutcome`, `ProbeResult`, the `Prober` signature, `DetectorConfig` (grace period, probe timeout and
interval; defaults in `bamboo.membership.timeouts`), `SweepResult` (what a parallel sweep found), and
`GrpcProber`, which probes an agent's `Probe` RPC on a fresh channel. The detector itself is in
`bamboo.membership.detector`.
"""

from __future__ import annotations

import enum
import errno
import selectors
import socket
import time
from collections.abc import Callable, Mapping, Sequence
from concurrent import futures
from typing import Any

import attrs
import grpc
from bamboo.membership import timeouts
from bamboo.membership.auth import token_metadata
from bamboo.membership.records import NodeRecord
from bamboo.membership.v1 import membership_pb2 as pb
from bamboo.membership.v1 import membership_pb2_grpc as pb_grpc

__all__ = ["ConnectProber", "DetectorConfig", "GrpcProber", "ProbeOutcome", "ProbeResult", "Prober", "SweepResult",
           "connect_probe", "probe_many"]


class ProbeOutcome(enum.Enum):
    ALIVE = "alive"  # the agent answered
    REFUSED = "refused"  # nothing listens: the process is gone
    TIMEOUT = "timeout"  # no answer within the deadline: slow, stopped, or partitioned
    DENIED = "denied"  # something listens but refused the prober's credentials: alive, identity unknown


@attrs.frozen
class ProbeResult:
    outcome: ProbeOutcome
    incarnation: int = 0
    progress: int = 0
    detail: str = ""

    def proves_dead(self, record: NodeRecord) -> str | None:
        """Why this answer to a probe of ``record``'s node proves that node dead (nothing listens on its port, or
        another incarnation answered: the id was taken by a new process); None when it does not."""
        if self.outcome is ProbeOutcome.REFUSED:
            return f"probe refused: {self.detail}".rstrip(": ")
        if self.outcome is ProbeOutcome.ALIVE and self.incarnation != record.incarnation:
            return f"probe answered by incarnation {self.incarnation}, not {record.incarnation}"
        return None


Prober = Callable[[NodeRecord, float], ProbeResult]
"""Probe a node's agent with a deadline in seconds. Must not raise; must return within about the deadline."""


@attrs.frozen
class DetectorConfig:
    """Timing of the probe path (seconds).

    - `grace_period`: how long a suspect must stay unresponsive before it is declared failed; a node
      stopped for less is only slow. Keep it at or below the lease TTL.
    - `probe_timeout`: deadline of one gRPC probe.
    - `probe_interval`: pause between two probes of the same suspect.
    """

    grace_period: float = attrs.field(default=timeouts.GRACE_PERIOD_S, validator=attrs.validators.gt(0))
    probe_timeout: float = attrs.field(default=timeouts.PROBE_TIMEOUT_S, validator=attrs.validators.gt(0))
    probe_interval: float = attrs.field(default=timeouts.PROBE_INTERVAL_S, validator=attrs.validators.gt(0))

    def __attrs_post_init__(self) -> None:
        if self.probe_timeout > self.grace_period:
            raise ValueError(
                f"DetectorConfig: probe_timeout {self.probe_timeout} must not exceed grace_period {self.grace_period}"
            )


@attrs.frozen
class SweepResult:
    """What `FailureDetector.probe_all` found, by node id (each tuple sorted).

    - `confirmed`: refused, or answered by another incarnation: declared failed now;
    - `alive`: answered by the registered incarnation (or refused only the prober's credentials);
    - `slow`: no answer within the probe timeout (or no agent port to probe): now suspects, declared
      only if they stay unresponsive for the grace period;
    - `unknown`: no node record (never registered, or its lease already expired: the lease path decides);
    - `already_failed`: declared failed in the current epoch before the sweep.
    """

    confirmed: tuple[str, ...] = ()
    alive: tuple[str, ...] = ()
    slow: tuple[str, ...] = ()
    unknown: tuple[str, ...] = ()
    already_failed: tuple[str, ...] = ()


def _tcp_refused(host: str, port: int, timeout: float) -> bool | None:
    """True: the connection is refused (nothing listens); False: something accepted it; None: no answer."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return False
    except ConnectionRefusedError:
        return True
    except OSError:
        return None


def _connect_result(record: NodeRecord, refused: bool | None, timeout: float) -> ProbeResult:
    if refused:
        return ProbeResult(ProbeOutcome.REFUSED, detail="connection refused")
    if refused is False:
        return ProbeResult(ProbeOutcome.ALIVE, incarnation=record.incarnation, detail="the port accepts connections")
    return ProbeResult(ProbeOutcome.TIMEOUT, detail=f"no answer to a connect within {timeout} s")


class ConnectProber:
    """A `Prober` that only opens a TCP connection to the agent's port: refused is REFUSED (the process is
    gone), accepted is ALIVE as the registered incarnation, no answer is TIMEOUT.

    It costs a tenth of a gRPC probe, but it cannot tell a new process that took the port from the old one,
    nor a stopped process from a live one (the kernel accepts the connection for it): a sweep that only looks
    for the dead uses it (stopped nodes are left to the lease and to their neighbours' reports).
    :meth:`probe_many` probes many nodes at once from the calling thread (non-blocking connects and one
    selector), so a sweep starts no thread: on a loaded process each thread's start waits for the interpreter
    lock, on the path of a failure's publication.
    """

    def __call__(self, record: NodeRecord, timeout: float) -> ProbeResult:
        return _connect_result(record, _tcp_refused(record.address, record.agent_port, timeout), timeout)

    def probe_many(self, records: Mapping[str, NodeRecord], timeout: float) -> dict[str, ProbeResult]:
        """Each of ``records`` (node id -> record) probed by a connect, all at once, within ``timeout`` in all."""
        refused: dict[str, bool | None] = dict.fromkeys(records)
        pending: dict[socket.socket, str] = {}
        with selectors.DefaultSelector() as selector:
            try:
                for node, record in records.items():
                    try:
                        family, _, _, _, address = socket.getaddrinfo(record.address, record.agent_port,
                                                                      type=socket.SOCK_STREAM)[0]
                        sock = socket.socket(family, socket.SOCK_STREAM)
                    except OSError:
                        continue  # an address that does not resolve, or no socket: no answer
                    sock.setblocking(False)
                    code = sock.connect_ex(address)
                    if code in (0, errno.ECONNREFUSED):
                        refused[node] = code != 0
                        sock.close()
                    elif code in (errno.EINPROGRESS, errno.EWOULDBLOCK, errno.EAGAIN):
                        pending[sock] = node
                        selector.register(sock, selectors.EVENT_WRITE)
                    else:
                        sock.close()
                deadline = time.monotonic() + timeout
                while pending and (left := deadline - time.monotonic()) > 0:
                    for key, _ in selector.select(left):
                        sock = key.fileobj
                        assert isinstance(sock, socket.socket)
                        code = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
                        refused[pending.pop(sock)] = True if code == errno.ECONNREFUSED else False if code == 0 else None
                        selector.unregister(sock)
                        sock.close()
            finally:
                for sock in pending:
                    sock.close()
        return {node: _connect_result(records[node], refused[node], timeout) for node in records}


connect_probe = ConnectProber()
"""The connect `Prober` (:class:`ConnectProber`)."""


def probe_many(prober: Prober, records: Mapping[str, NodeRecord], timeout: float, max_parallel: int,
               name: str = "") -> dict[str, ProbeResult]:
    """Each of ``records`` (node id -> record) probed once by ``prober`` with ``timeout``, at once: connects from
    this thread (:meth:`ConnectProber.probe_many`), any other prober on up to ``max_parallel`` threads (``name``
    in their names). A prober that raises reads as TIMEOUT (slow is the safe reading)."""
    if isinstance(prober, ConnectProber):
        return prober.probe_many(records, timeout)
    results: dict[str, ProbeResult] = {}
    with futures.ThreadPoolExecutor(max_workers=max(1, min(max_parallel, len(records))),
                                    thread_name_prefix=f"bamboo-sweep-{name}") as pool:
        running = {node: pool.submit(prober, record, timeout) for node, record in records.items()}
        for node, future in running.items():
            try:
                results[node] = future.result()
            except Exception as exc:
                results[node] = ProbeResult(ProbeOutcome.TIMEOUT, detail=f"prober raised {exc!r}")
    return results


_DENIED_CODES = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED}


class GrpcProber:
    """Probes an agent over gRPC on a fresh channel each time, so an earlier failure cannot mask a recovery.

    A plain TCP connect goes first: refused is REFUSED at once (the process is gone), without the channel, the
    call and its failure that gRPC costs (a few milliseconds of CPU, on the path of every confirmed kill; a
    neighbour's report of a dead peer is the common case). Then outcomes: an answer is ALIVE; UNAUTHENTICATED (or PERMISSION_DENIED) is DENIED (alive, but it refused
    our credentials); UNAVAILABLE is checked with a plain TCP connect: refused is REFUSED (the process is
    gone), accepted is DENIED (e.g. a failed TLS handshake), no answer is TIMEOUT; anything else (a missed
    deadline) is TIMEOUT. `credentials` enables TLS, `token` sends the job token, `channel_options` are
    passed to the channel (e.g. `TlsFiles.channel_options()`).
    """

    def __init__(
        self,
        from_node: str = "",
        credentials: grpc.ChannelCredentials | None = None,
        *,
        token: str | None = None,
        channel_options: Sequence[tuple[str, Any]] = (),
    ) -> None:
        self.from_node = from_node
        self.credentials = credentials
        self.metadata = token_metadata(token)
        self.channel_options = list(channel_options)

    def __call__(self, record: NodeRecord, timeout: float) -> ProbeResult:
        if _tcp_refused(record.address, record.agent_port, timeout) is True:
            return ProbeResult(ProbeOutcome.REFUSED, detail="connection refused")
        target = f"{record.address}:{record.agent_port}"
        channel = (
            grpc.secure_channel(target, self.credentials, options=self.channel_options)
            if self.credentials is not None
            else grpc.insecure_channel(target, options=self.channel_options)
        )
        try:
            reply = pb_grpc.AgentStub(channel).Probe(pb.ProbeRequest(from_node=self.from_node), timeout=timeout,
                                                     metadata=self.metadata)
            return ProbeResult(ProbeOutcome.ALIVE, incarnation=reply.incarnation, progress=reply.progress)
        except grpc.RpcError as exc:
            code = exc.code() if hasattr(exc, "code") else None
            detail = f"{code}: {exc.details() if hasattr(exc, 'details') else exc}"
            if code in _DENIED_CODES:
                return ProbeResult(ProbeOutcome.DENIED, detail=detail)
            if code == grpc.StatusCode.UNAVAILABLE:
                refused = _tcp_refused(record.address, record.agent_port, timeout)
                if refused:
                    return ProbeResult(ProbeOutcome.REFUSED, detail=detail)
                if refused is False:
                    return ProbeResult(ProbeOutcome.DENIED, detail=f"{detail} (but the port accepts connections)")
            return ProbeResult(ProbeOutcome.TIMEOUT, detail=detail)
        finally:
            channel.close()
