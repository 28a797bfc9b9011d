"""decide(view): each trigger, its urgency and its reason."""

from __future__ import annotations

import pytest
from bamboo.reconfig import ClusterView, Reason, When, decide, plan_layout


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


def test_a_failure_absorbed_by_its_shadow_carries_on_without_a_replacement(build, healthy) -> None:
    layout, nodes = healthy
    victim = layout.owner(1, 2)
    decision = decide(build.view_after(layout, build.with_states(nodes, {victim: "preempted"})))
    assert (decision.when, decision.reason) == (When.CARRY_ON, Reason.FAILURES_ABSORBED)
    assert decision.pipelines == (1,)


def test_a_shadow_carrying_two_stages_with_a_replacement_waiting_reconfigures_at_the_boundary(build, healthy) -> None:
    layout, nodes = healthy
    victim = layout.owner(1, 2)
    spare = build.zoned_nodes(1, "c", state="joining", prefix="spare")
    view = build.view_after(layout, [*build.with_states(nodes, {victim: "preempted"}), *spare])
    decision = decide(view)
    assert (decision.when, decision.reason) == (When.NEXT_STEP_BOUNDARY, Reason.SHADOW_CARRYING_TWO_STAGES)
    assert "stage(s) 2 carried by their shadows" in decision.detail


@pytest.mark.parametrize(("first", "second"), [(1, 2), (3, 0), (0, 3)])
def test_consecutive_failure_reconfigures_now(build, healthy, first: int, second: int) -> None:
    layout, nodes = healthy
    dead = {layout.owner(0, first): "preempted", layout.owner(0, second): "preempted"}
    decision = decide(build.view_after(layout, build.with_states(nodes, dead)))
    assert (decision.when, decision.reason) == (When.NOW, Reason.CONSECUTIVE_FAILURE)
    assert decision.pipelines == (0,)


def test_non_consecutive_failures_that_leave_no_safe_node_reconfigure_at_the_boundary(build, healthy) -> None:
    layout, nodes = healthy
    dead = {layout.owner(0, 0): "preempted", layout.owner(0, 2): "preempted"}
    decision = decide(build.view_after(layout, build.with_states(nodes, dead)))
    assert (decision.when, decision.reason) == (When.NEXT_STEP_BOUNDARY, Reason.ONE_MORE_FAILURE_FATAL)


def test_a_two_stage_pipeline_is_fragile_after_one_failure(build) -> None:
    nodes = build.zoned_nodes(4, "ab")
    layout = plan_layout(ClusterView(nodes=nodes, target_stages=2, target_pipelines=2, global_batch=4,
                                     layers=build.uniform_layers(4)))
    decision = decide(build.view_after(layout, build.with_states(nodes, {layout.owner(1, 0): "preempted"})))
    assert decision.reasons == (Reason.ONE_MORE_FAILURE_FATAL,)


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
