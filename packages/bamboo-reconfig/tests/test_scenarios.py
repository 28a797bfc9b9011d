"""The issue's scenarios, end to end: decide, plan_layout, plan_transfers on concrete clusters."""

from __future__ import annotations

import pytest
from bamboo.reconfig import ClusterView, Reason, When, decide, plan_layout, plan_transfers


def zones_of(layout, view: ClusterView) -> list[list[str]]:
    by_id = view.nodes_by_id
    return [[by_id[node].zone for node in row] for row in layout.owners]


@pytest.fixture
def twelve(build):
    """12 active nodes in 3 zones, P = 4, D = 3, and its first layout."""
    nodes = build.zoned_nodes(12, "abc")
    view = ClusterView(nodes=nodes, target_stages=4, target_pipelines=3, global_batch=12,
                       layers=build.uniform_layers(16))
    return view, plan_layout(view)


def test_twelve_nodes_in_three_zones_have_no_same_zone_neighbours(twelve) -> None:
    view, layout = twelve
    assert (layout.num_pipelines, layout.stages) == (3, 4)
    assert layout.same_zone_neighbours == 0
    for zones in zones_of(layout, view):
        assert all(zones[s] != zones[(s + 1) % 4] for s in range(4)), zones
    assert layout.standby == ()
    assert layout.microbatches == (4, 4, 4)
    assert layout.stage_layers == ((0, 4), (4, 8), (8, 12), (12, 16))


def test_a_whole_zone_lost_is_never_fatal_and_the_survivors_re_form(build, twelve) -> None:
    view, layout = twelve
    lost = {node.id: "preempted" for node in view.nodes if node.zone == "a"}
    after = build.view_after(layout, build.with_states(view.nodes, lost))
    decision = decide(after)
    # no same-zone neighbours, so losing one zone never takes a stage and its shadow together
    assert decision.when is When.NEXT_STEP_BOUNDARY
    assert Reason.CONSECUTIVE_FAILURE not in decision.reasons
    # no node waits; every pipeline failed over, and one with two stages lost is one failure from fatal
    assert decision.reasons[-1] is Reason.REBUILD_REDUNDANCY
    assert Reason.SHADOW_CARRYING_TWO_STAGES not in decision.reasons
    assert decision.pipelines == (0, 1, 2)
    new = plan_layout(after)
    assert (new.num_pipelines, new.stages) == (2, 4)
    assert new.same_zone_neighbours == 0
    assert new.microbatches == (6, 6)  # the global batch of 12 is kept
    assert not {node for row in new.owners for node in row} & set(lost)
    plan = plan_transfers(layout, new, [node.id for node in after.usable_nodes])
    assert not plan.restore_from_checkpoint
    assert all(t.source not in lost for t in plan.transfers)
    assert 0 < plan.bytes_moved < plan.naive_bytes


def test_losing_a_zone_in_a_single_zone_cluster_is_fatal(build) -> None:
    nodes = build.zoned_nodes(4, "a")
    layout = plan_layout(ClusterView(nodes=nodes, target_stages=4, target_pipelines=1, global_batch=4,
                                     layers=build.uniform_layers(4)))
    assert layout.same_zone_neighbours == 4
    after = build.view_after(layout, build.with_states(nodes, {n.id: "preempted" for n in nodes}))
    assert decide(after).reasons == (Reason.CONSECUTIVE_FAILURE, Reason.REBUILD_REDUNDANCY)
    assert plan_layout(after).num_pipelines == 0


def test_joiners_that_complete_a_pipeline(build) -> None:
    nodes = build.zoned_nodes(10, "ab")  # 2 pipelines of 4, 2 in standby
    first = ClusterView(nodes=nodes, target_stages=4, target_pipelines=3, global_batch=10,
                        layers=build.uniform_layers(8))
    layout = plan_layout(first)
    assert layout.num_pipelines == 2 and len(layout.standby) == 2
    assert layout.microbatches == (5, 5)
    standby = {node: "standby" for node in layout.standby}
    joiners = build.zoned_nodes(2, "ab", state="joining", prefix="j")
    after = build.view_after(layout, [*build.with_states(nodes, standby), *joiners], target_pipelines=3)
    decision = decide(after)
    assert (decision.when, decision.reasons) == (When.NEXT_STEP_BOUNDARY, (Reason.NEW_PIPELINE,))
    new = plan_layout(after)
    assert new.num_pipelines == 3 and new.standby == ()
    assert new.microbatches == (4, 3, 3)  # unequal shares, stated, and the global batch is kept
    assert new.same_zone_neighbours == 0
    # every old owner keeps a slot whose state it already holds: only the new pipeline's nodes fetch
    old_slots = layout.slots()
    new_slots = new.slots()
    for node, slot in old_slots.items():
        assert new_slots[node].stage == slot.stage
    plan = plan_transfers(layout, new, [node.id for node in after.usable_nodes])
    fresh = set(layout.standby) | {node.id for node in joiners}
    assert {t.destination for t in plan.transfers} == fresh
    assert plan.bytes_moved == sum(
        new.layers[layer].state_bytes for node in fresh for layer in new.layers_held_at(new_slots[node].stage)
    )
    assert plan.bytes_moved == plan.naive_bytes // 3


def test_fatal_loss_with_surviving_data_parallel_copies_rebuilds_from_peers(build, twelve) -> None:
    view, layout = twelve
    dead = {layout.owner(0, 1): "preempted", layout.owner(0, 2): "preempted"}
    after = build.view_after(layout, build.with_states(view.nodes, dead))
    decision = decide(after)
    assert (decision.when, decision.reasons) == (When.NOW, (Reason.CONSECUTIVE_FAILURE, Reason.REBUILD_REDUNDANCY))
    new = plan_layout(after)
    assert new.num_pipelines == 2
    plan = plan_transfers(layout, new, [node.id for node in after.usable_nodes])
    assert not plan.restore_from_checkpoint
    assert all(t.source not in dead for t in plan.transfers)
    assert plan.bytes_moved < plan.naive_bytes


def test_fatal_loss_without_surviving_copies_restores_from_checkpoint(build) -> None:
    nodes = build.zoned_nodes(6, "abc")  # one pipeline of 4, 2 in standby
    layout = plan_layout(ClusterView(nodes=nodes, target_stages=4, target_pipelines=1, global_batch=4,
                                     layers=build.uniform_layers(8)))
    # stage 2 lived on its owner and on its shadow, the owner of stage 1: both lost
    dead = {layout.owner(0, 1): "preempted", layout.owner(0, 2): "preempted"}
    states = {node: "standby" for node in layout.standby} | dead
    after = build.view_after(layout, build.with_states(nodes, states))
    assert decide(after).reason is Reason.CONSECUTIVE_FAILURE
    new = plan_layout(after)
    assert new.num_pipelines == 1
    plan = plan_transfers(layout, new, [node.id for node in after.usable_nodes])
    assert plan.restore_from_checkpoint
    assert plan.stages_without_copy == (2,)
    assert plan.layers_without_copy == (4, 5)
    assert plan.transfers == ()


def test_fewer_usable_nodes_than_stages_lowers_the_depth(build) -> None:
    view = ClusterView(nodes=build.zoned_nodes(3, "ab"), target_stages=4, target_pipelines=2, global_batch=4,
                       layers=build.uniform_layers(6))
    layout = plan_layout(view)
    assert (layout.num_pipelines, layout.stages) == (1, 3)
    assert layout.stage_layers == ((0, 2), (2, 4), (4, 6))


def test_a_transfer_plan_refuses_a_dead_node_in_the_new_layout(build, twelve) -> None:
    view, layout = twelve
    survivors = [node.id for node in view.nodes][1:]
    with pytest.raises(ValueError, match=r"not survivors \(marked \*\)"):
        plan_transfers(layout, layout, survivors)


def test_transfer_rounds_spread_the_senders(build, twelve) -> None:
    view, layout = twelve
    joiners = build.zoned_nodes(4, "abc", state="joining", prefix="j")
    after = build.view_after(layout, [*view.nodes, *joiners], target_pipelines=4, global_batch=12)
    new = plan_layout(after)
    plan = plan_transfers(layout, new, [node.id for node in after.usable_nodes])
    assert new.num_pipelines == 4
    assert len({t.destination for t in plan.transfers}) == 4
    # four fresh nodes each fetch two stages; three copies of every stage exist, so one round can serve them
    assert len(plan.rounds) <= 2


@pytest.mark.parametrize(("pipeline", "stage"), [(0, 0), (1, 2), (2, 3)])
def test_a_same_zone_replacement_takes_the_lost_slot_and_nobody_else_moves(build, twelve, pipeline, stage) -> None:
    view, layout = twelve
    victim = view.nodes_by_id[layout.owner(pipeline, stage)]
    joiner = build.zoned_nodes(1, victim.zone, state="joining", prefix="j")[0]
    after = build.view_after(layout, [*build.with_states(view.nodes, {victim.id: "preempted"}), joiner])
    assert decide(after).reasons == (Reason.SHADOW_CARRYING_TWO_STAGES, Reason.REBUILD_REDUNDANCY)
    new = plan_layout(after)
    assert new.same_zone_neighbours == 0
    plan = plan_transfers(layout, new, [node.id for node in after.usable_nodes])
    assert {t.destination for t in plan.transfers} == {joiner.id}
    assert new.slots()[joiner.id].stage == stage
    assert plan.bytes_moved == sum(new.layers[i].state_bytes for i in new.layers_held_at(stage))


def test_too_few_nodes_wait_in_standby_until_a_joiner_completes_the_first_pipeline(build) -> None:
    alone = build.zoned_nodes(1, "a")
    view = ClusterView(nodes=alone, target_stages=2, target_pipelines=2, global_batch=4,
                       layers=build.uniform_layers(4))
    layout = plan_layout(view)
    assert (layout.num_pipelines, layout.standby, layout.microbatches) == (0, ("n000",), ())
    waiting = build.with_states(alone, {"n000": "standby"})
    assert decide(build.view_after(layout, waiting, target_pipelines=2, global_batch=4)).when is When.CARRY_ON
    joiner = build.zoned_nodes(1, "b", state="joining", prefix="j")
    after = build.view_after(layout, [*waiting, *joiner], target_pipelines=2, global_batch=4)
    assert decide(after).reasons == (Reason.NEW_PIPELINE,)
    new = plan_layout(after)
    assert new.owners == (("j000", "n000"),) or new.owners == (("n000", "j000"),)
    assert new.microbatches == (4,)
    plan = plan_transfers(layout, new, ["n000", "j000"])
    # nobody holds any state yet: the first layout starts from the checkpoint (or the initial weights)
    assert plan.restore_from_checkpoint and plan.stages_without_copy == (0, 1)


def test_owners_without_redundancy_fetch_their_own_stage_only(build, twelve) -> None:
    """A generation with no redundancy (``replicas=False``): a fresh owner needs its stage alone, not its
    successor's replica, so it fetches half what it fetches with redundancy."""
    view, layout = twelve
    joiners = build.zoned_nodes(4, "abc", state="joining", prefix="j")
    after = build.view_after(layout, [*view.nodes, *joiners], target_pipelines=4, global_batch=12)
    new = plan_layout(after)
    usable = [node.id for node in after.usable_nodes]
    with_replicas, own_only = plan_transfers(layout, new, usable), plan_transfers(layout, new, usable, replicas=False)
    assert {t.destination for t in own_only.transfers} == {t.destination for t in with_replicas.transfers}
    assert own_only.bytes_moved * 2 == with_replicas.bytes_moved
    for transfer in own_only.transfers:
        slot = new.slots()[transfer.destination]
        assert set(transfer.layers) <= set(new.stage_layer_range(slot.stage))


def test_with_even_shares_the_pipelines_divide_the_global_batch_and_no_reconfiguration_chases_a_third(build) -> None:
    """P = 2, D = 4, 16 microbatches; one pipeline's node is lost and nobody replaces it: 7 nodes could run 3
    pipelines, but 16 microbatches do not split evenly over 3, so the live runtime's layout runs 2 pipelines of 8
    (the spare pipeline's nodes wait on standby), and `decide` sees no new pipeline to form while it stays so."""
    from bamboo.reconfig import pipeline_count

    assert [pipeline_count(usable, 2, 4, 16, even_shares=True) for usable in range(1, 10)] == [0, 1, 1, 2, 2, 2, 2, 4, 4]
    assert pipeline_count(7, 2, 4, 16) == 3  # the planner's own rule: uneven shares
    assert pipeline_count(8, 2, 4, 12, even_shares=True) == 4 and pipeline_count(6, 2, 4, 12, even_shares=True) == 3
    nodes = build.zoned_nodes(8, "ab")
    first = plan_layout(ClusterView(nodes=nodes, target_stages=2, target_pipelines=4, global_batch=16,
                                    layers=build.uniform_layers(4), even_shares=True))
    assert first.microbatches == (4, 4, 4, 4)
    lost = first.owners[1][0]
    after = build.view_after(first, build.with_states(nodes, {lost: "preempted"}), even_shares=True)
    new = plan_layout(after)
    assert new.microbatches == (8, 8) and len(new.standby) == 3
    uneven = plan_layout(build.view_after(first, build.with_states(nodes, {lost: "preempted"})))
    assert uneven.microbatches == (6, 5, 5)  # without the rule
    waiting = build.with_states([n for n in nodes if n.id != lost], dict.fromkeys(new.standby, "standby"))
    assert Reason.NEW_PIPELINE in decide(build.view_after(new, waiting, target_pipelines=4)).reasons  # 3 > 2
    assert Reason.NEW_PIPELINE not in decide(build.view_after(new, waiting, target_pipelines=4,
                                                              even_shares=True)).reasons


def test_the_even_pipeline_counts_are_the_counts_even_shares_can_choose() -> None:
    """Every count `pipeline_count` chooses with ``even_shares``, for any number of nodes, is one of
    `even_pipeline_counts`, and every one of those is chosen for some number of nodes."""
    from bamboo.reconfig import even_pipeline_counts, pipeline_count

    assert even_pipeline_counts(16, 4) == (4, 2, 1)
    assert even_pipeline_counts(64, 8) == (8, 4, 2, 1)
    assert even_pipeline_counts(12, 4) == (4, 3, 2, 1)
    assert even_pipeline_counts(3, 8) == (3, 1)  # never more pipelines than microbatches
    for global_batch, target in [(16, 4), (64, 8), (15, 3), (12, 4), (7, 8)]:
        chosen = {pipeline_count(usable, 2, target, global_batch, even_shares=True) for usable in range(2, 2 * target + 3)}
        assert chosen == set(even_pipeline_counts(global_batch, target)), (global_batch, target)
    with pytest.raises(ValueError, match="got 0 and 4"):
        even_pipeline_counts(0, 4)
