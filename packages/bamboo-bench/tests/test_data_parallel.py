"""Pure data parallelism (P = 1) in the simulator: the ring of replicas, hand-computed runs, profile checks.

The `dp` profile: 4 replicas (stages=1), 40 samples per step, steps of 4000/d ms with d replicas (1 s with
4), so d replicas train 10 * d samples/s. Timing as the `tiny_profile`: nodes ready 10 s after they are
added, global rendezvous 5 s, local 2 s, reconfiguration 3 s, failover pause 4 s, fallback x1.5, restart
20 s, checkpoints every 100 s of training. Nodes added at 0 form the ring at 18 s (10 + 5 + 3).
"""

from __future__ import annotations

import itertools
import json
import math
from collections import Counter
from pathlib import Path

import attrs
import pytest
from bamboo.bench.policy import NOT_A_HOLDER, is_consecutive_replica_failure, plan_replica_ring, reconfigures
from bamboo.bench.profile import ModelProfile, ProfileError, Timing, load_profile
from bamboo.bench.simulator import Policy, Strategy, holding_at_most, simulate_run
from bamboo.bench.sweep import sweep
from bamboo.bench.trace import EventKind, Trace, TraceEvent
from hypothesis import given, settings
from hypothesis import strategies as st

TIMING = Timing(
    instance_creation_s=10.0, global_rendezvous_s=5.0, local_rendezvous_s=2.0, reconfiguration_s=3.0,
    failover_pause_s=4.0, fallback_slowdown=1.5, restart_s=20.0, checkpoint_interval_s=100.0,
)


@pytest.fixture(scope="module")
def dp() -> ModelProfile:
    return ModelProfile(
        name="dp", stages=1, pipelines=4, samples_per_step=40,
        step_time_ms={(1, d): 4000.0 / d for d in range(1, 5)},
        spot_price_per_node_hour=1.0, on_demand_price_per_node_hour=3.0, on_demand_nodes=4,
        on_demand_samples_per_second=40.0, job_samples=1e9, timing=TIMING,
    )


def cluster(zones: str, removals: list[tuple[float, int]] = (), duration: float = 1000.0) -> Trace:
    events = [TraceEvent(0.0, EventKind.ADD, f"n{i}", zone) for i, zone in enumerate(zones)]
    events += [TraceEvent(t, EventKind.REMOVE, f"n{i}", zones[i]) for t, i in removals]
    return Trace.from_events("dp", events, duration_s=duration)


def run(trace: Trace, profile: ModelProfile, strategy: Strategy = Strategy.BAMBOO, zone_aware: bool = False):
    return simulate_run(trace, profile, strategy, policy=Policy(zone_aware=zone_aware), target_samples=math.inf,
                        until_s=trace.duration_s, record=True)


# ------------------------------------------------------------------------------------ hand-computed runs
def test_losing_one_replica_is_a_failover_not_a_restart(dp: ModelProfile) -> None:
    result = run(cluster("aaaa", [(500, 1)]), dp)
    # 18-500 at 40/s; failover pause 500-504; one fallback step (1.5 s, 40 samples); the rebuild after the
    # failover, local rendezvous + reconfiguration 505.5-510.5; then 3 replicas at 30/s until 1000.
    assert result.samples == pytest.approx(482 * 40 + 40 + 489.5 * 30)
    assert result.fatal_failures == 0
    assert result.reconfigurations == 2
    assert result.progress_share == pytest.approx((482 + 1.5 + 489.5) / 1000)


def test_losing_ring_neighbours_is_a_consecutive_failure_rebuilt_from_a_survivor(dp: ModelProfile) -> None:
    # Zone-blind, the ring is n0-n1-n2-n3 (id order). n2 goes during n1's failover pause: its ring
    # neighbour is lost, so the step's shares of n1 and n2 have no copy. Fatal, but n0 and n3 hold the
    # model: no rollback, a global rendezvous (500-510 counting from the second loss at 502), 2 replicas.
    result = run(cluster("aaaa", [(500, 1), (502, 2)]), dp)
    assert result.fatal_failures == 1
    assert result.samples == pytest.approx(482 * 40 + 490 * 20)


def test_losing_two_replicas_that_are_not_neighbours_is_a_failover(dp: ModelProfile) -> None:
    result = run(cluster("aaaa", [(500, 0), (500, 2)]), dp)
    assert result.fatal_failures == 0
    assert result.samples == pytest.approx(482 * 40 + 40 + 489.5 * 20)


def test_zone_aware_ring_survives_a_whole_zone(dp: ModelProfile) -> None:
    # Zones a, a, b, b. Zone-aware, the ring alternates zones (n0, n2, n1, n3), so losing zone a (n0 and
    # n1 at one instant) loses no two neighbours; zone-blind (n0, n1, n2, n3) it is a consecutive failure.
    aware = run(cluster("aabb", [(500, 0), (500, 1)]), dp, zone_aware=True)
    blind = run(cluster("aabb", [(500, 0), (500, 1)]), dp, zone_aware=False)
    assert aware.fatal_failures == 0
    assert aware.samples == pytest.approx(482 * 40 + 40 + 489.5 * 20)
    assert blind.fatal_failures == 1
    assert blind.samples == pytest.approx(482 * 40 + 492 * 20)


def test_the_last_replica_lost_rolls_back_to_the_checkpoint(dp: ModelProfile) -> None:
    two = attrs.evolve(dp, pipelines=2)
    # Two replicas at 20/s from 18 s. n0 lost at 500: failover pause to 504, one fallback step (3 s), the
    # rebuild 507-512 finds one node: a ring of one, at 10/s. n1 lost at 700: a lone replica has no shadow,
    # so the model is gone: back to the checkpoint taken after 600 s of training (482 s at 20/s, the 3 s
    # fallback step's 40 samples, 115 s at 10/s), and no node is left.
    result = run(cluster("ab", [(500, 0), (700, 1)]), two)
    assert result.fatal_failures == 1
    assert result.samples == pytest.approx(482 * 20 + 40 + 115 * 10)
    assert result.progress_share == pytest.approx(600 / 1000)


def test_strategies_without_redundancy_run_on_their_own_cluster(dp: ModelProfile) -> None:
    # Over-provisioned like the paper's data-parallel runs: Bamboo wants 4 replicas, checkpoint/restart and
    # sample dropping 2, with steps of 1500/d ms (2 replicas: 0.75 s, 53.3 samples/s).
    profile = attrs.evolve(dp, pipelines_without_redundancy=2,
                           step_time_ms_without_redundancy={(1, 1): 1500.0, (1, 2): 750.0})
    assert profile.desired_nodes_for(redundancy=False) == 2 and profile.desired_nodes == 4
    checkpoint = run(cluster("abab"), profile, Strategy.CHECKPOINT)
    # Checkpoint/restart forms after the global rendezvous and its restart (10 + 5 + 20 s).
    assert checkpoint.samples == pytest.approx(965 * 40 / 0.75)
    dropping = run(cluster("abab"), profile, Strategy.SAMPLE_DROPPING)
    assert dropping.samples == pytest.approx(982 * 40 / 0.75)
    assert run(cluster("abab"), profile).samples == pytest.approx(982 * 40)


def test_sweep_gives_each_strategy_its_own_cluster(dp: ModelProfile) -> None:
    profile = attrs.evolve(dp, pipelines=6, step_time_ms={(1, d): 4000.0 / d for d in range(1, 7)},
                           pipelines_without_redundancy=4, job_samples=200_000.0)
    bamboo = sweep(profile, [0.1], 3, workers=1)[0].result
    checkpoint = sweep(profile, [0.1], 3, strategy=Strategy.CHECKPOINT, workers=1)[0].result
    assert bamboo.completed_runs == checkpoint.completed_runs == 3
    assert 4.0 < bamboo.nodes <= 6.0
    assert checkpoint.nodes <= 4.0


def test_check_policy_refuses_one_stage(dp: ModelProfile) -> None:
    with pytest.raises(ValueError, match="at least 2 stages; got strategy 'bamboo' with 1 stage"):
        simulate_run(cluster("abab"), dp, Strategy.BAMBOO, check_policy=True)


# ----------------------------------------------------------------------------------------- the ring
def same_zone_pairs(zones: list[int]) -> int:
    return sum(1 for i in range(len(zones)) if len(zones) > 1 and zones[i] == zones[(i + 1) % len(zones)])


@settings(max_examples=200, deadline=None)
@given(
    zones=st.lists(st.integers(0, 3), min_size=0, max_size=9),
    held=st.lists(st.booleans(), min_size=9, max_size=9),
    pipelines=st.integers(2, 8),
)
def test_replica_ring_has_the_fewest_same_zone_neighbours(zones: list[int], held: list[bool], pipelines: int) -> None:
    usable = [(10 * i + 7, zone, 0 if held[i] else NOT_A_HOLDER) for i, zone in enumerate(zones)]
    owners = plan_replica_ring(usable, pipelines)
    ring = min(pipelines, len(usable))
    assert len(owners) == ring and all(len(row) == 1 for row in owners)
    chosen = [row[0] for row in owners]
    assert len(set(chosen)) == ring and set(chosen) <= {node for node, _, _ in usable}
    zone_of = {node: zone for node, zone, _ in usable}
    ring_zones = [zone_of[node] for node in chosen]
    # The ring reaches the fewest same-zone pairs of any ring of `ring` usable nodes (brute force over zone
    # sequences that the usable zone counts allow, for rings of up to 6).
    if ring <= 6:
        available = Counter(zones)
        best = min(
            (same_zone_pairs(list(sequence)) for sequence in itertools.product(sorted(available), repeat=ring)
             if all(Counter(sequence)[zone] <= count for zone, count in available.items())),
            default=0,
        )
        assert same_zone_pairs(ring_zones) == best
    # Among choices with as few pairs, nodes that hold the model come first: a non-holder runs only if the
    # holders of its zone all run.
    counts = Counter(ring_zones)
    bound = sum(max(0, 2 * c - ring) for c in counts.values()) if ring > 1 else 0
    assert same_zone_pairs(ring_zones) == bound
    for node, zone, stage in usable:
        if stage == NOT_A_HOLDER and node in chosen:
            assert all(other in chosen for other, z, s in usable if z == zone and s != NOT_A_HOLDER)


def test_replica_ring_alternates_zones_and_is_deterministic() -> None:
    usable = [(n, zone, NOT_A_HOLDER) for n, zone in [(1, 0), (2, 0), (3, 0), (4, 1), (5, 1), (6, 2)]]
    owners = plan_replica_ring(usable, 6)
    assert owners == [[1], [4], [2], [5], [3], [6]]
    assert plan_replica_ring(list(reversed(usable)), 6) == owners
    assert plan_replica_ring(usable, 2) == [[1], [4]]
    assert plan_replica_ring([], 3) == []


def test_consecutive_replica_failure_is_a_lost_ring_neighbour() -> None:
    assert is_consecutive_replica_failure({(3, 0)}, 0, 4)  # predecessor (ring wraps)
    assert is_consecutive_replica_failure({(1, 0)}, 0, 4)  # successor, the shadow
    assert not is_consecutive_replica_failure({(2, 0)}, 0, 4)
    assert not is_consecutive_replica_failure(set(), 1, 2)
    assert is_consecutive_replica_failure({(0, 0)}, 1, 2)
    assert is_consecutive_replica_failure(set(), 0, 1)  # a lone replica has no shadow
    # The decision's when holds for P = 1 unchanged: rebuild after a failover, grow when nodes wait.
    assert reconfigures({(0, 0)}, 4, 1, 4, 3, 0)
    assert reconfigures(set(), 3, 1, 4, 4, 1)
    assert not reconfigures(set(), 4, 1, 4, 5, 1)


# ------------------------------------------------------------------------------------------ profiles
def _dp_document() -> dict:
    return {
        "format": 1, "name": "mine", "stages": 1, "pipelines": 3, "samples_per_step": 30,
        "step_time_ms": [{"stages": 1, "pipelines": d, "ms": 3000 / d} for d in (1, 2, 3)],
        "prices": {"spot_per_node_hour": 1, "on_demand_per_node_hour": 3},
        "on_demand": {"nodes": 2, "samples_per_second": 20}, "job_samples": 1000,
        "without_redundancy": {"pipelines": 2, "step_time_ms": [{"stages": 1, "pipelines": d, "ms": 1500 / d}
                                                                 for d in (1, 2)]},
    }


def test_data_parallel_profile_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "mine.json"
    path.write_text(json.dumps(_dp_document()))
    profile = load_profile(path)
    assert profile.pipelines_for(redundancy=False) == 2
    assert profile.step_time_s(2, redundancy=False) == pytest.approx(0.75)
    assert profile.step_time_s(2) == pytest.approx(1.5)
    assert ModelProfile.from_dict(profile.to_dict(), "again") == profile


@pytest.mark.parametrize(
    ("change", "words"),
    [
        (lambda d: d.update(pipelines=1, step_time_ms=d["step_time_ms"][:1]),
         "a pure data-parallel profile (stages=1) needs pipelines >= 2, because each replica's shadow is its ring "
         "successor; got pipelines=1"),
        (lambda d: d["without_redundancy"].update(pipelines=3),
         "without_redundancy.step_time_ms has no step time for stages=1, pipelines=3"),
        (lambda d: d["without_redundancy"].update(stages=1), "unknown without_redundancy keys ['stages']"),
        (lambda d: d.update(without_redundancy=[2]), "'without_redundancy' must be an object, got [2]"),
        (lambda d: d["without_redundancy"].update(pipelines=0), "'pipelines_without_redundancy' must be > 0: 0"),
        (lambda d: d["step_time_ms"].append({"stages": 1, "pipelines": 2, "ms": 9}),
         "step_time_ms[3] repeats stages=1, pipelines=2"),
        (lambda d: d["without_redundancy"]["step_time_ms"][0].update(ms=-1),
         "without_redundancy.step_time_ms step time for (1, 1) must be > 0, got -1.0"),
    ],
)
def test_inconsistent_data_parallel_profiles_name_the_problem(tmp_path: Path, change, words: str) -> None:
    document = _dp_document()
    change(document)
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    with pytest.raises(ProfileError) as caught:
        load_profile(path)
    assert str(caught.value).startswith(f"{path}: ")
    assert words in str(caught.value)


# ------------------------------------------------------------------- holding a trace's instances
def test_holding_at_most_takes_new_instances_only_below_the_desired_size() -> None:
    events = [(0.0, True, 0, 0), (0.0, True, 1, 0), (0.0, True, 2, 0), (10.0, False, 2, 0), (20.0, False, 0, 0),
              (30.0, True, 3, 0), (40.0, True, 4, 0), (50.0, False, 1, 0)]
    # 2 is declined (its removal dropped), 0's loss makes room for 3, 4 is declined, 1 leaves.
    assert list(holding_at_most(events, 2)) == [(0.0, True, 0, 0), (0.0, True, 1, 0), (20.0, False, 0, 0),
                                                (30.0, True, 3, 0), (50.0, False, 1, 0)]
    assert list(holding_at_most(events, 5)) == events
    with pytest.raises(ValueError, match="desired_nodes must be >= 1, got 0"):
        list(holding_at_most(events, 0))


def test_a_strategy_holding_its_desired_cluster_pays_only_for_it(dp: ModelProfile) -> None:
    # Checkpointing wants 2 replicas (the cluster without redundancy), Bamboo 4; the trace offers 6 at once.
    small = attrs.evolve(dp, pipelines_without_redundancy=2, step_time_ms_without_redundancy={
        (1, d): 2000.0 / d for d in range(1, 3)})
    trace = cluster("aaaaaa", [(600, 0), (700, 5)])
    held = {s: simulate_run(trace, small, s, policy=Policy(zone_aware=False), target_samples=math.inf,
                            until_s=trace.duration_s, desired_nodes=small.desired_nodes_for(s is Strategy.BAMBOO))
            for s in (Strategy.BAMBOO, Strategy.CHECKPOINT)}
    every = run(trace, small, Strategy.CHECKPOINT)
    # Every node of the trace: 6 nodes to 600 s, 5 to 700 s, 4 after; holding 2: both until n0 goes at 600.
    assert every.nodes == pytest.approx((6 * 600 + 5 * 100 + 4 * 300) / 1000)
    assert held[Strategy.CHECKPOINT].nodes == pytest.approx((2 * 600 + 1 * 400) / 1000)
    assert held[Strategy.CHECKPOINT].preemptions == 1
    # Bamboo holds n0..n3: it loses n0 at 600 and n5's removal is not its own.
    assert held[Strategy.BAMBOO].nodes == pytest.approx((4 * 600 + 3 * 400) / 1000)
    assert held[Strategy.BAMBOO].preemptions == 1
    # Holding fewer nodes changes what is billed, not what is trained while they are the same nodes.
    assert held[Strategy.CHECKPOINT].value > every.value
