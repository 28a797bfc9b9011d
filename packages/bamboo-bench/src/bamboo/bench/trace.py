"""The `Trace`: spot instances coming and going, as timed events with a node and a zone.

Every loader in `bamboo.bench.loaders` and the synthetic generator produce one `Trace`. A trace
is columnar (numpy arrays sorted by time) so that the simulator can walk it quickly, and it hands
out `TraceEvent` value objects for everybody else (the launcher replays them on an emulated
cluster). Traces can be sliced by time, compressed in time and summarised.

Compact string form of an event, used in messages and tests: ``+node3@us-east-1a@60.0s`` for an
add, ``-node3@us-east-1a@120.0s`` for a remove.
"""

from __future__ import annotations

import enum
from collections.abc import Iterator

import attrs
import numpy as np

__all__ = ["EventKind", "Trace", "TraceEvent", "TraceSummary"]


class EventKind(enum.Enum):
    """Whether a spot instance became available (``ADD``) or was preempted (``REMOVE``)."""

    ADD = "add"
    REMOVE = "remove"

    @property
    def sign(self) -> str:
        """``+`` for an add, ``-`` for a remove (the compact string form)."""
        return "+" if self is EventKind.ADD else "-"


@attrs.frozen
class TraceEvent:
    """One spot-instance event: at `time_s` seconds from the trace start, `node` in `zone` is added or removed."""

    time_s: float = attrs.field(converter=float, validator=attrs.validators.ge(0.0))
    kind: EventKind = attrs.field(validator=attrs.validators.instance_of(EventKind))
    node: str = attrs.field(validator=attrs.validators.min_len(1))
    zone: str = attrs.field(validator=attrs.validators.min_len(1))

    def __str__(self) -> str:
        return f"{self.kind.sign}{self.node}@{self.zone}@{self.time_s:g}s"


@attrs.frozen
class TraceSummary:
    """What a trace holds: its length, how often it preempts, how preemptions bunch, and where.

    `bulk_sizes` lists, for every distinct (time, zone) with removals, how many nodes were removed
    there at once. `preemptions_per_hour` divides the removals by the trace duration.
    """

    name: str
    duration_h: float
    adds: int
    preemptions: int
    preemptions_per_hour: float
    bulk_sizes: tuple[int, ...]
    zones: tuple[str, ...]
    max_alive: int
    mean_alive: float

    @property
    def mean_bulk_size(self) -> float:
        """The mean number of nodes removed together (0.0 when the trace has no removals)."""
        return float(np.mean(self.bulk_sizes)) if self.bulk_sizes else 0.0

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict of the summary."""
        return {
            "name": self.name,
            "duration_h": round(self.duration_h, 4),
            "adds": self.adds,
            "preemptions": self.preemptions,
            "preemptions_per_hour": round(self.preemptions_per_hour, 4),
            "mean_bulk_size": round(self.mean_bulk_size, 4),
            "max_bulk_size": max(self.bulk_sizes, default=0),
            "zones": list(self.zones),
            "max_alive": self.max_alive,
            "mean_alive": round(self.mean_alive, 4),
        }


def _as_array(dtype: type) -> object:
    def convert(value: object) -> np.ndarray:
        array = np.asarray(value, dtype=dtype)
        array.setflags(write=False)
        return array

    return convert


@attrs.frozen(eq=False)
class Trace:
    """Spot-instance events in time order.

    Columns (equal length, sorted by `time_s`, stable for equal times):
    `time_s` seconds from the start, `is_add` (True for add, False for remove), `node` (index into
    `node_names`) and `zone` (index into `zone_names`). `duration_s` is the length of the observed
    window; it is at least the last event's time.
    """

    name: str
    time_s: np.ndarray = attrs.field(converter=_as_array(np.float64))
    is_add: np.ndarray = attrs.field(converter=_as_array(np.bool_))
    node: np.ndarray = attrs.field(converter=_as_array(np.int64))
    zone: np.ndarray = attrs.field(converter=_as_array(np.int64))
    node_names: tuple[str, ...] = attrs.field(converter=tuple)
    zone_names: tuple[str, ...] = attrs.field(converter=tuple)
    duration_s: float = attrs.field(converter=float)

    def __attrs_post_init__(self) -> None:
        n = len(self.time_s)
        lengths = {len(self.is_add), len(self.node), len(self.zone)}
        if lengths != {n}:
            raise ValueError(f"trace {self.name!r}: columns differ in length: time_s={n}, others={lengths}")
        if n and np.any(np.diff(self.time_s) < 0):
            bad = int(np.argmax(np.diff(self.time_s) < 0))
            raise ValueError(
                f"trace {self.name!r}: events not in time order at index {bad + 1}: "
                f"{self.time_s[bad]} then {self.time_s[bad + 1]}"
            )
        if n and self.time_s[0] < 0:
            raise ValueError(f"trace {self.name!r}: negative event time {self.time_s[0]}")
        if n and (self.node.min() < 0 or self.node.max() >= len(self.node_names)):
            raise ValueError(f"trace {self.name!r}: node index outside node_names (size {len(self.node_names)})")
        if n and (self.zone.min() < 0 or self.zone.max() >= len(self.zone_names)):
            raise ValueError(f"trace {self.name!r}: zone index outside zone_names {self.zone_names}")
        last = float(self.time_s[-1]) if n else 0.0
        if self.duration_s < last:
            raise ValueError(f"trace {self.name!r}: duration_s={self.duration_s} is before the last event at {last}")

    # ----------------------------------------------------------------- construction
    @classmethod
    def from_events(cls, name: str, events: list[TraceEvent], duration_s: float | None = None) -> Trace:
        """Build a trace from `TraceEvent`s (sorted stably by time here)."""
        ordered = sorted(events, key=lambda e: e.time_s)
        node_index: dict[str, int] = {}
        zone_index: dict[str, int] = {}
        for event in ordered:
            node_index.setdefault(event.node, len(node_index))
            zone_index.setdefault(event.zone, len(zone_index))
        last = ordered[-1].time_s if ordered else 0.0
        return cls(
            name=name,
            time_s=[e.time_s for e in ordered],
            is_add=[e.kind is EventKind.ADD for e in ordered],
            node=[node_index[e.node] for e in ordered],
            zone=[zone_index[e.zone] for e in ordered],
            node_names=tuple(node_index),
            zone_names=tuple(zone_index),
            duration_s=last if duration_s is None else duration_s,
        )

    # ----------------------------------------------------------------- access
    def __len__(self) -> int:
        return len(self.time_s)

    def __iter__(self) -> Iterator[TraceEvent]:
        return self.events()

    def events(self) -> Iterator[TraceEvent]:
        """The events in time order, as `TraceEvent` values (for replay on an emulated cluster)."""
        for t, add, node, zone in zip(
            self.time_s.tolist(), self.is_add.tolist(), self.node.tolist(), self.zone.tolist(), strict=True
        ):
            yield TraceEvent(t, EventKind.ADD if add else EventKind.REMOVE, self.node_names[node], self.zone_names[zone])

    def alive_at_start(self) -> int:
        """How many nodes the trace adds at time 0."""
        return int(np.sum(self.is_add & (self.time_s == 0.0)))

    def alive_series(self) -> tuple[np.ndarray, np.ndarray]:
        """The number of alive nodes as a step function: (times, count after the events at that time)."""
        delta = np.where(self.is_add, 1, -1)
        count = np.cumsum(delta)
        if len(self.time_s) == 0:
            return np.array([0.0]), np.array([0])
        last_of_time = np.append(self.time_s[1:] != self.time_s[:-1], True)
        return self.time_s[last_of_time], count[last_of_time]

    # ----------------------------------------------------------------- transforms
    def slice(self, start_s: float, end_s: float) -> Trace:
        """The window [start_s, end_s), shifted to start at 0.

        Nodes alive at `start_s` are re-added at time 0 (in their zone), so the slice replays the
        cluster as it was; removals of nodes added before the window are kept.
        """
        if not 0.0 <= start_s < end_s:
            raise ValueError(f"slice needs 0 <= start_s < end_s, got start_s={start_s}, end_s={end_s}")
        before = self.time_s < start_s
        alive: dict[int, int] = {}
        for add, node, zone in zip(
            self.is_add[before].tolist(), self.node[before].tolist(), self.zone[before].tolist(), strict=True
        ):
            if add:
                alive[node] = zone
            else:
                alive.pop(node, None)
        inside = (self.time_s >= start_s) & (self.time_s < end_s)
        n_alive = len(alive)
        return Trace(
            name=f"{self.name}[{start_s:g}s:{end_s:g}s]",
            time_s=np.concatenate([np.zeros(n_alive), self.time_s[inside] - start_s]),
            is_add=np.concatenate([np.ones(n_alive, dtype=bool), self.is_add[inside]]),
            node=np.concatenate([np.array(list(alive), dtype=np.int64), self.node[inside]]),
            zone=np.concatenate([np.array(list(alive.values()), dtype=np.int64), self.zone[inside]]),
            node_names=self.node_names,
            zone_names=self.zone_names,
            duration_s=min(end_s, max(self.duration_s, start_s)) - start_s,
        )

    def compress(self, factor: float) -> Trace:
        """Time divided by `factor` (factor 60 plays an hour of trace in a minute)."""
        if not factor > 0:
            raise ValueError(f"compression factor must be > 0, got {factor!r}")
        return attrs.evolve(
            self,
            name=f"{self.name}/x{factor:g}",
            time_s=self.time_s / factor,
            duration_s=self.duration_s / factor,
        )

    # ----------------------------------------------------------------- summary
    def summary(self) -> TraceSummary:
        """Preemptions per hour, bulk sizes (removals sharing a time and zone), zones, alive counts."""
        removes = ~self.is_add
        bulk: dict[tuple[float, int], int] = {}
        for t, z in zip(self.time_s[removes].tolist(), self.zone[removes].tolist(), strict=True):
            bulk[(t, z)] = bulk.get((t, z), 0) + 1
        times, counts = self.alive_series()
        if self.duration_s > 0 and len(self.time_s):
            edges = np.append(times, self.duration_s)
            mean_alive = float(np.sum(counts * np.diff(edges)) / self.duration_s)
        else:
            mean_alive = float(counts[-1])
        hours = self.duration_s / 3600.0
        n_removes = int(removes.sum())
        used_zones = sorted({self.zone_names[z] for z in set(self.zone.tolist())})
        return TraceSummary(
            name=self.name,
            duration_h=hours,
            adds=int(self.is_add.sum()),
            preemptions=n_removes,
            preemptions_per_hour=n_removes / hours if hours > 0 else 0.0,
            bulk_sizes=tuple(bulk.values()),
            zones=tuple(used_zones),
            max_alive=int(counts.max(initial=0)),
            mean_alive=mean_alive,
        )
