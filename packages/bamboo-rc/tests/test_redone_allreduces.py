"""Joining another pipeline's redo of a lost stage's all-reduce, on an interpreter with no groups and no tensors.

`InterpreterAllReduces.join_redone_allreduces` decides from the plan and this node's bookkeeping (the all-reduces
pending, the contributions kept, its step) whether it joins the redo, posts again, or can do neither.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from bamboo.rc.interpreter_allreduces import InterpreterAllReduces
from bamboo.schedule import FailoverPlan, Kind, failover_schedule, one_f_one_b


def _redo_of_stage_1() -> FailoverPlan:
    """P = 3, lflb: stage 1's node died before its shadow (node 0) got its replica sync, so node 0 redoes 1AR."""
    schedule = one_f_one_b(3, 4, rc="lflb")
    waiting_for_the_sync = len(schedule.streams[0]) - 1
    plan = failover_schedule(schedule, {1}, {0: waiting_for_the_sync, 2: len(schedule.streams[2])})
    assert any(i.kind is Kind.ALLREDUCE and i.stage == 1 for i in plan.remainder.streams[0])
    return plan


def _node_of_the_other_pipeline(step: int) -> InterpreterAllReduces:
    """The other pipeline's holder of stage 1, in `step`, with nothing pending and no contribution kept; its
    group table has no operations: any attempt to join would fail on it."""
    node = object.__new__(InterpreterAllReduces)
    node._reducing = {}
    node._contributions = {}
    node._owed_joins = []
    node.step = step
    node.groups = SimpleNamespace(members={"dp-s1": (1, 4)}, versions={"dp-s1": 1})
    return node


def test_a_node_past_the_redone_step_that_kept_no_contribution_of_it_raises_instead_of_leaving_the_redo_waiting() -> None:
    # It took stage 1 over in step 91 (its own pipeline's holder died), so it never contributed to step 90's.
    node = _node_of_the_other_pipeline(step=91)
    with pytest.raises(RuntimeError, match=r"stage 1: .* this node is in step 91 and kept no contribution of step 90"):
        node.join_redone_allreduces(_redo_of_stage_1(), {1}, 90, hosted=(0, 1))


def test_a_node_still_in_the_redone_step_posts_its_own_later_and_joins_nothing_now() -> None:
    node = _node_of_the_other_pipeline(step=90)  # its stream posts 1AR of step 90 on the rebuilt group later
    node.join_redone_allreduces(_redo_of_stage_1(), {1}, 90, hosted=(0, 1))
    assert node._reducing == {}
