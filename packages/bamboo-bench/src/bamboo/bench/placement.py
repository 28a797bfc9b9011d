"""Where the nodes run: bamboo-reconfig's placement (``plan_layout``'s owners grid) on the simulator's integers.

`plan_placement` gives the owners grid that ``bamboo.reconfig.plan_layout`` gives for the same nodes, zones and
held stages, at about 0.37 ms per layout instead of 2.3 ms (``bamboo.bench.policy`` describes how the simulator's
state maps onto the planner's view, and the tests that hold the two together). It matches nodes to slots with
the planner's own function (``bamboo.reconfig.assignment.cheapest_order``).

`plan_replica_ring` is the same placement rule for pure data parallelism (P = 1), which bamboo-reconfig does not
plan: the replicas form one ring whose neighbours sit in different zones wherever the zone counts allow.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np
from bamboo.reconfig.assignment import cheapest_order
from bamboo.reconfig.layout_plan import ARRANGEMENT_SEARCH_BUDGET
from bamboo.reconfig.placement import ring_arrangements

__all__ = ["NOT_A_HOLDER", "plan_placement", "plan_replica_ring"]

#: The held stage of a node that holds no state of the current layout (a standby node).
NOT_A_HOLDER = -1


@functools.lru_cache(maxsize=64)
def _missing_layers(stages: int) -> np.ndarray:
    """``table[h, s]``: layers a node that owned stage h must fetch to own stage s; row -1 is a non-holder.

    A stage's owner holds its own layer and its successor's (``Layout.layers_held_at``); with one layer per
    stage, owning stage s needs layers {s, s+1 mod P}.
    """
    need = [frozenset({s, (s + 1) % stages}) for s in range(stages)]
    rows = [[len(need[s] - need[h]) for s in range(stages)] for h in range(stages)]
    rows.append([len(need[s]) for s in range(stages)])
    table = np.array(rows, dtype=np.float64)
    table.setflags(write=False)
    return table


@functools.lru_cache(maxsize=64)
def _missing_layer_rows(stages: int) -> tuple[tuple[int, ...], ...]:
    """`_missing_layers` as tuples of ints (row -1, the last, is a non-holder's), for the slot assignment."""
    return tuple(tuple(int(count) for count in row) for row in _missing_layers(stages).tolist())


@functools.lru_cache(maxsize=64)
def _fit_stage(stages: int) -> tuple[int, ...]:
    """The first new stage a holder of old stage h can own without fetching anything (the planner's "fits")."""
    table = _missing_layers(stages)
    return tuple(int(np.flatnonzero(table[h] == 0)[0]) for h in range(stages))


def _spread_cost(total: int, rings: int, stages: int) -> int:
    """Same-zone pairs of one zone's `total` nodes spread as evenly as possible over `rings` rings."""
    base, extra = divmod(total, rings)
    return extra * max(0, 2 * (base + 1) - stages) + (rings - extra) * max(0, 2 * base - stages)


@functools.lru_cache(maxsize=1024)
def _marginal_pairs(rings: int, stages: int, longest: int) -> tuple[int, ...]:
    """Same-zone pairs added by a zone's (c+1)-th node, for c < `longest` (non-decreasing in c)."""
    return tuple(_spread_cost(c + 1, rings, stages) - _spread_cost(c, rings, stages) for c in range(longest))


@functools.lru_cache(maxsize=4096)
def _arrangements(counts: tuple[tuple[int, int], ...], stages: int) -> _Arrangements:
    """The planner's candidate zone sequences for one ring with these (zone, count) pairs (by zone), cached."""
    candidates = tuple(tuple(sequence) for sequence in ring_arrangements(dict(counts), stages))
    zones = tuple(zone for zone, _count in counts)
    position = {zone: index for index, zone in enumerate(zones)}
    # choice[c, k * stages + s] = 1 when candidate c puts zone k at stage s: scores are one product.
    choice = np.zeros((len(candidates), len(zones) * stages), dtype=np.float64)
    for c, candidate in enumerate(candidates):
        for stage, zone in enumerate(candidate):
            choice[c, position[zone] * stages + stage] = 1.0
    stages_of = tuple(
        tuple(tuple(stage for stage, zone in enumerate(candidate) if zone == wanted) for wanted in zones)
        for candidate in candidates
    )
    places = tuple(tuple(position[zone] * stages + stage for stage, zone in enumerate(candidate)) for candidate in candidates)
    return _Arrangements(candidates, zones, choice, stages_of, places)


class _Arrangements(NamedTuple):
    candidates: tuple[tuple[int, ...], ...]
    zones: tuple[int, ...]
    #: ``choice[c, k * stages + s]`` is 1 when candidate c puts ``zones[k]`` at stage s.
    choice: np.ndarray
    #: ``stages_of[c][k]``: the stages candidate c gives to ``zones[k]``, in order.
    stages_of: tuple[tuple[tuple[int, ...], ...], ...]
    #: ``places[c][s]``: ``k * stages + s`` where candidate c puts ``zones[k]`` at stage s.
    places: tuple[tuple[int, ...], ...]


def plan_placement(usable: Sequence[tuple[int, int, int]], stages: int, pipelines: int) -> list[list[int]]:
    """The owners grid (``owners[d][s]`` = node) that ``plan_layout`` gives for these usable nodes.

    `usable` holds ``(node, zone, held_stage)`` for every live registered node, `held_stage` being the
    stage the node owns in the current layout or `NOT_A_HOLDER`. Pipelines have depth `stages`; there are
    ``min(pipelines, len(usable) // stages)`` of them (none with fewer than `stages` nodes). Nodes left
    out are the standby queue. Steps, as in ``bamboo.reconfig.layout_plan``: choose the nodes (fewest
    same-zone neighbours, holders first, then by id), deal their zone counts round-robin over the rings,
    pick each ring's zone sequence (the first of the planner's candidates that lets the most holders keep
    their stage), and match each zone's nodes to its slots by the fewest layers fetched.
    """
    rings = min(pipelines, len(usable) // stages)
    if rings == 0:
        return []
    needed = rings * stages
    # 1. Which nodes run. The planner takes nodes one at a time, each time the one with the smallest
    # (added same-zone pairs, not a holder, id); within a zone those keys only grow (the added pairs of
    # the c-th node of a zone never fall as c grows, and the zone's nodes come in (not a holder, id)
    # order), so its picks are simply the `needed` smallest keys.
    if needed == len(usable):
        chosen = sorted([(zone, node, stage) for node, zone, stage in usable])
    else:
        ranked = sorted([(zone, stage == NOT_A_HOLDER, node, stage) for node, zone, stage in usable])
        marginal = _marginal_pairs(rings, stages, len(ranked))
        keys: list[tuple[int, bool, int, tuple[int, bool, int, int]]] = []
        previous, count = None, 0
        for item in ranked:
            if item[0] != previous:
                previous, count = item[0], 0
            keys.append((marginal[count], item[1], item[2], item))
            count += 1
        keys.sort()
        chosen = sorted([(item[0], item[2], item[3]) for _pairs, _rank, _node, item in keys[:needed]])
    # 2. Zone counts per ring: the chosen nodes in (zone, id) order, dealt round-robin (zone z holds a
    # run of that order, so each ring's share of it is counted, not dealt).
    nodes_of: dict[int, list[int]] = {}
    held_of: dict[int, list[int]] = {}
    for zone, node, stage in chosen:
        if zone in nodes_of:
            nodes_of[zone].append(node)
            held_of[zone].append(stage)
        else:
            nodes_of[zone] = [node]
            held_of[zone] = [stage]
    zones = tuple(nodes_of)
    ring_counts: list[list[tuple[int, int]]] = [[] for _ in range(rings)]
    first = 0
    for zone in zones:
        size = len(nodes_of[zone])
        full, extra = divmod(size, rings)
        for ring in range(rings):
            count = full + 1 if (ring - first) % rings < extra else full
            if count:
                ring_counts[ring].append((zone, count))
        first += size
    # 3. Each ring's zone sequence: the first of the planner's candidates that lets the most holders
    # keep their stage. fits[k * stages + s]: chosen holders of zones[k] that can own stage s as they are.
    fit_stage = _fit_stage(stages)
    fits = [0] * (len(zones) * stages)
    holders = 0
    for k, zone in enumerate(zones):
        base = k * stages
        for stage in held_of[zone]:
            if stage != NOT_A_HOLDER:
                fits[base + fit_stage[stage]] += 1
                holders += 1
    flags = np.array([1.0 if count else 0.0 for count in fits])
    ring_choice: list[tuple[_Arrangements, int]] = []
    for counts in ring_counts:
        arrangements = _arrangements(tuple(counts), stages)
        best = 0
        if holders and len(arrangements.candidates) * stages <= ARRANGEMENT_SEARCH_BUDGET:
            if arrangements.zones == zones:
                scores = arrangements.choice @ flags
            else:
                scores = arrangements.choice @ flags[_flag_columns(arrangements.zones, zones, stages)]
            best = int(scores.argmax())
            if scores[best]:
                places = arrangements.places[best]
                if arrangements.zones != zones:
                    places = _flag_columns(arrangements.zones, zones, stages)[list(places)].tolist()
                for at in places:
                    if fits[at]:
                        fits[at] -= 1
                        holders -= 1
                        if not fits[at]:
                            flags[at] = 0.0
        ring_choice.append((arrangements, best))
    # 4. Within each zone, nodes (by id) to slots (ring-major): identity, or the fewest layers fetched.
    slots_of: dict[int, list[tuple[int, int]]] = {zone: [] for zone in zones}
    for ring, (arrangements, best) in enumerate(ring_choice):
        for zone, zone_stages in zip(arrangements.zones, arrangements.stages_of[best], strict=True):
            slots_of[zone] += [(ring, stage) for stage in zone_stages]
    owners = [[0] * stages for _ in range(rings)]
    for zone in zones:
        nodes = nodes_of[zone]
        slots = slots_of[zone]
        stages_held = held_of[zone]
        if stages_held.count(NOT_A_HOLDER) == len(stages_held):
            for (ring, stage), node in zip(slots, nodes, strict=True):
                owners[ring][stage] = node
            continue
        rows = _missing_layer_rows(stages)
        order = cheapest_order([rows[held] for held in stages_held], [stage for _ring, stage in slots])
        for (ring, stage), node_index in zip(slots, order, strict=True):
            owners[ring][stage] = nodes[node_index]
    return owners


def plan_replica_ring(usable: Sequence[tuple[int, int, int]], pipelines: int) -> list[list[int]]:
    """P = 1: the owners grid (``owners[d] == [node]``) of ``min(pipelines, len(usable))`` replicas in one ring.

    `usable` holds ``(node, zone, held)`` for every live registered node, `held` being 0 for a replica of the
    current layout and `NOT_A_HOLDER` otherwise. Replica d's shadow is replica ``(d + 1) % D`` (its ring
    successor). bamboo-reconfig's placement rule for one ring of D slots, applied to the ring of replicas:
    the nodes run are the D smallest (added same-zone pairs, not a holder, id) as in `plan_placement`, and
    the ring interleaves the zones, most common first (ties by zone index): ring positions 0, 2, 4, ...
    then 1, 3, 5, ..., each zone's nodes in id order (one zone: id order). That reaches the fewest same-zone neighbour pairs a
    ring with these zone counts can have, ``sum(max(0, 2 * count - D))``. Every replica holds the same
    state, so a position carries no state of its own: holders are preferred only over nodes that would
    have to fetch the model.
    """
    ring = min(pipelines, len(usable))
    if ring == 0:
        return []
    ranked = sorted([(zone, held == NOT_A_HOLDER, node) for node, zone, held in usable])
    marginal = _marginal_pairs(1, ring, len(ranked))
    keys: list[tuple[int, bool, int, int]] = []
    previous, count = None, 0
    for zone, fetches, node in ranked:
        if zone != previous:
            previous, count = zone, 0
        keys.append((marginal[count], fetches, node, zone))
        count += 1
    keys.sort()
    nodes_of: dict[int, list[int]] = {}
    for _pairs, _fetches, node, zone in keys[:ring]:
        nodes_of.setdefault(zone, []).append(node)
    order = sorted(nodes_of, key=lambda zone: (-len(nodes_of[zone]), zone))
    sequence = [node for zone in order for node in sorted(nodes_of[zone])]
    # One zone has nothing to keep apart: the ring is in id order.
    positions = [*range(0, ring, 2), *range(1, ring, 2)] if len(order) > 1 else list(range(ring))
    owners: list[list[int]] = [[] for _ in range(ring)]
    for position, node in zip(positions, sequence, strict=True):
        owners[position] = [node]
    return owners


@functools.lru_cache(maxsize=1024)
def _flag_columns(ring_zones: tuple[int, ...], zones: tuple[int, ...], stages: int) -> np.ndarray:
    """Indices into the flat (zone, stage) fits of `zones` for a ring whose zones are `ring_zones`."""
    return np.array([zones.index(zone) * stages + stage for zone in ring_zones for stage in range(stages)])

