"""A second failure in a pipeline that has already failed over: from the steady (merged) schedule of
a later iteration, and mid-remainder of the same iteration. Every plan validates and accounts for
all work of the iteration exactly once; a second victim next to a failed stage is a consecutive failure."""

from __future__ import annotations

import attrs
import pytest
from bamboo.schedule import Kind, generate, one_f_one_b
from bamboo.schedule.failover import (
    ConsecutiveFailure,
    failover_schedule,
    merged_schedule,
    progress_at,
    validate_failover,
)
from bamboo.schedule.validate import ScheduleError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

MODES = ["lflb", "eflb", "efeb"]


def _adjacent(a: int, b: int, stages: int) -> bool:
    return (a - b) % stages in (1, stages - 1)


@st.composite
def second_failures(draw: st.DrawFn) -> tuple[str, int, int, str, int, int, int]:
    stages = draw(st.integers(3, 8))
    first = draw(st.integers(0, stages - 1))
    second = draw(st.sampled_from([n for n in range(stages) if n != first]))
    return (
        draw(st.sampled_from(["1f1b", "gpipe"])),
        stages,
        draw(st.integers(1, 8)),
        draw(st.sampled_from(MODES)),
        first,
        second,
        draw(st.integers(0, 2**31)),
    )


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=second_failures())
def test_second_failure_in_a_later_iteration_at_every_index(case, random_cut) -> None:  # type: ignore[no-untyped-def]
    policy, stages, microbatches, rc, first, second, seed = case
    schedule = generate(policy, stages, microbatches, rc)
    steady = failover_schedule(schedule, [first], random_cut(schedule, seed)).steady
    if _adjacent(first, second, stages):
        with pytest.raises(ConsecutiveFailure):
            failover_schedule(steady, [second], dict.fromkeys(steady.nodes, 0))
        return
    for index in range(len(steady.streams[second]) + 1):
        plan = failover_schedule(steady, [second], progress_at(steady, {second: index}))
        validate_failover(plan)
        assert set(plan.survivors) == set(range(stages)) - {first, second}
    assert plan.steady == merged_schedule(schedule, [first, second])


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=second_failures())
def test_second_failure_during_the_remainder_at_every_index(case, random_cut) -> None:  # type: ignore[no-untyped-def]
    policy, stages, microbatches, rc, first, second, seed = case
    schedule = generate(policy, stages, microbatches, rc)
    plan = failover_schedule(schedule, [first], random_cut(schedule, seed))
    remainder = plan.remainder
    if _adjacent(first, second, stages):
        with pytest.raises(ConsecutiveFailure):
            failover_schedule(plan, [second], dict.fromkeys(remainder.nodes, 0))
        return
    cuts = [random_cut(remainder, seed + 1)]
    cuts += [progress_at(remainder, {second: i}) for i in range(len(remainder.streams[second]) + 1)]
    for cut in cuts:
        again = failover_schedule(plan, [second], cut)
        validate_failover(again)  # the first plan's prefixes + the remainder's prefixes + the new remainder
        assert again.earlier is plan
        assert again.recovered == (frozenset({first}) - plan.persisted) | (frozenset({second}) - again.persisted)
        for n in again.survivors:
            assert again.executed[n] == plan.executed[n] + remainder.streams[n][: cut[n]]
    assert again.steady == merged_schedule(schedule, [first, second])


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stages=st.integers(6, 9),
    microbatches=st.integers(1, 6),
    rc=st.sampled_from(MODES),
    seed=st.integers(0, 2**31),
)
def test_three_failures_in_one_iteration(stages, microbatches, rc, seed, random_cut) -> None:  # type: ignore[no-untyped-def]
    schedule = one_f_one_b(stages, microbatches, rc)
    plan = failover_schedule(schedule, [0], random_cut(schedule, seed))
    plan = failover_schedule(plan, [2], random_cut(plan.remainder, seed + 1))
    plan = failover_schedule(plan, [4], random_cut(plan.remainder, seed + 2))
    validate_failover(plan)
    assert plan.steady.placement[:5] == (stages - 1, 1, 1, 3, 3)


def test_steady_schedule_after_a_second_failure_runs_two_merged_stages() -> None:
    schedule = one_f_one_b(6, 4, "eflb")
    steady = failover_schedule(schedule, [2], progress_at(schedule, {2: 5})).steady
    plan = failover_schedule(steady, [5], progress_at(steady, {5: 7}))
    validate_failover(plan)
    assert plan.remainder.placement == (0, 1, 1, 3, 4, 4)
    assert plan.steady.shadows == (None, 0, None, None, 3, None)
    shadow = [str(i) for i in plan.remainder.streams[4]]
    assert any(t.startswith("5BR") for t in shadow) and "5AR" in shadow


def test_a_second_victim_next_to_a_taken_over_stage_names_the_lost_stages() -> None:
    schedule = one_f_one_b(6, 4, "eflb")
    steady = merged_schedule(schedule, [2])
    with pytest.raises(ConsecutiveFailure) as info:  # node 1 runs stages 1 and 2; 2 has no replica left
        failover_schedule(steady, [1], dict.fromkeys(steady.nodes, 0))
    assert info.value.pair == (1, 2) and info.value.lost == (1, 2) and info.value.earlier == (2,)
    assert "lost stages [1, 2]" in str(info.value) and "failed earlier [2]" in str(info.value)
    with pytest.raises(ConsecutiveFailure) as info:  # stage 3's replica died with node 2
        failover_schedule(steady, [3], dict.fromkeys(steady.nodes, 0))
    assert info.value.pair == (2, 3) and info.value.lost == (3,)
    with pytest.raises(ValueError, match=r"victims \[2\] had already failed"):
        failover_schedule(steady, [2], dict.fromkeys(steady.nodes, 0))


def test_bad_progress_into_the_remainder_is_named() -> None:
    schedule = one_f_one_b(6, 4, "eflb")
    plan = failover_schedule(schedule, [2], progress_at(schedule, {2: 5}))
    with pytest.raises(ValueError, match=r"progress 999 of node 4 out of range 0..\d+ \(its remainder\)"):
        failover_schedule(plan, [0], {**dict.fromkeys(plan.survivors, 0), 4: 999})
    with pytest.raises(ValueError, match="progress of surviving node 3 is missing"):
        failover_schedule(plan, [0], {1: 0, 4: 0, 5: 0})


def test_validator_counts_the_first_victims_redone_work_in_a_chained_plan() -> None:
    schedule = one_f_one_b(6, 4, "eflb")
    plan = failover_schedule(schedule, [2], progress_at(schedule, {2: 9}))
    again = failover_schedule(plan, [5], progress_at(plan.remainder, {5: 4}))
    validate_failover(again)
    brc = next(
        (n, i) for n, s in again.remainder.streams.items() for i, instr in enumerate(s)
        if instr.kind is Kind.BRC and instr.stage == 2
    )
    n, i = brc
    streams = dict(again.remainder.streams)
    streams[n] = streams[n][:i] + streams[n][i + 1 :]
    broken = attrs.evolve(again, remainder=attrs.evolve(again.remainder, streams=streams))
    with pytest.raises(ScheduleError):
        validate_failover(broken)
