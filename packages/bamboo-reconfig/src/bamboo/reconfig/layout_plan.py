"""``plan_layout(view)``: the new layout after a reconfiguration.

The policy (paper §5; docs/architecture.md, "A reconfiguration"):

1. Keep depth P first. P is only lowered when fewer than P nodes are usable; a smaller P is tried from
   the target down to 2 and must also fit node memory.
2. ``D' = min(D, usable // P, global_batch)``: no asymmetric pipelines (and no pipeline without a
   microbatch). Surplus nodes wait in the standby queue.
3. Zone-aware placement with the minimum possible number of same-zone neighbours (``placement``).
4. Among placements that reach that minimum, nodes stay where they already hold the state they need:
   each ring's zone arrangement is picked to match the holders of each stage, and within each zone the
   nodes are matched to slots by a minimum-cost assignment of the bytes each would have to fetch
   (``assignment``: exact, between the few kinds of node and slot).
5. The layers are split into P stages by compute cost, within node memory (``partition``).
6. The global batch is unchanged: with D' pipelines each runs ``B // D'`` microbatches and the first
   ``B % D'`` run one more (``Layout.microbatches`` states the shares).

Every input is sorted by node id first, so the output does not depend on input order.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from bamboo.reconfig.assignment import cheapest_order
from bamboo.reconfig.model import ClusterView, LayerSpec, Layout, Node, NodeState
from bamboo.reconfig.partition import InfeasibleSplit, split_layers
from bamboo.reconfig.placement import (
    choose_nodes,
    deal_zone_counts,
    minimum_same_zone_pairs,
    ring_arrangements,
    same_zone_pairs,
)

#: Rings whose arrangement search would score more candidate slots than this use the canonical one only.
ARRANGEMENT_SEARCH_BUDGET = 200_000

_STATE_RANK = {NodeState.ACTIVE: 0, NodeState.STANDBY: 1, NodeState.JOINING: 2, NodeState.PREEMPTED: 3}


def pipeline_count(usable: int, stages: int, target_pipelines: int, global_batch: int, even_shares: bool = False) -> int:
    """D' = min(D, usable // P, global batch): whole pipelines only, each with at least one microbatch. With
    ``even_shares``, the largest D' up to that which divides the global batch (`even_pipeline_counts`: every pipeline
    runs the same number of microbatches, for a trainer that needs equal shares: 16 microbatches over nodes for 3 run
    as 2 of 8)."""
    count = min(target_pipelines, usable // stages, global_batch)
    return even_pipeline_counts(global_batch, count)[0] if even_shares and count > 1 else count


def even_pipeline_counts(global_batch: int, pipelines: int) -> tuple[int, ...]:
    """The pipeline counts from ``pipelines`` down to 1 that divide ``global_batch``: the only counts a layout with
    ``even_shares`` runs (16 microbatches over up to 4 pipelines: 4, 2 and 1; nodes for 3 run 2)."""
    if global_batch < 1 or pipelines < 1:
        raise ValueError(f"global_batch and pipelines must be >= 1, got {global_batch} and {pipelines}")
    return tuple(count for count in range(min(pipelines, global_batch), 0, -1) if global_batch % count == 0)


def microbatch_shares(global_batch: int, pipelines: int) -> tuple[int, ...]:
    """Each pipeline's microbatches so that they add up to the global batch; the first ones take the rest."""
    if pipelines == 0:
        return ()
    base, extra = divmod(global_batch, pipelines)
    return tuple(base + 1 if d < extra else base for d in range(pipelines))


def held_layers(view: ClusterView) -> dict[str, frozenset[int]]:
    """Layers whose state each live node holds under the current layout (owners hold two stages)."""
    layout = view.layout
    if layout is None:
        return {}
    alive = {node.id for node in view.usable_nodes}
    return {
        node: layout.layers_held_at(slot.stage)
        for node, slot in layout.slots().items()
        if node in alive
    }


def choose_depth(view: ClusterView, usable: int) -> tuple[int, tuple[tuple[int, int], ...]]:
    """The deepest P <= target that the usable nodes can fill and whose split fits node memory.

    With fewer than 2 usable nodes no pipeline can form: the target depth is kept and everyone waits.
    """
    errors: list[str] = []
    for stages in range(view.target_stages, 1, -1):
        if stages > usable:
            continue
        try:
            return stages, split_layers(view.layers, stages, view.node_memory_bytes)
        except InfeasibleSplit as error:
            errors.append(str(error))
    if errors:
        raise InfeasibleSplit(errors[0])
    return view.target_stages, split_layers(view.layers, view.target_stages, view.node_memory_bytes)


def plan_layout(view: ClusterView) -> Layout:
    """The new layout for ``view``: same inputs (in any order) give the same layout."""
    usable = list(view.usable_nodes)
    stages, bounds = choose_depth(view, len(usable))
    rings = pipeline_count(len(usable), stages, view.target_pipelines, view.global_batch, view.even_shares)
    holdings = held_layers(view)

    def preference(node: Node) -> tuple[int, int]:
        return (0 if holdings.get(node.id) else 1, _STATE_RANK[node.state])

    # With one stage (P = 1) the shadow ring runs over the pipelines (pipeline d's shadow is pipeline d + 1's
    # node), so the ring to keep zone-diverse is the D pipelines' nodes: one ring of D slots.
    shadow_ring = stages == 1 and rings > 1
    ring_count, ring_length = (1, rings) if shadow_ring else (rings, stages)
    chosen = choose_nodes(usable, ring_count, ring_length, preference) if rings else []
    chosen_ids = {node.id for node in chosen}
    standby = tuple(node.id for node in sorted(usable, key=lambda n: (preference(n), n.id))
                    if node.id not in chosen_ids)
    need = _needed_layers(bounds, stages)
    missing_bytes = _missing_bytes_table(view.layers, need, holdings)
    if shadow_ring:
        pipeline_ring = ring_arrangements(Counter(node.zone for node in chosen), rings)[0]
        ring_zones = [(zone,) for zone in pipeline_ring]
        conflicts = same_zone_pairs(pipeline_ring)
    else:
        ring_zones = _arrange_rings(chosen, rings, stages, holdings, missing_bytes)
        conflicts = sum(same_zone_pairs(zones) for zones in ring_zones)
    owners = _assign_slots(chosen, ring_zones, holdings, missing_bytes)
    bound = minimum_same_zone_pairs(Counter(node.zone for node in chosen), ring_count, ring_length)
    if conflicts != bound:  # pragma: no cover - guarded by the brute-force tests
        raise AssertionError(f"placement has {conflicts} same-zone pairs, the minimum is {bound}")
    return Layout(
        stages=stages,
        layers=view.layers,
        stage_layers=bounds,
        owners=owners,
        microbatches=microbatch_shares(view.global_batch, rings),
        standby=standby,
        same_zone_neighbours=conflicts,
    )


def _needed_layers(bounds: Sequence[tuple[int, int]], stages: int) -> list[frozenset[int]]:
    stage_sets = [frozenset(range(start, end)) for start, end in bounds]
    return [stage_sets[s] | stage_sets[(s + 1) % stages] for s in range(stages)]


def _missing_bytes_table(
    layers: Sequence[LayerSpec], need: Sequence[frozenset[int]], holdings: dict[str, frozenset[int]]
) -> dict[frozenset[int], list[int]]:
    """For each distinct holding (the empty set included), the bytes missing at every new stage."""
    table: dict[frozenset[int], list[int]] = {}
    for held in [frozenset(), *holdings.values()]:
        if held not in table:
            table[held] = [sum(layers[layer].state_bytes for layer in needed - held) for needed in need]
    return table


def _arrange_rings(
    chosen: Sequence[Node],
    rings: int,
    stages: int,
    holdings: dict[str, frozenset[int]],
    missing_bytes: dict[frozenset[int], list[int]],
) -> list[tuple[str, ...]]:
    """Each ring's zone sequence: minimum same-zone pairs, then the most slots a holder can fill as is."""
    if rings == 0:
        return []
    # fits[zone][stage]: chosen nodes of that zone that already hold everything stage `stage` needs.
    fits: dict[str, list[int]] = {}
    for node in chosen:
        row = fits.setdefault(node.zone, [0] * stages)
        held = holdings.get(node.id)
        if held:
            for stage, missing in enumerate(missing_bytes[held]):
                if missing == 0:
                    row[stage] += 1
                    break
    any_fit = any(any(row) for row in fits.values())
    arrangements: dict[tuple[tuple[str, int], ...], list[tuple[str, ...]]] = {}
    result: list[tuple[str, ...]] = []
    for counts in deal_zone_counts(chosen, rings):
        key = tuple(sorted(counts.items()))
        if key not in arrangements:
            arrangements[key] = ring_arrangements(counts, stages)
        candidates = arrangements[key]
        if not any_fit or len(candidates) * stages > ARRANGEMENT_SEARCH_BUDGET:
            result.append(candidates[0])
            continue
        best, best_score = candidates[0], -1
        for candidate in candidates:
            score = sum(1 for stage, zone in enumerate(candidate) if fits[zone][stage] > 0)
            if score > best_score:
                best, best_score = candidate, score
        for stage, zone in enumerate(best):
            if fits[zone][stage] > 0:
                fits[zone][stage] -= 1
        result.append(best)
    return result


def _assign_slots(
    chosen: Sequence[Node],
    ring_zones: Sequence[tuple[str, ...]],
    holdings: dict[str, frozenset[int]],
    missing_bytes: dict[frozenset[int], list[int]],
) -> list[list[str]]:
    """Match each zone's nodes to that zone's slots, minimising the bytes they must fetch."""
    owners = [[""] * len(zones) for zones in ring_zones]
    slots_by_zone: dict[str, list[tuple[int, int]]] = {}
    for ring, zones in enumerate(ring_zones):
        for stage, zone in enumerate(zones):
            slots_by_zone.setdefault(zone, []).append((ring, stage))
    nodes_by_zone: dict[str, list[Node]] = {}
    for node in sorted(chosen, key=lambda n: n.id):
        nodes_by_zone.setdefault(node.zone, []).append(node)
    for zone, slots in sorted(slots_by_zone.items()):
        nodes = nodes_by_zone[zone]
        rows = [missing_bytes[holdings.get(node.id, frozenset())] for node in nodes]
        # nodes that hold nothing are one kind: they are dealt out in id order, the order the slots were listed in
        order = cheapest_order(rows, [stage for _ring, stage in slots])
        for slot_position, (ring, stage) in enumerate(slots):
            owners[ring][stage] = nodes[order[slot_position]].id
    return owners
