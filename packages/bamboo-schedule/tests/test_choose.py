"""`--redundancy auto`'s model: each mode's expected loss per hour, and the mode it picks."""

from __future__ import annotations

import pytest
from bamboo.schedule import Costs, FailureModel, choose_redundancy


def _choice(stages: int, microbatches: int, rate: float) -> str:
    return choose_redundancy(Costs(), stages, microbatches, 1.0, FailureModel(rate, 2 * stages)).mode


def test_without_preemptions_no_redundancy_pays() -> None:
    choice = choose_redundancy(Costs(), 4, 8, 1.0, FailureModel(0.0, 8))
    assert choice.mode == "none"
    assert choice.estimates[0].lost_s_per_hour == pytest.approx(0.0, abs=1e-9)
    assert all(e.lost_s_per_hour > 0 for e in choice.estimates[1:])  # every redundant mode costs its overhead


def test_a_low_rate_picks_the_cheap_mode_and_a_high_rate_the_eager_one() -> None:
    """P = 4, M = 4: the bubbles hold every FRC, so eager FRC costs what lazy FRC costs when nothing fails and
    less when something does."""
    assert _choice(4, 4, 0.01) == "none"
    assert _choice(4, 4, 1.0) == "eflb"


def test_where_eager_frc_outgrows_the_bubbles_the_lazy_mode_pays() -> None:
    """P = 4, M = 8: FRC overflows the bubbles, and a failure's extra recomputation costs lflb less than eflb's
    overhead costs every step."""
    assert _choice(4, 8, 0.01) == "none"
    assert _choice(4, 8, 1.0) == "lflb"


def test_the_choice_explains_itself_and_ranks_every_mode() -> None:
    choice = choose_redundancy(Costs(), 4, 8, 2.0, FailureModel(1.0, 8))
    assert choice.estimates[0].mode == choice.mode
    assert sorted(e.mode for e in choice.estimates) == ["efeb", "eflb", "lflb", "none"]
    assert choice.reason.startswith(f"{choice.mode}: least training lost per hour at 1 preemptions per node-hour")
    losses = {e.mode: e.lost_s_per_hour for e in choice.estimates}
    assert losses[choice.mode] == min(losses.values())
    assert choice.as_dict()["estimates"][0]["mode"] == choice.mode  # type: ignore[index]
    steps = {e.mode: e.step_s for e in choice.estimates}
    assert steps["none"] == pytest.approx(2.0) and steps["efeb"] > steps["eflb"] >= steps["lflb"] > 2.0


def test_one_stage_has_only_no_redundancy_to_choose() -> None:
    assert choose_redundancy(Costs(), 1, 4, 1.0, FailureModel(5.0, 4)).mode == "none"


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"preemptions_per_node_hour": -1.0, "nodes": 4}, "preemptions_per_node_hour"),
    ({"preemptions_per_node_hour": 0.1, "nodes": 0}, "nodes"),
    ({"preemptions_per_node_hour": 0.1, "nodes": 4, "checkpoint_interval_s": 0.0}, "checkpoint_interval_s"),
    ({"preemptions_per_node_hour": 0.1, "nodes": 4, "pipelines": 0}, "pipelines"),
    ({"preemptions_per_node_hour": 0.1, "nodes": 4, "spare_nodes": -1}, "spare_nodes"),
])
def test_bad_failure_models_are_named(kwargs: dict[str, float], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        FailureModel(**kwargs)  # type: ignore[arg-type]


def test_a_step_time_must_be_positive() -> None:
    with pytest.raises(ValueError, match="step_s must be > 0"):
        choose_redundancy(Costs(), 4, 8, 0.0, FailureModel(0.1, 8))


def test_a_step_measured_under_another_mode_stands_for_nones_shorter_step() -> None:
    """The same job measured under eflb: its step is eflb's, so none's is shorter by the simulated ratio, and the
    choice is the one made from none's step."""
    failures = FailureModel(1.0, 8)
    from_none = choose_redundancy(Costs(), 4, 8, 1.0, failures)
    eflb = next(e for e in from_none.estimates if e.mode == "eflb")
    from_eflb = choose_redundancy(Costs(), 4, 8, eflb.step_s, failures, measured_mode="eflb")
    assert from_eflb.mode == from_none.mode
    assert [e.as_dict() for e in from_eflb.estimates] == [e.as_dict() for e in from_none.estimates]


def test_stage_work_gives_costs_in_proportion() -> None:
    from bamboo.schedule import stage_work_costs

    costs = stage_work_costs([1.0, 3.0])
    assert [(s.forward_ms, s.backward_ms) for s in costs.stages] == [(1 / 3, 2 / 3), (1.0, 2.0)]
    with pytest.raises(ValueError, match="one non-negative figure per stage"):
        stage_work_costs([])


def test_failures_faster_than_redundancy_is_rebuilt_still_favour_redundancy() -> None:
    """At `make demo`'s market rate (about 35 preemptions per node-hour of wall time, a loss every 13 s on 8 nodes)
    a neighbour often goes before redundancy is rebuilt, but not always: the failures redundancy absorbs keep it
    ahead of `none`, which restores from a checkpoint after every one."""
    choice = choose_redundancy(Costs(), 4, 8, 1.0, FailureModel(34.8, 8))
    assert choice.mode != "none"
    losses = {e.mode: e.per_failure_s for e in choice.estimates}
    assert losses["none"] > max(losses[m] for m in ("lflb", "eflb", "efeb"))


def test_one_pipeline_without_a_spare_waits_for_a_replacement_under_none_alone() -> None:
    """Without redundancy a lost node of the only pipeline stops the job until a replacement starts
    (``rebuild_after_s``); with a spare node, or with other pipelines that train on, nothing waits. A redundant mode
    waits only when a second loss comes before the rebuild."""
    alone = FailureModel(1.0, 4, restore_s=30.0, checkpoint_interval_s=600.0, rebuild_after_s=60.0)
    assert alone.unprotected_s == pytest.approx(30.0 + 300.0 + 60.0)
    assert FailureModel(1.0, 4, restore_s=30.0, checkpoint_interval_s=600.0, rebuild_after_s=60.0,
                        spare_nodes=1).unprotected_s == pytest.approx(330.0)
    assert FailureModel(1.0, 8, restore_s=30.0, checkpoint_interval_s=600.0, rebuild_after_s=60.0,
                        pipelines=2).unprotected_s == pytest.approx(330.0)
    choice = choose_redundancy(Costs(), 4, 8, 1.0, alone)
    none = next(e for e in choice.estimates if e.mode == "none")
    assert none.per_failure_s == pytest.approx(390.0)


def test_a_near_tie_at_a_high_rate_goes_to_redundancy_when_the_only_pipeline_would_wait() -> None:
    """A heavy-churn run's case (3 nodes, one pipeline, no spare; 152 preemptions per node-hour, a replacement
    about 4 s after each loss, in-memory copies every 1.2 s): `none` and `lflb` were within 0.2 s an hour of each
    other, because none's wait for the replacement was not counted; it is the larger part of none's loss."""
    common = {"restore_s": 0.5, "checkpoint_interval_s": 1.2, "rebuild_after_s": 4.0, "reconfigure_s": 0.4,
              "detect_s": 0.3}
    waits = choose_redundancy(Costs(), 3, 6, 0.12, FailureModel(152.0, 3, **common))
    spare = choose_redundancy(Costs(), 3, 6, 0.12, FailureModel(152.0, 3, spare_nodes=1, **common))
    loss = {e.mode: e.per_failure_s for e in waits.estimates}
    assert waits.mode != "none" and loss["none"] > max(loss[m] for m in ("lflb", "eflb"))
    assert spare.mode == "none"  # a spare takes the place at once: the wait was what made none lose
    assert {e.mode: e.per_failure_s for e in spare.estimates}["none"] == pytest.approx(0.5 + 0.6)
