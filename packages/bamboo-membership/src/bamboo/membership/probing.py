"""Probes: what they answer, how the detector is configured, and the gRPC prober.

`ProbeOutcome`, `ProbeResult`, the `Prober` signature, `DetectorConfig` (grace period, probe timeout and
interval; defaults in `bamboo.membership.timeouts`), `SweepResult` (what a parallel sweep found), and
`GrpcProber`, which probes an agent's `Probe` RPC on a fresh channel. The detector itself is in
`bamboo.membership.detector`.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import grpc
from bamboo.membership import timeouts
from bamboo.membership.auth import token_metadata
from bamboo.membership.records import NodeRecord
from bamboo.membership.v1 import membership_pb2 as pb
from bamboo.membership.v1 import membership_pb2_grpc as pb_grpc

__all__ = ["DetectorConfig", "GrpcProber", "ProbeOutcome", "ProbeResult", "Prober", "SweepResult", "connect_probe"]


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


def connect_probe(record: NodeRecord, timeout: float) -> ProbeResult:
    """A `Prober` that only opens a TCP connection to the agent's port: refused is REFUSED (the process is
    gone), accepted is ALIVE as the registered incarnation, no answer is TIMEOUT.

    It costs a tenth of a gRPC probe, but it cannot tell a new process that took the port from the old one,
    nor a stopped process from a live one (the kernel accepts the connection for it): a sweep that only looks
    for the dead uses it (stopped nodes are left to the lease and to their neighbours' reports).
    """
    refused = _tcp_refused(record.address, record.agent_port, timeout)
    if refused:
        return ProbeResult(ProbeOutcome.REFUSED, detail="connection refused")
    if refused is False:
        return ProbeResult(ProbeOutcome.ALIVE, incarnation=record.incarnation, detail="the port accepts connections")
    return ProbeResult(ProbeOutcome.TIMEOUT, detail=f"no answer to a connect within {timeout} s")


_DENIED_CODES = {grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED, grpc.StatusCode.UNIMPLEMENTED}


class GrpcProber:
    """Probes an agent over gRPC on a fresh channel each time, so an earlier failure cannot mask a recovery.

    Outcomes: an answer is ALIVE; UNAUTHENTICATED (or PERMISSION_DENIED) is DENIED (alive, but it refused
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
