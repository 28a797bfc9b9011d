"""Seedable synthetic spot traces, following the Bamboo paper's simulation model.

Hour by hour:

1. The hour's allocation probability `a` is drawn uniformly from [0, 1) (``random_allocation``;
   otherwise the fixed `allocation_probability` is used).
2. Every alive instance is preempted in this hour with probability `preemption_probability`.
   Preemptions come in bulk within one zone: the victims of a zone are put in groups whose sizes
   are geometric with mean `bulk_mean` (1.0: every victim on its own), and each group shares one
   uniformly drawn time in the hour. A zone's victims of the hour cap the groups, so the mean bulk
   seen in a trace is smaller than `bulk_mean` when preemptions are rare.
3. Every missing instance (desired minus alive, plus this hour's victims) is requested once, and
   arrives with probability `a` at a uniform time in the hour, in a uniformly chosen zone, unless
   the cluster is already at the desired size then. A new instance may be preempted later in the
   same hour with the same probability.

At time 0 each of the desired instances is there with the first hour's allocation probability.
The generator is infinite (`SyntheticTraceGenerator.events`); `generate_trace` cuts a `Trace` of a
given length, which can be written to the generic CSV.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator

import attrs
from bamboo.bench._validators import PROBABILITY
from bamboo.bench.trace import Trace

__all__ = ["SyntheticSpec", "SyntheticTraceGenerator", "generate_trace"]


@attrs.frozen
class SyntheticSpec:
    """The parameters of the synthetic model (see the module docstring)."""

    preemption_probability: float = attrs.field(validator=PROBABILITY)
    desired_nodes: int = attrs.field(default=48, validator=attrs.validators.ge(1))
    zones: int = attrs.field(default=3, validator=attrs.validators.ge(1))
    bulk_mean: float = attrs.field(default=1.0, validator=attrs.validators.ge(1))
    random_allocation: bool = True
    allocation_probability: float = attrs.field(default=0.5, validator=PROBABILITY)
    start_full: bool = False
    """Every one of ``desired_nodes`` is allocated at time 0 (a job launched on its nodes), instead of each with
    the first hour's allocation probability (the paper's model: a cluster that starts as the market allows)."""

    def zone_names(self) -> tuple[str, ...]:
        """Zone names ``zone-a``, ``zone-b``, ... (one per zone)."""
        return tuple(f"zone-{chr(ord('a') + i)}" if i < 26 else f"zone-{i}" for i in range(self.zones))


class SyntheticTraceGenerator:
    """An endless stream of (time_s, is_add, node, zone) events for one seed, produced an hour at a time."""

    def __init__(self, spec: SyntheticSpec, seed: int) -> None:
        self.spec = spec
        self.seed = seed

    def events(self, until_s: float = math.inf) -> Iterator[tuple[float, bool, int, int]]:
        """Events in time order: (seconds, True for add, node id, zone index), those before `until_s`.

        Without `until_s` the stream never ends (and a quiet cluster may yield nothing for ever).
        """
        spec = self.spec
        rng = random.Random(self.seed)
        rand = rng.random
        p = spec.preemption_probability
        zones = spec.zones
        join = 1.0 - 1.0 / spec.bulk_mean
        alive: dict[int, int] = {}
        next_id = 0
        allocation = rand() if spec.random_allocation else spec.allocation_probability
        for _ in range(spec.desired_nodes):
            if rand() < allocation or spec.start_full:
                zone = int(rand() * zones)
                alive[next_id] = zone
                yield (0.0, True, next_id, zone)
                next_id += 1
        hour = 0
        while hour * 3600.0 < until_s:
            start = hour * 3600.0
            if hour:
                allocation = rand() if spec.random_allocation else spec.allocation_probability
            # Preemptions of the instances alive at the start of the hour, grouped in zone bulks.
            removals: list[tuple[float, int]] = []
            group_time: dict[int, float] = {}
            for node, zone in alive.items():
                if rand() < p:
                    if zone in group_time and rand() < join:
                        when = group_time[zone]
                    else:
                        when = start + rand() * 3600.0
                        group_time[zone] = when
                    removals.append((when, node))
            requested = spec.desired_nodes - len(alive) + len(removals)
            additions = sorted(start + rand() * 3600.0 for _ in range(requested) if rand() < allocation)
            removals.sort()
            count = len(alive)
            out: list[tuple[float, bool, int, int]] = []
            ri = ai = 0
            while ri < len(removals) or ai < len(additions):
                if ri < len(removals) and (ai == len(additions) or removals[ri][0] <= additions[ai]):
                    when, node = removals[ri]
                    ri += 1
                    zone = alive.pop(node)
                    count -= 1
                    out.append((when, False, node, zone))
                    continue
                when = additions[ai]
                ai += 1
                if count >= spec.desired_nodes:
                    continue
                zone = int(rand() * zones)
                node = next_id
                next_id += 1
                alive[node] = zone
                count += 1
                out.append((when, True, node, zone))
                if rand() < p:
                    leave = start + rand() * 3600.0
                    if leave > when:
                        # Insert keeping `removals` sorted from position ri on.
                        j = len(removals)
                        removals.append((leave, node))
                        while j > ri and removals[j - 1][0] > leave:
                            removals[j], removals[j - 1] = removals[j - 1], removals[j]
                            j -= 1
            for event in out:
                if event[0] >= until_s:
                    return
                yield event
            hour += 1


def generate_trace(spec: SyntheticSpec, hours: float, seed: int) -> Trace:
    """A `Trace` of the first `hours` hours of the synthetic stream for `seed`."""
    if not hours > 0:
        raise ValueError(f"hours must be > 0, got {hours!r}")
    end = hours * 3600.0
    rows = list(SyntheticTraceGenerator(spec, seed).events(until_s=end))
    nodes = sorted({r[2] for r in rows})
    index = {n: i for i, n in enumerate(nodes)}
    return Trace(
        name=f"synthetic-p{spec.preemption_probability:g}-seed{seed}",
        time_s=[r[0] for r in rows],
        is_add=[r[1] for r in rows],
        node=[index[r[2]] for r in rows],
        zone=[r[3] for r in rows],
        node_names=[f"node{n}" for n in nodes],
        zone_names=spec.zone_names(),
        duration_s=end,
    )
