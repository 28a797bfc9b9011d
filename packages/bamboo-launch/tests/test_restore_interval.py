"""``--checkpoint-every auto`` / ``--memory-copy-every auto``: Young's rule on hand-computed cases, the cost of a
restore point read from step records, and the interval carried by the layout and read by the spec."""

from __future__ import annotations

import json
import math
from typing import Any

import attrs
import pytest
from bamboo.launch.coordinator_layouts import first_layout
from bamboo.launch.event_records import Preemption, Step, event_from_dict, event_to_dict
from bamboo.launch.redundancy import LayoutChoices, choose, failure_model
from bamboo.launch.restore_interval import (
    ASSUMED_BOUNDARY_STEPS,
    UNMEASURED_MIN_STEPS,
    BoundaryCost,
    choose_restore_every,
    measured_boundary,
)
from bamboo.launch.spec import AUTO_EVERY, DEFAULT_CHECKPOINT_EVERY, MEMORY_COPY_EVERY, JobSpec, steps_or_auto
from bamboo.launch.timeouts import RESTORE_EVERY_MAX_S
from bamboo.reconfig import JobLayout

LAYER = {"param_bytes": 400, "optimizer_bytes": 800, "compute_cost": 100.0}


def _spec(**changes: Any) -> JobSpec:
    fields: dict[str, Any] = {"job": "points", "stages": 2, "pipelines": 2, "steps": 1000, "micro_batches": 4,
                              "created_unix": 1.0, "layers": [LAYER] * 4, "config": {}, "redundancy": "lflb"}
    return JobSpec(**{**fields, **changes})


def _steps(generation: int, intervals: list[float], every: int, start_t: float = 0.0) -> list[Step]:
    """Step records 1.. of ``generation`` whose intervals are ``intervals``, a restore point after every
    ``every``-th step."""
    t, records = start_t, []
    for number, interval in enumerate([0.0, *intervals], start=1):
        t += interval
        records.append(Step(t=t, step=number, samples=8, loss=1.0, nodes_active=4, duration_s=0.1,
                            generation=generation, restore_point=number % every == 0))
    return records


def test_youngs_rule_on_a_hand_computed_case() -> None:
    # 36 preemptions per node-hour on 10 nodes: 0.1 restores a second; a point costs 0.2 s: T = sqrt(2 * 0.2 / 0.1)
    # = 2 s, 20 steps of 0.1 s.
    measured = BoundaryCost(cost_s=0.2, step_s=0.1, with_point=3, without=30)
    chosen = choose_restore_every(36.0, 10, step_s=5.0, boundary=measured)  # the measured step wins
    assert chosen.steps == 20
    assert "every 20 steps of 0.100 s" in chosen.reason and "0.200 s measured over 3 boundaries" in chosen.reason
    # Before any measurement a point costs ASSUMED_BOUNDARY_STEPS steps: 0.5 s of a 0.5 s step, T = sqrt(10) s.
    assumed = choose_restore_every(36.0, 10, step_s=0.5, boundary=None)
    assert assumed.steps == round(math.sqrt(2 * ASSUMED_BOUNDARY_STEPS * 0.5 / 0.1) / 0.5) == 6
    # ... and with the step assumed too, no fewer than the fixed default's steps
    unmeasured = choose_restore_every(36.0, 10, step_s=0.5, boundary=None, step_assumed=True)
    assert unmeasured.steps == UNMEASURED_MIN_STEPS and "before a step is measured" in unmeasured.reason
    assert choose_restore_every(0.1, 10, step_s=0.5, boundary=None, step_assumed=True).steps > UNMEASURED_MIN_STEPS


def test_the_interval_is_bounded_by_one_step_and_by_the_longest_interval() -> None:
    assert choose_restore_every(0.0, 8, step_s=2.0, boundary=None).steps == RESTORE_EVERY_MAX_S / 2.0
    free = BoundaryCost(cost_s=0.0, step_s=0.1, with_point=1, without=1)
    assert choose_restore_every(1000.0, 8, step_s=1.0, boundary=free).steps == 1
    assert choose_restore_every(1e-9, 8, step_s=1.0, boundary=None).steps == RESTORE_EVERY_MAX_S
    with pytest.raises(ValueError, match="step_s must be a positive number"):
        choose_restore_every(1.0, 8, step_s=0.0, boundary=None)


def test_a_higher_preemption_rate_takes_restore_points_more_often() -> None:
    steps = [choose_restore_every(rate, 6, step_s=0.1, boundary=None).steps for rate in (0.1, 1.0, 10.0, 100.0)]
    assert steps == sorted(steps, reverse=True) and steps[0] > steps[-1]


def test_the_cost_of_a_restore_point_is_read_from_the_step_intervals_that_held_one() -> None:
    # every 5th step holds a point: its next interval is 0.3 s against 0.1 s: a point costs 0.2 s
    intervals = [0.3 if (number - 1) % 5 == 0 and number > 1 else 0.1 for number in range(2, 31)]
    records = _steps(3, intervals, every=5)
    cost = measured_boundary(records)
    assert cost is not None and cost.cost_s == pytest.approx(0.2) and cost.step_s == pytest.approx(0.1)
    assert cost.with_point == 5 and cost.without == 24
    # an older generation's records do not count when the newest has both kinds; a rewritten record neither
    older = _steps(2, [1.0] * 20, every=2)
    again = attrs.evolve(records[4], t=records[4].t + 50.0)
    assert measured_boundary([*older, *records, again]) == cost
    assert measured_boundary(_steps(4, [0.1] * 3, every=10)) is None  # no interval held a point yet
    assert measured_boundary([]) is None


def test_a_step_record_writes_its_restore_point_only_when_it_took_one() -> None:
    plain, point = _steps(0, [0.1], every=2)
    assert "restore_point" not in event_to_dict(plain)
    assert event_to_dict(point)["restore_point"] is True
    for record in (plain, point):
        assert event_from_dict(json.loads(json.dumps(event_to_dict(record)))) == record


def test_the_spec_takes_the_layouts_interval_only_for_auto() -> None:
    auto = _spec()
    assert auto.checkpoint_every == auto.memory_copy_every == AUTO_EVERY and auto.chooses_restore_points
    assert auto.checkpoint_interval(37) == auto.memory_copy_interval(37) == 37
    assert auto.checkpoint_interval(None) == DEFAULT_CHECKPOINT_EVERY  # a layout written by an older launcher
    assert auto.memory_copy_interval(None) == MEMORY_COPY_EVERY
    fixed = _spec(checkpoint_every=25, memory_copy_every=0)
    assert not fixed.chooses_restore_points
    assert fixed.checkpoint_interval(37) == 25 and fixed.memory_copy_interval(37) == 0
    mixed = _spec(checkpoint_every=25)
    assert mixed.chooses_restore_points and mixed.memory_copy_interval(37) == 37
    assert JobSpec.from_json(auto.to_json()) == auto
    assert steps_or_auto("auto") == AUTO_EVERY and steps_or_auto("12") == 12
    with pytest.raises(ValueError):
        steps_or_auto("often")
    with pytest.raises(ValueError, match="checkpoint_every"):
        _spec(checkpoint_every="sometimes")
    with pytest.raises(ValueError, match="memory_copy_every"):
        _spec(memory_copy_every=-1)


def test_a_layout_decision_chooses_the_interval_and_the_layout_carries_it() -> None:
    spec = _spec()
    plan = first_layout(spec, {f"n{i}": "a" for i in range(4)}).plan
    quiet = choose(spec, plan, [], now_t=0.0)
    assert quiet.redundancy is None and quiet.restore_every is not None
    # the job's own preemptions: 20 in 4 node-hours (with the prior's node-hour at 0.1), measured steps of 0.1 s
    busy_events = [*_steps(1, [0.3 if n % 10 == 1 and n > 1 else 0.1 for n in range(2, 101)], every=10),
                   *[Preemption(t=float(i), node=f"m{i}", zone="a") for i in range(20)]]
    busy = choose(spec, plan, busy_events, now_t=4 * 3600.0 / 4)
    assert busy.restore_every is not None and busy.restore_every < quiet.restore_every
    assert choose(_spec(checkpoint_every=10, memory_copy_every=10), plan, busy_events, 10.0) == LayoutChoices()
    layout = attrs.evolve(first_layout(spec, {f"n{i}": "a" for i in range(4)}), restore_every=busy.restore_every)
    data = json.loads(layout.to_json())
    assert data["restore_every"] == busy.restore_every and JobLayout.from_dict(data) == layout
    assert "restore_every" not in first_layout(spec, {f"n{i}": "a" for i in range(4)}).to_dict()
    # the mode's failure model redoes half of the chosen interval at a restore
    model = failure_model(_spec(steps=100_000), 4, 1.0, 0.5, [], restore_every=40)
    assert model.checkpoint_interval_s == 40 * 0.5


def test_under_auto_redundancy_the_reason_says_where_the_restore_points_are() -> None:
    spec = _spec(redundancy="auto")
    plan = first_layout(spec, {f"n{i}": "a" for i in range(4)}).plan
    chosen = choose(spec, plan, [], now_t=0.0)
    assert chosen.redundancy is not None and chosen.restore_every is not None
    assert f"restore points every {chosen.restore_every} steps" in chosen.redundancy.reason
