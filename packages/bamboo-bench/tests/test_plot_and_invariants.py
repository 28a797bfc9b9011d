"""Plot helper arithmetic, a synthetic plot, and simulator invariants on random small traces (hypothesis)."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
from bamboo.bench.profile import ModelProfile
from bamboo.bench.simulator import Policy, Strategy, simulate_run, simulate_synthetic
from bamboo.bench.synthetic import SyntheticSpec, generate_trace
from hypothesis import given, settings
from hypothesis import strategies as st


def test_binned_mean_of_a_step_function() -> None:
    from bamboo.bench.plot import binned_mean  # here: collecting the suite need not import matplotlib

    # 0-10 s: 2, 10-30 s: 5, 30-40 s: 0; two bins of 20 s.
    hours, means = binned_mean(np.array([0.0, 10.0, 30.0]), np.array([2.0, 5.0, 0.0]), 40.0, 2)
    assert list(means) == pytest.approx([(2 * 10 + 5 * 10) / 20, (5 * 10 + 0) / 20])
    assert list(hours * 3600) == pytest.approx([10.0, 30.0])
    with pytest.raises(ValueError, match="end_s=0"):
        binned_mean(np.array([0.0]), np.array([1.0]), 0.0, 3)


def test_plot_of_synthetic_runs(tiny_profile: ModelProfile, tmp_path: Path) -> None:
    from bamboo.bench.plot import plot_runs  # here: collecting the suite need not import matplotlib

    spec = SyntheticSpec(preemption_probability=0.3, desired_nodes=8, zones=2)
    runs = [
        simulate_synthetic(spec, 1, tiny_profile, strategy, target_samples=50_000, max_hours=100, record=True)
        for strategy in (Strategy.BAMBOO, Strategy.CHECKPOINT, Strategy.ON_DEMAND)
    ]
    out = plot_runs(runs, tiny_profile, tmp_path / "plot.png")
    assert out.stat().st_size > 10_000
    with pytest.raises(ValueError, match="has no timeline"):
        plot_runs([simulate_synthetic(spec, 1, tiny_profile, Strategy.BAMBOO)], tiny_profile, tmp_path / "x.png")


@settings(deadline=None, max_examples=30)
@given(
    seed=st.integers(0, 100_000),
    p=st.floats(0.0, 0.9),
    zones=st.integers(1, 3),
    bulk=st.floats(1.0, 4.0),
    strategy=st.sampled_from([Strategy.BAMBOO, Strategy.CHECKPOINT, Strategy.SAMPLE_DROPPING]),
    zone_aware=st.booleans(),
)
def test_simulator_invariants(
    tiny_profile: ModelProfile, seed: int, p: float, zones: int, bulk: float, strategy: Strategy, zone_aware: bool
) -> None:
    """On any small trace: kept work never exceeds what the fastest configuration could do, shares stay in [0, 1],
    the timeline integrates to the samples, and costs follow the allocated nodes."""
    spec = SyntheticSpec(preemption_probability=p, desired_nodes=10, zones=zones, bulk_mean=bulk)
    trace = generate_trace(spec, hours=3, seed=seed)
    result = simulate_run(trace, tiny_profile, strategy, policy=Policy(zone_aware=zone_aware),
                          target_samples=math.inf, until_s=trace.duration_s, record=True)
    fastest = tiny_profile.samples_per_second(tiny_profile.pipelines)
    assert 0.0 <= result.samples <= fastest * trace.duration_s + 1e-6
    assert 0.0 <= result.progress_share <= 1.0 + 1e-9
    assert result.preemptions == trace.summary().preemptions
    assert result.nodes == pytest.approx(trace.summary().mean_alive)
    assert result.cost_per_hour == pytest.approx(result.nodes * tiny_profile.spot_price_per_node_hour)
    assert result.fatal_failures <= result.preemptions
    timeline = result.timeline
    assert timeline is not None
    assert np.all(np.diff(timeline.time_s) >= 0)
    widths = np.diff(np.append(timeline.time_s, trace.duration_s))
    assert float(np.sum(widths * timeline.rate)) == pytest.approx(result.samples, rel=1e-9, abs=1e-6)
