"""Failover: merged streams validate at every failure point and account for all work exactly once."""

from __future__ import annotations

import attrs
import pytest
from bamboo.schedule import Kind, generate, one_f_one_b
from bamboo.schedule.failover import (
    ConsecutiveFailure,
    check_victims,
    failover_schedule,
    merged_schedule,
    placement_after,
    progress_at,
    validate_failover,
)
from bamboo.schedule.validate import ScheduleError, validate
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

MODES = ["lflb", "eflb", "efeb"]


@st.composite
def failure_cases(draw: st.DrawFn) -> tuple[str, int, int, str, frozenset[int], int]:
    stages = draw(st.integers(2, 12))
    microbatches = draw(st.integers(1, 32))
    victims = draw(st.sets(st.integers(0, stages - 1), min_size=1, max_size=max(1, stages // 2)))
    assume(all((v + 1) % stages not in victims for v in victims))
    return (
        draw(st.sampled_from(["1f1b", "gpipe"])),
        stages,
        microbatches,
        draw(st.sampled_from(MODES)),
        frozenset(victims),
        draw(st.integers(0, 2**31)),
    )


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=failure_cases())
def test_failover_at_any_consistent_cut_validates(case, random_cut) -> None:  # type: ignore[no-untyped-def]
    policy, stages, microbatches, rc, victims, seed = case
    schedule = generate(policy, stages, microbatches, rc)
    progress = random_cut(schedule, seed)
    plan = failover_schedule(schedule, victims, progress)
    validate_failover(plan)  # deadlock-free remainder, dependencies, every F/B once, AR/OPT once
    assert set(plan.remainder.nodes) == set(range(stages)) - victims
    for v in victims:
        assert plan.steady.placement[v] == (v - 1) % stages


@settings(max_examples=25, deadline=None)
@given(
    stages=st.integers(2, 6),
    microbatches=st.integers(1, 6),
    rc=st.sampled_from(MODES),
    policy=st.sampled_from(["1f1b", "gpipe"]),
    victim=st.integers(0, 5),
)
def test_every_failure_index_of_a_single_victim(stages, microbatches, rc, policy, victim) -> None:  # type: ignore[no-untyped-def]
    victim %= stages
    schedule = generate(policy, stages, microbatches, rc)
    for index in range(len(schedule.streams[victim]) + 1):
        plan = failover_schedule(schedule, [victim], progress_at(schedule, {victim: index}))
        validate_failover(plan)


@pytest.mark.parametrize(("stages", "victims", "pair"), [(4, {1, 2}, (1, 2)), (5, {4, 0}, (4, 0)), (2, {0, 1}, (0, 1))])
def test_adjacent_victims_raise_consecutive_failure(stages: int, victims: set[int], pair: tuple[int, int]) -> None:
    schedule = one_f_one_b(stages, 4, "eflb")
    with pytest.raises(ConsecutiveFailure) as info:
        failover_schedule(schedule, victims, dict.fromkeys(range(stages), 0))
    assert info.value.pair == pair
    assert f"stages {pair[0]} and {pair[1]}" in str(info.value)


def test_bad_failover_inputs_are_named() -> None:
    schedule = one_f_one_b(4, 4, "eflb")
    with pytest.raises(ValueError, match=r"victim stages \[7\] out of range 0..3"):
        failover_schedule(schedule, [7], {})
    with pytest.raises(ValueError, match="progress of surviving node 0 is missing"):
        failover_schedule(schedule, [2], {1: 0, 3: 0})
    with pytest.raises(ValueError, match="progress 999 of node 1 out of range"):
        failover_schedule(schedule, [2], {0: 0, 1: 999, 3: 0})
    with pytest.raises(ValueError, match="rc=none"):
        failover_schedule(one_f_one_b(4, 4), [2], dict.fromkeys(range(4), 0))


def _plan_in_backward_phase():  # type: ignore[no-untyped-def]
    schedule = one_f_one_b(4, 6, "eflb")
    index = [str(i) for i in schedule.streams[2]].index("2B3")
    plan = failover_schedule(schedule, [2], progress_at(schedule, {2: index}))
    validate_failover(plan)
    return schedule, plan


def test_successor_resends_the_gradients_it_sent_the_victim_first() -> None:
    _schedule, plan = _plan_in_backward_phase()
    sent_before = [i for i in plan.executed[3] if i.kind is Kind.SEND_GRAD and i.peer == 2]
    assert sent_before, "the cut should be late enough for node 3 to have sent gradients"
    resent = plan.resent[3]
    assert [(i.stage, i.microbatch) for i in resent] == [(i.stage, i.microbatch) for i in sent_before]
    assert all(i.peer == 1 for i in resent)
    assert plan.remainder.streams[3][: len(resent)] == resent  # the victim's external communication comes first


def test_shadow_swaps_in_and_runs_brc_for_every_microbatch_and_takes_the_all_reduce() -> None:
    _schedule, plan = _plan_in_backward_phase()
    shadow = [str(i) for i in plan.remainder.streams[1]]
    for k in range(6):
        assert f"2BR{k}" in shadow
        assert f"2F{k}" not in shadow
    for k in range(6):
        if f"2FR{k}" in [str(i) for i in plan.executed[1]] and f"2SI{k}" not in shadow[: shadow.index(f"2BR{k}")]:
            pytest.fail(f"stash of microbatch {k} was not swapped in before its BRC")
    assert shadow.index("2AR") > max(shadow.index(f"2BR{k}") for k in range(6))
    assert "2OPT" in shadow
    # messages between victim and shadow became local; nobody talks to the victim any more
    assert all(i.peer != 2 for s in plan.remainder.streams.values() for i in s)
    # the replica syncs that involved the victim are gone
    assert "2RY<2" not in shadow and "3SY>2" not in [str(i) for i in plan.remainder.streams[3]]


def test_victims_executed_work_is_lost_but_the_shadows_frc_counts() -> None:
    _schedule, plan = _plan_in_backward_phase()
    iteration = plan.iteration_streams()
    frc_before = [i.microbatch for i in plan.executed[1] if i.kind is Kind.FRC and i.stage == 2]
    frc_after = [i.microbatch for i in plan.remainder.streams[1] if i.kind is Kind.FRC and i.stage == 2]
    assert sorted(frc_before + frc_after) == list(range(6))
    assert not any(i.kind is Kind.FORWARD and i.stage == 2 for s in iteration.values() for i in s)


def test_validator_catches_a_missing_resend_and_a_missing_brc() -> None:
    _schedule, plan = _plan_in_backward_phase()
    streams = dict(plan.remainder.streams)
    streams[3] = streams[3][1:]
    with pytest.raises(ScheduleError):
        validate_failover(attrs.evolve(plan, remainder=attrs.evolve(plan.remainder, streams=streams)))
    streams = dict(plan.remainder.streams)
    streams[1] = tuple(i for i in streams[1] if str(i) != "2BR0")
    with pytest.raises(ScheduleError, match="2AR runs before its input"):
        validate_failover(attrs.evolve(plan, remainder=attrs.evolve(plan.remainder, streams=streams)))


def test_inconsistent_cut_is_rejected() -> None:
    schedule = one_f_one_b(3, 2, "eflb")
    progress = dict.fromkeys(range(3), 0)
    progress[1] = 1  # node 1 has "received" activation 0 that node 0 never sent
    with pytest.raises(ValueError, match="inconsistent cut"):
        failover_schedule(schedule, [2], progress)


def test_failure_after_the_victims_sync_redoes_nothing_for_it() -> None:
    schedule = one_f_one_b(3, 3, "eflb")
    progress = {n: len(s) for n, s in schedule.streams.items()}
    plan = failover_schedule(schedule, [1], progress)
    validate_failover(plan)
    assert plan.persisted == frozenset({1})
    assert all(not s for s in plan.remainder.streams.values())


def test_first_stage_victim_is_taken_over_by_the_last_node_which_loads_the_input() -> None:
    schedule = one_f_one_b(4, 4, "eflb")
    plan = failover_schedule(schedule, [0], progress_at(schedule, {0: 3}))
    validate_failover(plan)
    last = [str(i) for i in plan.remainder.streams[3]]
    assert any(t.startswith("0L") for t in last)
    assert any(t.startswith("0SA") and t.endswith(">1") for t in last)  # node 3 now feeds stage 1
    assert plan.steady.placement == (3, 1, 2, 3)


def test_two_failures_in_one_iteration() -> None:
    schedule = one_f_one_b(6, 8, "eflb")
    plan = failover_schedule(schedule, [1, 4], progress_at(schedule, {1: 15, 4: 15}))
    validate_failover(plan)
    assert plan.steady.placement == (0, 0, 2, 3, 3, 5)


@pytest.mark.parametrize("rc", MODES)
def test_steady_schedule_runs_both_stages_on_the_shadow(rc: str) -> None:
    schedule = one_f_one_b(5, 6, rc)
    steady = merged_schedule(schedule, [3])
    validate(steady)
    assert steady.nodes == (0, 1, 2, 4)
    assert steady.stages_on(2) == (2, 3)
    assert steady.shadows[3] is None and steady.shadows[4] is None  # unprotected until reconfiguration
    shadow = [i for i in steady.streams[2] if i.kind in (Kind.FORWARD, Kind.BACKWARD)]
    assert {i.stage for i in shadow} == {2, 3}
    assert not any(i.kind in (Kind.FRC, Kind.BRC) and i.stage == 3 for s in steady.streams.values() for i in s)


def test_progress_at_is_a_consistent_cut_and_stops_the_victim_at_its_index() -> None:
    schedule = one_f_one_b(4, 4, "efeb")
    progress = progress_at(schedule, {2: 9})
    assert progress[2] <= 9
    with pytest.raises(ValueError, match="failure index 999 for stage 2 out of range"):
        progress_at(schedule, {2: 999})


@pytest.mark.parametrize("rc", MODES)
@pytest.mark.parametrize("policy", ["1f1b", "gpipe"])
def test_largest_property_sizes_at_several_cuts(rc: str, policy: str, random_cut) -> None:  # type: ignore[no-untyped-def]
    schedule = generate(policy, 12, 32, rc)
    for victims, seed in [({0, 5, 9}, 1), ({11}, 2), ({3, 7}, 3), ({1, 3, 5, 7, 9}, 4)]:
        validate_failover(failover_schedule(schedule, victims, random_cut(schedule, seed)))
    for victim, fraction in [(6, 0.3), (11, 0.8)]:
        index = int(len(schedule.streams[victim]) * fraction)
        validate_failover(failover_schedule(schedule, [victim], progress_at(schedule, {victim: index})))


def test_validator_catches_work_done_twice_in_the_failing_iteration() -> None:
    _schedule, plan = _plan_in_backward_phase()
    streams = dict(plan.remainder.streams)
    shadow = list(streams[1])
    index = next(i for i, instr in enumerate(shadow) if str(instr) == "2BR5")
    streams[1] = (*shadow[: index + 1], shadow[index], *shadow[index + 1 :])
    with pytest.raises(ScheduleError, match="backward of stage 2 microbatch 5 happens 2 times") as info:
        validate_failover(attrs.evolve(plan, remainder=attrs.evolve(plan.remainder, streams=streams)))
    assert info.value.grid.count(">>2BR5<<") == 2


def test_validate_failover_checks_the_cut_again_when_the_prefixes_change() -> None:
    schedule = generate("1f1b", 4, 4, "eflb")
    plan = failover_schedule(schedule, [1], progress_at(schedule, {1: 12}))
    validate_failover(plan)  # the cut failover_schedule checked is not checked twice
    plan.executed[2] = schedule.streams[2]  # node 2 "completed" receives that node 1 never sent
    with pytest.raises(ScheduleError, match="inconsistent cut"):
        validate_failover(plan)
    evolved = attrs.evolve(plan, executed={**plan.executed, 2: schedule.streams[2]})
    with pytest.raises(ScheduleError, match="inconsistent cut"):
        validate_failover(evolved)


def test_check_victims_and_placement_after_are_the_public_failover_rules() -> None:
    schedule = one_f_one_b(4, 4, "eflb")
    assert check_victims(schedule, [1, 3]) == frozenset({1, 3})
    assert placement_after(schedule, {1, 3}) == ((0, 0, 2, 2), (None, None, None, None))
    assert placement_after(schedule, {2}) == ((0, 1, 1, 3), (3, 0, None, None))
    with pytest.raises(ConsecutiveFailure) as info:
        check_victims(schedule, [2, 3])
    assert info.value.pair == (2, 3) and info.value.lost == (2, 3)
    # after a failover, a victim next to the taken-over stage: node 1 runs stages 1 and 2
    steady = merged_schedule(schedule, [2])
    assert steady.placement == placement_after(schedule, {2})[0]
    assert steady.shadows == placement_after(schedule, {2})[1]
    with pytest.raises(ConsecutiveFailure) as info:
        check_victims(steady, [1])
    assert info.value.lost == (1, 2) and info.value.earlier == (2,)
    with pytest.raises(ValueError, match=r"victims \[2\] had already failed"):
        check_victims(steady, [2])


@pytest.mark.parametrize(("stages", "microbatches"), [(2, 8), (3, 6), (4, 8), (4, 16)])
def test_failover_of_a_placement_refined_for_costs_validates_at_every_index(stages: int, microbatches: int) -> None:
    """With a cost model, eflb's FRCs are placed by local search (they may run where they do not fit whole, and
    so delay normal work): the failover rules hold for those streams too, for every victim at every index, and a
    second victim in the next iteration."""
    from bamboo.schedule.simulate import Costs

    cost = Costs.bert_like(stages).linearizer_cost()
    schedule = one_f_one_b(stages, microbatches, "eflb", cost, refine=True)
    validate(schedule)
    assert one_f_one_b(stages, microbatches, "eflb", cost).streams != schedule.streams  # the search moved some
    for victim in range(stages):
        for index in range(len(schedule.streams[victim]) + 1):
            plan = failover_schedule(schedule, [victim], progress_at(schedule, {victim: index}))
            validate_failover(plan)
        if stages > 3:
            second = (victim + 2) % stages
            again = failover_schedule(plan.steady, [second], progress_at(plan.steady, {second: 3}))
            validate_failover(again)
