"""The system's reconfiguration policy, on the simulator's integers: bamboo-reconfig's rules, fast.

The simulator's ``bamboo`` strategy takes every placement and every reconfiguration decision from here.
They are the rules of ``bamboo.reconfig.plan_layout`` and ``bamboo.reconfig.decide``, computed on plain
integers because a sweep makes millions of them (on 40 to 48 nodes, building a ``ClusterView`` and calling
bamboo-reconfig costs about 1.2 ms per layout and 0.24 ms per decision; these functions about 50 µs per
layout and a few µs per decision). Where the planner matches nodes to slots with scipy's
``linear_sum_assignment``, `plan_placement` takes the answer from a greedy pass when scipy's algorithm
is forced to the same choice, and from scipy otherwise. The simulator state maps onto the planner's
inputs like this (``system_view`` builds that ``ClusterView``):

- Nodes that are allocated but still starting are not in the view (they have not registered yet). The
  owners of the current layout are ``active`` (with their slot) or ``preempted``; every other live node is
  ``standby``, as the launcher reports waiting nodes (``bamboo.launch.reconfigure.build_view``).
- The depth is the profile's P and never lower: a profile gives step times for depth P only. The view says
  so with a model of P one-byte layers and a node memory of two bytes (a node holds its stage and its
  successor's replica), so with fewer than P usable nodes the planner finds no split
  (``InfeasibleSplit``) and the job waits for nodes.
- The global batch does not bind: the view's global batch is D microbatches, so D' = min(D, usable // P).
- Node ids and zone indices become names that sort like the integers (``node_name``, ``zone_name``), so
  every tie the planner breaks by name is broken the same way here. Zone-blind placement
  (``Policy(zone_aware=False)``) is the planner on a view where every node is in one zone, which is what
  the launcher does with nodes that register without a zone (it files them under ``default``).

`plan_placement` equals ``plan_layout(system_view(...)).owners`` and `decision` equals
``decide(system_view(...))`` (when and reasons); `reconfigures` is whether that decision reconfigures, without
building its reasons (the simulator asks it at every event). The tests check all three on random clusters
(hypothesis), and ``simulate_run(..., check_policy=True)`` checks every placement and decision of a run
against bamboo-reconfig itself.

Pure data parallelism (P = 1), which bamboo-reconfig does not plan (it needs P >= 2): every node is one
replica of the whole model, and the replicas form one ring, each node's shadow being its ring successor (it
also computes its predecessor's share of the global batch). The same rules carry over with the ring of
replicas in place of a pipeline's ring of stages: `plan_replica_ring` chooses and orders the replicas so that
ring neighbours sit in different zones wherever the zone counts allow (bamboo-reconfig's placement rule for
one ring of D slots), `is_consecutive_replica_failure` is the consecutive failure (a replica lost next to a
lost one), and `reconfigures` holds unchanged (it depends on P only through ``usable // P``).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping, Sequence
from typing import NamedTuple

import numpy as np
from bamboo.reconfig import ClusterView, LayerSpec, Layout, Node, Reason, StageSlot, When, microbatch_shares
from bamboo.reconfig.layout_plan import ARRANGEMENT_SEARCH_BUDGET
from bamboo.reconfig.placement import ring_arrangements
from scipy.optimize import linear_sum_assignment

__all__ = [
    "NOT_A_HOLDER",
    "ZONE_BLIND_NAME",
    "decision",
    "is_consecutive_failure",
    "is_consecutive_replica_failure",
    "node_name",
    "plan_placement",
    "plan_replica_ring",
    "reconfigures",
    "system_view",
    "zone_name",
]

#: The held stage of a node that holds no state of the current layout (a standby node).
NOT_A_HOLDER = -1
#: The one zone of a zone-blind view (the launcher's name for nodes that register without a zone).
ZONE_BLIND_NAME = "default"


def node_name(node: int) -> str:
    """The view's name for simulator node `node`: names sort like the integers (up to 10**12 nodes)."""
    return f"n{node:012d}"


def zone_name(zone: int) -> str:
    """The view's name for simulator zone index `zone`: names sort like the integers."""
    return f"z{zone:06d}"


# ------------------------------------------------------------------------------------------ placement
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
        slot_stages = [stage for _ring, stage in slots]
        columns = _greedy_assignment(stages_held, slot_stages, stages)
        if columns is None:
            cost = _missing_layers(stages).take(stages_held, axis=0).take(slot_stages, axis=1)
            columns = linear_sum_assignment(cost)[1].tolist()
        for node, column in zip(nodes, columns, strict=True):
            ring, stage = slots[column]
            owners[ring][stage] = node
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


@functools.lru_cache(maxsize=64)
def _cost_levels(stages: int) -> dict[int, tuple[tuple[int, ...] | None, ...]]:
    """For each held stage (and `NOT_A_HOLDER`), the new stages grouped by layers to fetch, fewest first.

    A group that holds every stage is None: any column of the zone is in it.
    """
    table = _missing_layers(stages)
    levels: dict[int, tuple[tuple[int, ...] | None, ...]] = {}
    for held in [*range(stages), NOT_A_HOLDER]:
        row = table[held].tolist()
        groups = [tuple(s for s in range(stages) if row[s] == cost) for cost in sorted(set(row))]
        levels[held] = tuple(None if len(group) == stages else group for group in groups)
    return levels


def _greedy_assignment(stages_held: Sequence[int], slot_stages: Sequence[int], stages: int) -> list[int] | None:
    """``linear_sum_assignment``'s columns for this zone's cost matrix, when a greedy pass can tell; else None.

    scipy's solver (shortest augmenting paths, rows in order) gives row i the lowest-numbered free column
    among those of the row's smallest cost whenever one of them is free: its dual variables stay zero
    for the columns and no path runs through an assigned column. When some row's cheapest columns are
    all taken that argument ends, and the caller asks scipy itself. The tests check both against
    ``plan_layout``, which calls scipy.
    """
    count = len(slot_stages)
    columns_at: dict[int, list[int]] = {}
    for column, stage in enumerate(slot_stages):
        if stage in columns_at:
            columns_at[stage].append(column)
        else:
            columns_at[stage] = [column]
    levels = _cost_levels(stages)
    taken = [False] * count
    lowest_free = 0
    result = []
    for held in stages_held:
        pick = -1
        for group in levels[held]:
            if group is None:
                while taken[lowest_free]:
                    lowest_free += 1
                pick = lowest_free
                break
            present = False
            for stage in group:
                at = columns_at.get(stage)
                if at:
                    present = True
                    for column in at:
                        if not taken[column]:
                            if pick < 0 or column < pick:
                                pick = column
                            break
            if present:
                if pick < 0:
                    return None
                break
        if pick < 0:
            # No group of this row is present among the columns: impossible (the last group is every
            # stage left), kept as scipy's case for safety.
            return None
        taken[pick] = True
        result.append(pick)
    return result


@functools.lru_cache(maxsize=1024)
def _flag_columns(ring_zones: tuple[int, ...], zones: tuple[int, ...], stages: int) -> np.ndarray:
    """Indices into the flat (zone, stage) fits of `zones` for a ring whose zones are `ring_zones`."""
    return np.array([zones.index(zone) * stages + stage for zone in ring_zones for stage in range(stages)])


# ------------------------------------------------------------------------------------------- decision
def is_consecutive_failure(dead: Collection[tuple[int, int]], pipeline: int, stage: int, stages: int) -> bool:
    """Whether the lost slot (`pipeline`, `stage`) has a lost neighbour: a stage and its shadow are both gone."""
    return (pipeline, (stage - 1) % stages) in dead or (pipeline, (stage + 1) % stages) in dead


def is_consecutive_replica_failure(dead: Collection[tuple[int, int]], pipeline: int, pipelines: int) -> bool:
    """P = 1: whether losing replica `pipeline` of a ring of `pipelines` replicas is a consecutive failure.

    It is when a ring neighbour is already lost (`dead` holds ``(replica, 0)`` slots): the lost replica's
    shadow (its successor) is gone, or it was itself the shadow of its lost predecessor. A lone replica has
    no shadow, so losing it is always one.
    """
    if pipelines < 2:
        return True
    return ((pipeline - 1) % pipelines, 0) in dead or ((pipeline + 1) % pipelines, 0) in dead


def decision(
    dead: Collection[tuple[int, int]],
    layout_pipelines: int,
    stages: int,
    target_pipelines: int,
    usable: int,
    waiting: int,
) -> tuple[When, tuple[Reason, ...]]:
    """``decide``'s when and reasons for a layout of `layout_pipelines` x `stages` whose slots `dead` are lost.

    `usable` counts the live registered nodes (surviving owners and waiting nodes), `waiting` the live
    nodes outside the layout. The rules, most urgent first: a pipeline that lost a stage and its shadow
    reconfigures now; at the next step boundary when every survivor of some degraded pipeline has a lost
    neighbour (one more failure would be fatal), when a shadow carries a lost stage and a node waits, when
    the waiting nodes let more pipelines run, or after any failover (rebuild redundancy, listed after every
    other reason, the consecutive failure's included); a whole layout carries on unless more pipelines can run.
    bamboo-reconfig decides for P >= 2 only; with ``stages < 2`` this raises ValueError (`reconfigures` and
    `is_consecutive_replica_failure` cover P = 1).
    """
    if stages < 2:
        raise ValueError(f"bamboo-reconfig decides for pipelines of at least 2 stages, got {stages}")
    if not dead:
        if waiting and min(target_pipelines, usable // stages) > layout_pipelines:
            return When.NEXT_STEP_BOUNDARY, _NEW_PIPELINE
        return When.CARRY_ON, _WHOLE
    lost_by_pipeline: dict[int, set[int]] = {}
    for pipeline, stage in dead:
        if pipeline in lost_by_pipeline:
            lost_by_pipeline[pipeline].add(stage)
        else:
            lost_by_pipeline[pipeline] = {stage}
    fragile = False
    for lost in lost_by_pipeline.values():
        if any((stage - 1) % stages in lost for stage in lost):
            return When.NOW, _CONSECUTIVE
        if not fragile:
            fragile = all(
                (stage - 1) % stages in lost or (stage + 1) % stages in lost
                for stage in range(stages)
                if stage not in lost
            )
    more = bool(waiting) and min(target_pipelines, usable // stages) > layout_pipelines
    return When.NEXT_STEP_BOUNDARY, _FAILED_OVER[fragile, bool(waiting), more]


def reconfigures(
    dead: Collection[tuple[int, int]],
    layout_pipelines: int,
    stages: int,
    target_pipelines: int,
    usable: int,
    waiting: int,
) -> bool:
    """Whether `decision` on the same arguments reconfigures (now or at the next step boundary), cheaply.

    It does after any failover (some slot is lost), and when the waiting nodes let more pipelines run:
    with the rebuild after a failover, a decision carries on only while the layout is whole and cannot grow.
    """
    return bool(dead) or (waiting > 0 and min(target_pipelines, usable // stages) > layout_pipelines)


_NEW_PIPELINE = (Reason.NEW_PIPELINE,)
_WHOLE = (Reason.ALL_PIPELINES_WHOLE,)
_CONSECUTIVE = (Reason.CONSECUTIVE_FAILURE, Reason.REBUILD_REDUNDANCY)
#: The reasons after a failover that is not consecutive, by (fragile, a node waits, more pipelines can run).
_FAILED_OVER = {
    (fragile, waiting, more): tuple(
        reason for reason, holds in (
            (Reason.ONE_MORE_FAILURE_FATAL, fragile),
            (Reason.SHADOW_CARRYING_TWO_STAGES, waiting),
            (Reason.NEW_PIPELINE, more),
            (Reason.REBUILD_REDUNDANCY, True),
        ) if holds
    )
    for fragile in (False, True) for waiting in (False, True) for more in (False, True)
}


# ---------------------------------------------------------------------------------------- system view
@functools.lru_cache(maxsize=64)
def _layers(stages: int) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(param_bytes=1, optimizer_bytes=0, compute_cost=1.0) for _ in range(stages))


def system_view(
    owners: Sequence[Sequence[int]],
    alive: Iterable[int],
    zone_of: Mapping[int, int],
    stages: int,
    pipelines: int,
    zone_aware: bool = True,
) -> ClusterView:
    """The ``ClusterView`` that bamboo-reconfig sees for this simulator state (see the module docstring).

    `owners` is the current layout's grid (empty before the first layout), dead owners included; `alive`
    the live registered nodes (owners still alive and waiting nodes); `zone_of` every node's zone index.
    """
    if stages < 2:
        raise ValueError(f"bamboo-reconfig plans pipelines of at least 2 stages, got {stages}")
    live = set(alive)

    def zone(node: int) -> str:
        return zone_name(zone_of[node]) if zone_aware else ZONE_BLIND_NAME

    nodes: list[Node] = []
    slots: set[int] = set()
    for pipeline, row in enumerate(owners):
        for stage, node in enumerate(row):
            slots.add(node)
            if node in live:
                nodes.append(Node(node_name(node), zone(node), "active", StageSlot(pipeline, stage)))
            else:
                nodes.append(Node(node_name(node), zone(node), "preempted"))
    nodes.extend(Node(node_name(node), zone(node), "standby") for node in live - slots)
    layers = _layers(stages)
    layout = None
    if owners:
        layout = Layout(
            stages=stages,
            layers=layers,
            stage_layers=[(stage, stage + 1) for stage in range(stages)],
            owners=[[node_name(node) for node in row] for row in owners],
            microbatches=microbatch_shares(pipelines, len(owners)),
        )
    return ClusterView(
        nodes=nodes, target_stages=stages, target_pipelines=pipelines, global_batch=pipelines,
        layers=layers, layout=layout, node_memory_bytes=2,
    )
