"""The records bamboo-launch keeps in etcd, each a frozen attrs class with a versioned JSON codec.

Decisions live under ``/bamboo/<job>/decisions/<name>`` and are written first-writer-wins
(:meth:`bamboo.membership.MembershipStore.decide`); everyone reads the winner. The names:

| name | record | written by |
|---|---|---|
| ``g<g>-stop`` | :class:`StopDecision` | the lowest live rank of generation g: the step it stops at and why |
| ``g<g>-prepare``, ``g<g>-a<k>-prepare`` | :class:`PreparedLayout` | the lowest live rank of g: the next layout, prepared while g trains |
| ``g<G>-built-<node>`` | :class:`NodeBuilt` | each node of a prepared layout G once its part is built |
| ``finish`` | :class:`FinishRequest` | ``bamboo-launch finish`` (or a test): end the job early, at a step boundary |
| ``g<g>-ready-<node>``, ``g<g>-a<k>-ready-<node>`` | :class:`BarrierReady` | each holder at the barrier of g (attempt k) |
| ``g<g>-next``, ``g<g>-a<k>-next`` | :class:`bamboo.reconfig.JobLayout` | the first holder to see every holder ready |
| ``g<G>-up-<node>`` | :class:`NodeUp` | each node of attempt G once its part is done |
| ``g<G>-outcome`` | :class:`AttemptOutcome` | the first node that can tell whether attempt G goes ahead |
| ``g<g>-epoch-<e>`` | ``bamboo.rc.FailureEvent`` | the elected coordinator: the ranks of generation g that died |
| ``preempted-<node>`` | :class:`Preempted` | the coordinator, once per confirmed node, or the node itself when it hands its stage over after a notice; its writer writes the ``preemption`` event |
| ``joined-<node>`` | :class:`NodeJoined` | an agent once it registered and wrote its ``join`` event |
| ``warm-<node>`` | :class:`WorkerWarm` | a worker once its model is built and it waits for a role |
| ``error-<node>`` | :class:`WorkerError` | a worker that failed: its last exception line |
| ``end`` | :class:`JobEnd` | the first worker that finished the job, or found that it cannot go on |

The layout itself is ``/bamboo/<job>/layout`` (a :class:`bamboo.reconfig.JobLayout`, compare-and-swap on
its revision), the spec ``/bamboo/<job>/spec`` (:class:`bamboo.launch.spec.JobSpec`) and the elected
coordinator ``/bamboo/<job>/leader`` (:class:`Leader`, held by the leader's lease).

Every reader rejects an unknown version or a malformed value with a ``RecordError`` naming the
record and the key.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import TYPE_CHECKING, ClassVar, TypeVar

import attrs
from bamboo.launch.json_types import JSONObject
from bamboo.reconfig import RecordError

if TYPE_CHECKING:
    from bamboo.membership import Decision

__all__ = [
    "FINISH_DECISION",
    "RECORD_VERSION",
    "AttemptOutcome",
    "BarrierReady",
    "FinishRequest",
    "JobEnd",
    "Leader",
    "NodeBuilt",
    "NodeJoined",
    "NodeUp",
    "Preempted",
    "PreparedLayout",
    "RecordError",
    "StopDecision",
    "WorkerError",
    "WorkerWarm",
    "node_of_decision",
    "outcome_name",
    "read_record",
]

RECORD_VERSION = 1

#: The decision that holds a :class:`FinishRequest`.
FINISH_DECISION = "finish"
R = TypeVar("R")


_NON_NEGATIVE_INT = attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(0))


def _finite(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ValueError(f"key {attribute.name!r} must be a finite number, got {value!r}")


def _optional_finite(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        _finite(_instance, attribute, value)


def _string(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str):
        raise ValueError(f"key {attribute.name!r} must be a string, got {value!r}")


def _node(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"key {attribute.name!r} must be a node id, got {value!r}")


def _optional_string(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, str):
        raise ValueError(f"key {attribute.name!r} must be a string or null, got {value!r}")


def _stages(value: object) -> tuple[int, ...]:
    if not isinstance(value, (list, tuple)) or any(isinstance(s, bool) or not isinstance(s, int) for s in value):
        raise ValueError(f"key 'holds' must be a list of stage numbers, got {value!r}")
    return tuple(sorted(value))


class _Record:
    """The codec every record shares: ``to_dict`` adds ``"v"``; ``from_dict`` checks it and the keys."""

    NAME: ClassVar[str]

    def to_dict(self) -> JSONObject:
        data = attrs.asdict(self, recurse=False)  # type: ignore[arg-type]
        return {"v": RECORD_VERSION, **{k: list(v) if isinstance(v, tuple) else v for k, v in data.items()}}

    @classmethod
    def from_dict(cls: type[R], data: object) -> R:
        name = cls.NAME  # type: ignore[attr-defined]
        if not isinstance(data, Mapping):
            raise RecordError(f"{name}: must be a JSON object, got {type(data).__name__}")
        version = data.get("v")
        if version != RECORD_VERSION:
            raise RecordError(f"{name}: unknown version {version!r} (this reader knows version {RECORD_VERSION})")
        fields = attrs.fields(cls)  # type: ignore[arg-type]
        known = {field.name for field in fields}
        unknown = sorted(set(data) - known - {"v"})
        if unknown:
            raise RecordError(f"{name}: unknown key {unknown[0]!r}")
        for field in fields:
            if field.default is attrs.NOTHING and field.name not in data:
                raise RecordError(f"{name}: missing key {field.name!r}")
        try:
            return cls(**{key: value for key, value in data.items() if key != "v"})
        except (TypeError, ValueError) as error:
            raise RecordError(f"{name}: {error.args[0] if error.args else error}") from None


def read_record(cls: type[R], found: Decision | None) -> R | None:
    """The record of class ``cls`` in a decision read from the store (``None`` when there is none)."""
    if found is None:
        return None
    return cls.from_dict(found.value)  # type: ignore[attr-defined,no-any-return]


@attrs.frozen
class StopDecision(_Record):
    """Generation g stops at ``step`` (a step boundary) and reconfigures, for ``reason``; or, with
    ``finish``, the job ends there (a :class:`FinishRequest`)."""

    NAME: ClassVar[str] = "stop decision"
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    reason: str = attrs.field(validator=_string)
    finish: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    attempt: int | None = attrs.field(default=None, validator=attrs.validators.optional(_NON_NEGATIVE_INT))
    """The prepared attempt of the next layout to switch to at ``step`` (:mod:`bamboo.launch.prepare`);
    None: meet at the barrier and decide the next layout there."""
    at: float | None = attrs.field(default=None, validator=_optional_finite)
    """When it was decided (wall clock)."""


@attrs.frozen
class FinishRequest(_Record):
    """Someone asked the job to end before its last step: at the first step boundary every node can still
    reach (four steps after the lowest live rank sees the request: `bamboo.launch.stop.STOP_AHEAD`), with a final checkpoint."""

    NAME: ClassVar[str] = "finish request"
    by: str = attrs.field(validator=_string)
    """Who asked (a user name, ``bamboo-launch finish``, a test)."""
    unix: float = attrs.field(validator=_finite)


@attrs.frozen
class BarrierReady(_Record):
    """A holder at the barrier: the step it is at, the stages whose state it holds at that step, and when."""

    NAME: ClassVar[str] = "barrier record"
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    holds: tuple[int, ...] = attrs.field(converter=_stages)
    at: float = attrs.field(validator=_finite)


@attrs.frozen
class NodeUp(_Record):
    """A node of an attempt finished its part (engine built, state received or sent), and when each part of it
    ended (wall clock; None for a part it did not have): ``stopped`` training the previous layout (a holder),
    ``warm`` (its worker had started and built its model: a node new to the job), ``planned`` (it had the
    layout), ``built`` (its engine and groups), ``state`` (its stages' state in place), ``at`` (it published
    this). :mod:`bamboo.launch.pauses` breaks the reconfiguration's pause down from them."""

    NAME: ClassVar[str] = "up record"
    node: str = attrs.field(validator=_node)
    at: float | None = attrs.field(default=None, validator=_optional_finite)
    stopped: float | None = attrs.field(default=None, validator=_optional_finite)
    planned: float | None = attrs.field(default=None, validator=_optional_finite)
    built: float | None = attrs.field(default=None, validator=_optional_finite)
    state: float | None = attrs.field(default=None, validator=_optional_finite)
    warm: float | None = attrs.field(default=None, validator=_optional_finite)


@attrs.frozen
class PreparedLayout(_Record):
    """The next layout, decided while the current one trains (``g<g>-prepare``, ``g<g>-a<k>-prepare``): a
    :class:`bamboo.reconfig.JobLayout` as a dict, planned when the current layout had seen ``epoch`` failure
    events; or, with ``closed``, the mark that no layout may be prepared at this index any more (a node went to
    the barrier)."""

    NAME: ClassVar[str] = "prepared layout"
    layout: JSONObject | None = attrs.field(default=None)
    epoch: int = attrs.field(default=0, validator=_NON_NEGATIVE_INT)
    closed: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.closed != (self.layout is None):
            raise ValueError(f"a prepared layout is either closed or holds a layout (closed={self.closed})")


@attrs.frozen
class NodeBuilt(_Record):
    """A node of a prepared layout built its part (its engine and groups, its transfer group) while the current
    layout trained (``g<G>-built-<node>``)."""

    NAME: ClassVar[str] = "built record"
    node: str = attrs.field(validator=_node)
    at: float = attrs.field(validator=_finite)


@attrs.frozen
class AttemptOutcome(_Record):
    """How a reconfiguration attempt ended: ``go`` (every node of it trains it) or abort, and why."""

    NAME: ClassVar[str] = "attempt outcome"
    go: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    reason: str = attrs.field(validator=_string)
    at: float | None = attrs.field(default=None, validator=_optional_finite)
    """When it was written (wall clock)."""


def node_of_decision(key: str, kind: str) -> str:
    """The node that the decision at etcd key ``.../<kind><node>`` names (``kind``: ``warm-``, ``preempted-``,
    ``handover-``)."""
    return key.rsplit("/", 1)[-1].removeprefix(kind)


def outcome_name(generation: int) -> str:
    """The decision that holds the :class:`AttemptOutcome` of the start of layout generation ``generation``."""
    return f"g{generation}-outcome"


@attrs.frozen
class Preempted(_Record):
    """A node the coordinator confirmed dead, or that left after its notice (the ``preemption`` event is written once
    per node, by whoever wrote this first)."""

    NAME: ClassVar[str] = "preemption record"
    node: str = attrs.field(validator=_node)
    zone: str = attrs.field(validator=_string)
    reason: str = attrs.field(validator=_string)


@attrs.frozen
class WorkerWarm(_Record):
    """A worker whose model is built and which waits for a role (a warm joiner)."""

    NAME: ClassVar[str] = "warm record"
    node: str = attrs.field(validator=_node)
    at: float = attrs.field(validator=_finite)
    zone: str | None = attrs.field(default=None, validator=_optional_string)
    """The node's zone: what its preemption record says if it is lost while no coordinator follows the membership."""


@attrs.frozen
class NodeJoined(_Record):
    """A node whose agent registered and announced itself (its ``join`` event): the job bills it from then on.

    It outlives the node's lease, so a coordinator elected after the node died unseen (its lease expired while the
    previous coordinator, killed, no longer followed the membership) still knows to record its preemption: a
    joiner killed before its worker was warm had no other record, and was billed to the end of the run."""

    NAME: ClassVar[str] = "join record"
    node: str = attrs.field(validator=_node)
    at: float = attrs.field(validator=_finite)
    zone: str | None = attrs.field(default=None, validator=_optional_string)


@attrs.frozen
class WorkerError(_Record):
    """A worker that failed: its node and the last line of its exception."""

    NAME: ClassVar[str] = "worker error"
    node: str = attrs.field(validator=_node)
    error: str = attrs.field(validator=_string)
    at: float = attrs.field(validator=_finite)


@attrs.frozen
class JobEnd(_Record):
    """The job ended: after ``steps`` steps, or with ``error`` (it cannot go on)."""

    NAME: ClassVar[str] = "job end"
    steps: int = attrs.field(validator=_NON_NEGATIVE_INT)
    error: str | None = attrs.field(default=None, validator=_optional_string)
    node: str = attrs.field(default="", validator=_string)
    """The node that wrote it."""


@attrs.frozen
class Leader(_Record):
    """The elected coordinator of a job: its node and since when (wall clock). Held by its lease."""

    NAME: ClassVar[str] = "leader record"
    node: str = attrs.field(validator=_node)
    since: float = attrs.field(validator=_finite)
