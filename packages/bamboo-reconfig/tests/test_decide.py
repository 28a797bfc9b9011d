"""decide(view): each trigger, its urgency and its reason."""

from __future__ import annotations

import pytest
from bamboo.reconfig import ClusterView, Decision, NodeState, Reason, When, decide, plan_layout


@pytest.fixture
def healthy(build):
    """2 pipelines of 4 stages over zones a, b (all active), target D = 3, plus the nodes."""
    nodes = build.zoned_nodes(8, "ab")
    view = ClusterView(nodes=nodes, target_stages=4, target_pipelines=3, global_batch=12,
                       layers=build.uniform_layers(8))
    return plan_layout(view), nodes


def test_no_layout_means_configure_now(build) -> None:
    view = ClusterView(nodes=build.zoned_nodes(4), target_stages=2, target_pipelines=2, global_batch=4,
                       layers=build.uniform_layers(4))
    decision = decide(view)
    assert (decision.when, decision.reason) == (When.NOW, Reason.NO_LAYOUT)


def test_whole_pipelines_carry_on(build, healthy) -> None:
    layout, nodes = healthy
    decision = decide(build.view_after(layout, nodes, target_pipelines=3))
    assert (decision.when, decision.reason) == (When.CARRY_ON, Reason.ALL_PIPELINES_WHOLE)
    assert not decision.reconfigure


def test_a_failover_without_a_replacement_rebuilds_redundancy_at_the_boundary(build, healthy) -> None:
    layout, nodes = healthy
    victim = layout.owner(1, 2)
    after = build.view_after(layout, build.with_states(nodes, {victim: "preempted"}))
    decision = decide(after)
    # stage 2 runs on its shadow (stage 1's owner): stages 2 and 3 have no shadow until the next layout
    assert (decision.when, decision.reasons) == (When.NEXT_STEP_BOUNDARY, (Reason.REBUILD_REDUNDANCY,))
    assert decision.pipelines == (1,)
    assert decision.detail.startswith("rebuild redundancy after a failover: pipeline 1: stage(s) 2 lost")
    # the launcher records the reason by its value, word for word
    assert Reason.REBUILD_REDUNDANCY.value == "rebuild redundancy after a failover"
    assert Decision.from_json(decision.to_json()) == decision
    # the rebuilt layout: one pipeline of the 7 survivors, the other 3 in standby, nobody preempted
    new = plan_layout(after)
    assert (new.num_pipelines, len(new.standby)) == (1, 3)
    assert victim not in {node for row in new.owners for node in row}


def test_a_rebuilt_layout_carries_on(build, healthy) -> None:
    layout, nodes = healthy
    after = build.view_after(layout, build.with_states(nodes, {layout.owner(1, 2): "preempted"}))
    new = plan_layout(after)
    survivors = [node for node in after.nodes if node.state is not NodeState.PREEMPTED]
    standby = {node: "standby" for node in new.standby}
    decision = decide(build.view_after(new, build.with_states(survivors, standby), target_pipelines=2))
    assert (decision.when, decision.reasons) == (When.CARRY_ON, (Reason.ALL_PIPELINES_WHOLE,))


def test_a_shadow_carrying_two_stages_with_a_replacement_waiting_reconfigures_at_the_boundary(build, healthy) -> None:
    layout, nodes = healthy
    victim = layout.owner(1, 2)
    spare = build.zoned_nodes(1, "c", state="joining", prefix="spare")
    view = build.view_after(layout, [*build.with_states(nodes, {victim: "preempted"}), *spare])
    decision = decide(view)
    assert (decision.when, decision.reasons) == (
        When.NEXT_STEP_BOUNDARY, (Reason.SHADOW_CARRYING_TWO_STAGES, Reason.REBUILD_REDUNDANCY))
    assert "stage(s) 2 carried by their shadows" in decision.detail
    assert decision.pipelines == (1,)


@pytest.mark.parametrize(("first", "second"), [(1, 2), (3, 0), (0, 3)])
def test_consecutive_failure_reconfigures_now(build, healthy, first: int, second: int) -> None:
    layout, nodes = healthy
    dead = {layout.owner(0, first): "preempted", layout.owner(0, second): "preempted"}
    decision = decide(build.view_after(layout, build.with_states(nodes, dead)))
    # the consecutive failure comes first; every failover also calls for the rebuild
    assert (decision.when, decision.reasons) == (When.NOW, (Reason.CONSECUTIVE_FAILURE, Reason.REBUILD_REDUNDANCY))
    assert decision.pipelines == (0,)


def test_non_consecutive_failures_that_leave_no_safe_node_reconfigure_at_the_boundary(build, healthy) -> None:
    layout, nodes = healthy
    dead = {layout.owner(0, 0): "preempted", layout.owner(0, 2): "preempted"}
    decision = decide(build.view_after(layout, build.with_states(nodes, dead)))
    assert (decision.when, decision.reasons) == (
        When.NEXT_STEP_BOUNDARY, (Reason.ONE_MORE_FAILURE_FATAL, Reason.REBUILD_REDUNDANCY))


def test_a_two_stage_pipeline_is_fragile_after_one_failure(build) -> None:
    nodes = build.zoned_nodes(4, "ab")
    layout = plan_layout(ClusterView(nodes=nodes, target_stages=2, target_pipelines=2, global_batch=4,
                                     layers=build.uniform_layers(4)))
    decision = decide(build.view_after(layout, build.with_states(nodes, {layout.owner(1, 0): "preempted"})))
    assert decision.reasons == (Reason.ONE_MORE_FAILURE_FATAL, Reason.REBUILD_REDUNDANCY)


def test_waiting_nodes_that_can_form_a_pipeline_reconfigure_at_the_boundary(build, healthy) -> None:
    layout, nodes = healthy
    joiners = build.zoned_nodes(3, "ab", state="joining", prefix="j")
    assert decide(build.view_after(layout, [*nodes, *joiners], target_pipelines=3)).reason is Reason.ALL_PIPELINES_WHOLE
    joiners = build.zoned_nodes(4, "ab", state="joining", prefix="j")
    decision = decide(build.view_after(layout, [*nodes, *joiners], target_pipelines=3))
    assert (decision.when, decision.reasons) == (When.NEXT_STEP_BOUNDARY, (Reason.NEW_PIPELINE,))
    assert "instead of 2" in decision.detail
    # at the target D already, joiners only wait in standby
    assert decide(build.view_after(layout, [*nodes, *joiners], target_pipelines=2)).when is When.CARRY_ON


def test_decision_round_trips_and_validates(build, healthy) -> None:
    layout, nodes = healthy
    decision = decide(build.view_after(layout, nodes))
    assert type(decision).from_json(decision.to_json()) == decision
    with pytest.raises(ValueError, match="at least one reason"):
        type(decision)(When.NOW, [], "x")
    with pytest.raises(ValueError, match="'soon'"):
        type(decision)("soon", [Reason.NO_LAYOUT], "x")


def test_waiting_nodes_that_restore_the_target_depth_reconfigure_at_the_boundary(build) -> None:
    nodes = build.zoned_nodes(3, "ab")
    layout = plan_layout(ClusterView(nodes=nodes, target_stages=4, target_pipelines=1, global_batch=4,
                                     layers=build.uniform_layers(8)))
    assert (layout.stages, layout.num_pipelines) == (3, 1)
    joiner = build.zoned_nodes(1, "c", state="joining", prefix="j")
    after = build.view_after(layout, [*nodes, *joiner], target_stages=4)
    decision = decide(after)
    assert decision.reasons == (Reason.NEW_PIPELINE,)
    assert "1 pipeline(s) of 4 stages, back towards the target depth, instead of 1 of 3" in decision.detail
    assert plan_layout(after).stages == 4


def test_every_reason_that_holds_is_listed_in_order(build, healthy) -> None:
    layout, nodes = healthy
    # pipeline 0 loses stages 0 and 2 (no safe survivor left), pipeline 1 loses stage 1; 7 nodes join
    dead = {layout.owner(0, 0): "preempted", layout.owner(0, 2): "preempted", layout.owner(1, 1): "preempted"}
    joiners = build.zoned_nodes(7, "ab", state="joining", prefix="j")
    decision = decide(build.view_after(layout, [*build.with_states(nodes, dead), *joiners], target_pipelines=3))
    assert decision.when is When.NEXT_STEP_BOUNDARY
    assert decision.reasons == (Reason.ONE_MORE_FAILURE_FATAL, Reason.SHADOW_CARRYING_TWO_STAGES,
                                Reason.NEW_PIPELINE, Reason.REBUILD_REDUNDANCY)
    assert decision.pipelines == (0, 1)
    assert "pipeline 0: stage(s) 0, 2 lost; pipeline 1: stage(s) 1 lost" in decision.detail


def test_p1_a_lost_node_is_a_failover_and_only_losing_every_node_is_consecutive(build) -> None:
    nodes = build.zoned_nodes(3, "abc")
    view = ClusterView(nodes=nodes, target_stages=1, target_pipelines=3, global_batch=12,
                       layers=build.uniform_layers(4))
    layout = plan_layout(view)
    assert (layout.stages, layout.num_pipelines, layout.microbatches) == (1, 3, (4, 4, 4))
    one = build.view_after(layout, build.with_states(nodes, {layout.owner(1, 0): "preempted"}))
    decision = decide(one)
    assert (decision.when, decision.reasons) == (When.NEXT_STEP_BOUNDARY, (Reason.REBUILD_REDUNDANCY,))
    rebuilt = plan_layout(one)
    assert (rebuilt.num_pipelines, rebuilt.microbatches) == (2, (6, 6))  # the global batch is kept
    two = build.with_states(nodes, {layout.owner(0, 0): "preempted", layout.owner(1, 0): "preempted"})
    assert decide(build.view_after(layout, two)).when is When.NEXT_STEP_BOUNDARY  # ring neighbours: one is left
    every = build.with_states(nodes, {row[0]: "preempted" for row in layout.owners})
    assert decide(build.view_after(layout, every)).reason is Reason.CONSECUTIVE_FAILURE


@pytest.mark.parametrize(("zones", "pipelines", "expected"), [("aabbcc", 6, 0), ("aaaabb", 6, 2), ("aabb", 4, 0)])
def test_p1_the_shadow_ring_over_the_pipelines_is_zone_aware(
    build, zones: str, pipelines: int, expected: int
) -> None:
    """With one stage, pipeline d's shadow is pipeline d + 1's node: consecutive pipelines sit in different zones."""
    nodes = [build.zoned_nodes(1, zone, prefix=f"n{i}")[0] for i, zone in enumerate(zones)]
    view = ClusterView(nodes=nodes, target_stages=1, target_pipelines=pipelines, global_batch=12,
                       layers=build.uniform_layers(4))
    layout = plan_layout(view)
    zone_of = {node.id: node.zone for node in nodes}
    ring = [zone_of[row[0]] for row in layout.owners]
    same = sum(1 for d in range(len(ring)) if ring[d] == ring[(d + 1) % len(ring)])
    assert len(ring) == pipelines
    assert same == expected == layout.same_zone_neighbours  # the fewest possible: max(0, 2 * 4 - 6) for "aaaabb"
