"""Simulator tests on tiny hand-computed traces (the `tiny_profile` fixture: 2 x 4 nodes, 10 samples per step).

The arithmetic in each test: nodes added at 0 are ready at 10 s; the job forms after the global
rendezvous, 5 s plus 3 s reconfiguration for Bamboo (8 s), or 5 s plus a 20 s restart for
checkpoint/restart (25 s). Two pipelines train 10 samples/s, one pipeline 10/1.5 samples/s, and a
taken-over slot slows the job 1.5x. Checkpoints every 100 s of training.
"""

from __future__ import annotations

import math

import attrs
import pytest
from bamboo.bench.policy import NOT_A_HOLDER, plan_placement
from bamboo.bench.profile import ModelProfile
from bamboo.bench.simulator import Policy, Strategy, average_results, simulate_run
from bamboo.bench.synthetic import SyntheticSpec
from bamboo.bench.trace import EventKind, Trace, TraceEvent

ONE_PIPELINE = 10 / 1.5  # samples/s with one pipeline (and with two pipelines in fallback)


def cluster(zones: str, removals: list[tuple[float, int]] = (), duration: float = 1000.0) -> Trace:
    """Nodes n0..n{k-1} added at 0 in the given zones (one letter each), then the removals (time, node)."""
    events = [TraceEvent(0.0, EventKind.ADD, f"n{i}", zone) for i, zone in enumerate(zones)]
    events += [TraceEvent(t, EventKind.REMOVE, f"n{i}", zones[i]) for t, i in removals]
    return Trace.from_events("tiny", events, duration_s=duration)


def run(trace: Trace, profile: ModelProfile, strategy: Strategy = Strategy.BAMBOO, zone_aware: bool = False):
    return simulate_run(
        trace, profile, strategy, policy=Policy(zone_aware=zone_aware), target_samples=math.inf,
        until_s=trace.duration_s, record=True,
    )


def test_no_preemption(tiny_profile: ModelProfile) -> None:
    result = run(cluster("abababab"), tiny_profile)
    assert result.samples == pytest.approx((1000 - 18) * 10)
    assert result.preemptions == 0
    assert math.isnan(result.interval_h)
    assert result.lifetime_h == pytest.approx(1000 / 3600)
    assert result.nodes == pytest.approx(8)
    assert result.cost_per_hour == pytest.approx(8.0)
    assert result.value == pytest.approx(result.throughput / 8.0)
    assert result.progress_share == pytest.approx(0.982)
    assert result.fatal_failures == 0


def test_no_preemption_until_completion(tiny_profile: ModelProfile) -> None:
    trace = cluster("abababab")
    result = simulate_run(trace, tiny_profile, Strategy.BAMBOO)  # job_samples = 1000
    assert result.completed
    assert result.duration_h * 3600 == pytest.approx(18 + 100)
    assert result.throughput == pytest.approx(1000 / 118)


def test_one_preemption_bamboo(tiny_profile: ModelProfile) -> None:
    result = run(cluster("abababab", [(500, 1)]), tiny_profile)
    # 18-500 at 10/s; failover pause 500-504; one fallback step (1.5 s, 10/1.5 samples/s); then decide
    # rebuilds redundancy after the failover although no node waits: local rendezvous + reconfiguration
    # 505.5-510.5, and the seven survivors run one whole pipeline (three in standby) until the end.
    expected = 482 * 10 + 1.5 * ONE_PIPELINE + 489.5 * ONE_PIPELINE
    assert result.samples == pytest.approx(expected)
    assert result.fatal_failures == 0
    assert result.reconfigurations == 2
    assert result.preemptions == 1
    assert result.nodes == pytest.approx((8 * 500 + 7 * 500) / 1000)
    assert result.lifetime_h == pytest.approx((500 + 7 * 1000) / 8 / 3600)
    assert result.progress_share == pytest.approx((482 + 1.5 + 489.5) / 1000)


def test_one_preemption_checkpoint(tiny_profile: ModelProfile) -> None:
    result = run(cluster("abababab", [(500, 1)]), tiny_profile, Strategy.CHECKPOINT)
    # Training 35-500 (465 s): last checkpoint after 400 s of training, 4000 samples; restart 500-525.
    assert result.samples == pytest.approx(4000 + 475 * ONE_PIPELINE)
    assert result.fatal_failures == 1
    assert result.progress_share == pytest.approx((465 - 65 + 475) / 1000)


def test_one_preemption_sample_dropping(tiny_profile: ModelProfile) -> None:
    result = run(cluster("abababab", [(500, 1)]), tiny_profile, Strategy.SAMPLE_DROPPING)
    # Pipeline 0 drops out: half the samples at the 2-pipeline step time, after a 4 s pause.
    # Seven nodes cannot form two pipelines, so it never reconfigures.
    assert result.samples == pytest.approx(482 * 10 + 496 * 5)
    assert result.fatal_failures == 0


def test_on_demand_ignores_the_trace(tiny_profile: ModelProfile) -> None:
    result = run(cluster("abababab", [(500, 1)]), tiny_profile, Strategy.ON_DEMAND)
    assert result.samples == pytest.approx(12 * 1000)
    assert result.cost_per_hour == pytest.approx(18.0)
    assert result.value == pytest.approx(12 / 18)
    assert result.preemptions == 0


def test_consecutive_pair_is_fatal_but_rebuilt_from_the_other_pipeline(tiny_profile: ModelProfile) -> None:
    # Arrival-order placement: n0..n3 are stages 0..3 of pipeline 0. n2 dies during n1's failover.
    result = run(cluster("abababab", [(500, 1), (502, 2)]), tiny_profile)
    assert result.fatal_failures == 1
    # Pipeline 1 still holds stages 1 and 2, so no rollback: global rendezvous 502-510, then one pipeline.
    assert result.samples == pytest.approx(482 * 10 + 490 * ONE_PIPELINE)
    assert result.progress_share == pytest.approx((482 + 490) / 1000)


def test_a_neighbour_lost_after_the_rebuild_is_an_ordinary_failover(tiny_profile: ModelProfile) -> None:
    # The first loss is rebuilt at 505.5-510.5 (one pipeline: the planner keeps n0, n2, n3 at their
    # stages and gives stage 1 to n4). n2, the lost n1's neighbour, is lost 200 s later: the new layout
    # has full redundancy again, so it is a failover (pause 700-704, one fallback step of 2.25 s), rebuilt
    # at 706.25-711.25 with the six survivors, not a consecutive failure.
    result = run(cluster("abababab", [(500, 1), (700, 2)]), tiny_profile)
    assert result.fatal_failures == 0
    assert result.reconfigurations == 3
    slow = ONE_PIPELINE / 1.5
    expected = 482 * 10 + 1.5 * ONE_PIPELINE + (700 - 510.5) * ONE_PIPELINE + 2.25 * slow + (1000 - 711.25) * ONE_PIPELINE
    assert result.samples == pytest.approx(expected)


def test_a_replacement_brings_back_the_pipeline_that_the_rebuild_dropped(tiny_profile: ModelProfile) -> None:
    events = [TraceEvent(0.0, EventKind.ADD, f"n{i}", "ab"[i % 2]) for i in range(8)]
    events += [TraceEvent(500.0, EventKind.REMOVE, "n1", "b"), TraceEvent(550.0, EventKind.ADD, "n8", "b"),
               TraceEvent(700.0, EventKind.REMOVE, "n2", "a")]
    result = run(Trace.from_events("replaced", events, duration_s=1000), tiny_profile, zone_aware=True)
    # n1's failover (pause 500-504, one fallback step) is rebuilt at 505.5-510.5 into one pipeline.
    # n8 is ready at 560: eight nodes make two pipelines again at the next step boundary (a one-pipeline
    # step, 561.5), local rendezvous + reconfiguration until 566.5. n2's loss at 700 is an ordinary
    # failover: pause until 704, one fallback step, rebuilt at 705.5-710.5 into one pipeline again.
    expected = (482 * 10 + 1.5 * ONE_PIPELINE + (561.5 - 510.5) * ONE_PIPELINE + (700 - 566.5) * 10
                + 1.5 * ONE_PIPELINE + (1000 - 710.5) * ONE_PIPELINE)
    assert result.samples == pytest.approx(expected)
    assert result.fatal_failures == 0
    assert result.reconfigurations == 4


def test_job_waits_with_its_state_and_rolls_back_when_the_last_copy_goes(tiny_profile: ModelProfile) -> None:
    profile = attrs.evolve(tiny_profile, pipelines=1)
    events = [TraceEvent(0.0, EventKind.ADD, f"n{i}", "ab"[i % 2]) for i in range(4)]
    events += [TraceEvent(t, EventKind.REMOVE, f"n{i}", "ab"[i % 2]) for t, i in ((500, 1), (600, 3), (700, 0))]
    result = run(Trace.from_events("stop", events, duration_s=1000), profile, zone_aware=True)
    # n0..n3 own stages 0..3. One pipeline runs at 10/1.5 samples/s from 18 s; n1 is lost at 500 (pause
    # to 504, then one fallback step of 2.25 s): the rebuild after the failover, at 506.25-511.25, finds
    # three nodes, too few for a pipeline: the job waits, n0, n2 and n3 keep their state. n3's loss at 600
    # leaves a copy of every stage; n0's at 700 leaves stage 0 with none (its shadow n3 is gone): back to
    # the checkpoint taken at 400 s of training, with 484.25 s trained.
    assert result.samples == pytest.approx(400 * ONE_PIPELINE)
    assert result.fatal_failures == 1
    assert result.reconfigurations == 1
    assert result.progress_share == pytest.approx((484.25 - 84.25) / 1000)


def test_consecutive_pair_in_a_single_pipeline_rolls_back(tiny_profile: ModelProfile) -> None:
    profile = attrs.evolve(tiny_profile, pipelines=1)
    result = run(cluster("abab", [(500, 1), (502, 2)]), profile)
    # One pipeline from 18 s; stages 1 and 2 are lost everywhere: back to the checkpoint at 400 s of
    # training (418 s), 400 * 10/1.5 samples; then only 2 nodes are left and the job stops.
    assert result.fatal_failures == 1
    assert result.samples == pytest.approx(400 * ONE_PIPELINE)
    assert result.progress_share == pytest.approx(0.4)


def test_whole_zone_lost_with_zone_aware_placement(tiny_profile: ModelProfile) -> None:
    # Zone a holds n0..n3. Zone-aware placement alternates zones, so no two neighbours go together. Each
    # pipeline keeps stages 1 and 3, whose loss would now be fatal: after the failover pause (500-504)
    # reconfigure at the next step boundary (a fallback step, 505.5), 5 s, then one pipeline from 510.5.
    result = run(cluster("aaaabbbb", [(500, 0), (500, 1), (500, 2), (500, 3)]), tiny_profile, zone_aware=True)
    assert result.fatal_failures == 0
    assert result.samples == pytest.approx(482 * 10 + 1.5 * ONE_PIPELINE + 489.5 * ONE_PIPELINE)


def test_whole_zone_lost_without_zone_awareness(tiny_profile: ModelProfile) -> None:
    # Arrival order puts all of zone a into pipeline 0: the second loss is next to the first.
    result = run(cluster("aaaabbbb", [(500, 0), (500, 1), (500, 2), (500, 3)]), tiny_profile)
    assert result.fatal_failures == 1
    # Pipeline 1 (zone b) has every stage: global rendezvous 500-508, then one pipeline.
    assert result.samples == pytest.approx(482 * 10 + 492 * ONE_PIPELINE)


def test_planner_placement_alternates_zones() -> None:
    zone_of = {i: (0 if i < 6 else 1 if i < 9 else 2) for i in range(12)}
    owners = plan_placement([(n, zone_of[n], NOT_A_HOLDER) for n in range(12)], stages=4, pipelines=3)
    for row in owners:
        zones = [zone_of[n] for n in row]
        assert all(zones[s] != zones[(s + 1) % 4] for s in range(4)), zones
    assert sorted(n for row in owners for n in row) == list(range(12))


def test_node_added_later_joins_at_reconfiguration(tiny_profile: ModelProfile) -> None:
    events = [TraceEvent(0.0, EventKind.ADD, f"n{i}", "ab"[i % 2]) for i in range(4)]
    events.append(TraceEvent(100.0, EventKind.ADD, "n4", "a"))
    events += [TraceEvent(100.0, EventKind.ADD, f"n{i}", "ab"[i % 2]) for i in range(5, 8)]
    trace = Trace.from_events("grow", events, duration_s=1000)
    result = run(trace, tiny_profile)
    # One pipeline 18-110; four nodes ready at 110 make a second pipeline: decide at the step
    # boundary (111.5), local rendezvous + reconfiguration until 116.5, then two pipelines.
    expected = (111.5 - 18) * ONE_PIPELINE + (1000 - 116.5) * 10
    assert result.samples == pytest.approx(expected)
    assert result.reconfigurations == 2


def test_timeline_matches_the_totals(tiny_profile: ModelProfile) -> None:
    result = run(cluster("abababab", [(500, 1), (502, 2)]), tiny_profile, Strategy.CHECKPOINT)
    timeline = result.timeline
    assert timeline is not None
    durations = [*(timeline.time_s[1:] - timeline.time_s[:-1]).tolist(), 0.0]
    kept = sum(d * r for d, r in zip(durations, timeline.rate, strict=True))
    assert kept == pytest.approx(result.samples)


def test_bert_table6_keeps_value_above_on_demand_and_nodes_near_the_table() -> None:
    """A small-sample version of the Table 6 check (the full 1,000-run sweep is in the package notes)."""
    from bamboo.bench.profile import load_profile
    from bamboo.bench.simulator import simulate_synthetic

    profile = load_profile("bert-table6")
    table = {0.01: (2.10, 45.18), 0.5: (1.59, 26.96)}
    for probability, (value, nodes) in table.items():
        spec = SyntheticSpec(preemption_probability=probability, desired_nodes=48, zones=3, bulk_mean=2.0)
        mean = average_results([simulate_synthetic(spec, seed, profile, Strategy.BAMBOO) for seed in range(40)])
        assert mean.completed_runs == 40
        assert mean.value > profile.on_demand_value
        assert mean.value == pytest.approx(value, rel=0.10)
        assert mean.nodes == pytest.approx(nodes, rel=0.10)
