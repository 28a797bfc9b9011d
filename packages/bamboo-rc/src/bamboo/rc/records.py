"""The records bamboo-rc writes for other processes: frozen attrs classes with versioned JSON codecs.

Every value that crosses a process boundary is one of these (the keys live under
``bamboo/<job>/`` of the c10d store; see :mod:`bamboo.rc.coordinator`):

- :class:`FailureEvent` (``epoch/<e>``): the event that starts an epoch, written first writer wins:
  the authority's confirmed failures, or a leaver's own hand-over;
- :class:`SuspicionRecord` (``suspect/<e>/<reporter>/<peer>``): a worker saw a peer fail;
- :class:`ProgressRecord` (``progress/d<p>/v<victims>/n<node>``): a survivor's progress, for the
  agreement on the cut, with the :class:`CommitResult` of its last commit;
- :class:`ReducedRecord` (``reduced/r<lost>/n<rank>``): the data-parallel all-reduces a node had completed
  when it learned that a node of another pipeline holding one of its stages was lost (a witness for a
  redo of an earlier failover that the lost node had to join);
- :class:`HandoverRecord` (``handover/d<p>/<step>/<rank>``): a node leaves at an iteration
  boundary after a preemption notice (``handover_cancelled/<step>/<rank>`` withdraws it);
- :class:`FailoverRecord`: what one failover did and when (``StageExecutor.failovers``; verify's
  workers hand them to their parent).

Each JSON object carries ``"v": 1``. A reader rejects an unknown version, a missing key or a
malformed value with :class:`RecordError` (bamboo-reconfig's, one error type for every record of
the system), whose one-line message names the record and the key.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from typing import Any, ClassVar, TypeVar

import attrs
from bamboo.reconfig import RecordError

__all__ = [
    "RECORD_VERSION",
    "CommitResult",
    "FailoverRecord",
    "FailureEvent",
    "HandoverRecord",
    "JsonRecord",
    "ProgressRecord",
    "RecordError",
    "RecordReader",
    "ReducedRecord",
    "SuspicionRecord",
    "decode_json",
]

RECORD_VERSION = 1
"""The version every record of this module writes, and the only one its readers accept."""


class RecordReader:
    """Reads the keys of one decoded record, raising :class:`RecordError` that names the record and key.

    It checks that the record is a JSON object of the version this reader knows.
    """

    def __init__(self, what: str, data: object) -> None:
        self.what = what
        if not isinstance(data, Mapping):
            raise RecordError(f"{what}: must be a JSON object, got {type(data).__name__}")
        self.data = data
        version = self._get("v")
        if version != RECORD_VERSION:
            raise RecordError(f"{what}: unknown version {version!r} (this reader knows version {RECORD_VERSION})")

    def _get(self, key: str) -> Any:
        if key not in self.data:
            raise RecordError(f"{self.what}: missing key {key!r}")
        return self.data[key]

    def _bad(self, key: str, expected: str, value: object) -> RecordError:
        return RecordError(f"{self.what}: key {key!r} must be {expected}, got {value!r}")

    def integer(self, key: str, minimum: int = 0) -> int:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
            raise self._bad(key, f"an integer >= {minimum}", value)
        return value

    def number(self, key: str) -> float:
        value = self._get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise self._bad(key, "a number", value)
        return float(value)

    def optional_number(self, key: str) -> float | None:
        """A number or null (the key itself must be there)."""
        return None if self._get(key) is None else self.number(key)

    def boolean(self, key: str) -> bool:
        value = self._get(key)
        if not isinstance(value, bool):
            raise self._bad(key, "true or false", value)
        return value

    def text(self, key: str) -> str:
        value = self._get(key)
        if not isinstance(value, str):
            raise self._bad(key, "a string", value)
        return value

    def ranks(self, key: str, what: str = "ranks") -> tuple[int, ...]:
        value = self._get(key)
        if not isinstance(value, list) or any(isinstance(r, bool) or not isinstance(r, int) or r < 0 for r in value):
            raise self._bad(key, f"a list of {what} (integers >= 0)", value)
        return tuple(value)

    def int_map(self, key: str, what: str, optional: bool = False) -> dict[int, Any] | None:
        """A JSON object whose keys are integers written as strings (JSON keys are strings); null
        when `optional` (the key itself must be there)."""
        value = self._get(key)
        if value is None and optional:
            return None
        if not isinstance(value, Mapping) or any(not str(k).isdigit() for k in value):
            raise self._bad(key, f"an object from {what}", value)
        return {int(k): v for k, v in value.items()}

    def int_lists(self, key: str, keys: str, items: str) -> dict[int, tuple[int, ...]]:
        """A JSON object from integers (`keys`, written as strings) to lists of integers >= 0 (`items`)."""
        value = self.int_map(key, f"{keys} to lists of {items}")
        assert value is not None
        for name, listed in value.items():
            if not isinstance(listed, list) or any(isinstance(i, bool) or not isinstance(i, int) or i < 0
                                                   for i in listed):
                raise RecordError(f"{self.what}: key {key!r} must map {keys} to lists of {items}, got {listed!r} "
                                  f"for {keys.removesuffix('s')} {name}")
        return {name: tuple(listed) for name, listed in value.items()}

    def seconds_map(self, key: str, optional: bool = False) -> dict[str, float] | None:
        value = self._get(key)
        if value is None and optional:
            return None
        if not isinstance(value, Mapping) or any(
            not isinstance(k, str) or isinstance(v, bool) or not isinstance(v, (int, float)) for k, v in value.items()
        ):
            raise self._bad(key, "an object from names to seconds", value)
        return {k: float(v) for k, v in value.items()}


def decode_json(what: str, text: str | bytes) -> object:
    """The JSON value of a record's text; :class:`RecordError` naming the record when it is not JSON."""
    try:
        return json.loads(text)
    except (ValueError, UnicodeDecodeError) as error:
        raise RecordError(f"{what}: not JSON ({error})") from None


R = TypeVar("R", bound="JsonRecord")


class JsonRecord:
    """``to_json`` and ``from_json`` on top of a record's ``to_dict`` and ``from_dict``; ``RECORD``
    names the record in error messages."""

    RECORD: ClassVar[str] = "record"

    def to_dict(self) -> dict[str, Any]:  # pragma: no cover - every record defines it
        raise NotImplementedError

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Any:  # pragma: no cover - every record defines it
        raise NotImplementedError

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls: type[R], text: str | bytes) -> R:
        return cls.from_dict(decode_json(cls.RECORD, text))  # type: ignore[arg-type, no-any-return]


def _sorted_ranks(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(sorted(value))


_NON_NEGATIVE_INT = attrs.validators.and_(attrs.validators.instance_of(int),
                                          attrs.validators.not_(attrs.validators.instance_of(bool)),
                                          attrs.validators.ge(0))
"""An int (not a bool) >= 0."""


@attrs.frozen
class FailureEvent(JsonRecord):
    """Confirmed failures that start membership epoch ``epoch``: the global ranks that died."""

    RECORD: ClassVar[str] = "failure event"

    epoch: int = attrs.field(validator=attrs.validators.ge(1))
    victims: tuple[int, ...] = attrs.field(converter=_sorted_ranks)
    handover: bool = False
    """True when the ranks left after a preemption notice, at an iteration boundary."""

    def to_dict(self) -> dict[str, Any]:
        return {"v": RECORD_VERSION, "epoch": self.epoch, "victims": list(self.victims), "handover": self.handover}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FailureEvent:
        read = RecordReader(cls.RECORD, data)
        return cls(read.integer("epoch", 1), read.ranks("victims"), read.boolean("handover"))



@attrs.frozen
class SuspicionRecord(JsonRecord):
    """Rank ``reporter`` saw rank ``peer`` fail during ``instruction`` in epoch ``epoch``."""

    RECORD: ClassVar[str] = "suspicion"

    epoch: int = attrs.field(validator=_NON_NEGATIVE_INT)
    reporter: int = attrs.field(validator=_NON_NEGATIVE_INT)
    peer: int = attrs.field(validator=_NON_NEGATIVE_INT)
    instruction: str

    def to_dict(self) -> dict[str, Any]:
        return {"v": RECORD_VERSION, "epoch": self.epoch, "reporter": self.reporter, "peer": self.peer,
                "instruction": self.instruction}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> SuspicionRecord:
        read = RecordReader(cls.RECORD, data)
        return cls(read.integer("epoch"), read.integer("reporter"), read.integer("peer"), read.text("instruction"))



@attrs.frozen
class CommitResult(JsonRecord):
    """The result of one commit (the all-reduce over the pipeline that ends a step): the sum of
    the squared gradient norms of every stage and the summed loss of step ``step``."""

    RECORD: ClassVar[str] = "commit result"

    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    squared_norm: float = attrs.field(converter=float)
    loss: float = attrs.field(converter=float)

    def to_dict(self) -> dict[str, Any]:
        return {"v": RECORD_VERSION, "step": self.step, "squared_norm": self.squared_norm, "loss": self.loss}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], what: str = RECORD) -> CommitResult:
        read = RecordReader(what, data)
        return cls(read.integer("step"), read.number("squared_norm"), read.number("loss"))


@attrs.frozen
class ProgressRecord(JsonRecord):
    """A survivor's progress when its pipeline failed: ``done`` instructions completed in step
    ``step``, counted in a failover's remainder when ``remainder`` (a second failure during the
    recovery), else in its steady schedule.

    ``commit`` is the result of the last commit the survivor completed (that of step
    ``step - 1``; None before its first): the commit's all-reduce is not atomic, so a victim that
    dies during it can leave some survivors done with it (and into the next step) and others
    not; those finish it with this result (:class:`bamboo.rc.agreement.PipelinePlan`)."""

    RECORD: ClassVar[str] = "progress"

    done: int = attrs.field(validator=_NON_NEGATIVE_INT)
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    remainder: bool = False
    commit: CommitResult | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"v": RECORD_VERSION, "done": self.done, "step": self.step, "remainder": self.remainder,
                "commit": None if self.commit is None else self.commit.to_dict()}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ProgressRecord:
        read = RecordReader(cls.RECORD, data)
        commit = read._get("commit")
        if commit is not None:
            commit = CommitResult.from_dict(commit, f"{cls.RECORD}: key 'commit'")
        return cls(read.integer("done"), read.integer("step"), read.boolean("remainder"), commit)


def _steps_by_stage(value: Mapping[int, Iterable[int]]) -> dict[int, tuple[int, ...]]:
    return {int(stage): tuple(sorted(steps)) for stage, steps in sorted(value.items())}


@attrs.frozen
class ReducedRecord(JsonRecord):
    """What a node had done when it learned of a loss in another pipeline: it was in step ``step``, and
    ``completed`` maps each stage it holds to the steps whose data-parallel all-reduce of that stage it
    had completed (kept as contributions: the current step and the one before)."""

    RECORD: ClassVar[str] = "reduced"

    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    completed: dict[int, tuple[int, ...]] = attrs.field(factory=dict, converter=_steps_by_stage)

    def has_completed(self, stage: int, step: int) -> bool:
        """Whether stage `stage`'s all-reduce of step `step` had completed here (a later step implies it)."""
        return self.step > step or step in self.completed.get(stage, ())

    def to_dict(self) -> dict[str, Any]:
        return {"v": RECORD_VERSION, "step": self.step,
                "completed": {str(stage): list(steps) for stage, steps in self.completed.items()}}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ReducedRecord:
        read = RecordReader(cls.RECORD, data)
        completed = read.int_lists("completed", "stages", "steps")
        return cls(read.integer("step"), completed)


@attrs.frozen
class HandoverRecord(JsonRecord):
    """Node ``node`` of pipeline ``pipeline`` (global rank ``rank``) hands its stage to its shadow
    after step ``step`` and leaves."""

    RECORD: ClassVar[str] = "hand-over"

    rank: int = attrs.field(validator=_NON_NEGATIVE_INT)
    pipeline: int = attrs.field(validator=_NON_NEGATIVE_INT)
    node: int = attrs.field(validator=_NON_NEGATIVE_INT)
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)

    def to_dict(self) -> dict[str, Any]:
        return {"v": RECORD_VERSION, "rank": self.rank, "pipeline": self.pipeline, "node": self.node, "step": self.step}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> HandoverRecord:
        read = RecordReader(cls.RECORD, data)
        return cls(read.integer("rank"), read.integer("pipeline"), read.integer("node"), read.integer("step"))


def _victims_by_pipeline(value: Mapping[int, Iterable[int]]) -> dict[int, tuple[int, ...]]:
    return {int(d): tuple(sorted(nodes)) for d, nodes in sorted(value.items())}


def _optional_cut(value: Mapping[int, int] | None) -> dict[int, int] | None:
    return None if value is None else {int(n): int(i) for n, i in sorted(value.items())}


def _optional_seconds(value: Mapping[str, float] | None) -> dict[str, float] | None:
    return None if value is None else dict(value)


@attrs.frozen
class FailoverRecord(JsonRecord):
    """What one failover did, as seen by one node (:attr:`StageExecutor.failovers`).

    Times are wall clock (seconds since the Unix epoch): ``caught_at`` when the node caught the
    failure (a failed transfer or a noticed event), ``confirmed_at`` when it held the confirmed
    event, ``resumed_at`` when it resumed (its remainder, or where it was), ``iteration_end`` when
    the failed iteration ended (set for the node's own pipeline).
    """

    RECORD: ClassVar[str] = "failover record"

    epoch: int = attrs.field(validator=_NON_NEGATIVE_INT)
    victims: dict[int, tuple[int, ...]] = attrs.field(converter=_victims_by_pipeline)
    """Pipeline -> the nodes (stages of the fault-free layout) that failed in it."""
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    cut: dict[int, int] | None = attrs.field(converter=_optional_cut)
    """Node -> instructions completed at the agreed cut, for the node's own pipeline; None when its
    pipeline lost nobody."""
    caught_at: float
    confirmed_at: float
    resumed_at: float
    own_pipeline: bool
    """Whether the node's own pipeline lost a node (it ran a failover remainder)."""
    kinds_before: dict[str, float] = attrs.field(factory=dict, converter=dict)
    """The node's seconds per instruction kind before the failover (``StageExecutor.kind_seconds``)."""
    iteration_end: float | None = None
    recovery_kinds: dict[str, float] | None = attrs.field(default=None, converter=_optional_seconds)
    """Seconds per instruction kind from the failover to the end of the failed iteration."""

    @property
    def pause_s(self) -> float:
        """Seconds from catching the failure to resuming (detection and re-routing)."""
        return max(0.0, self.resumed_at - self.caught_at)

    def ended(self, iteration_end: float, kind_seconds: Mapping[str, float]) -> FailoverRecord:
        """This record with the end of the failed iteration and the work since the failover."""
        recovery = {kind: seconds - self.kinds_before.get(kind, 0.0) for kind, seconds in kind_seconds.items()}
        return attrs.evolve(self, iteration_end=iteration_end, recovery_kinds=recovery)

    def to_dict(self) -> dict[str, Any]:
        return {
            "v": RECORD_VERSION,
            "epoch": self.epoch,
            "victims": {str(d): list(nodes) for d, nodes in self.victims.items()},
            "step": self.step,
            "cut": None if self.cut is None else {str(n): i for n, i in self.cut.items()},
            "caught_at": self.caught_at,
            "confirmed_at": self.confirmed_at,
            "resumed_at": self.resumed_at,
            "own_pipeline": self.own_pipeline,
            "kinds_before": dict(self.kinds_before),
            "iteration_end": self.iteration_end,
            "recovery_kinds": None if self.recovery_kinds is None else dict(self.recovery_kinds),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> FailoverRecord:
        read = RecordReader(cls.RECORD, data)
        victims = read.int_lists("victims", "pipelines", "nodes")
        cut = read.int_map("cut", "nodes to instruction counts", optional=True)
        if cut is not None and any(isinstance(i, bool) or not isinstance(i, int) or i < 0 for i in cut.values()):
            raise RecordError(f"failover record: key 'cut' must map nodes to instruction counts, got {data['cut']!r}")
        kinds_before = read.seconds_map("kinds_before")
        assert kinds_before is not None
        return cls(
            epoch=read.integer("epoch"),
            victims=victims,
            step=read.integer("step"),
            cut=cut,
            caught_at=read.number("caught_at"),
            confirmed_at=read.number("confirmed_at"),
            resumed_at=read.number("resumed_at"),
            own_pipeline=read.boolean("own_pipeline"),
            kinds_before=kinds_before,
            iteration_end=read.optional_number("iteration_end"),
            recovery_kinds=read.seconds_map("recovery_kinds", optional=True),
        )

