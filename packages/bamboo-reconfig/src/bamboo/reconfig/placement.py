"""Zone-aware placement: which nodes run, and where, so that consecutive stages sit in different zones.

Bulk preemptions hit one zone at a time, so consecutive stages of a pipeline (last to first included)
should be in different zones. The counting facts this module rests on:

- A ring of P slots whose most common zone has ``m`` nodes has at least ``max(0, 2m - P)`` same-zone
  neighbour pairs, and an interleaved arrangement reaches that bound (the zone with ``m`` nodes can be
  cut into at most ``P - m`` runs).
- Summed over zones, a ring's cost is ``sum_z max(0, 2 x_z - P)`` (only one zone can exceed half a
  ring), so the cost over D rings separates by zone and is convex in each zone's per-ring count. Hence
  spreading every zone evenly over the rings is optimal, and dealing the chosen nodes round-robin in zone
  order achieves it for all zones at once.
- Choosing which nodes run (when there are more usable nodes than slots) is a separable convex
  selection: taking nodes one by one from the zone with the smallest marginal cost is optimal.

The resulting count is the minimum possible, and the tests check it against brute force. Among the
arrangements that reach it, the planner prefers the one that keeps nodes at the stages whose state they
already hold (``assign_slots``).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from itertools import permutations

from bamboo.reconfig.model import Node

#: Above this many distinct zones in one ring, only the canonical zone order is tried (no permutations).
MAX_PERMUTED_ZONES = 4


def ring_cost(zone_counts: Mapping[str, int], stages: int) -> int:
    """The fewest same-zone neighbour pairs a ring of ``stages`` slots with these zone counts can have."""
    return sum(max(0, 2 * count - stages) for count in zone_counts.values())


def same_zone_pairs(zones: Sequence[str]) -> int:
    """Same-zone neighbour pairs of one ring, last to first included."""
    count = len(zones)
    return sum(1 for s in range(count) if zones[s] == zones[(s + 1) % count])


def _even_spread_cost(total: int, rings: int, stages: int) -> int:
    """Cost of one zone's ``total`` nodes spread as evenly as possible over ``rings`` rings."""
    base, extra = divmod(total, rings)
    return extra * max(0, 2 * (base + 1) - stages) + (rings - extra) * max(0, 2 * base - stages)


def minimum_same_zone_pairs(zone_totals: Mapping[str, int], rings: int, stages: int) -> int:
    """The fewest same-zone pairs over ``rings`` rings when exactly these zone totals fill them."""
    if rings == 0:
        return 0
    return sum(_even_spread_cost(total, rings, stages) for total in zone_totals.values())


def choose_nodes(
    candidates: Sequence[Node], rings: int, stages: int, preference: Callable[[Node], tuple]
) -> list[Node]:
    """The ``rings * stages`` nodes to run, chosen so the same-zone pair count is the minimum possible.

    Ties between zones of equal marginal cost, and the choice within a zone, go to the node that
    ``preference`` ranks first (smallest key), so nodes holding useful state are kept.
    """
    needed = rings * stages
    if needed > len(candidates):
        raise ValueError(f"{needed} slots but only {len(candidates)} usable nodes")
    by_zone: dict[str, list[Node]] = {}
    for node in sorted(candidates, key=lambda n: (preference(n), n.id)):
        by_zone.setdefault(node.zone, []).append(node)
    taken: Counter[str] = Counter()
    chosen: list[Node] = []
    for _ in range(needed):
        best_key = None
        best_zone = ""
        for zone, queue in by_zone.items():
            count = taken[zone]
            if count >= len(queue):
                continue
            marginal = _even_spread_cost(count + 1, rings, stages) - _even_spread_cost(count, rings, stages)
            key = (marginal, preference(queue[count]), queue[count].id)
            if best_key is None or key < best_key:
                best_key, best_zone = key, zone
        chosen.append(by_zone[best_zone][taken[best_zone]])
        taken[best_zone] += 1
    return chosen


def deal_zone_counts(chosen: Sequence[Node], rings: int) -> list[Counter[str]]:
    """Per-ring zone counts: the chosen nodes, sorted by zone, dealt round-robin over the rings."""
    ordered = sorted(chosen, key=lambda node: (node.zone, node.id))
    counts: list[Counter[str]] = [Counter() for _ in range(rings)]
    for index, node in enumerate(ordered):
        counts[index % rings][node.zone] += 1
    return counts


def interleave(zone_order: Sequence[str], zone_counts: Mapping[str, int], stages: int) -> list[str]:
    """Slots 0, 2, 4, ... then 1, 3, 5, ... filled zone by zone in ``zone_order``."""
    sequence = [zone for zone in zone_order for _ in range(zone_counts[zone])]
    positions = list(range(0, stages, 2)) + list(range(1, stages, 2))
    ring = [""] * stages
    for position, zone in zip(positions, sequence, strict=True):
        ring[position] = zone
    return ring


def ring_arrangements(zone_counts: Mapping[str, int], stages: int) -> list[tuple[str, ...]]:
    """Distinct zone sequences for one ring that reach ``ring_cost``, in a fixed order.

    The canonical sequence interleaves zones from the most to the least common (ties by name). With at
    most ``MAX_PERMUTED_ZONES`` zones every zone order is tried too, and every rotation and reflection of
    each, so the planner can pick the one that best matches where nodes already hold state.
    """
    zones = sorted(zone_counts, key=lambda zone: (-zone_counts[zone], zone))
    orders = [tuple(zones)]
    if len(zones) <= MAX_PERMUTED_ZONES:
        orders += [order for order in permutations(zones) if order != tuple(zones)]
    best = ring_cost(zone_counts, stages)
    seen: set[tuple[str, ...]] = set()
    result: list[tuple[str, ...]] = []
    for order in orders:
        base = interleave(order, zone_counts, stages)
        if same_zone_pairs(base) != best:
            continue
        for variant in (base, base[::-1]):
            for shift in range(stages):
                rotated = tuple(variant[shift:] + variant[:shift])
                if rotated not in seen:
                    seen.add(rotated)
                    result.append(rotated)
    if not result:  # pragma: no cover - the canonical order always reaches the bound (tested)
        raise AssertionError(f"no arrangement reaches the bound for {dict(zone_counts)} on {stages} stages")
    return result
