"""The records of the launcher's event log: one frozen, validated attrs class per kind, and their JSON codec.

Every record is a JSON object with two common keys:

- ``"kind"``: the record type (see the list below);
- ``"t"``: seconds since the run started (float, >= 0).

and the kind's own keys:

- ``run_start``: ``job`` (str), ``unix_time`` (float, wall clock at t=0), ``target_nodes``,
  ``stages``, ``pipelines`` (int);
- ``join``: ``node``, ``zone`` (str): a node started (billing starts) and joined, as a worker
  or on standby;
- ``preemption``: ``node``, ``zone`` (str), ``notice_s`` (float, seconds of notice, 0 if
  none) and, optionally, ``reason`` (str: how the loss was confirmed, e.g. ``lease expired``): the node was
  killed; billing stops;
- ``failover``: ``victim``, ``shadow`` (str), ``stage`` (int), ``pause_s`` (float, seconds
  the survivors could not make progress: from catching the failure to resuming on the merged
  schedule), and, optionally, the wall-clock times (Unix seconds) at the shadow ``caught_unix``
  (it caught the failure), ``resumed_unix`` (it ran the first instruction of the merged schedule)
  and ``step_end_unix`` (the failed step committed);
- ``reconfiguration``: ``reason`` (str), ``pipelines``, ``stages``, ``standby`` (int),
  ``bytes_moved`` (int, bytes of layers transferred), ``duration_s`` (float, the pause: from the
  first node that stopped training to the new layout's go, plus what its first step took beyond a
  usual step), ``attempts`` (int, optional, default 1: more when a node died while the new layout
  started and it was redone), and, optionally, the pause broken down (:mod:`bamboo.launch.pauses`):
  ``nodes_s``, ``decide_s``, ``barrier_s``, ``transfers_s``, ``group_builds_s``, ``first_step_s`` (floats), whether
  the new layout was ``prepared`` while the old one trained (make before break), its ``generation``;
- ``checkpoint``: ``step`` (int), ``path`` (str), ``bytes`` (int), ``duration_s`` (float);
- ``restore``: ``step`` (int, the step training restarts from), ``path`` (str, the checkpoint's
  folder, ``memory`` when every stage came from a peer's memory, ``initial`` when none was left), ``lost_stages`` (str, the stages no
  survivor held, comma separated), ``discarded_steps`` (int, steps done since that copy, trained
  again), and, optionally, ``source`` (``memory``: every stage from an in-memory copy on a live peer;
  ``disk``; ``initial``: no copy of any step was left, the job started over from step 0) and
  ``duration_s`` (float, the pause of the restore);
- ``startup``: ``node`` (str) and the seconds of each phase of its worker's start (optional floats,
  absent for a phase the node did not go through): ``process_s`` (from the agent's spawn to the
  worker's first line of Python), ``imports_s`` (torch, DeepSpeed, the script), ``model_s`` (the
  program and the spec: the worker is warm after it), ``wait_s`` (warm, waiting for a role),
  ``model_build_s`` (its stages' layers), ``group_build_s`` (its gloo groups), ``first_step_s``;
- ``step``: ``step`` (int), ``samples`` (int, samples in this step), ``loss`` (float),
  ``nodes_active`` (int), ``duration_s`` (float, the step's own time), and, optionally, ``generation``
  (int, the layout generation that trained it; the DeepSpeed baseline writes none) and ``restore_point``
  (bool, default false: in-memory copies or a checkpoint were taken right after it);
- ``redundancy_choice``: ``generation`` (int), ``mode`` (str: the redundancy mode that generation trains
  with, chosen by ``--redundancy auto``), ``reason`` (str, one line), ``lost_s_per_hour`` (object: mode ->
  the seconds of training each mode was expected to lose per hour), ``step_s`` (float, the fault-free step
  of ``none`` it assumed) and ``preemptions_per_node_hour`` (float, the rate it assumed);
- ``phase``: ``node`` (str), ``phase`` and ``previous`` (str, :class:`bamboo.launch.worker_phases.Phase`
  values), ``cause`` (str, the outcome that ended the previous phase) and, optionally, ``generation`` (int,
  the layout that outcome concerns): the node's worker entered ``phase`` (its state machine);
- ``run_end``: ``steps`` (int): the run finished; nodes still alive stop being billed here.

Unknown keys are rejected, so a typo in a writer fails at once instead of silently vanishing
from the report. :mod:`bamboo.launch.events` reads and writes them (files and etcd).
"""

from __future__ import annotations

import math
from typing import ClassVar, TypeAlias

import attrs
from bamboo.launch.json_types import JSON, JSONObject

__all__ = [
    "EVENT_TYPES",
    "Checkpoint",
    "Event",
    "EventField",
    "Failover",
    "Join",
    "Preemption",
    "Reconfiguration",
    "RedundancyChoice",
    "Restore",
    "RunEnd",
    "RunStart",
    "Startup",
    "Step",
    "WorkerPhase",
    "event_from_dict",
    "event_to_dict",
]


_V = attrs.validators
_NON_NEGATIVE_TIME = _V.and_(_V.instance_of((int, float)), _V.ge(0), _V.lt(math.inf))
_NON_NEGATIVE_INT = _V.and_(_V.instance_of(int), _V.ge(0))
_POSITIVE_INT = _V.and_(_V.instance_of(int), _V.ge(1))


def _non_empty_str(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty string, got {value!r}")


def _finite(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


@attrs.frozen
class RunStart:
    """The run began: the job's name, the wall-clock time of t=0 and the requested layout."""

    KIND: ClassVar[str] = "run_start"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    job: str = attrs.field(validator=_non_empty_str)
    unix_time: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    target_nodes: int = attrs.field(validator=_POSITIVE_INT)
    stages: int = attrs.field(validator=_POSITIVE_INT)
    pipelines: int = attrs.field(validator=_POSITIVE_INT)


@attrs.frozen
class Join:
    """A node started (billing starts) and joined the cluster, as a worker or on standby."""

    KIND: ClassVar[str] = "join"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    node: str = attrs.field(validator=_non_empty_str)
    zone: str = attrs.field(validator=_non_empty_str)
    returns: str | None = attrs.field(default=None, validator=attrs.validators.optional(_non_empty_str))
    """The identity of the same machine's previous incarnation, when its agent comes back as a fresh node after
    its worker failed (that identity's ``preemption`` record is then no loss of the market's); None for a new
    machine."""


@attrs.frozen
class Preemption:
    """A node was killed by the (emulated or real) spot market; billing stops."""

    KIND: ClassVar[str] = "preemption"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    node: str = attrs.field(validator=_non_empty_str)
    zone: str = attrs.field(validator=_non_empty_str)
    notice_s: float = attrs.field(default=0.0, validator=_NON_NEGATIVE_TIME)
    reason: str | None = attrs.field(default=None, validator=attrs.validators.optional(_non_empty_str))
    """How the loss was confirmed (the failure detector's report: a lease that expired, a probe refused, ...);
    None where the writer killed the node itself."""


@attrs.frozen
class Failover:
    """The shadow took over a victim's stage; ``pause_s`` is how long progress stopped."""

    KIND: ClassVar[str] = "failover"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    victim: str = attrs.field(validator=_non_empty_str)
    shadow: str = attrs.field(validator=_non_empty_str)
    stage: int = attrs.field(validator=_NON_NEGATIVE_INT)
    pause_s: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    caught_unix: float | None = attrs.field(default=None)
    resumed_unix: float | None = attrs.field(default=None)
    step_end_unix: float | None = attrs.field(default=None)


@attrs.frozen
class Reconfiguration:
    """The pipelines were re-formed: the new layout, the bytes of layers moved, how long it took, in how many
    attempts."""

    KIND: ClassVar[str] = "reconfiguration"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    reason: str = attrs.field(validator=_non_empty_str)
    pipelines: int = attrs.field(validator=_NON_NEGATIVE_INT)
    stages: int = attrs.field(validator=_POSITIVE_INT)
    standby: int = attrs.field(validator=_NON_NEGATIVE_INT)
    bytes_moved: int = attrs.field(validator=_NON_NEGATIVE_INT)
    duration_s: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    attempts: int = attrs.field(default=1, validator=_POSITIVE_INT)
    """Starts it took: more than 1 when a node died while it started and the decision was redone."""
    nodes_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    decide_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    barrier_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    transfers_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    group_builds_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    first_step_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    prepared: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))
    """The new layout was prepared while the old one trained (make before break): only the switch paused."""
    generation: int | None = attrs.field(default=None, validator=attrs.validators.optional(_NON_NEGATIVE_INT))


@attrs.frozen
class Checkpoint:
    """A checkpoint of ``step`` was committed at ``path`` (``bytes`` on disk, ``duration_s`` to write)."""

    KIND: ClassVar[str] = "checkpoint"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    path: str = attrs.field(validator=_non_empty_str)
    bytes: int = attrs.field(validator=_NON_NEGATIVE_INT)
    duration_s: float = attrs.field(validator=_NON_NEGATIVE_TIME)


def _stage_list(instance: object, attribute: attrs.Attribute, value: str) -> None:
    parts = value.split(",") if isinstance(value, str) else []
    if not parts or not all(part.isdigit() for part in parts):
        raise ValueError(f"{attribute.name} must be stage numbers separated by commas, like '1,2', got {value!r}")


@attrs.frozen
class Restore:
    """No survivor held some stage: every node restarted from the checkpoint of ``step`` at ``path``.

    ``lost_stages`` are the stages whose every copy was gone (``"1"``, ``"1,2"``);
    ``discarded_steps`` the steps done after that checkpoint, which are trained again.
    """

    KIND: ClassVar[str] = "restore"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    path: str = attrs.field(validator=_non_empty_str)
    lost_stages: str = attrs.field(validator=_stage_list)
    discarded_steps: int = attrs.field(validator=_NON_NEGATIVE_INT)
    source: str | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.in_(("memory", "disk", "initial"))))
    """Where the state came from: ``memory`` (in-memory copies on live peers), ``disk``, or ``initial`` (no copy
    of any step was left: the job started over from its seeded initial state)."""
    duration_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    """The restore's pause (its reconfiguration's)."""


@attrs.frozen
class Startup:
    """How long each phase of a worker's start took (see the module docstring; None: not gone through)."""

    KIND: ClassVar[str] = "startup"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    node: str = attrs.field(validator=_non_empty_str)
    process_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    imports_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    model_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    wait_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    model_build_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    group_build_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))
    first_step_s: float | None = attrs.field(default=None, validator=_V.optional(_NON_NEGATIVE_TIME))


@attrs.frozen
class Step:
    """One optimizer step finished at ``t``: its global batch size and loss, and the nodes at work;
    ``restore_point``: the job took a restore point (in-memory copies, a checkpoint) right after it."""

    KIND: ClassVar[str] = "step"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    samples: int = attrs.field(validator=_POSITIVE_INT)
    loss: float = attrs.field(validator=_finite)
    nodes_active: int = attrs.field(validator=_NON_NEGATIVE_INT)
    duration_s: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    generation: int | None = attrs.field(default=None, validator=attrs.validators.optional(_NON_NEGATIVE_INT))
    restore_point: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))


def _losses(instance: object, attribute: attrs.Attribute, value: dict[str, float]) -> None:
    if not isinstance(value, dict) or not value or not all(
            isinstance(mode, str) and isinstance(lost, (int, float)) and math.isfinite(lost)
            for mode, lost in value.items()):
        raise ValueError(f"{attribute.name} must map each mode to a finite number, got {value!r}")


@attrs.frozen
class RedundancyChoice:
    """``--redundancy auto`` chose ``mode`` for layout generation ``generation``: why, and each mode's expected
    loss per hour."""

    KIND: ClassVar[str] = "redundancy_choice"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    generation: int = attrs.field(validator=_NON_NEGATIVE_INT)
    mode: str = attrs.field(validator=_non_empty_str)
    reason: str = attrs.field(validator=_non_empty_str)
    lost_s_per_hour: dict[str, float] = attrs.field(validator=_losses)
    step_s: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    preemptions_per_node_hour: float = attrs.field(validator=_NON_NEGATIVE_TIME)


@attrs.frozen
class WorkerPhase:
    """Node ``node``'s worker entered ``phase`` from ``previous`` when that phase ended in ``cause``, about layout
    generation ``generation`` (None: no layout, say a job that ended while the node waited)."""

    KIND: ClassVar[str] = "phase"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    node: str = attrs.field(validator=_non_empty_str)
    phase: str = attrs.field(validator=_non_empty_str)
    previous: str = attrs.field(validator=_non_empty_str)
    cause: str = attrs.field(validator=_non_empty_str)
    generation: int | None = attrs.field(default=None, validator=attrs.validators.optional(_NON_NEGATIVE_INT))


@attrs.frozen
class RunEnd:
    """The run finished after ``steps`` steps; nodes still alive stop being billed at ``t``."""

    KIND: ClassVar[str] = "run_end"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    steps: int = attrs.field(validator=_NON_NEGATIVE_INT)


Event = (RunStart | Join | Preemption | Failover | Reconfiguration | Checkpoint | Restore | Startup | Step | RunEnd
         | RedundancyChoice | WorkerPhase)

EventField: TypeAlias = "str | int | float | bool | dict[str, float] | None"
"""The value of one field of a record (the types of the record classes' fields above)."""

EVENT_TYPES: dict[str, type[Event]] = {
    cls.KIND: cls
    for cls in (RunStart, Join, Preemption, Failover, Reconfiguration, Checkpoint, Restore, Startup, Step, RunEnd,
                RedundancyChoice, WorkerPhase)
}


def event_to_dict(event: Event) -> JSONObject:
    """The JSON object of one record: ``kind`` first, then ``t``, then the kind's own keys (a step's
    ``restore_point`` only when true: step records are nearly all of a long job's log)."""
    return {"kind": type(event).KIND, **attrs.asdict(event, filter=_written)}


def _written(attribute: attrs.Attribute, value: EventField) -> bool:
    return not (attribute.name == "restore_point" and value is False)


def event_from_dict(record: JSON) -> Event:
    """Parse one JSON value, which must be an object, into its typed record; raises ``ValueError`` saying what is
    wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    kind = record.get("kind")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(EVENT_TYPES)}")
    names = {f.name for f in attrs.fields(cls)}
    fields = {k: v for k, v in record.items() if k != "kind"}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"{kind} record has unknown keys {unknown}; allowed: {sorted(names)}")
    required = {f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING}
    missing = sorted(required - set(fields))
    if missing:
        raise ValueError(f"{kind} record is missing keys {missing}")
    return cls(**fields)
