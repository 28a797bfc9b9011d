"""Trace value tests: construction checks, slicing, compression, summaries; synthetic traces."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
from bamboo.bench.loaders import load_generic_csv, write_generic_csv
from bamboo.bench.synthetic import SyntheticSpec, SyntheticTraceGenerator, generate_trace
from bamboo.bench.trace import EventKind, Trace, TraceEvent
from hypothesis import given, settings
from hypothesis import strategies as st


def _events(*rows: tuple[float, str, str, str]) -> list[TraceEvent]:
    return [TraceEvent(t, EventKind(kind), node, zone) for t, kind, node, zone in rows]


def small_trace() -> Trace:
    return Trace.from_events(
        "small",
        _events(
            (0, "add", "n1", "a"), (0, "add", "n2", "b"), (0, "add", "n3", "a"),
            (600, "remove", "n1", "a"), (600, "remove", "n3", "a"), (1200, "add", "n4", "b"),
            (3000, "remove", "n2", "b"),
        ),
        duration_s=3600,
    )


def test_summary_counts_bulks_per_time_and_zone() -> None:
    summary = small_trace().summary()
    assert summary.preemptions == 3
    assert summary.preemptions_per_hour == pytest.approx(3.0)
    assert sorted(summary.bulk_sizes) == [1, 2]
    assert summary.zones == ("a", "b")
    assert summary.max_alive == 3
    # 3 nodes for 600 s, 1 for 600 s, 2 for 1800 s, 1 for 600 s.
    assert summary.mean_alive == pytest.approx((3 * 600 + 600 + 2 * 1800 + 600) / 3600)


def test_slice_re_adds_alive_nodes_at_zero() -> None:
    part = small_trace().slice(900, 3600)
    assert [str(e) for e in part] == ["+n2@b@0s", "+n4@b@300s", "-n2@b@2100s"]
    assert part.duration_s == 2700


def test_compress_divides_time() -> None:
    fast = small_trace().compress(60)
    assert fast.duration_s == 60
    assert [e.time_s for e in fast] == [0, 0, 0, 10, 10, 20, 50]
    with pytest.raises(ValueError, match="factor must be > 0, got 0"):
        small_trace().compress(0)


def test_construction_errors_carry_the_offending_values() -> None:
    with pytest.raises(ValueError, match=re.escape("not in time order at index 1: 5.0 then 1.0")):
        Trace("bad", [5.0, 1.0], [True, True], [0, 1], [0, 0], ["a", "b"], ["z"], 10)
    with pytest.raises(ValueError, match=re.escape("duration_s=1.0 is before the last event at 5.0")):
        Trace("bad", [5.0], [True], [0], [0], ["a"], ["z"], 1)
    with pytest.raises(ValueError, match=re.escape("'time_s' must be >= 0.0: -1.0")):
        TraceEvent(-1, EventKind.ADD, "n", "z")
    with pytest.raises(ValueError, match="start_s=5, end_s=5"):
        small_trace().slice(5, 5)


def test_synthetic_is_seeded_and_respects_the_desired_size() -> None:
    spec = SyntheticSpec(preemption_probability=0.3, desired_nodes=20, zones=2, bulk_mean=3.0)
    one = generate_trace(spec, hours=30, seed=7)
    two = generate_trace(spec, hours=30, seed=7)
    other = generate_trace(spec, hours=30, seed=8)
    assert list(one) == list(two)
    assert list(one) != list(other)
    _, alive = one.alive_series()
    assert alive.max() <= 20
    assert set(one.summary().zones) <= {"zone-a", "zone-b"}


def test_synthetic_preemption_rate_follows_the_probability() -> None:
    # With allocation always succeeding the cluster stays near 40 nodes, so removals ~ p * 40 per hour.
    spec = SyntheticSpec(preemption_probability=0.2, desired_nodes=40, random_allocation=False,
                         allocation_probability=1.0)
    summary = generate_trace(spec, hours=200, seed=1).summary()
    assert summary.preemptions_per_hour == pytest.approx(0.2 * 40, rel=0.1)


def test_synthetic_bulks_stay_within_one_zone() -> None:
    spec = SyntheticSpec(preemption_probability=0.3, desired_nodes=30, zones=3, bulk_mean=4.0)
    trace = generate_trace(spec, hours=100, seed=3)
    zones_at: dict[float, set[int]] = {}
    for t, add, zone in zip(trace.time_s.tolist(), trace.is_add.tolist(), trace.zone.tolist(), strict=True):
        if not add:
            zones_at.setdefault(t, set()).add(zone)
    assert all(len(zones) == 1 for zones in zones_at.values())
    bunched = trace.summary().mean_bulk_size
    assert max(trace.summary().bulk_sizes) >= 4
    spec1 = SyntheticSpec(preemption_probability=0.3, desired_nodes=30, zones=3, bulk_mean=1.0)
    independent = generate_trace(spec1, hours=100, seed=3).summary().mean_bulk_size
    assert independent == pytest.approx(1.0, abs=0.01)
    assert bunched > independent + 0.3


def test_synthetic_spec_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match=re.escape("'preemption_probability' must be <= 1: 1.5")):
        SyntheticSpec(preemption_probability=1.5)
    with pytest.raises(ValueError, match=re.escape("'bulk_mean' must be >= 1: 0.5")):
        SyntheticSpec(preemption_probability=0.1, bulk_mean=0.5)


@settings(deadline=None, max_examples=25)
@given(
    p=st.floats(0.0, 0.9),
    nodes=st.integers(1, 30),
    zones=st.integers(1, 4),
    bulk=st.floats(1.0, 5.0),
    seed=st.integers(0, 10_000),
)
def test_synthetic_streams_are_consistent(p: float, nodes: int, zones: int, bulk: float, seed: int) -> None:
    """Every remove follows the node's add, times never go back, and the cluster never exceeds its size."""
    spec = SyntheticSpec(preemption_probability=p, desired_nodes=nodes, zones=zones, bulk_mean=bulk)
    alive: set[int] = set()
    last = 0.0
    for time_s, is_add, node, zone in SyntheticTraceGenerator(spec, seed).events(until_s=10 * 3600):
        assert time_s >= last
        last = time_s
        assert 0 <= zone < zones
        if is_add:
            assert node not in alive
            alive.add(node)
            assert len(alive) <= nodes
        else:
            alive.remove(node)


@settings(deadline=None, max_examples=15)
@given(seed=st.integers(0, 1000), start=st.floats(0, 5 * 3600), length=st.floats(60, 5 * 3600))
def test_slices_and_csv_round_trip_preserve_the_alive_count(seed: int, start: float, length: float, tmp_path_factory) -> None:
    spec = SyntheticSpec(preemption_probability=0.25, desired_nodes=12)
    trace = generate_trace(spec, hours=10, seed=seed)
    part = trace.slice(start, start + length)
    # The alive count at the end of the slice equals the original's at that moment.
    times, counts = trace.alive_series()
    at_end = counts[np.searchsorted(times, start + length, side="left") - 1] if times[0] < start + length else 0
    _, part_counts = part.alive_series()
    assert (part_counts[-1] if len(part) else 0) == at_end
    out: Path = tmp_path_factory.mktemp("csv") / "t.csv"
    write_generic_csv(part, out)
    assert list(load_generic_csv(out)) == list(part)


def test_a_launched_job_s_synthetic_trace_starts_with_every_node_for_every_seed() -> None:
    """``--preemptions synthetic:RATE`` (run, market, compare, measure) starts with all ``nodes`` nodes: the
    paper's model alone starts with as many as the first hour's allocation draw gives, for some seeds none."""
    from bamboo.bench.preemptions import load_preemptions

    spec = SyntheticSpec(preemption_probability=0.33, desired_nodes=8)
    paper_starts = [sum(1 for e in generate_trace(spec, hours=1.45, seed=s).events() if e.time_s == 0.0)
                    for s in range(771, 781)]
    assert min(paper_starts) < 8  # the paper's model: some seeds start short
    for seed in range(771, 781):
        trace = load_preemptions("synthetic:0.33", nodes=8, hours=1.45, seed=seed)
        at_start = [e for e in trace.events() if e.time_s == 0.0]
        assert len(at_start) == 8 and all(e.kind is EventKind.ADD for e in at_start), seed
        assert any(e.kind is EventKind.REMOVE for e in trace.events()), seed  # the market still preempts


def test_a_trace_file_that_holds_more_machines_than_nodes_is_named_in_one_line() -> None:
    """``--nodes`` sizes a synthetic trace only: a file of 55 machines runs 55 emulated nodes, which ``run`` and
    ``compare`` say before they start."""
    from bamboo.bench.emulated.market import ActionKind, MarketAction
    from bamboo.bench.emulated.run import _peak
    from bamboo.bench.preemptions import size_notice

    notice = size_notice("gcp.txt", 55, 7)
    assert notice is not None and "55 machines" in notice and "--nodes 7" in notice and "\n" not in notice
    assert size_notice("gcp.txt", 7, 7) is None
    assert size_notice("synthetic:0.5", 55, 7) is None
    plan = [MarketAction(0.0, ActionKind.ADD, "a", "z"), MarketAction(0.0, ActionKind.ADD, "b", "z"),
            MarketAction(1.0, ActionKind.NOTIFY, "a", "z"), MarketAction(2.0, ActionKind.KILL, "a", "z"),
            MarketAction(3.0, ActionKind.ADD, "c", "z"), MarketAction(3.0, ActionKind.ADD, "d", "z")]
    assert _peak(plan) == 3 and _peak([]) == 0
