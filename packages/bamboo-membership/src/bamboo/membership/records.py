"""Values of bamboo.membership: how records are encoded in etcd, and the events handed to callers.

Stored values are the protobuf messages of `proto/bamboo/membership/v1` in their JSON mapping (readable
with `etcdctl get`), or plain JSON objects for layouts and decisions. Never pickle. A value that does not
decode raises `MalformedValueError`, whose message names the key, the expected type and the raw bytes.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

import attrs
from bamboo.membership.v1 import membership_pb2 as pb
from google.protobuf import json_format
from google.protobuf.message import Message

__all__ = [
    "DetectionPath",
    "FailureReport",
    "MalformedValueError",
    "NodeFailed",
    "NodeRecord",
    "NodeState",
    "PreemptionNotice",
    "decode_json",
    "decode_message",
    "encode_json",
    "encode_message",
    "validate_node_record",
]

NodeRecord = pb.NodeRecord
NodeState = pb.NodeState
FailureReport = pb.FailureReport
PreemptionNotice = pb.PreemptionNotice
DetectionPath = pb.DetectionPath

M = TypeVar("M", bound=Message)

_REQUIRED: dict[str, tuple[str, ...]] = {
    "NodeRecord": ("id",),
    "FailureReport": ("node",),
    "PreemptionNotice": ("node",),
}


class MalformedValueError(ValueError):
    """A value read from etcd could not be decoded. Carries the key and the raw bytes."""

    def __init__(self, key: str, expected: str, raw: bytes, detail: str) -> None:
        self.key = key
        self.expected = expected
        self.raw = raw
        shown = raw if len(raw) <= 120 else raw[:120] + b"..."
        super().__init__(f"etcd key {key} holds a malformed {expected}: {detail}; raw value {shown!r}")


def encode_message(message: Message) -> bytes:
    """A protobuf message as compact JSON bytes (proto field names, enums by name)."""
    data = json_format.MessageToDict(message, preserving_proto_field_name=True)
    return json.dumps(data, sort_keys=True, separators=(",", ":")).encode()


def decode_message(key: str, raw: bytes, message_type: type[M]) -> M:
    """Decode what `encode_message` wrote; unknown fields are ignored (newer writers), the rest must parse."""
    name = message_type.DESCRIPTOR.name
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedValueError(key, name, raw, f"not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise MalformedValueError(key, name, raw, f"expected a JSON object, got {type(data).__name__}")
    message = message_type()
    try:
        json_format.ParseDict(data, message, ignore_unknown_fields=True)
    except json_format.ParseError as exc:
        raise MalformedValueError(key, name, raw, str(exc)) from exc
    for field in _REQUIRED.get(name, ()):
        if not getattr(message, field):
            raise MalformedValueError(key, name, raw, f"required field {field!r} is empty")
    return message


def encode_json(value: dict[str, Any]) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":")).encode()


def decode_json(key: str, raw: bytes, expected: str = "JSON object") -> dict[str, Any]:
    try:
        data = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MalformedValueError(key, expected, raw, f"not JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise MalformedValueError(key, expected, raw, f"expected a JSON object, got {type(data).__name__}")
    return data


def validate_node_record(record: pb.NodeRecord) -> None:
    """Raise ValueError naming the bad field and value if `record` cannot be registered."""
    if not record.id or "/" in record.id or record.id != record.id.strip():
        raise ValueError(f"node id must be non-empty, without '/' or surrounding spaces, got {record.id!r}")
    if record.agent_port > 65535:
        raise ValueError(f"node {record.id!r}: agent_port must be < 65536, got {record.agent_port}")
    if record.agent_port and not record.address:
        raise ValueError(f"node {record.id!r}: agent_port {record.agent_port} given without an address")


@attrs.frozen
class NodeFailed:
    """`node` failed in membership epoch `epoch`: emitted once per node per epoch to every watcher.

    `detected_by` names the detector that wrote the failure record first; `reason` says how
    (lease expiry, neighbour report confirmed by a probe, probes timing out past the grace period).
    """

    node: str
    epoch: int
    detected_by: str
    reason: str
    incarnation: int = 0
    path: str = "unspecified"
    detected_at: float = 0.0

    @classmethod
    def from_report(cls, report: pb.FailureReport) -> NodeFailed:
        path = pb.DetectionPath.Name(report.path).removeprefix("DETECTION_PATH_").lower()
        return cls(
            node=report.node,
            epoch=int(report.epoch),
            detected_by=report.detected_by,
            reason=report.reason,
            incarnation=int(report.incarnation),
            path=path,
            detected_at=float(report.detected_at),
        )
