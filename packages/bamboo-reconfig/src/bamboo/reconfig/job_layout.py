"""The job layout: the one record that tells every node of a job its role, as stored in etcd.

A :class:`JobLayout` is a generation of the job: the planner's :class:`~bamboo.reconfig.Layout` (who owns
each stage of each pipeline, the shadows, the stage bounds, the microbatch shares, the standby queue),
plus what the nodes need to start it: the step it starts at, how the state gets there (``mode``: the
first layout, state moved from surviving peers by a :class:`~bamboo.reconfig.TransferPlan`, or a
checkpoint :class:`RestorePoint`), why it was made, and where it came from (the barrier step, the
generation and attempt it follows, the holders that survived). ``history`` lists ``(first step,
pipelines)`` of every generation so far, which is how the single-process reference groups the global
batch exactly as the run did. ``redundancy`` (a :class:`ModeChoice`, only when the job's redundancy is
``auto``) is the mode this generation trains with and why it was chosen; ``restore_every`` (only when the job
chooses its restore points per generation) the steps between its in-memory copies and checkpoints.

The node at global rank ``pipeline * stages + stage`` owns ``stage`` of ``pipeline``; the stage bounds in
``plan.stage_layers`` are exactly the layers each stage's executor builds.

The record travels as versioned JSON (``"v": 2``), compact because every node reads it at every change: each
pipeline's owners as one list (a shadow is the owner of the stage before it) and the nodes grouped by zone
(``{"zone-a": ["node0000", ...]}``); at 1,000 nodes etcd stores 27 KB, against 75 KB in version 1, which wrote
an object per stage and per node and is still read. :meth:`JobLayout.from_dict` rejects an unknown version, a
missing key or a malformed value with a :class:`RecordError` that names the key.
"""

from __future__ import annotations

import enum
import functools
import json
import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs
from bamboo.reconfig.model import Layout
from bamboo.reconfig.transfers import TransferPlan

__all__ = ["LAYOUT_VERSION", "MODES", "JobLayout", "ModeChoice", "RecordError", "RestorePoint", "StartMode"]

LAYOUT_VERSION = 2
_READABLE_VERSIONS = (1, 2)


class RecordError(ValueError):
    """A record read from the store is malformed, or of a version this reader does not know.

    The message names the record and the offending key.
    """


class StartMode(enum.Enum):
    """How the state of a generation gets into place."""

    FIRST = "first"
    """The job's first layout: every stage starts from its seeded initial weights."""
    PEERS = "peers"
    """State moves from surviving holders (owners, shadows, data-parallel peers) by the transfer plan."""
    CHECKPOINT = "checkpoint"
    """Some stage lost every copy: every node loads the checkpoint named by the restore point."""


_NON_NEGATIVE_INT = attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(0))


def _node_ids(value: Iterable[str]) -> tuple[str, ...]:
    return tuple(value)


def _keepers(value: Mapping[Any, Iterable[str]]) -> dict[int, tuple[str, ...]]:
    return {int(stage): tuple(str(node) for node in nodes) for stage, nodes in dict(value).items()}


@attrs.frozen
class RestorePoint:
    """The copy of an earlier step a generation restarts from: its step, the stages that forced it, and where
    every stage's state is: in the memory of live nodes (``memory``: stage -> the nodes that keep it at that
    step, nearest first), in the checkpoint folder ``path`` (disk), or, with ``initial``, nowhere: no copy of
    any step is left, and the job starts over from its seeded initial state (step 0)."""

    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    path: str = attrs.field(validator=attrs.validators.instance_of(str))
    lost_stages: tuple[int, ...] = attrs.field(converter=lambda v: tuple(sorted(int(s) for s in v)))
    memory: dict[int, tuple[str, ...]] = attrs.field(factory=dict, converter=_keepers)
    initial: bool = attrs.field(default=False, validator=attrs.validators.instance_of(bool))

    def __attrs_post_init__(self) -> None:
        if self.initial and (self.step or self.path or self.memory):
            raise ValueError(f"a start over from the initial state is step 0 with no copy, got step {self.step}, "
                             f"path {self.path!r} and {len(self.memory)} stage(s) in memory")
        if not self.path and not self.memory and not self.initial:
            raise ValueError("a restore point needs the checkpoint's folder or in-memory copies, got neither")
        if not self.lost_stages:
            raise ValueError(f"a restore point names the stages that lost every copy, got none (step {self.step})")
        empty = sorted(stage for stage, nodes in self.memory.items() if not nodes)
        if empty:
            raise ValueError(f"a restore from memory names the nodes that keep every stage; stage(s) {empty} have none")

    @property
    def source(self) -> str:
        """``memory``, ``disk`` or ``initial``."""
        return "initial" if self.initial else "memory" if self.memory else "disk"

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"step": self.step, "path": self.path, "lost_stages": list(self.lost_stages)}
        if self.memory:
            data["memory"] = {str(stage): list(nodes) for stage, nodes in sorted(self.memory.items())}
        if self.initial:
            data["initial"] = True
        return data


MODES = ("none", "lflb", "eflb", "efeb")
"""The redundancy modes a generation can train with."""


def _losses(value: Mapping[str, float]) -> dict[str, float]:
    return {str(mode): float(lost) for mode, lost in dict(value).items()}


@attrs.frozen
class ModeChoice:
    """The redundancy mode a generation of an ``auto`` job trains with, and why: the expected training lost per
    hour of each mode considered (seconds), from the step time and preemption rate it assumed."""

    mode: str = attrs.field(validator=attrs.validators.in_(MODES))
    reason: str = attrs.field(validator=attrs.validators.instance_of(str))
    lost_s_per_hour: dict[str, float] = attrs.field(converter=_losses)
    step_s: float = attrs.field(validator=attrs.validators.and_(attrs.validators.instance_of((int, float)),
                                                                attrs.validators.gt(0)))
    """The fault-free step of ``none`` it assumed (measured, or the default before any)."""
    preemptions_per_node_hour: float = attrs.field(validator=attrs.validators.and_(
        attrs.validators.instance_of((int, float)), attrs.validators.ge(0)))

    def __attrs_post_init__(self) -> None:
        unknown = sorted(set(self.lost_s_per_hour) - set(MODES))
        if unknown or self.mode not in self.lost_s_per_hour:
            raise ValueError(f"lost_s_per_hour must name modes of {list(MODES)} including {self.mode!r}, got "
                             f"{sorted(self.lost_s_per_hour)}")

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)


def _mode_choice(value: ModeChoice | Mapping[str, Any] | None) -> ModeChoice | None:
    return value if value is None or isinstance(value, ModeChoice) else ModeChoice(**value)


def _history(value: Iterable[Iterable[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(first), int(pipelines)) for first, pipelines in value)


def _zones(value: Mapping[str, str]) -> dict[str, str]:
    return {str(node): str(zone) for node, zone in dict(value).items()}


@attrs.frozen
class JobLayout:
    """Generation ``generation`` of a job: its placement (``plan``) and how it starts (see the module docstring)."""

    generation: int = attrs.field(validator=_NON_NEGATIVE_INT)
    plan: Layout = attrs.field(validator=attrs.validators.instance_of(Layout))
    start_step: int = attrs.field(default=0, validator=_NON_NEGATIVE_INT)
    mode: StartMode = attrs.field(default=StartMode.FIRST, converter=StartMode)
    reason: str = attrs.field(default="first layout", validator=attrs.validators.instance_of(str))
    transfers: TransferPlan = attrs.field(
        factory=lambda: TransferPlan(rounds=(), bytes_moved=0, naive_bytes=0),
        validator=attrs.validators.instance_of(TransferPlan),
    )
    restore: RestorePoint | None = attrs.field(default=None)
    barrier_step: int = attrs.field(default=0, validator=_NON_NEGATIVE_INT)
    """The step at which the previous generation's holders met (the start step, unless restored)."""
    barrier_unix: float | None = attrs.field(default=None)
    """When the first holder reached that barrier (wall clock); None for the first layout."""
    base_generation: int | None = attrs.field(default=None)
    """The generation whose barrier this layout comes from; None for the first layout."""
    attempt: int = attrs.field(default=0, validator=_NON_NEGATIVE_INT)
    """How many starts of that barrier were abandoned before this one."""
    survivors: tuple[str, ...] = attrs.field(default=(), converter=_node_ids)
    """The nodes that held state at that barrier."""
    history: tuple[tuple[int, int], ...] = attrs.field(default=((0, 0),), converter=_history)
    """``(first step, pipelines)`` of every generation so far, this one last."""
    zones: dict[str, str] = attrs.field(factory=dict, converter=_zones)
    """The zone of every node placed or on standby when the layout was planned."""
    redundancy: ModeChoice | None = attrs.field(default=None, converter=_mode_choice)
    """The mode this generation trains with when the job's is ``auto``; None: the job spec's mode."""
    restore_every: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.ge(1))))
    """Steps between this generation's restore points (in-memory copies and checkpoints) when the job chooses them
    per generation; None: the job spec's intervals."""

    def __attrs_post_init__(self) -> None:
        if self.mode is StartMode.CHECKPOINT and self.restore is None:
            raise ValueError(f"generation {self.generation} restarts from a checkpoint but names no restore point")
        if self.mode is not StartMode.CHECKPOINT and self.restore is not None:
            raise ValueError(f"generation {self.generation} is mode {self.mode.value} but names a restore point")
        if self.restore is not None and self.restore.step != self.start_step:
            raise ValueError(f"generation {self.generation} starts at step {self.start_step} but its checkpoint "
                             f"is of step {self.restore.step}")
        if self.barrier_unix is not None and not math.isfinite(self.barrier_unix):
            raise ValueError(f"barrier_unix must be finite, got {self.barrier_unix!r}")
        if self.history == ((0, 0),):  # the default: this generation alone
            object.__setattr__(self, "history", ((self.start_step, self.pipelines),))
        if not self.history or self.history[-1] != (self.start_step, self.pipelines):
            raise ValueError(f"history {list(self.history)} must end with this generation's (start step, "
                             f"pipelines) = {(self.start_step, self.pipelines)}")

    # ---- the placement, as every node reads it --------------------------------------------------------

    @property
    def stages(self) -> int:
        return self.plan.stages

    @property
    def pipelines(self) -> int:
        return self.plan.num_pipelines

    @property
    def stage_bounds(self) -> tuple[tuple[int, int], ...]:
        """The half-open layer range of every stage: exactly what each executor builds."""
        return self.plan.stage_layers

    @property
    def micro_batches(self) -> int:
        """Microbatches per pipeline per step. Raises when the shares differ (a pipeline runs M each)."""
        shares = set(self.plan.microbatches)
        if len(shares) != 1:
            raise ValueError(f"generation {self.generation} has unequal microbatch shares "
                             f"{list(self.plan.microbatches)}; every pipeline must run the same number")
        return shares.pop()

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    @functools.cached_property
    def ranks(self) -> dict[str, int]:
        """Node -> global rank (``pipeline * stages + stage``) of every owner. Built once per layout (a
        thousand nodes' map is read many times per generation): read it, never change it."""
        stages = self.stages
        return {node: d * stages + s for d, row in enumerate(self.plan.owners) for s, node in enumerate(row)}

    @functools.cached_property
    def node_of_rank(self) -> dict[int, str]:
        """Global rank -> node: the inverse of :attr:`ranks` (built once; read it, never change it)."""
        return {rank: node for node, rank in self.ranks.items()}

    @property
    def owners(self) -> tuple[tuple[str, ...], ...]:
        return self.plan.owners

    @property
    def standby(self) -> tuple[str, ...]:
        return self.plan.standby

    @property
    def nodes(self) -> tuple[str, ...]:
        """Every node this generation knows: owners, then standby."""
        return (*self.ranks, *self.standby)

    def shadow(self, pipeline: int, stage: int) -> str:
        return self.plan.shadow(pipeline, stage)

    def history_at(self, step: int) -> int:
        """The pipelines that ran step ``step``."""
        return next(d for first, d in reversed(self.history) if step >= first)

    def stages_of_layers(self, layers: Iterable[int]) -> tuple[int, ...]:
        """The stages whose layers are exactly ``layers`` (a transfer moves whole stages).

        Raises ValueError when ``layers`` covers part of a stage: the executors hold state per stage.
        """
        wanted = set(layers)
        stages = sorted({self.plan.stage_of_layer(layer) for layer in wanted})
        covered = {layer for stage in stages for layer in self.plan.stage_layer_range(stage)}
        if covered != wanted:
            raise ValueError(f"layers {sorted(wanted)} are not whole stages of the split "
                             f"{list(self.stage_bounds)} (stages {stages} have layers {sorted(covered)})")
        return tuple(stages)

    def holdings_of_stages(self, stages_by_node: Mapping[str, Iterable[int]]) -> dict[str, frozenset[int]]:
        """Node -> layers it holds, from node -> stages it holds (for :func:`bamboo.reconfig.plan_transfers`)."""
        return {node: frozenset(layer for stage in stages for layer in self.plan.stage_layer_range(int(stage)))
                for node, stages in stages_by_node.items()}

    # ---- JSON ---------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        chosen: dict[str, Any] = {} if self.redundancy is None else {"redundancy": self.redundancy.to_dict()}
        if self.restore_every is not None:
            chosen["restore_every"] = self.restore_every
        return {
            "v": LAYOUT_VERSION,
            "generation": self.generation,
            "plan": self.plan.to_dict(),
            "start_step": self.start_step,
            "mode": self.mode.value,
            "reason": self.reason,
            "transfers": self.transfers.to_dict(),
            "restore": None if self.restore is None else self.restore.to_dict(),
            "barrier_step": self.barrier_step,
            "barrier_unix": self.barrier_unix,
            "base_generation": self.base_generation,
            "attempt": self.attempt,
            "survivors": list(self.survivors),
            "history": [list(item) for item in self.history],
            "zones": _nodes_by_zone(self.zones),
            **chosen,
        }

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> JobLayout:
        """The layout in ``data``; :class:`RecordError` names the key of anything unknown or malformed."""
        read = _Reader("layout", data)
        version = read.value("v", int)
        if version not in _READABLE_VERSIONS:
            raise RecordError(f"layout: unknown version {version!r} (this reader knows versions "
                              f"{', '.join(map(str, _READABLE_VERSIONS))})")
        plan = read.parsed("plan", Layout.from_dict)
        transfers = read.parsed("transfers", TransferPlan.from_dict)
        restore_data = read.value("restore", (dict, type(None)))
        restore = None
        if restore_data is not None:
            restore = _Reader("layout", data).parsed("restore", lambda d: RestorePoint(
                step=d["step"], path=d["path"], lost_stages=d["lost_stages"], memory=d.get("memory", {}),
                initial=d.get("initial", False)))
        try:
            return cls(
                generation=read.value("generation", int),
                plan=plan,
                start_step=read.value("start_step", int),
                mode=read.parsed("mode", StartMode),
                reason=read.value("reason", str),
                transfers=transfers,
                restore=restore,
                barrier_step=read.value("barrier_step", int),
                barrier_unix=read.value("barrier_unix", (int, float, type(None))),
                base_generation=read.value("base_generation", (int, type(None))),
                attempt=read.value("attempt", int),
                survivors=read.value("survivors", list),
                history=read.value("history", list),
                zones=read.parsed("zones", _zone_of_node if version >= 2 else dict),
                redundancy=read.parsed("redundancy", _mode_choice) if "redundancy" in data else None,
                restore_every=read.value("restore_every", int) if "restore_every" in data else None,
            )
        except (TypeError, ValueError) as error:
            if isinstance(error, RecordError):
                raise
            raise RecordError(f"layout: {error}") from None

    @classmethod
    def from_json(cls, text: str | bytes) -> JobLayout:
        try:
            data = json.loads(text)
        except ValueError as error:
            raise RecordError(f"layout: not JSON ({error})") from None
        return cls.from_dict(data)


def _nodes_by_zone(zones: Mapping[str, str]) -> dict[str, list[str]]:
    """``zones`` (node -> zone) as version 2 writes it: zone -> its nodes, sorted."""
    grouped: dict[str, list[str]] = {}
    for node, zone in sorted(zones.items()):
        grouped.setdefault(zone, []).append(node)
    return grouped


def _zone_of_node(grouped: Mapping[str, list[str]]) -> dict[str, str]:
    """Version 2's zone -> nodes back to node -> zone; a node listed in two zones is refused."""
    if not isinstance(grouped, Mapping):
        raise TypeError(f"must be an object of zone -> nodes, got {grouped!r}")
    zones: dict[str, str] = {}
    for zone, nodes in grouped.items():
        if not isinstance(nodes, list):
            raise TypeError(f"zone {zone!r} must list its nodes, got {nodes!r}")
        for node in nodes:
            if zones.setdefault(node, zone) != zone:
                raise ValueError(f"node {node!r} is in zones {zones[node]!r} and {zone!r}")
    return zones


class _Reader:
    """Reads typed keys of one JSON record, naming the record and the key in every error."""

    def __init__(self, what: str, data: object) -> None:
        if not isinstance(data, Mapping):
            raise RecordError(f"{what}: must be a JSON object, got {type(data).__name__}")
        self.what = what
        self.data = data

    def value(self, key: str, kinds: type | tuple[type, ...]) -> Any:
        if key not in self.data:
            raise RecordError(f"{self.what}: missing key {key!r}")
        value = self.data[key]
        allowed = kinds if isinstance(kinds, tuple) else (kinds,)
        if isinstance(value, bool) and bool not in allowed:
            raise RecordError(f"{self.what}: key {key!r} must be {_names(allowed)}, got {value!r}")
        if not isinstance(value, allowed):
            raise RecordError(f"{self.what}: key {key!r} must be {_names(allowed)}, got {value!r}")
        return value

    def parsed(self, key: str, parse: Any) -> Any:
        if key not in self.data:
            raise RecordError(f"{self.what}: missing key {key!r}")
        try:
            return parse(self.data[key])
        except (KeyError, TypeError, ValueError, AttributeError) as error:
            detail = f"missing key {error}" if isinstance(error, KeyError) else str(error)
            raise RecordError(f"{self.what}: key {key!r} is malformed: {detail}") from None


def _names(kinds: tuple[type, ...]) -> str:
    names = {int: "an integer", float: "a number", str: "a string", list: "a list", dict: "an object",
             type(None): "null", bool: "true or false"}
    return " or ".join(names.get(kind, kind.__name__) for kind in kinds)
