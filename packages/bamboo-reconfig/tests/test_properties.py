"""Property-based tests of plan_layout and plan_transfers over random clusters, failures and joins."""

from __future__ import annotations

import json
import random
from collections import Counter

from bamboo.reconfig import (
    ClusterView,
    Layout,
    NodeState,
    Reason,
    When,
    decide,
    minimum_rounds,
    plan_layout,
    plan_transfers,
    same_zone_pairs,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

SETTINGS = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def check_layout_invariants(view: ClusterView, layout: Layout) -> None:
    by_id = view.nodes_by_id
    placed = [node for row in layout.owners for node in row]
    # every stage of every pipeline has exactly one owner and one shadow, and no node has two roles
    assert len(placed) == len(set(placed)) == layout.num_pipelines * layout.stages
    assert not set(placed) & set(layout.standby)
    for d in range(layout.num_pipelines):
        shadows = [layout.shadow(d, s) for s in range(layout.stages)]
        assert sorted(shadows) == sorted(layout.owners[d])
        for s in range(layout.stages):
            assert layout.shadow(d, s) != layout.owner(d, s)
    # only live nodes run or wait; every live node does one of the two
    usable = {node.id for node in view.usable_nodes}
    assert set(placed) | set(layout.standby) == usable
    # no asymmetric pipelines, D' within its bounds, global batch kept
    assert layout.stages <= view.target_stages
    assert layout.num_pipelines == min(view.target_pipelines, len(usable) // layout.stages, view.global_batch)
    if layout.num_pipelines:
        assert layout.global_batch == view.global_batch
        assert max(layout.microbatches) - min(layout.microbatches) <= 1
    # the reported same-zone count is the real one
    real = sum(same_zone_pairs([by_id[node].zone for node in row]) for row in layout.owners)
    assert layout.same_zone_neighbours == real


@SETTINGS
@given(data=st.data())
def test_layouts_keep_their_invariants(strategies, data) -> None:
    first, second = data.draw(strategies.scenario())
    check_layout_invariants(first, plan_layout(first))
    check_layout_invariants(second, plan_layout(second))


@SETTINGS
@given(data=st.data(), seed=st.integers(0, 2**32 - 1))
def test_same_input_in_any_order_gives_the_same_output(strategies, data, seed) -> None:
    _first, view = data.draw(strategies.scenario())
    layout = plan_layout(view)
    rng = random.Random(seed)
    # the same cluster, described in another order: nodes, old pipelines (interchangeable data-parallel
    # replicas), the standby queue, and the survivors handed to plan_transfers
    data_view = json.loads(view.to_json())
    rng.shuffle(data_view["nodes"])
    old = data_view["layout"]
    rng.shuffle(old["pipelines"])
    rng.shuffle(old["standby"])
    shuffled = ClusterView.from_dict(data_view)
    again = plan_layout(shuffled)
    assert again.to_json() == layout.to_json()
    first_decision, second_decision = decide(view), decide(shuffled)
    assert (first_decision.when, first_decision.reasons) == (second_decision.when, second_decision.reasons)
    survivors = [node.id for node in view.usable_nodes]
    reordered = list(survivors)
    rng.shuffle(reordered)
    assert plan_transfers(shuffled.layout, again, reordered) == plan_transfers(view.layout, layout, survivors)


#: The order in which a decision lists its reasons (decide's docstring).
REASON_ORDER = [Reason.NO_LAYOUT, Reason.CONSECUTIVE_FAILURE, Reason.ONE_MORE_FAILURE_FATAL,
                Reason.SHADOW_CARRYING_TWO_STAGES, Reason.NEW_PIPELINE, Reason.REBUILD_REDUNDANCY,
                Reason.ALL_PIPELINES_WHOLE]


@SETTINGS
@given(data=st.data())
def test_a_failover_always_reconfigures_and_reasons_come_in_order(strategies, data) -> None:
    _first, view = data.draw(strategies.scenario())
    decision = decide(view)
    assert list(decision.reasons) == sorted(decision.reasons, key=REASON_ORDER.index)
    assert len(set(decision.reasons)) == len(decision.reasons)
    assert view.layout is not None
    states = view.nodes_by_id
    failed_over = sorted({d for d, row in enumerate(view.layout.owners)
                          for node in row if states[node].state is NodeState.PREEMPTED})
    # the rebuild is listed exactly when some owner of the layout is preempted, so only whole layouts carry on
    assert (Reason.REBUILD_REDUNDANCY in decision.reasons) == bool(failed_over)
    assert (decision.when is When.CARRY_ON) == (decision.reasons == (Reason.ALL_PIPELINES_WHOLE,))
    if failed_over:
        assert decision.when is not When.CARRY_ON
        assert set(failed_over) <= set(decision.pipelines)
    assert (decision.when is When.NOW) == (Reason.CONSECUTIVE_FAILURE in decision.reasons)


@SETTINGS
@given(data=st.data())
def test_transfers_read_only_survivors_and_never_move_more_than_naive(strategies, data) -> None:
    _first, view = data.draw(strategies.scenario())
    old = view.layout
    new = plan_layout(view)
    survivors = {node.id for node in view.usable_nodes}
    plan = plan_transfers(old, new, survivors)
    dead = {node.id for node in view.nodes} - survivors
    assert plan.bytes_moved <= plan.naive_bytes
    held = {node: set(old.layers_held_at(slot.stage)) for node, slot in old.slots().items() if node in survivors}
    if plan.restore_from_checkpoint:
        surviving_layers = set().union(*held.values()) if held else set()
        assert plan.layers_without_copy
        assert not set(plan.layers_without_copy) & surviving_layers
        assert set(plan.stages_without_copy) == {new.stage_of_layer(layer) for layer in plan.layers_without_copy}
        return
    assert len(plan.rounds) == minimum_rounds(plan.transfers)
    for round_ in plan.rounds:
        assert len({t.source for t in round_}) == len(round_)
        assert len({t.destination for t in round_}) == len(round_)
    initially = {node: set(layers) for node, layers in held.items()}
    for transfer in plan.transfers:
        assert transfer.source not in dead and transfer.source in survivors
        # the source really holds what it sends, from the old layout (no relaying)
        assert set(transfer.layers) <= initially[transfer.source]
        held.setdefault(transfer.destination, set()).update(transfer.layers)
    for node, slot in new.slots().items():
        assert new.layers_held_at(slot.stage) <= held.get(node, set())
    # minimal: exactly the layers each new owner lacked are moved
    lacked = sum(
        new.layers[layer].state_bytes
        for node, slot in new.slots().items()
        for layer in new.layers_held_at(slot.stage) - initially.get(node, set())
    )
    assert plan.bytes_moved == lacked


@SETTINGS
@given(data=st.data())
def test_every_value_class_round_trips_through_json(strategies, data) -> None:
    _first, view = data.draw(strategies.scenario())
    layout = plan_layout(view)
    plan = plan_transfers(view.layout, layout, [node.id for node in view.usable_nodes])
    decision = decide(view)
    assert ClusterView.from_json(view.to_json()) == view
    assert Layout.from_json(layout.to_json()) == layout
    assert type(plan).from_json(plan.to_json()) == plan
    assert type(decision).from_json(decision.to_json()) == decision


def brute_force_same_zone_minimum(zones_available: Counter[str], rings: int, stages: int) -> int:
    """Try every zone sequence for the rings * stages slots that the available zone counts allow."""
    slots = rings * stages
    best = None
    zones = sorted(zones_available)

    def walk(prefix: list[str], left: Counter[str]) -> None:
        nonlocal best
        if len(prefix) == slots:
            cost = sum(same_zone_pairs(prefix[r * stages:(r + 1) * stages]) for r in range(rings))
            best = cost if best is None else min(best, cost)
            return
        for zone in zones:
            if left[zone]:
                left[zone] -= 1
                prefix.append(zone)
                walk(prefix, left)
                prefix.pop()
                left[zone] += 1

    walk([], Counter(zones_available))
    return 0 if best is None else best


@settings(max_examples=80, deadline=None)
@given(
    zones=st.lists(st.sampled_from("abc"), min_size=2, max_size=8),
    stages=st.integers(2, 4),
    pipelines=st.integers(1, 3),
    layer_count=st.integers(4, 6),
)
def test_same_zone_count_equals_brute_force_optimum(build, zones, stages, pipelines, layer_count) -> None:
    nodes = [build.zoned_nodes(1, zone, prefix=f"x{i}")[0] for i, zone in enumerate(zones)]
    view = ClusterView(nodes=nodes, target_stages=stages, target_pipelines=pipelines, global_batch=12,
                       layers=build.uniform_layers(layer_count))
    layout = plan_layout(view)
    rings, depth = layout.num_pipelines, layout.stages
    assert layout.same_zone_neighbours == brute_force_same_zone_minimum(Counter(zones), rings, depth)
