from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class NodeState(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    NODE_STATE_UNSPECIFIED: _ClassVar[NodeState]
    NODE_STATE_JOINING: _ClassVar[NodeState]
    NODE_STATE_ACTIVE: _ClassVar[NodeState]
    NODE_STATE_STANDBY: _ClassVar[NodeState]
    NODE_STATE_PREEMPTING: _ClassVar[NodeState]
    NODE_STATE_LEFT: _ClassVar[NodeState]

class DetectionPath(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    DETECTION_PATH_UNSPECIFIED: _ClassVar[DetectionPath]
    DETECTION_PATH_NEIGHBOUR_REPORT: _ClassVar[DetectionPath]
    DETECTION_PATH_LEASE_EXPIRY: _ClassVar[DetectionPath]
    DETECTION_PATH_PROBE_TIMEOUT: _ClassVar[DetectionPath]
    DETECTION_PATH_PROBE_SWEEP: _ClassVar[DetectionPath]
NODE_STATE_UNSPECIFIED: NodeState
NODE_STATE_JOINING: NodeState
NODE_STATE_ACTIVE: NodeState
NODE_STATE_STANDBY: NodeState
NODE_STATE_PREEMPTING: NodeState
NODE_STATE_LEFT: NodeState
DETECTION_PATH_UNSPECIFIED: DetectionPath
DETECTION_PATH_NEIGHBOUR_REPORT: DetectionPath
DETECTION_PATH_LEASE_EXPIRY: DetectionPath
DETECTION_PATH_PROBE_TIMEOUT: DetectionPath
DETECTION_PATH_PROBE_SWEEP: DetectionPath

class NodeRecord(_message.Message):
    __slots__ = ("id", "zone", "address", "agent_port", "incarnation", "state")
    ID_FIELD_NUMBER: _ClassVar[int]
    ZONE_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    AGENT_PORT_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    id: str
    zone: str
    address: str
    agent_port: int
    incarnation: int
    state: NodeState
    def __init__(self, id: _Optional[str] = ..., zone: _Optional[str] = ..., address: _Optional[str] = ..., agent_port: _Optional[int] = ..., incarnation: _Optional[int] = ..., state: _Optional[_Union[NodeState, str]] = ...) -> None: ...

class FailureReport(_message.Message):
    __slots__ = ("node", "epoch", "incarnation", "detected_by", "path", "reason", "detected_at")
    NODE_FIELD_NUMBER: _ClassVar[int]
    EPOCH_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DETECTED_BY_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    DETECTED_AT_FIELD_NUMBER: _ClassVar[int]
    node: str
    epoch: int
    incarnation: int
    detected_by: str
    path: DetectionPath
    reason: str
    detected_at: float
    def __init__(self, node: _Optional[str] = ..., epoch: _Optional[int] = ..., incarnation: _Optional[int] = ..., detected_by: _Optional[str] = ..., path: _Optional[_Union[DetectionPath, str]] = ..., reason: _Optional[str] = ..., detected_at: _Optional[float] = ...) -> None: ...

class PreemptionNotice(_message.Message):
    __slots__ = ("node", "incarnation", "deadline", "source")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    DEADLINE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: int
    deadline: float
    source: str
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[int] = ..., deadline: _Optional[float] = ..., source: _Optional[str] = ...) -> None: ...

class ProbeRequest(_message.Message):
    __slots__ = ("from_node",)
    FROM_NODE_FIELD_NUMBER: _ClassVar[int]
    from_node: str
    def __init__(self, from_node: _Optional[str] = ...) -> None: ...

class ProbeResponse(_message.Message):
    __slots__ = ("node", "incarnation", "progress", "state", "lease", "record_create_revision")
    NODE_FIELD_NUMBER: _ClassVar[int]
    INCARNATION_FIELD_NUMBER: _ClassVar[int]
    PROGRESS_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    LEASE_FIELD_NUMBER: _ClassVar[int]
    RECORD_CREATE_REVISION_FIELD_NUMBER: _ClassVar[int]
    node: str
    incarnation: int
    progress: int
    state: NodeState
    lease: int
    record_create_revision: int
    def __init__(self, node: _Optional[str] = ..., incarnation: _Optional[int] = ..., progress: _Optional[int] = ..., state: _Optional[_Union[NodeState, str]] = ..., lease: _Optional[int] = ..., record_create_revision: _Optional[int] = ...) -> None: ...

class NotifyRequest(_message.Message):
    __slots__ = ("notice",)
    NOTICE_FIELD_NUMBER: _ClassVar[int]
    notice: PreemptionNotice
    def __init__(self, notice: _Optional[_Union[PreemptionNotice, _Mapping]] = ...) -> None: ...

class NotifyResponse(_message.Message):
    __slots__ = ("published",)
    PUBLISHED_FIELD_NUMBER: _ClassVar[int]
    published: bool
    def __init__(self, published: _Optional[bool] = ...) -> None: ...

class PeerFailureRequest(_message.Message):
    __slots__ = ("node", "reason", "reporter")
    NODE_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    REPORTER_FIELD_NUMBER: _ClassVar[int]
    node: str
    reason: str
    reporter: str
    def __init__(self, node: _Optional[str] = ..., reason: _Optional[str] = ..., reporter: _Optional[str] = ...) -> None: ...

class PeerFailureResponse(_message.Message):
    __slots__ = ("accepted",)
    ACCEPTED_FIELD_NUMBER: _ClassVar[int]
    accepted: bool
    def __init__(self, accepted: _Optional[bool] = ...) -> None: ...

class SubscribeRequest(_message.Message):
    __slots__ = ("subscriber",)
    SUBSCRIBER_FIELD_NUMBER: _ClassVar[int]
    subscriber: str
    def __init__(self, subscriber: _Optional[str] = ...) -> None: ...

class ClusterEvent(_message.Message):
    __slots__ = ("node_failed", "preemption")
    NODE_FAILED_FIELD_NUMBER: _ClassVar[int]
    PREEMPTION_FIELD_NUMBER: _ClassVar[int]
    node_failed: FailureReport
    preemption: PreemptionNotice
    def __init__(self, node_failed: _Optional[_Union[FailureReport, _Mapping]] = ..., preemption: _Optional[_Union[PreemptionNotice, _Mapping]] = ...) -> None: ...
