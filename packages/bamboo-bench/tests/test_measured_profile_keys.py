"""The profile keys that measured profiles need, on hand-computed traces (the `tiny_profile` fixture).

- ``timing.checkpoint_s``: synchronous checkpoints take that share of training time;
- ``checkpoint_restart_on_join``: ``every-join`` (torchrun's agents) restarts from the last checkpoint
  whenever a node joins, where ``new-pipeline`` restarts after a fresh checkpoint, and only for a pipeline;
- ``on_demand.startup_s``: the on-demand cluster trains from then on and is billed from the start;
- ``timing.startup_s``: a measured cold start replaces the first start (instance creation and the first global
  rendezvous) of the nodes present at time 0; every later start is unchanged.

Old profiles (without the keys) load as before: every shipped profile round-trips with its defaults.
"""

from __future__ import annotations

import math

import attrs
import pytest
from bamboo.bench.profile import ModelProfile, ProfileError, builtin_profiles, load_profile
from bamboo.bench.simulator import Policy, Strategy, simulate_run
from bamboo.bench.trace import EventKind, Trace, TraceEvent

ONE_PIPELINE = 10 / 1.5  # samples/s of one pipeline in the tiny profile


def _trace(events: list[tuple[float, str, int]], nodes: int = 8, duration: float = 1000.0) -> Trace:
    """``nodes`` nodes added at 0 (zones a, b alternating), then (time, "add"|"remove", node index)."""
    zone = "ab"
    listed = [TraceEvent(0.0, EventKind.ADD, f"n{i}", zone[i % 2]) for i in range(nodes)]
    listed += [TraceEvent(t, EventKind(kind), f"n{i}", zone[i % 2]) for t, kind, i in events]
    return Trace.from_events("tiny", listed, duration_s=duration)


def _run(trace: Trace, profile: ModelProfile, strategy: Strategy):
    return simulate_run(trace, profile, strategy, policy=Policy(zone_aware=False), target_samples=math.inf,
                        until_s=trace.duration_s, record=True)


def test_synchronous_checkpoints_slow_training_by_their_share(tiny_profile: ModelProfile) -> None:
    profile = attrs.evolve(tiny_profile, timing=attrs.evolve(tiny_profile.timing, checkpoint_s=10.0))
    for strategy, start in ((Strategy.CHECKPOINT, 35.0), (Strategy.BAMBOO, 18.0)):
        result = _run(_trace([]), profile, strategy)
        # Two pipelines train 10 samples/s; checkpoints take 10 s of every 100 s of training.
        assert result.samples == pytest.approx((1000 - start) * 10 * 0.9)
    assert profile.timing.checkpoint_share == pytest.approx(0.1)


def test_a_checkpoint_longer_than_its_interval_is_refused(tiny_profile: ModelProfile) -> None:
    with pytest.raises(ValueError, match=r"checkpoint_s \(100.0\) must be less than checkpoint_interval_s \(100.0\)"):
        attrs.evolve(tiny_profile.timing, checkpoint_s=100.0)


def test_every_join_restarts_from_the_last_checkpoint(tiny_profile: ModelProfile) -> None:
    # n1 dies at 200: training ran 35-200 (165 s), its checkpoint after 100 s of training held 1000 samples;
    # restart 200-225 on 7 nodes (one pipeline). n8 is added at 300 and ready at 310.
    trace = _trace([(200.0, "remove", 1), (300.0, "add", 8)])
    every = _run(trace, attrs.evolve(tiny_profile, checkpoint_restart_on_join="every-join"), Strategy.CHECKPOINT)
    # every-join: the join at 310 restarts from the checkpoint of 200 (no checkpoint in the 85 s since):
    # the 85 s of one pipeline are lost; restart 310-335, then two pipelines until 1000.
    assert every.samples == pytest.approx(1000 + 665 * 10)
    new_pipeline = _run(trace, tiny_profile, Strategy.CHECKPOINT)
    # new-pipeline: a fresh checkpoint at 310 keeps those 85 s of one pipeline, then the same restart.
    assert new_pipeline.samples == pytest.approx(1000 + 85 * ONE_PIPELINE + 665 * 10)
    assert every.fatal_failures == new_pipeline.fatal_failures == 1  # a join is a restart, not a failure


def test_every_join_restarts_even_when_no_pipeline_is_added(tiny_profile: ModelProfile) -> None:
    # n1 and n2 die at 200 (6 nodes: one pipeline); n8 added at 300 makes 7 nodes, still one pipeline.
    trace = _trace([(200.0, "remove", 1), (200.0, "remove", 2), (300.0, "add", 8)])
    new_pipeline = _run(trace, tiny_profile, Strategy.CHECKPOINT)
    every = _run(trace, attrs.evolve(tiny_profile, checkpoint_restart_on_join="every-join"), Strategy.CHECKPOINT)
    # new-pipeline: one restart (200-225), then one pipeline until 1000 from the 1000 samples of the checkpoint.
    assert new_pipeline.samples == pytest.approx(1000 + 775 * ONE_PIPELINE)
    # every-join: the join at 310 throws away 225-310 and restarts (310-335) on one pipeline again.
    assert every.samples == pytest.approx(1000 + 665 * ONE_PIPELINE)
    assert every.reconfigurations == new_pipeline.reconfigurations + 1


def test_every_join_during_a_restart_starts_it_over(tiny_profile: ModelProfile) -> None:
    # n1 dies at 200 (restart 200-225); n8, added at 205, is ready at 215, inside that restart.
    trace = _trace([(200.0, "remove", 1), (205.0, "add", 8)])
    every = _run(trace, attrs.evolve(tiny_profile, checkpoint_restart_on_join="every-join"), Strategy.CHECKPOINT)
    # every-join: torchrun's agents restart the workers again for the waiting node: 215-240, then two pipelines.
    assert every.samples == pytest.approx(1000 + 760 * 10)
    # new-pipeline: the restart under way takes the new node in: two pipelines from 225.
    assert _run(trace, tiny_profile, Strategy.CHECKPOINT).samples == pytest.approx(1000 + 775 * 10)


def test_bamboo_and_other_joins_ignore_the_checkpoint_restart_key(tiny_profile: ModelProfile) -> None:
    trace = _trace([(200.0, "remove", 1), (300.0, "add", 8)])
    every = attrs.evolve(tiny_profile, checkpoint_restart_on_join="every-join")
    for strategy in (Strategy.BAMBOO, Strategy.SAMPLE_DROPPING):
        assert _run(trace, every, strategy).samples == pytest.approx(_run(trace, tiny_profile, strategy).samples)


def test_a_measured_startup_times_the_first_start_only(tiny_profile: ModelProfile) -> None:
    profile = attrs.evolve(tiny_profile, timing=attrs.evolve(tiny_profile.timing, startup_s=30.0))
    # Bamboo: the first layout at 30 s (not 10 + 5 + 3 = 18 s), then 10 samples/s until 1000.
    assert _run(_trace([]), profile, Strategy.BAMBOO).samples == pytest.approx(970 * 10)
    # Checkpoint/restart: first start at 30 s (not 35 s); n1 dies at 200 (170 s of training: the checkpoint
    # after 100 s holds 1000 samples); the restart still takes the global rendezvous and restart_s (25 s).
    result = _run(_trace([(200.0, "remove", 1)]), profile, Strategy.CHECKPOINT)
    assert result.samples == pytest.approx(1000 + 775 * ONE_PIPELINE)
    # A node added later still takes its instance creation (10 s): n8 at 300 is ready at 310, and
    # new-pipeline restarts at once after a fresh checkpoint (310-335).
    joined = _run(_trace([(200.0, "remove", 1), (300.0, "add", 8)]), profile, Strategy.CHECKPOINT)
    assert joined.samples == pytest.approx(1000 + 85 * ONE_PIPELINE + 665 * 10)


def test_on_demand_trains_after_its_startup(tiny_profile: ModelProfile) -> None:
    profile = attrs.evolve(tiny_profile, on_demand_startup_s=20.0)
    result = simulate_run(_trace([]), profile, Strategy.ON_DEMAND, until_s=1000.0, target_samples=math.inf,
                          record=True)
    assert result.samples == pytest.approx(980 * 12.0)
    assert result.throughput == pytest.approx(980 * 12.0 / 1000)
    assert result.progress_share == pytest.approx(0.98)
    assert result.cost_per_hour == pytest.approx(6 * 3.0)  # billed from the start
    assert list(result.timeline.rate) == [0.0, 12.0, 12.0]
    done = simulate_run(_trace([]), profile, Strategy.ON_DEMAND, target_samples=1200.0)
    assert done.completed and done.duration_h * 3600 == pytest.approx(120.0)
    assert done.throughput == pytest.approx(1200 / 120)


def test_the_new_keys_round_trip_and_old_profiles_keep_their_defaults(tiny_profile: ModelProfile) -> None:
    measured = attrs.evolve(tiny_profile, on_demand_startup_s=12.5, checkpoint_restart_on_join="every-join",
                            timing=attrs.evolve(tiny_profile.timing, checkpoint_s=0.25, startup_s=17.0))
    document = measured.to_dict()
    assert document["on_demand"]["startup_s"] == 12.5
    assert document["timing"]["startup_s"] == 17.0
    assert document["checkpoint_restart_on_join"] == "every-join"
    assert document["timing"]["checkpoint_s"] == 0.25
    assert ModelProfile.from_dict(document, "measured") == measured
    for name in builtin_profiles():
        profile = load_profile(name)
        assert (profile.on_demand_startup_s, profile.checkpoint_restart_on_join) == (0.0, "new-pipeline")
        assert profile.timing.checkpoint_s == 0.0 and profile.timing.startup_s is None
        assert "startup_s" not in profile.to_dict()["timing"]
        assert "startup_s" not in profile.to_dict()["on_demand"]
        assert "checkpoint_restart_on_join" not in profile.to_dict()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"checkpoint_restart_on_join": "sometimes"},
         "'checkpoint_restart_on_join' must be one of \\['new-pipeline', 'every-join'\\], got 'sometimes'"),
        ({"on_demand": {"nodes": 6, "samples_per_second": 12.0, "start": 3}},
         "unknown on_demand keys \\['start'\\]; known: \\['nodes', 'samples_per_second', 'startup_s'\\]"),
        ({"on_demand": {"nodes": 6, "samples_per_second": 12.0, "startup_s": -1}}, "'on_demand_startup_s' must be >= 0: -1.0"),
        ({"timing": {"startup_s": -2}}, "'startup_s' must be >= 0: -2.0"),
    ],
)
def test_bad_new_keys_name_the_file_and_the_key(tiny_profile: ModelProfile, change: dict, message: str) -> None:
    with pytest.raises(ProfileError, match=f"^measured.json: .*{message}"):
        ModelProfile.from_dict({**tiny_profile.to_dict(), **change}, "measured.json")


def test_a_rebuild_delay_keeps_bamboo_training_degraded_until_it_passes(tiny_profile: ModelProfile) -> None:
    """n1 dies at 200: the failover pauses 200-204, then two pipelines train 3x slower (10 samples per 3 s).
    Without a delay the rebuild is decided at the next step's end (207), pauses 5 s and one pipeline trains
    10 samples per 1.5 s from 212; with ``rebuild_delay_s`` 30 it is decided at 230 and trains from 235."""
    trace = _trace([(200.0, "remove", 1)])

    def samples(delay: float) -> float:
        timing = attrs.evolve(tiny_profile.timing, fallback_slowdown=3.0, rebuild_delay_s=delay)
        return _run(trace, attrs.evolve(tiny_profile, timing=timing), Strategy.BAMBOO).samples

    at_once = samples(0.0)
    assert at_once - samples(30.0) == pytest.approx((3 + 23 * 2) * 10 / 3 - 26 * 10 / 3)
    assert samples(1.0) == pytest.approx(at_once)  # shorter than the step in progress: nothing changes
    assert ModelProfile.from_dict(attrs.evolve(tiny_profile, timing=attrs.evolve(
        tiny_profile.timing, rebuild_delay_s=2.5)).to_dict(), "x").timing.rebuild_delay_s == 2.5
