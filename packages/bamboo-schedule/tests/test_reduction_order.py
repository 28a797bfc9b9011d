"""A node posts every all-reduce whose gradients are ready before it waits for a reduction at a replica sync
(`bamboo.schedule.reduction_order`): the lowering pass, and the validator's check."""

from __future__ import annotations

import pytest
from bamboo.schedule import Instruction, Kind, Schedule, merged_schedule, one_f_one_b, validate
from bamboo.schedule.reduction_order import allreduces_before_syncs, sync_problem
from bamboo.schedule.validate import ScheduleError


def _stream(text: str) -> tuple[Instruction, ...]:
    return tuple(Instruction.parse(cell) for cell in text.split())


def test_a_shadow_that_hosts_two_stages_posts_both_all_reduces_before_its_sync() -> None:
    """P = 3: the last stage left (a hand-over), its shadow runs stages 1 and 2. The linearizer ends that node's
    iteration with 1AR 1OPT 1SY 2AR 2OPT; across pipelines, waiting in 1SY before posting 2AR deadlocked."""
    merged = merged_schedule(one_f_one_b(3, 3, rc="lflb"), [2])
    tail = [str(i) for i in merged.streams[1] if i.kind in (Kind.ALLREDUCE, Kind.OPTIMIZER, Kind.SYNC_SEND)]
    assert tail == ["1AR", "1OPT", "2AR", "1SY>0", "2OPT"]
    validate(merged)


def test_the_pass_moves_only_an_all_reduce_whose_gradients_are_ready() -> None:
    streams = {1: _stream("1B0 2B0 1AR 1SY>0 2AR 2OPT"), 6: _stream("6B0 6AR 6SY>5 0RG0<1 0B0 0AR")}
    lowered = allreduces_before_syncs(streams)
    assert [str(i) for i in lowered[1]] == ["1B0", "2B0", "1AR", "2AR", "1SY>0", "2OPT"]
    assert lowered[6] == streams[6]  # stage 0's backward comes after the sync: its AR cannot move before it
    assert sync_problem(lowered) is None
    found = sync_problem(streams)
    assert found is not None and found[1] == [(1, 3), (1, 4)] and "1SY>0 before it posts 2AR" in found[0]


def test_the_validator_marks_a_sync_before_a_ready_all_reduce() -> None:
    merged = merged_schedule(one_f_one_b(3, 3, rc="lflb"), [2])
    stream = list(merged.streams[1])
    two, sync = stream.index(Instruction.parse("2AR")), stream.index(Instruction.parse("1SY>0"))
    stream[two], stream[sync] = stream[sync], stream[two]
    broken = Schedule(merged.stages, merged.microbatches, merged.policy, merged.rc, merged.placement,
                      {**merged.streams, 1: tuple(stream)}, merged.shadows)
    with pytest.raises(ScheduleError, match="node 1 waits for a reduction at 1SY>0 before it posts 2AR") as caught:
        validate(broken)
    assert ">>1SY>0<<" in caught.value.grid and ">>2AR<<" in caught.value.grid


def test_a_shadow_that_redoes_a_lost_stage_s_all_reduce_syncs_its_own_stage_after_it_where_it_can() -> None:
    """efeb, P = 4: the last stage dies right after posting 3AR. Its shadow, node 2, redoes 3AR after its eager
    backward of stage 3, which runs after its own 2SY: waiting there for stage 2's reduction deadlocked other
    pipelines. In the remainder its 2SY now follows 3AR; the plan validates."""
    from bamboo.schedule import failover_schedule, progress_at, validate_failover
    from bamboo.schedule.reduction_order import syncs_after_allreduces

    schedule = one_f_one_b(4, 4, rc="efeb")
    plan = failover_schedule(schedule, [3], progress_at(schedule, {3: 28}))
    validate_failover(plan)
    stream = [str(i) for i in plan.remainder.streams[2]]
    assert stream.index("3AR") < stream.index("2SY>1")
    moved = syncs_after_allreduces({2: _stream("2AR 2SY>1 3BR0 3AR 3OPT")})
    assert [str(i) for i in moved[2]] == ["2AR", "3BR0", "3AR", "2SY>1", "3OPT"]


def test_the_syncs_of_a_remainder_follow_the_work_that_the_redo_of_a_lost_all_reduce_waits_for() -> None:
    """efeb, P = 5: the last stage dies right after its 4AR. The shadow (node 3) sends its eager gradients to node 1
    on its way to the redone 4AR; node 1 waited for stage 1's reduction at its 1SY before it received them, while
    another pipeline's stage 1 could not post 1AR until that pipeline's last stage, waiting at 4SY for the redo,
    took its gradient. In the remainder every SY now comes after the node's other work (before its closing RY)."""
    from bamboo.schedule import failover_schedule, validate_failover
    from bamboo.schedule.reduction_order import syncs_last

    schedule = one_f_one_b(5, 4, rc="efeb")
    plan = failover_schedule(schedule, [4], {0: 30, 1: 34, 2: 34, 3: 39})
    validate_failover(plan)
    streams = {n: [str(i) for i in stream] for n, stream in plan.remainder.streams.items()}
    assert streams[1][-2:] == ["1SY>0", "2RY<2"] and streams[1].index("2RG3<3") < streams[1].index("1SY>0")
    assert streams[2][-2:] == ["2SY>1", "3RY<3"]
    moved = syncs_last({1: _stream("1AR 1OPT 1SY>0 2RG2<3 2BR2 2RY<2"), 2: _stream("2SY>1 3RY<3 0RY<0")})
    assert [str(i) for i in moved[1]] == ["1AR", "1OPT", "2RG2<3", "2BR2", "1SY>0", "2RY<2"]
    assert [str(i) for i in moved[2]] == ["2SY>1", "3RY<3", "0RY<0"]
