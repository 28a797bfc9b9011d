"""The simulator runs the system's policy: its fast path equals bamboo-reconfig's decide and plan_layout.

Three levels, all with hypothesis:

- `plan_placement` against ``plan_layout(system_view(...))`` on random clusters: nodes, zones, a random
  current layout with preempted owners, P and D, zone-aware or zone-blind (the same nodes, the same slots);
- `decision` against ``decide(system_view(...))`` on the same clusters (the same when and reasons), and
  `reconfigures` against its when;
- whole simulated runs with ``check_policy=True`` on random traces and synthetic streams, which ask
  bamboo-reconfig for every placement and decision the run makes and fail on the first difference.
"""

from __future__ import annotations

import math

import attrs
import pytest
from bamboo.bench import placement, sim_engine
from bamboo.bench.policy import NOT_A_HOLDER, decision, plan_placement, reconfigures, system_view
from bamboo.bench.profile import ModelProfile, Timing
from bamboo.bench.simulator import Policy, PolicyMismatch, Strategy, simulate_run, simulate_synthetic
from bamboo.bench.synthetic import SyntheticSpec
from bamboo.bench.trace import EventKind, Trace, TraceEvent
from bamboo.reconfig import InfeasibleSplit, Reason, When, decide, plan_layout
from hypothesis import given, settings
from hypothesis import strategies as st


@attrs.frozen
class Cluster:
    """A simulator state: the current layout (dead owners included), the live nodes, their zones."""

    stages: int
    pipelines: int
    owners: list[list[int]]
    alive: list[int]
    zone_of: dict[int, int]

    def usable(self, zone_aware: bool) -> list[tuple[int, int, int]]:
        slot = {node: stage for row in self.owners for stage, node in enumerate(row)}
        return [(node, self.zone_of[node] if zone_aware else 0, slot.get(node, NOT_A_HOLDER)) for node in self.alive]


@st.composite
def clusters(draw: st.DrawFn, need_layout: bool = False) -> Cluster:
    stages = draw(st.integers(2, 7))
    pipelines = draw(st.integers(1, 4))
    zones = draw(st.integers(1, 4))
    count = draw(st.integers(stages if need_layout else 0, 3 * stages * pipelines))
    nodes = draw(st.lists(st.integers(0, 10**6), min_size=count, max_size=count, unique=True))
    zone_of = dict(zip(nodes, draw(st.lists(st.integers(0, zones - 1), min_size=count, max_size=count)), strict=True))
    most = min(pipelines, count // stages)
    rows = draw(st.integers(1 if need_layout else 0, most)) if most else 0
    order = draw(st.permutations(nodes))
    owners = [list(order[d * stages:(d + 1) * stages]) for d in range(rows)]
    placed = {node for row in owners for node in row}
    lost = draw(st.lists(st.booleans(), min_size=len(placed), max_size=len(placed)))
    dead = {node for node, gone in zip(sorted(placed), lost, strict=True) if gone}
    alive = [node for node in nodes if node not in dead]
    return Cluster(stages, pipelines, owners, alive, zone_of)


def reference_owners(cluster: Cluster, zone_aware: bool) -> list[list[int]]:
    view = system_view(cluster.owners, cluster.alive, cluster.zone_of, cluster.stages, cluster.pipelines, zone_aware)
    try:
        layout = plan_layout(view)
    except InfeasibleSplit:
        return []
    return [[int(name[1:]) for name in row] for row in layout.owners]


@settings(max_examples=300, deadline=None)
@given(cluster=clusters(), zone_aware=st.booleans())
def test_placement_equals_plan_layout(cluster: Cluster, zone_aware: bool) -> None:
    fast = plan_placement(cluster.usable(zone_aware), cluster.stages, cluster.pipelines)
    assert fast == reference_owners(cluster, zone_aware)


@settings(max_examples=300, deadline=None)
@given(cluster=clusters(need_layout=True), zone_aware=st.booleans())
def test_decision_equals_decide(cluster: Cluster, zone_aware: bool) -> None:
    slot = {node: (d, s) for d, row in enumerate(cluster.owners) for s, node in enumerate(row)}
    alive = set(cluster.alive)
    dead = {where for node, where in slot.items() if node not in alive}
    waiting = len(alive - slot.keys())
    when, reasons = decision(dead, len(cluster.owners), cluster.stages, cluster.pipelines, len(alive), waiting)
    expected = decide(
        system_view(cluster.owners, cluster.alive, cluster.zone_of, cluster.stages, cluster.pipelines, zone_aware)
    )
    assert (when, reasons) == (expected.when, expected.reasons), expected.detail
    reconfigure = reconfigures(dead, len(cluster.owners), cluster.stages, cluster.pipelines, len(alive), waiting)
    assert reconfigure == (expected.when is not When.CARRY_ON)
    # the system's policy rebuilds redundancy after every failover
    assert (Reason.REBUILD_REDUNDANCY in reasons) == bool(dead)


def test_the_depth_is_never_lowered() -> None:
    # Five usable nodes for P=6: plan_layout would lower P if memory allowed; the view's node memory does
    # not, so no pipeline forms (the profile has step times for depth P only).
    cluster = Cluster(6, 2, [], list(range(5)), dict.fromkeys(range(5), 0))
    assert plan_placement(cluster.usable(True), 6, 2) == []
    with pytest.raises(InfeasibleSplit):
        plan_layout(system_view([], cluster.alive, cluster.zone_of, 6, 2))


def small_profile(stages: int, pipelines: int) -> ModelProfile:
    """`pipelines` x `stages` nodes; steps of 1 s with every pipeline, longer with fewer."""
    return ModelProfile(
        name=f"small-{pipelines}x{stages}", stages=stages, pipelines=pipelines, samples_per_step=10,
        step_time_ms={(stages, d): 1000.0 * pipelines / d for d in range(1, pipelines + 1)},
        spot_price_per_node_hour=1.0, on_demand_price_per_node_hour=3.0, on_demand_nodes=stages * pipelines,
        on_demand_samples_per_second=10.0, job_samples=1e9,
        timing=Timing(instance_creation_s=10.0, global_rendezvous_s=5.0, local_rendezvous_s=2.0,
                      reconfiguration_s=3.0, failover_pause_s=4.0, checkpoint_interval_s=100.0),
    )


@st.composite
def traces(draw: st.DrawFn) -> tuple[Trace, int, int]:
    stages = draw(st.integers(2, 4))
    pipelines = draw(st.integers(1, 3))
    zones = "abcd"[: draw(st.integers(1, 4))]
    count = draw(st.integers(stages, stages * pipelines + 6))
    events = []
    for node in range(count):
        added = draw(st.floats(0.0, 1500.0, allow_nan=False)) if node >= stages else 0.0
        zone = draw(st.sampled_from(zones))
        events.append(TraceEvent(added, EventKind.ADD, f"n{node}", zone))
        if draw(st.booleans()):
            # removals bunch in time (bulks) when they share a drawn instant
            removed = added + draw(st.sampled_from([0.0, 5.0, 30.0, 200.0])) + draw(st.integers(0, 3)) * 100.0
            events.append(TraceEvent(removed, EventKind.REMOVE, f"n{node}", zone))
    return Trace.from_events("random", events, duration_s=2500.0), stages, pipelines


@settings(max_examples=120, deadline=None)
@given(case=traces(), zone_aware=st.booleans())
def test_every_placement_and_decision_of_a_run_is_bamboo_reconfigs(case: tuple[Trace, int, int], zone_aware: bool) -> None:
    trace, stages, pipelines = case
    result = simulate_run(trace, small_profile(stages, pipelines), Strategy.BAMBOO, policy=Policy(zone_aware=zone_aware),
                          target_samples=math.inf, until_s=trace.duration_s, check_policy=True)
    assert result.preemptions == int((~trace.is_add).sum())


@pytest.mark.parametrize("seed", range(3))
def test_synthetic_runs_follow_bamboo_reconfig(seed: int) -> None:
    spec = SyntheticSpec(preemption_probability=0.5, desired_nodes=12, zones=3, bulk_mean=2.0)
    profile = attrs.evolve(small_profile(4, 3), job_samples=2e5)
    result = simulate_synthetic(spec, seed, profile, Strategy.BAMBOO, max_hours=30.0, check_policy=True)
    assert result.reconfigurations > 5


def test_check_policy_catches_a_different_placement(monkeypatch: pytest.MonkeyPatch, tiny_profile: ModelProfile) -> None:
    def reversed_rows(usable: list[tuple[int, int, int]], stages: int, pipelines: int) -> list[list[int]]:
        return [row[::-1] for row in placement.plan_placement(usable, stages, pipelines)]

    monkeypatch.setattr(sim_engine, "plan_placement", reversed_rows)
    events = [TraceEvent(0.0, EventKind.ADD, f"n{i}", "ab"[i % 2]) for i in range(8)]
    with pytest.raises(PolicyMismatch, match="the simulator placed"):
        simulate_run(Trace.from_events("t", events, duration_s=100.0), tiny_profile, Strategy.BAMBOO,
                     target_samples=math.inf, until_s=100.0, check_policy=True)


def test_check_policy_catches_a_different_decision(monkeypatch: pytest.MonkeyPatch, tiny_profile: ModelProfile) -> None:
    monkeypatch.setattr(sim_engine, "decision", lambda *args: (When.CARRY_ON, decision(*args)[1]))
    events = [TraceEvent(0.0, EventKind.ADD, f"n{i}", "ab"[i % 2]) for i in range(8)]
    events.append(TraceEvent(50.0, EventKind.ADD, "n8", "a"))
    events.append(TraceEvent(300.0, EventKind.REMOVE, "n1", "b"))
    with pytest.raises(PolicyMismatch, match="the simulator decided carry-on"):
        simulate_run(Trace.from_events("t", events, duration_s=400.0), tiny_profile, Strategy.BAMBOO,
                     target_samples=math.inf, until_s=400.0, check_policy=True)


def test_check_policy_catches_a_shortcut_that_disagrees(monkeypatch: pytest.MonkeyPatch, tiny_profile: ModelProfile) -> None:
    monkeypatch.setattr(sim_engine, "reconfigures", lambda *args: False)
    events = [TraceEvent(0.0, EventKind.ADD, f"n{i}", "ab"[i % 2]) for i in range(8)]
    events.append(TraceEvent(300.0, EventKind.REMOVE, "n1", "b"))
    with pytest.raises(PolicyMismatch, match=r"reconfigures\(\) says False, the decision next-step-boundary"):
        simulate_run(Trace.from_events("t", events, duration_s=400.0), tiny_profile, Strategy.BAMBOO,
                     target_samples=math.inf, until_s=400.0, check_policy=True)
