"""``--redundancy auto`` in the launcher: each generation's mode from the job's profile and its event records, the
layout that carries it, the flags that take it, and the report and live view that show it. No cluster."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace
from typing import Any

import attrs
import pytest
from bamboo.bench.value import compute_report, format_report
from bamboo.launch import events as events_module
from bamboo.launch import redundancy
from bamboo.launch.cli import main
from bamboo.launch.coordinator_layouts import first_layout
from bamboo.launch.events import (
    Join,
    Preemption,
    RedundancyChoice,
    RunStart,
    Step,
    event_from_dict,
    event_to_dict,
    read_etcd_events,
)
from bamboo.launch.live import LiveState
from bamboo.launch.redundancy import (
    choice_record,
    choose_mode,
    holds_replicas,
    layout_mode,
    measured_step,
    observed_rate,
    with_mode,
)
from bamboo.launch.spec import JobSpec, SpecError
from bamboo.reconfig import JobLayout, RecordError

LAYER = {"param_bytes": 400, "optimizer_bytes": 800, "compute_cost": 100.0}


def _spec(**changes: Any) -> JobSpec:
    fields: dict[str, Any] = {"job": "auto", "stages": 4, "pipelines": 1, "steps": 10, "micro_batches": 8,
                              "created_unix": 1.0, "layers": [LAYER] * 8, "config": {}, "redundancy": "auto"}
    return JobSpec(**{**fields, **changes})


def _layout(spec: JobSpec) -> JobLayout:
    return first_layout(spec, {f"n{i}": "a" for i in range(spec.stages * spec.pipelines)})


def _choice(generation: int, mode: str, t: float = 0.0) -> RedundancyChoice:
    return RedundancyChoice(t=t, generation=generation, mode=mode, reason=f"{mode}: chosen",
                            lost_s_per_hour={mode: 1.0}, step_s=1.0, preemptions_per_node_hour=0.1)


def _steps(generation: int, durations: list[float], t0: float = 1.0) -> list[Step]:
    return [Step(t=t0 + i, step=i + 1, samples=8, loss=1.0, nodes_active=4, duration_s=d, generation=generation)
            for i, d in enumerate(durations)]


def test_a_low_rate_picks_the_cheap_mode_and_a_high_rate_the_eager_one() -> None:
    """P = 4, M = 8, equal layers: with no preemption in sight nothing pays for redundancy; after two hours in
    which 4 nodes saw 40 preemptions, with a measured step of 300 s and a checkpoint every 2 steps, eager FRC pays
    (a lazy recovery recomputes more of a long step)."""
    spec = _spec(preemptions_per_node_hour=0.0, checkpoint_dir="/ckpt", checkpoint_every=2, memory_copy_every=0)
    plan = _layout(spec).plan
    assert choose_mode(spec, plan, [], now_t=0.0).mode == "none"
    history: list[Any] = [Join(t=0.0, node=f"n{i}", zone="a") for i in range(4)]
    for i in range(40):  # short-lived spot nodes, each preempted as it came
        history += [Join(t=100.0 + i, node=f"s{i}", zone="b"), Preemption(t=100.0 + i, node=f"s{i}", zone="b")]
    history += [_choice(0, "none"), *_steps(0, [300.0, 300.0, 300.0])]
    busy = choose_mode(spec, plan, history, now_t=7200.0)
    assert busy.preemptions_per_node_hour == pytest.approx(40 / 9)  # 40 preemptions, 8 node-hours and the prior's 1
    assert busy.mode == "eflb", busy.reason
    assert busy.lost_s_per_hour["eflb"] < min(busy.lost_s_per_hour[m] for m in ("none", "lflb", "efeb"))
    assert busy.step_s == pytest.approx(300.0)
    assert "the measured none step of 300.000 s" in busy.reason


def test_the_step_time_is_the_newest_generations_median_in_the_mode_it_ran() -> None:
    assert measured_step([]) is None
    assert measured_step(_steps(0, [1.0, 2.0])) is None  # no choice record: the mode of those steps is unknown
    events = [_choice(0, "none"), *_steps(0, [1.0, 1.0, 1.0]), _choice(1, "eflb", t=9.0),
              *_steps(1, [9.0, 2.0, 2.5, 2.0], t0=10.0)]
    assert measured_step(events) == (2.25, "eflb")


def test_the_step_time_is_the_median_of_the_newest_steps_and_a_decision_types_no_other_step_record(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A day-long generation's log holds its last 20,000 steps; the measured step is that of its newest
    MEASURED_STEPS (here 3), and the read behind a layout's choice types those steps and every other record, not
    the rest (0.85 s of every decision at the log's cap)."""
    monkeypatch.setattr(redundancy, "MEASURED_STEPS", 3)
    events = [_choice(0, "none"), *_steps(0, [1.0, 1.0]), _choice(1, "eflb", t=9.0),
              *_steps(1, [9.0, 9.0, 2.0, 2.5, 2.0], t0=10.0), Join(t=0.5, node="n0", zone="a")]
    assert measured_step(events) == (2.0, "eflb")
    items = [SimpleNamespace(key=f"/bamboo/auto/events/w/{i:010d}", value=json.dumps(event_to_dict(e)).encode())
             for i, e in enumerate(events)]
    typed: list[str] = []
    real = events_module.event_from_dict

    def counting(record: Any) -> Any:
        typed.append(record["kind"])
        return real(record)

    monkeypatch.setattr(events_module, "event_from_dict", counting)
    kv = SimpleNamespace(get_prefix=lambda prefix: items)
    read = read_etcd_events(kv, "auto", select=redundancy._choice_records)  # type: ignore[arg-type]
    # the three newest steps of generation 1 (eflb), the two of generation 0 (the newest in none on that shape), two
    # choices and the join
    assert typed.count("step") == 5 and len(typed) == 5 + 3
    assert measured_step(read) == (2.0, "eflb")
    assert redundancy.measured_steps(read, nodes=4) == {"eflb": 2.0, "none": 1.0}
    spec = _spec()
    assert redundancy.mode_for(spec, _layout(spec).plan, kv, now=3600.0) == choose_mode(  # type: ignore[arg-type]
        spec, _layout(spec).plan, events, 3600.0 - spec.created_unix)


def test_the_rate_is_the_jobs_preemptions_per_node_hour_weighed_against_the_prior() -> None:
    """n0..n3 join at 0; n3 goes at half an hour and n4 replaces it: 4 node-hours and one preemption by the end of
    the hour, plus one node-hour at the prior's 0.1."""
    events: list[Any] = [Join(t=0.0, node=f"n{i}", zone="a") for i in range(4)]
    events += [Preemption(t=1800.0, node="n3", zone="a"), Join(t=1800.0, node="n4", zone="a")]
    assert observed_rate(events, 3600.0, prior=0.1) == pytest.approx((1 + 0.1) / (4 + 1))
    assert observed_rate([], 0.0, prior=0.7) == pytest.approx(0.7)  # no history: the rate the job was given


def test_a_node_known_lost_counts_once_before_its_record_is_written() -> None:
    """A barrier decides with the nodes it found gone; the coordinator may not have written their ``preemption``
    records yet (an e2e run chose ``none`` again at the barrier after its only kill). Each counts once, and not
    again once its record is there; its hours run to ``now_t`` until then."""
    events: list[Any] = [Join(t=0.0, node=f"n{i}", zone="a") for i in range(4)]
    assert observed_rate(events, 3600.0, prior=0.1, lost=["n3"]) == pytest.approx((1 + 0.1) / (4 + 1))
    events.append(Preemption(t=3600.0, node="n3", zone="a"))
    assert observed_rate(events, 3600.0, prior=0.1, lost=["n3"]) == pytest.approx((1 + 0.1) / (4 + 1))


def test_the_measured_mode_is_scaled_to_nones_step() -> None:
    """A step measured under eflb, which the model says runs longer than none, stands for a shorter none step."""
    spec = _spec()
    plan = _layout(spec).plan
    events = [_choice(0, "eflb"), *_steps(0, [2.0, 2.0, 2.0])]
    chosen = choose_mode(spec, plan, events, now_t=10.0)
    assert chosen.step_s < 2.0
    assert "the measured eflb step of 2.000 s" in chosen.reason


def test_the_layout_carries_the_mode_and_every_worker_reads_it() -> None:
    spec = _spec()
    layout = attrs.evolve(_layout(spec), redundancy=choose_mode(spec, _layout(spec).plan, [], 0.0))
    data = json.loads(layout.to_json())
    assert data["redundancy"]["mode"] == layout.redundancy.mode
    assert JobLayout.from_dict(data) == layout
    assert layout_mode(spec, layout) == layout.redundancy.mode
    plain = JobSpec(**{**attrs.asdict(spec), "redundancy": "lflb", "checkpoint_every": 10, "memory_copy_every": 10})
    fixed = first_layout(plain, {f"n{i}": "a" for i in range(4)})
    assert "redundancy" not in fixed.to_dict() and layout_mode(plain, fixed) == "lflb"  # without auto: as before
    assert with_mode(plain, fixed, kv=None) is fixed
    assert JobLayout.from_dict(fixed.to_dict()).redundancy is None
    with pytest.raises(ValueError, match="names no redundancy mode, and the job's is auto"):
        layout_mode(spec, fixed)
    with pytest.raises(RecordError, match="key 'redundancy' is malformed"):
        JobLayout.from_dict({**data, "redundancy": {**data["redundancy"], "mode": "eager"}})
    assert holds_replicas(plain, None) and not holds_replicas(spec, attrs.evolve(layout.redundancy, mode="none",
                                                                                 lost_s_per_hour={"none": 0.0}))


def test_the_choice_record_round_trips_and_is_checked() -> None:
    spec = _spec()
    layout = attrs.evolve(_layout(spec), redundancy=choose_mode(spec, _layout(spec).plan, [], 0.0))
    record = choice_record(layout, 3.0)
    assert record is not None and record.generation == 0 and record.mode == layout.redundancy.mode
    assert event_from_dict(json.loads(json.dumps(event_to_dict(record)))) == record
    assert choice_record(attrs.evolve(layout, redundancy=None), 3.0) is None
    with pytest.raises(ValueError, match="lost_s_per_hour must map each mode to a finite number"):
        event_from_dict({**event_to_dict(record), "lost_s_per_hour": {"none": "a lot"}})


def test_the_spec_and_the_flags_take_auto_and_refuse_nonsense_in_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert _spec().redundancy == "auto"
    assert JobSpec.from_json(_spec(preemptions_per_node_hour=0.5).to_json()).preemptions_per_node_hour == 0.5
    with pytest.raises(SpecError, match="job spec: 'redundancy' must be in"):
        JobSpec.from_dict({**_spec().to_dict(), "redundancy": "eager"})
    for argv, message in (
        (["run", "--redundancy", "eager"], "argument --redundancy: invalid choice: 'eager'"),
        (["run", "--redundancy", "auto", "--preemption-rate", "-1"], "argument --preemption-rate"),
        (["agent", "--job", "j", "--etcd", "127.0.0.1:1", "--redundancy", "sometimes"], "invalid choice: 'sometimes'"),
    ):
        status = main(argv)
        err = capsys.readouterr().err
        assert status == 2 and message in err and "Traceback" not in err
        assert err.count("\n") == 1, err


def test_the_report_and_the_live_view_show_the_mode_in_force_and_why() -> None:
    events: list[Any] = [RunStart(t=0.0, job="auto", unix_time=1.0, target_nodes=4, stages=4, pipelines=1),
                         *[Join(t=0.0, node=f"n{i}", zone="a") for i in range(4)],
                         _choice(0, "lflb", t=0.5), *_steps(0, [1.0, 1.0]), _choice(1, "eflb", t=4.0),
                         *_steps(1, [1.0, 1.0], t0=5.0), _choice(2, "none", t=8.0)]  # 2 decided, not yet training
    report = compute_report(events)
    assert (report.redundancy_mode, report.redundancy_choices) == ("eflb", 3)
    assert report.redundancy_lost_s_per_hour == {"eflb": 1.0}
    assert report.to_dict()["redundancy_reason"] == "eflb (auto, generation 1): eflb: chosen"
    assert "  redundancy       eflb (auto, generation 1): eflb: chosen" in format_report(report).splitlines()
    state = LiveState()
    state.apply_all(events)
    assert state.summary()["redundancy"] == "eflb"
    assert any("redundancy    none (auto, generation 2)" in line for line in state.summary()["recent"])
    plain = compute_report([event for event in events if not isinstance(event, RedundancyChoice)])
    assert plain.redundancy_mode is None and "redundancy" not in format_report(plain)


def test_a_machine_that_came_back_after_its_worker_failed_was_not_preempted() -> None:
    """n3's worker failed and its agent came back as n3.2: the record of n3's end stops its hours but adds no
    preemption (a market kill of n2 does)."""
    events: list[Any] = [Join(t=0.0, node=f"n{i}", zone="a") for i in range(4)]
    events += [Preemption(t=1800.0, node="n3", zone="a"), Join(t=1800.0, node="n3.2", zone="a", returns="n3"),
               Preemption(t=1800.0, node="n2", zone="a"), Join(t=1800.0, node="n5", zone="a")]
    assert observed_rate(events, 3600.0, prior=0.1) == pytest.approx((1 + 0.1) / (4 + 1))


def test_what_a_failure_costs_is_the_jobs_own() -> None:
    """The median failover and reconfiguration pauses once there are some; a restore redoes half the checkpoint
    interval, or half the job without checkpoints."""
    from bamboo.launch.event_records import Failover, Reconfiguration
    from bamboo.launch.redundancy import failure_model

    spec = _spec(steps=1000, memory_copy_every=0)
    fresh = failure_model(spec, 4, 0.5, 2.0, [])
    assert fresh.checkpoint_interval_s == pytest.approx(2000.0)  # no copies, no checkpoint dir: the whole job
    assert failure_model(_spec(steps=1000, memory_copy_every=5), 4, 0.5, 2.0, []).checkpoint_interval_s == 10.0
    assert (fresh.preemptions_per_node_hour, fresh.nodes) == (0.5, 4)
    history: list[Any] = [Failover(t=1.0, victim="n1", shadow="n0", stage=1, pause_s=p) for p in (0.1, 0.3, 0.2)]
    history += [Reconfiguration(t=2.0, reason="r", pipelines=1, stages=4, standby=0, bytes_moved=0, duration_s=d)
                for d in (4.0, 6.0)]
    seen = failure_model(_spec(steps=1000, checkpoint_dir="/ckpt", checkpoint_every=10, memory_copy_every=50), 4, 0.5,
                         2.0, history)
    assert (seen.detect_s, seen.reconfigure_s, seen.checkpoint_interval_s) == pytest.approx((0.2, 5.0, 20.0))
    assert (seen.pipelines, seen.spare_nodes) == (1, 0)


def test_a_replacement_s_wait_is_the_jobs_own() -> None:
    """How long the job trained on a failover's merged schedule: from each failover to the start of the next
    reconfiguration (its record's time less its pause); the default before any."""
    from bamboo.launch.event_records import Failover, Reconfiguration
    from bamboo.launch.redundancy import failure_model
    from bamboo.schedule.timeouts import REBUILD_AFTER_S

    spec = _spec(steps=1000)
    assert failure_model(spec, 3, 1.0, 0.1, []).rebuild_after_s == REBUILD_AFTER_S
    history: list[Any] = [
        Failover(t=10.0, victim="n1", shadow="n0", stage=1, pause_s=0.1),
        Reconfiguration(t=14.5, reason="r", pipelines=1, stages=3, standby=0, bytes_moved=0, duration_s=0.5),
        Failover(t=20.0, victim="n2", shadow="n1", stage=2, pause_s=0.1),
        Failover(t=21.0, victim="n0", shadow="n2", stage=0, pause_s=0.1),
        Reconfiguration(t=27.0, reason="r", pipelines=1, stages=3, standby=1, bytes_moved=0, duration_s=1.0),
        Failover(t=40.0, victim="n1", shadow="n0", stage=1, pause_s=0.1),  # none after it yet: not counted
    ]
    model = failure_model(spec, 3, 1.0, 0.1, history, pipelines=2, spare_nodes=1)
    assert model.rebuild_after_s == pytest.approx(5.0)  # the median of 4.0, 6.0 and 5.0
    assert (model.pipelines, model.spare_nodes) == (2, 1)


def test_a_mode_measured_on_the_layouts_shape_is_priced_at_its_measured_step() -> None:
    """The model sees no fault-free cost in lflb (its replica's optimizer step and sync fit its bubbles); where the
    job measured lflb 30% slower than none on the same shape (cores that the nodes share), none is chosen at a rate
    where the model alone picks lflb. Steps of a generation in its failover state (a node dead) do not count, nor do
    those of another shape."""
    spec = _spec(stages=2, pipelines=1, preemptions_per_node_hour=1.0)
    plan = first_layout(spec, {"n0": "a", "n1": "b"}).plan
    assert choose_mode(spec, plan, [], now_t=0.0).mode == "lflb"
    history: list[Any] = [
        _choice(0, "none"), *[attrs.evolve(step, nodes_active=2) for step in _steps(0, [1.0] * 5)],
        _choice(1, "lflb", t=9.0), *[attrs.evolve(step, nodes_active=2) for step in _steps(1, [1.3] * 5, t0=10.0)],
        *[attrs.evolve(step, nodes_active=1, duration_s=5.0) for step in _steps(1, [1.0] * 3, t0=20.0)],
        _choice(2, "eflb", t=30.0), *_steps(2, [0.5] * 3, t0=31.0)]  # 4 nodes: another shape
    assert redundancy.measured_steps(history, nodes=2) == {"none": 1.0, "lflb": 1.3}
    measured = choose_mode(spec, plan, history, now_t=40.0)
    assert measured.mode == "none", measured.reason
    assert "measured on this shape: lflb 1.300 s, none 1.000 s" in measured.reason


def test_without_redundancy_a_loss_with_other_pipelines_costs_a_barrier_not_a_restore() -> None:
    from bamboo.schedule import FailureModel

    one = FailureModel(1.0, 4, pipelines=1, restore_s=30.0, checkpoint_interval_s=20.0, rebuild_after_s=60.0)
    assert one.without_redundancy_s(2.0) == one.unprotected_s == 30.0 + 10.0 + 60.0
    two = FailureModel(1.0, 4, pipelines=2, restore_s=30.0, checkpoint_interval_s=20.0, rebuild_after_s=60.0,
                       reconfigure_s=0.5)
    every_peer = 1 - math.exp(-1.0 * 60.0 / 3600.0)
    expected = (1 - every_peer) * (0.5 + 1.0 + 30.0) + every_peer * (30.0 + 10.0)  # a pipeline's share lost: 60 / 2
    assert two.without_redundancy_s(2.0) == pytest.approx(expected)
    spare = attrs.evolve(two, spare_nodes=1)
    assert spare.without_redundancy_s(2.0) == pytest.approx((1 - every_peer) * 1.5 + every_peer * 40.0)
