"""Tests of a run's report computed from its event log: the numbers by hand, prices, errors, the timeline and
the figure (bamboo.bench.value.report)."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.bench.value import (
    Prices,
    ReportError,
    compute_report,
    compute_timeline,
    format_report,
    plot_report,
)
from bamboo.launch.events import (
    Failover,
    Join,
    Preemption,
    Reconfiguration,
    RunEnd,
    RunStart,
    Step,
)
from hypothesis import given, settings
from hypothesis import strategies as st


def test_report_numbers_by_hand(sample_run: Callable[[], list]) -> None:
    report = compute_report(sample_run())
    assert report.steps == 4 and report.samples == 40
    assert report.throughput == pytest.approx(40 / 3600)
    assert report.window_throughput == pytest.approx(40 / 3600)  # the first step starts at the run's start
    # n0: 1 h, n1: 0.5 h, n2: 0.25 h.
    assert report.node_hours == pytest.approx(1.75)
    assert report.avg_nodes == pytest.approx(1.75)
    assert report.cost_spot == pytest.approx(1.75 * 0.918)
    assert report.cost_on_demand == pytest.approx(1.75 * 3.06)
    assert report.saving == pytest.approx(3.06 / 0.918)
    assert report.value == pytest.approx((40 / 3600) / (1.75 * 0.918))
    assert report.preemptions == 1 and report.joins == 3 and report.failovers == 3
    assert report.median_pause_s == 2.0 and report.max_pause_s == 3.0
    assert report.reconfigurations == 1 and report.bytes_moved == 4096
    assert report.checkpoints == 1 and report.final_loss == 0.5


def test_a_step_whose_record_was_lost_still_counts_with_the_global_batch(sample_run: Callable[[], list]) -> None:
    """The node that writes the step records killed with a record still queued: the steps on either side show the
    step was trained (steps run one after the other), so it counts, with every step's samples, and is reported."""
    events = [e for e in sample_run() if not (isinstance(e, Step) and e.step == 2)]
    report = compute_report(events)
    assert report.steps == 4 and report.samples == 40 and report.missing_step_records == 1
    assert report.to_dict()["missing_step_records"] == 1
    whole = compute_report(sample_run())
    assert whole.missing_step_records == 0 and whole.throughput == report.throughput


def test_report_with_measured_on_demand_reference(sample_run: Callable[[], list]) -> None:
    prices = Prices(spot=1.0, on_demand=4.0, on_demand_throughput=0.02, on_demand_nodes=2)
    report = compute_report(sample_run(), prices)
    assert report.cost_on_demand == pytest.approx(40 / 0.02 / 3600 * 2 * 4.0)
    assert report.on_demand_value == pytest.approx(0.02 / 8.0)
    assert "measured" in report.on_demand_basis


def test_prices_validation_names_the_value() -> None:
    with pytest.raises(ValueError, match="-1"):
        Prices(spot=-1)
    with pytest.raises(ValueError, match="go together"):
        Prices(on_demand_throughput=3.0)


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([], "empty"),
        ([Join(t=0, node="n0", zone="a")], "no step records"),
        (
            [Join(t=0, node="n0", zone="a"), Join(t=1, node="n0", zone="a")],
            "already alive",
        ),
        ([Join(t=0, node="n0", zone="a"), Preemption(t=1, node="n0", zone="a"), Preemption(t=2, node="n0", zone="a")],
         "again, and never joined"),
    ],
)
def test_report_errors(events: list, message: str) -> None:
    with pytest.raises(ReportError, match=message):
        compute_report(events)


def test_a_node_preempted_before_its_join_was_recorded_is_billed_nothing(sample_run: Callable[[], list]) -> None:
    events = [*sample_run(), Preemption(t=10.0, node="ghost", zone="a")]
    assert compute_report(events).node_hours == compute_report(sample_run()).node_hours
    assert compute_report(events).preemptions == compute_report(sample_run()).preemptions + 1


def test_a_market_record_bills_each_machine_from_its_start_to_its_kill(tmp_path: Path,
                                                                        sample_run: Callable[[], list]) -> None:
    """The job's records bill n1 from its agent's join (t = 0) to its confirmed loss (1800 s) and n2 from 2700 s;
    the market started n1 at 0 and killed it 600 s earlier than the job saw it (a standby node's loss is seen a
    lease's TTL late), and started n2 60 s before its agent joined. Billed by the market: the machines' own
    lives, in the report and the timeline alike; the samples do not move."""
    import json

    from bamboo.bench.emulated.run_results import MARKET_LOG, market_billing

    events = sample_run()
    unix = events[0].unix_time
    lines = [("add", "n0", 0.0), ("add", "n1", 0.0), ("kill", "n1", 1200.0), ("add", "n2", 2640.0)]
    (tmp_path / MARKET_LOG).write_text("".join(json.dumps({"action": action, "node": node, "zone": "a",
                                                            "unix": unix + t}) + "\n" for action, node, t in lines))
    billing = market_billing(tmp_path, events)
    assert billing is not None and market_billing(tmp_path / "elsewhere", events) is None
    by_job, by_market = compute_report(events), compute_report(events, billing=billing)
    assert by_job.node_hours == pytest.approx(1.75)
    assert by_market.node_hours == pytest.approx(1.0 + 1200 / 3600 + 960 / 3600)  # n0, n1, n2
    assert by_market.cost_spot == pytest.approx(by_market.node_hours * 0.918)
    assert by_market.samples == by_job.samples and by_market.throughput == by_job.throughput
    timeline = compute_timeline(events, bins=4, billing=billing)
    assert sum(timeline.nodes) * 900 == pytest.approx(by_market.node_hours * 3600)


def test_timeline_conserves_node_seconds_and_samples(sample_run: Callable[[], list]) -> None:
    timeline = compute_timeline(sample_run(), bins=8)
    width = 3600 / 8
    assert sum(timeline.nodes) * width == pytest.approx(1.75 * 3600)
    assert sum(timeline.throughput) * width == pytest.approx(40)
    assert timeline.preemption_times == (1800.0,)
    assert all(math.isfinite(v) for v in timeline.value)


def test_plot_writes_a_png(tmp_path: Path, sample_run: Callable[[], list]) -> None:
    out = plot_report(sample_run(), tmp_path / "report.png", bins=12)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert out.stat().st_size > 10_000


@st.composite
def random_runs(draw) -> list:
    """A valid log over [0, 1000]: nodes joining and maybe leaving, steps inside the window."""
    events: list = [RunStart(t=0.0, job="prop", unix_time=0.0, target_nodes=2, stages=1, pipelines=2)]
    for index in range(draw(st.integers(1, 6))):
        joined = draw(st.floats(0, 900))
        events.append(Join(t=joined, node=f"n{index}", zone="z"))
        if draw(st.booleans()):
            events.append(Preemption(t=draw(st.floats(joined, 1000)), node=f"n{index}", zone="z"))
    for step in range(draw(st.integers(1, 20))):
        end = draw(st.floats(1, 1000))
        duration = draw(st.floats(0, end))
        events.append(Step(t=end, step=step, samples=draw(st.integers(1, 50)), loss=0.0, nodes_active=1,
                           duration_s=duration))  # fmt: skip
    events.append(RunEnd(t=1000.0, steps=0))
    return events


@settings(deadline=None, max_examples=60)
@given(random_runs(), st.integers(1, 40))
def test_timeline_conserves_random_runs(events: list, bins: int) -> None:
    report = compute_report(events)
    timeline = compute_timeline(events, bins=bins)
    width = 1000 / bins
    assert sum(timeline.nodes) * width == pytest.approx(report.node_hours * 3600, rel=1e-9, abs=1e-6)
    assert sum(timeline.throughput) * width == pytest.approx(report.samples, rel=1e-9)
    assert report.avg_nodes == pytest.approx(report.node_hours * 3600 / 1000)


def test_the_report_accounts_for_where_the_time_went() -> None:
    from bamboo.launch.events import Restore, TimeAccount

    start = 1_700_000_000.0
    events = [
        RunStart(t=0.0, job="j", unix_time=start, target_nodes=4, stages=2, pipelines=2),
        Join(t=0.0, node="a", zone="z"),
        *(Step(t=10.0 + k, step=k, samples=8, loss=1.0, nodes_active=4, duration_s=1.0) for k in range(1, 5)),
        # step 5 was interrupted by a failover (its pause inside the step), written by two shadows
        Failover(t=15.5, victim="b", shadow="a", stage=1, pause_s=0.5, caught_unix=start + 14.2,
                 resumed_unix=start + 14.7),
        Failover(t=15.6, victim="c", shadow="d", stage=0, pause_s=0.4, caught_unix=start + 14.3,
                 resumed_unix=start + 14.7),
        Step(t=15.5, step=5, samples=8, loss=1.0, nodes_active=4, duration_s=1.5),
        Reconfiguration(t=17.5, reason="r", pipelines=1, stages=2, standby=0, bytes_moved=0, duration_s=2.0),
        Step(t=18.5, step=6, samples=8, loss=1.0, nodes_active=2, duration_s=1.0),
        Reconfiguration(t=21.5, reason="every holder lost", pipelines=1, stages=2, standby=0, bytes_moved=0,
                        duration_s=3.0),
        Restore(t=21.5, step=4, path="/c/step-4", lost_stages="0,1", discarded_steps=2),
        *(Step(t=21.5 + k, step=4 + k, samples=8, loss=1.0, nodes_active=2, duration_s=1.0) for k in (1, 2, 3)),
    ]
    account = TimeAccount()
    for event in events:
        account.apply(event)
    assert account.startup_s == 10.0  # the first step started at t=10
    assert account.window_s == 24.5 - 10.0
    assert account.step_s == 4 + 1.5 + 1 + 3
    assert account.failover_s == 0.5  # the two shadows' pauses of one event count once
    assert (account.reconfiguration_s, account.restore_s) == (2.0, 3.0)
    assert account.step_share == (9.5 / 14.5)
    assert account.lost_s == 24.5 - (9.5 - 2.0 - 0.5)  # steps 5 and 6 were trained again; the pause was lost
    report = compute_report(events)
    assert (report.startup_s, report.failover_s, report.restore_s) == (10.0, 0.5, 3.0)
    assert report.to_dict()["step_share"] == account.step_share
    text = format_report(report)
    assert "time lost" in text and "restores 3.00 s" in text and "65.5% of the training window" in text


def test_report_labels_whole_run_and_training_window_throughput() -> None:
    events = [
        RunStart(t=0.0, job="j", unix_time=1.0, target_nodes=1, stages=1, pipelines=1),
        Join(t=0.0, node="n0", zone="a"),
        Step(t=12.0, step=1, samples=10, loss=1.0, nodes_active=1, duration_s=2.0),  # 10 s of start-up
        Step(t=14.0, step=2, samples=10, loss=0.5, nodes_active=1, duration_s=2.0),
    ]
    report = compute_report(events)
    assert report.throughput == pytest.approx(20 / 14) and report.window_throughput == pytest.approx(20 / 4)
    text = format_report(report)
    assert "1.429 samples/s over the run, start-up included (5.000 in the training window" in text
