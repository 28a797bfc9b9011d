"""The `--kill` syntax (per-kill step, /recovery) and when a `KillPoint` fires; no processes."""

from __future__ import annotations

import argparse
import itertools

import pytest
from bamboo.rc.cli import _kill_points
from bamboo.rc.faults import KillPoint
from bamboo.schedule import Instruction


def test_kill_points_keep_the_old_form_and_take_a_step_and_recovery() -> None:
    assert _kill_points("1@1F2") == ((1, 0, "1F2", None, False),)
    assert _kill_points("2:1@-1,3@2SA0>3") == ((2, 1, "-1", None, False), (3, 0, "2SA0>3", None, False))
    assert _kill_points("3@3B2/2") == ((3, 0, "3B2", 2, False),)
    assert _kill_points("3@3B2/1/recovery,0@0/recovery") == ((3, 0, "3B2", 1, True), (0, 0, "0", None, True))


@pytest.mark.parametrize("text", ["1", "1@", "x@1F0", "1@1F0/", "1@1F0/x", "1@1F0/recovery/2", "1@1F0/1/2"])
def test_bad_kill_points_are_one_line_errors(text: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match=r"expected STAGE\[:PIPELINE\]@INSTRUCTION\[/STEP\]\[/recovery\]"):
        _kill_points(text)


def test_a_recovery_kill_point_fires_only_in_a_failover_remainder() -> None:
    b2 = Instruction.parse("3B2")
    normal = KillPoint(3, 0, "3B2", step=1)
    recovery = KillPoint(3, 0, "3B2", step=1, in_recovery=True)
    assert normal.matches(1, b2, 5, 10) and not normal.matches(1, b2, 5, 10, recovering=True)
    assert recovery.matches(1, b2, 5, 10, recovering=True) and not recovery.matches(1, b2, 5, 10)
    assert not recovery.matches(2, b2, 5, 10, recovering=True)
    by_index = KillPoint(3, 0, "-1", step=1, in_recovery=True)
    assert by_index.matches(1, b2, 3, 4, recovering=True) and not by_index.matches(1, b2, 2, 4, recovering=True)


def test_seeded_plans_of_one_pipeline_are_the_same_as_before_several_pipelines() -> None:
    """A soak's seed names its kill points: the plans for D = 1 are those the notes' soak figures came from."""
    from bamboo.rc.chaos import random_kill_points

    def plans(*args: object, **kwargs: object) -> list[list[str]]:
        return [[str(kill) for kill in plan] for plan in random_kill_points(*args, **kwargs)]  # type: ignore[arg-type]

    assert plans(5, 4, 4, 3, "eflb", True) == [
        ["2:0@29/0", "0:0@15/1"], ["1:0@30/1", "3:0@24/2"], ["1:0@26/0", "3:0@24/0/recovery"],
        ["1:0@28/0", "3:0@0/0/recovery"]]
    assert plans(0, 4, 4, 3, "eflb", False) == [["1:0@25/1", "3:0@19/1"], ["2:0@13/1"], ["1:0@16/2", "3:0@9/2"],
                                                ["0:0@21/1"]]


@pytest.mark.parametrize("second_failures", [False, True])
def test_plans_over_several_pipelines_kill_in_any_pipeline_and_never_two_neighbours_of_one(
    second_failures: bool,
) -> None:
    from bamboo.rc.chaos import random_kill_points

    stages, pipelines = 4, 3
    plans = random_kill_points(11, 200, stages, 3, "eflb", second_failures, pipelines=pipelines)
    assert {kill.pipeline for plan in plans for kill in plan} == set(range(pipelines))
    assert any(len({kill.pipeline for kill in plan}) == 2 for plan in plans)  # victims in two pipelines
    for plan in plans:
        for a, b in itertools.pairwise(plan):
            if a.pipeline == b.pipeline:  # one pipeline: never the same stage or ring neighbours
                assert (a.stage - b.stage) % stages not in (0, 1, stages - 1), plan


@pytest.mark.parametrize(("stages", "pipelines"), [(4, 2), (3, 3), (1, 3)])
def test_hand_over_plans_kill_another_pipeline_no_earlier_than_the_notice_step(stages: int, pipelines: int) -> None:
    from bamboo.rc.chaos import HANDOVER_LEAD_S, random_handover_plans

    steps = 4
    plans = random_handover_plans(3, 200, stages, steps, "lflb", pipelines)
    assert plans == random_handover_plans(3, 200, stages, steps, "lflb", pipelines)  # the seed names them
    assert len(set(plans)) > 100
    for notice, kill in plans:
        assert notice.pipeline != kill.pipeline and 1 <= notice.step <= steps - 2 <= steps - 1
        assert notice.step <= kill.step < steps and notice.lead_s == HANDOVER_LEAD_S
        assert 0 <= notice.stage < stages and 0 <= kill.stage < stages and int(kill.instruction) >= 0
    assert {notice.step for notice, _ in plans} == {1, 2}
    assert {kill.pipeline for _, kill in plans} == set(range(pipelines))


def test_same_pipeline_hand_over_plans_kill_the_leavers_pipeline_in_its_last_step_or_not_adjacent_later() -> None:
    from bamboo.rc.chaos import random_handover_plans

    stages, pipelines, steps = 4, 2, 4
    plans = random_handover_plans(5, 200, stages, steps, "eflb", pipelines, same_pipeline=True)
    assert plans == random_handover_plans(5, 200, stages, steps, "eflb", pipelines, same_pipeline=True)
    for notice, kill in plans:
        assert notice.pipeline == kill.pipeline and notice.stage != kill.stage and int(kill.instruction) >= 0
        assert 1 <= notice.step <= steps - 2 and notice.step <= kill.step < steps
        if kill.step > notice.step:  # after the hand-over: never the leaver's ring neighbours
            assert (kill.stage - notice.stage) % stages not in (1, stages - 1), (notice, kill)
    later = sum(1 for notice, kill in plans if kill.step > notice.step)
    assert 50 < later < 150  # about half of each kind
    assert {kill.pipeline for _, kill in plans} == set(range(pipelines))


def test_hand_over_plans_refuse_what_cannot_mix_a_hand_over_and_a_failure() -> None:
    from bamboo.rc.chaos import random_handover_plans

    with pytest.raises(ValueError, match="at least 3 steps, got 2"):
        random_handover_plans(0, 1, 4, 2, pipelines=2)
    with pytest.raises(ValueError, match="at least 2 pipelines with P = 4, got 1"):
        random_handover_plans(0, 1, 4, 3, pipelines=1)
    with pytest.raises(ValueError, match="at least 3 pipelines with P = 1, got 2"):
        random_handover_plans(0, 1, 1, 3, pipelines=2)
    with pytest.raises(ValueError, match="own pipeline needs at least 3 stages, got 1"):
        random_handover_plans(0, 1, 1, 3, pipelines=3, same_pipeline=True)


@pytest.mark.parametrize(("stages", "pipelines", "global_microbatches"), [(4, 3, 10), (1, 4, 10), (3, 3, 11)])
def test_uneven_shares_kill_within_each_victims_own_stream(stages: int, pipelines: int, global_microbatches: int) -> None:
    """With a global batch that the pipelines do not divide, each pipeline runs its own share, so its stream's
    length is its own: a kill point never indexes past its victim's stream, and the longest streams are reached."""
    from bamboo.rc.chaos import pipeline_shares, random_handover_plans, random_kill_points
    from bamboo.rc.ring import fault_free_ring_stream
    from bamboo.schedule import one_f_one_b

    shares = pipeline_shares(pipelines, global_microbatches)
    assert sum(shares) == global_microbatches and max(shares) - min(shares) == 1

    def length(stage: int, pipeline: int) -> int:
        if stages == 1:
            return len(fault_free_ring_stream(pipeline, shares, "eflb"))
        return len(one_f_one_b(stages, shares[pipeline], rc="eflb").streams[stage])

    plans = random_kill_points(7, 300, stages, 3, "eflb", pipelines=pipelines, global_microbatches=global_microbatches)
    kills = [kill for plan in plans for kill in plan if not kill.in_recovery]
    kills += [kill for _, kill in random_handover_plans(7, 300, stages, 3, "eflb", pipelines,
                                                        global_microbatches=global_microbatches)]
    assert all(0 <= int(kill.instruction) < length(kill.stage, kill.pipeline) for kill in kills)
    longest = max(range(pipelines), key=lambda p: length(0, p))
    assert max(int(k.instruction) for k in kills if k.pipeline == longest and k.stage == 0) >= length(0, longest) - 3
    assert pipeline_shares(pipelines) == [4] * pipelines  # without a global batch: verify's 4 a pipeline
