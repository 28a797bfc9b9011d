"""The cost-model simulator: per-stage durations and link/swap speeds in, timeline and metrics out.

`simulate(schedule, costs)` runs the streams with the blocking interpreter (`engine.execute`)
where each instruction takes the time the cost model gives it (milliseconds):

- ``F``/``B``/``FR``/``BR``/``OPT``: the stage's ``forward_ms``/``backward_ms``/``frc_ms``/
  ``brc_ms``/``optimizer_ms`` (FRC defaults to the forward, BRC to the backward);
- activations and gradients: ``latency_ms + size / link_gb_per_s`` (sizes in MB, 1 GB/s = 1 MB/ms);
  the gradient w.r.t. a stage's input has the size of the previous stage's activation;
- ``SO``/``SI``: ``stash_mb / swap_gb_per_s`` (``activation_mb`` of the previous stage in lflb), or nothing
  when ``swap_overlaps`` (the default): the copy runs beside the computation (a side stream on a GPU; on a CPU a
  tensor already in host memory needs no copy), so it takes no time from the node;
- ``AR``: ``2 * grad_mb / link_gb_per_s`` (ring all-reduce), or the stage's measured ``allreduce_ms``;
- ``SY``/``RY``: with ``sync_overlaps`` (the default) the replica sync's send is posted and not waited for: the
  sender pays ``latency_ms``, the data lands ``latency_ms + grad_mb / link`` later, and the receive pays
  ``latency_ms`` once it is there (the replica's own optimizer step is applied at its next use, in a bubble of
  the next iteration); otherwise both sides pay ``latency_ms + grad_mb / link`` together;
- ``L``: free.

It reports the makespan, each node's bubble (``makespan - busy``), the share of FRC that fits in
the bubbles of the same schedule without redundancy (``frc_hidden_pct``: per node
``min(FRC time, baseline bubble)``, summed, over the total FRC time), the overhead against that
baseline, and the peak stash each node holds (MB, device plus swap store). Costs come from JSON
(`Costs.from_json`) or the defaults.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from operator import sub
from pathlib import Path
from typing import Any

import attrs
from bamboo.schedule._gc import gc_paused
from bamboo.schedule._tasks import KindStageCost
from bamboo.schedule.bound import overhead_bound
from bamboo.schedule.engine import StageTable, Timeline, execute
from bamboo.schedule.ir import Instruction, Kind, RCMode, Schedule

__all__ = ["Costs", "SimResult", "StageCost", "simulate"]


def _non_negative(_inst: object, attribute: attrs.Attribute, value: float) -> None:
    # Hand-written, not attrs' instance_of/not_/ge: a costs file reaches it as JSON, and its one-line message
    # names the field and the value for a string or a bool too (attrs' type errors carry a tuple with the
    # Attribute's repr, and not_'s names neither the field nor the value).
    if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be a number >= 0, got {value!r}")


_OPTIONAL_NON_NEGATIVE = attrs.validators.optional(_non_negative)


@attrs.frozen
class StageCost:
    """Durations (ms) and tensor sizes (MB) of one stage."""

    forward_ms: float = attrs.field(default=1.0, validator=_non_negative)
    backward_ms: float = attrs.field(default=2.0, validator=_non_negative)
    frc_ms: float | None = attrs.field(default=None, validator=_OPTIONAL_NON_NEGATIVE)
    brc_ms: float | None = attrs.field(default=None, validator=_OPTIONAL_NON_NEGATIVE)
    optimizer_ms: float = attrs.field(default=0.2, validator=_non_negative)
    activation_mb: float = attrs.field(default=1.0, validator=_non_negative)
    stash_mb: float = attrs.field(default=4.0, validator=_non_negative)
    grad_mb: float = attrs.field(default=16.0, validator=_non_negative)
    allreduce_ms: float | None = attrs.field(default=None, validator=_OPTIONAL_NON_NEGATIVE)
    """The data-parallel all-reduce's time, when measured (a group of one pipeline takes none); default: a ring
    all-reduce of ``grad_mb``."""

    @property
    def frc(self) -> float:
        return self.forward_ms if self.frc_ms is None else self.frc_ms

    @property
    def brc(self) -> float:
        return self.backward_ms if self.brc_ms is None else self.brc_ms


_STAGE_KEYS = {f.name for f in attrs.fields(StageCost)}
_NUMBER_KEYS = ("latency_ms", "link_gb_per_s", "swap_gb_per_s")
_FLAG_KEYS = ("swap_overlaps", "sync_overlaps")
_TOP_KEYS = {*_NUMBER_KEYS, *_FLAG_KEYS, "default", "stages"}


@attrs.frozen
class Costs:
    """The cost model. ``stages[s]`` overrides ``default`` for stage s (shorter lists fall back)."""

    default: StageCost = attrs.field(factory=StageCost)
    stages: tuple[StageCost, ...] = attrs.field(default=(), converter=tuple)
    latency_ms: float = attrs.field(default=0.05, validator=_non_negative)
    link_gb_per_s: float = attrs.field(default=10.0, validator=_non_negative)
    swap_gb_per_s: float = attrs.field(default=12.0, validator=_non_negative)
    swap_overlaps: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    """Swap-outs and swap-ins run beside the computation (a copy on a side stream, or none on a CPU)."""
    sync_overlaps: bool = attrs.field(default=True, validator=attrs.validators.instance_of(bool))
    """The replica sync's transfer runs in the background: its send is posted and not waited for."""

    def __attrs_post_init__(self) -> None:
        if self.link_gb_per_s == 0 or self.swap_gb_per_s == 0:
            raise ValueError(
                f"bandwidths must be > 0, got link_gb_per_s={self.link_gb_per_s}, swap_gb_per_s={self.swap_gb_per_s}"
            )

    @classmethod
    def bert_like(cls, stages: int = 8, growth: float = 0.3) -> Costs:
        """A synthetic profile shaped like the paper's BERT pipeline (Figure 10), not a measurement.

        Stage i's forward takes ``1 + growth * i`` ms (later stages hold more layers), its backward
        twice that; 2 MB activations, 8 MB FRC stash, 32 MB of gradients per stage.
        """
        def stage(i: int) -> StageCost:
            forward = 1.0 + growth * i
            return StageCost(forward_ms=forward, backward_ms=2.0 * forward, optimizer_ms=0.5,
                             activation_mb=2.0, stash_mb=8.0, grad_mb=32.0)

        return cls(default=stage(0), stages=tuple(stage(i) for i in range(stages)))

    def stage(self, s: int) -> StageCost:
        return self.stages[s] if s < len(self.stages) else self.default

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Costs:
        """Build from the JSON layout: top-level link/swap keys, ``default`` and ``stages`` objects."""
        if not isinstance(data, Mapping):
            raise ValueError(f"costs must be a JSON object, got {type(data).__name__}")
        unknown = set(data) - _TOP_KEYS
        if unknown:
            raise ValueError(f"unknown cost keys {sorted(unknown)}; expected some of {sorted(_TOP_KEYS)}")

        def stage(obj: Any, where: str) -> StageCost:
            if not isinstance(obj, Mapping):
                raise ValueError(f"{where} must be an object, got {obj!r}")
            bad = set(obj) - _STAGE_KEYS
            if bad:
                raise ValueError(f"unknown keys {sorted(bad)} in {where}; expected some of {sorted(_STAGE_KEYS)}")
            return StageCost(**obj)

        top = {k: data[k] for k in (*_NUMBER_KEYS, *_FLAG_KEYS) if k in data}
        default = stage(data.get("default", {}), "default")
        stages = data.get("stages", [])
        if not isinstance(stages, Sequence) or isinstance(stages, str):
            raise ValueError(f"stages must be a list, got {stages!r}")
        merged = [stage({**attrs.asdict(default), **s}, f"stages[{i}]") if isinstance(s, Mapping)
                  else stage(s, f"stages[{i}]") for i, s in enumerate(stages)]
        return cls(default, tuple(merged), **top)

    @classmethod
    def from_json(cls, path: str | Path) -> Costs:
        """Read a costs file; errors name the file and the bad value."""
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as error:
            raise ValueError(f"cannot read costs file {str(path)!r}: {error}") from None
        try:
            return cls.from_dict(data)
        except (TypeError, ValueError) as error:
            raise ValueError(f"bad costs file {str(path)!r}: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        return {
            "latency_ms": self.latency_ms,
            "link_gb_per_s": self.link_gb_per_s,
            "swap_gb_per_s": self.swap_gb_per_s,
            "swap_overlaps": self.swap_overlaps,
            "sync_overlaps": self.sync_overlaps,
            "default": attrs.asdict(self.default),
            "stages": [attrs.asdict(s) for s in self.stages],
        }

    def duration(self, rc: RCMode, stages: int = 0) -> StageTable:
        """The engine's duration function: (node, instruction) -> ms, as a table per kind and stage.

        Rows cover ``stages`` stages (at least those listed in ``stages``); later stages are
        filled in on first use.
        """
        link, swap, latency = self.link_gb_per_s, self.swap_gb_per_s, self.latency_ms
        rows: dict[Kind, list[float]] = {kind: [] for kind in Kind}
        transfers: list[float] = []

        def fill(s: int) -> None:
            c = self.stage(s)
            prev_act = self.stage(s - 1).activation_mb if s > 0 else c.activation_mb
            swapped = 0.0 if self.swap_overlaps else (prev_act if rc is RCMode.LFLB else c.stash_mb) / swap
            sync = latency if self.sync_overlaps else latency + c.grad_mb / link
            transfers.append(latency + c.grad_mb / link)
            for kind, value in (
                (Kind.FORWARD, c.forward_ms),
                (Kind.BACKWARD, c.backward_ms),
                (Kind.FRC, c.frc),
                (Kind.BRC, c.brc),
                (Kind.OPTIMIZER, c.optimizer_ms),
                (Kind.LOAD, 0.0),
                (Kind.SEND_ACT, latency + c.activation_mb / link),
                (Kind.RECV_GRAD, latency + c.activation_mb / link),
                (Kind.RECV_ACT, latency + prev_act / link),
                (Kind.SEND_GRAD, latency + prev_act / link),
                (Kind.SWAP_OUT, swapped),
                (Kind.SWAP_IN, swapped),
                (Kind.ALLREDUCE, 2 * c.grad_mb / link if c.allreduce_ms is None else c.allreduce_ms),
                (Kind.SYNC_SEND, sync),
                (Kind.SYNC_RECV, sync),
            ):
                rows[kind].append(value)

        for s in range(max(len(self.stages), stages, 1)):
            fill(s)

        def beyond(_node: int, instr: Instruction) -> float:
            while len(rows[Kind.FORWARD]) <= instr.stage:
                fill(len(rows[Kind.FORWARD]))
            return rows[instr.kind][instr.stage]

        return StageTable(rows, beyond, {Kind.SYNC_SEND: transfers})

    def linearizer_cost(self) -> Callable[[Instruction], float]:
        """Durations for the generators, so streams are ordered (and redundant work placed) for these costs."""
        duration = self.duration(RCMode.EFLB)
        transfer = duration.buffered.get(Kind.SYNC_SEND)

        def cost(instr: Instruction) -> float:
            if instr.kind is Kind.SYNC_SEND and transfer is not None:
                return transfer[instr.stage] if instr.stage < len(transfer) else duration(0, instr)
            return duration(0, instr)

        return KindStageCost(cost)


@attrs.frozen
class SimResult:
    """What `simulate` measured. Times in ms, stash in MB; per-node values are keyed by node."""

    timeline: Timeline
    makespan: float
    busy: dict[int, float]
    bubble: dict[int, float]
    frc: dict[int, float]
    peak_stash: dict[int, float]
    baseline_makespan: float | None
    baseline_bubble: dict[int, float] | None
    overhead_bound_pct: float | None = None
    """The least overhead any placement of this mode's redundant work can have for these costs (`bound`)."""

    @property
    def bubble_pct(self) -> float:
        """Idle share of all node-time in the iteration, in percent."""
        total = self.makespan * len(self.bubble)
        return 100.0 * sum(self.bubble.values()) / total if total else 0.0

    @property
    def overhead_pct(self) -> float | None:
        """Makespan increase against the same schedule without redundancy, in percent."""
        if self.baseline_makespan is None or self.baseline_makespan == 0:
            return None
        return 100.0 * (self.makespan - self.baseline_makespan) / self.baseline_makespan

    def frc_hidden(self, node: int) -> float | None:
        """Share (0..1) of node's FRC time that its baseline bubble can hold; None without FRC."""
        if self.baseline_bubble is None or self.frc.get(node, 0.0) == 0.0:
            return None
        return min(self.frc[node], self.baseline_bubble.get(node, 0.0)) / self.frc[node]

    @property
    def frc_hidden_pct(self) -> float | None:
        total = sum(self.frc.values())
        if self.baseline_bubble is None or total == 0:
            return None
        hidden = sum(min(f, self.baseline_bubble.get(n, 0.0)) for n, f in self.frc.items())
        return 100.0 * hidden / total


def _stash_sizes(schedule: Schedule, costs: Costs) -> Callable[[int], float]:
    def size(s: int) -> float:
        if schedule.rc is RCMode.LFLB:
            return costs.stage(s - 1).activation_mb if s > 0 else costs.stage(0).activation_mb
        return costs.stage(s).stash_mb

    return size


def measure(schedule: Schedule, timeline: Timeline, costs: Costs) -> tuple[dict, dict, dict, dict]:
    """Busy time, bubble, FRC time and peak stash per node for an executed ``timeline``."""
    makespan = timeline.makespan
    size = _stash_sizes(schedule, costs)
    busy, bubble, frc, peak = {}, {}, {}, {}
    frc_kind, swap_out, brc = Kind.FRC, Kind.SWAP_OUT, Kind.BRC
    for n, stream in schedule.streams.items():
        total = 0.0
        frc_time = 0.0
        held = 0.0
        top = 0.0
        for instr, d in zip(stream, map(sub, timeline.end[n], timeline.start[n]), strict=True):
            total += d
            kind = instr.kind
            if kind is frc_kind:
                frc_time += d
            elif kind is swap_out:
                held += size(instr.stage)
                if held > top:
                    top = held
            elif kind is brc:
                held = max(0.0, held - size(instr.stage))
        busy[n] = total
        bubble[n] = makespan - total
        frc[n] = frc_time
        peak[n] = top
    return busy, bubble, frc, peak


@gc_paused
def simulate(schedule: Schedule, costs: Costs | None = None, baseline: Schedule | None = None) -> SimResult:
    """Simulate one iteration of ``schedule``; compare with ``baseline`` (default: no redundancy).

    The default baseline is the same policy, stages and microbatches without redundancy, generated
    for the same costs. Pass ``baseline`` explicitly for failover schedules.
    """
    costs = costs or Costs()
    timeline = execute(schedule.streams, costs.duration(schedule.rc, schedule.stages))
    busy, bubble, frc, peak = measure(schedule, timeline, costs)
    if baseline is None and schedule.rc is not RCMode.NONE and schedule.placement == tuple(range(schedule.stages)):
        from bamboo.schedule.generate import generate

        baseline = generate(schedule.policy, schedule.stages, schedule.microbatches, "none", costs.linearizer_cost())
    base_makespan = base_bubble = bound = None
    if baseline is not None:
        base_timeline = execute(baseline.streams, costs.duration(baseline.rc, baseline.stages))
        base_makespan = base_timeline.makespan
        base_bubble = measure(baseline, base_timeline, costs)[1]
        if baseline.rc is RCMode.NONE and baseline.placement == tuple(range(baseline.stages)):
            bound = overhead_bound(baseline, base_timeline, schedule.rc, costs.duration(schedule.rc, schedule.stages))
    elif schedule.rc is RCMode.NONE:
        base_makespan, base_bubble, bound = timeline.makespan, bubble, 0.0
    return SimResult(timeline, timeline.makespan, busy, bubble, frc, peak, base_makespan, base_bubble, bound)
