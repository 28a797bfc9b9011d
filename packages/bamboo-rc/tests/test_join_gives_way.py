"""The join of another pipeline's redo gives way to any confirmed failure while it waits for the redo's group, and
is resumed after the agreement on it (or dropped, when that failure rebuilt the group).

The join used to wait for the rebuilt group's build heeding only the next event, and only if it removed a member
of that group. Forced (``P = 3, D = 3, efeb``): pipeline 0's last stage died after its ``2AR`` of step 1, so
pipeline 1's last stage (rank 5) joined the redo and waited for ``dp-s2``'s build; pipeline 2's last stage (rank 8)
had not yet applied that failure when rank 4 (pipeline 1) died, then rank 8. Rank 5 read only the event of rank
4, which does not touch ``dp-s2``, never the death of rank 8, which its build waited for: it sat there until the
group timeout, while its pipeline-mate waited for its progress in the agreement on rank 4's death, and every
survivor ended with an ``AgreementError`` (``survivors [5] of pipeline 1 did not publish their progress``).

In-process: a real group table whose build of the redo's group completes (or fails) when the test says so, and a
fake coordinator that reports a confirmed failure.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from bamboo.rc.agreement import Agreement, PipelinePlan
from bamboo.rc.comm import GroupTable
from bamboo.rc.config import load_config
from bamboo.rc.executor_failover import ExecutorFailover
from bamboo.rc.failures import FailureNoticed
from bamboo.rc.interpreter import StageInterpreter
from bamboo.rc.layout import Layout
from bamboo.rc.records import FailureEvent
from bamboo.rc.timeouts import CommTimeouts
from bamboo.rc.verify import DEFAULT_CONFIG
from bamboo.schedule import FailoverPlan, Kind, failover_schedule, one_f_one_b

GIVE_UP_S = 30.0
"""The held build fails on its own after this long (as gloo's would at the group timeout): a join that does not give
way to the failure fails the test (a PeerFailure) instead of hanging. Long, so that a loaded machine never reaches
it when the join does give way: no assertion depends on the time taken."""

STEP = 90
OWN_PIPELINE_FAILS = FailureEvent(2, (5,))
"""Stage 2 of this node's pipeline (not a member of the redo's group) dies: its survivors wait for this node."""


class FakeGloo:
    """The redo's group, once built: every all-reduce posted on it (never completed: nobody waits for a join's)."""

    def __init__(self) -> None:
        self.posted: list[torch.Tensor] = []

    def allreduce(self, tensors: list[torch.Tensor]) -> object:
        self.posted.append(tensors[0])
        return SimpleNamespace(is_completed=lambda: False)


class FakeSlice:
    loss_scale = None  # fp32: no dynamic loss scale


def _redo_of_stage_1() -> FailoverPlan:
    """P = 3, lflb: pipeline 0's stage 1 died before its shadow (node 0) got its replica sync: node 0 redoes 1AR."""
    schedule = one_f_one_b(3, 4, rc="lflb")
    plan = failover_schedule(schedule, {1}, {0: len(schedule.streams[0]) - 1, 2: len(schedule.streams[2])})
    assert any(i.kind is Kind.ALLREDUCE and i.stage == 1 for i in plan.remainder.streams[0])
    return plan


@pytest.fixture
def node(noticing_coordinator: object) -> Iterator[StageInterpreter]:
    """Stage 1 of pipeline 1 (P = 3, D = 2: rank 4) in step `STEP`, its 1AR of that step completed, after pipeline
    0 lost its stage 1 (rank 1): the redo's group dp-s1 is (0, 4) in epoch 1, being built in the background."""
    table = GroupTable(store=None, job="join", rank=4, timeouts=CommTimeouts(poll=0.01), names={})  # type: ignore[arg-type]
    table.set_members(1, {"pipe-d1": (3, 4, 5), "dp-s1": (0, 4)})
    build: concurrent.futures.Future[object] = concurrent.futures.Future()
    table.building["dp-s1"] = build  # type: ignore[assignment]
    give_up = threading.Timer(GIVE_UP_S, _fail, (build,))
    give_up.start()
    made = StageInterpreter(
        {1: FakeSlice()}, lambda *_: torch.zeros(()), load_config(DEFAULT_CONFIG), Layout(3, 2), 1, 1,  # type: ignore[dict-item]
        table, noticing_coordinator,  # type: ignore[arg-type]
    )
    made.step = STEP
    made._contributions[(1, STEP)] = (torch.full((4,), 3.0), torch.tensor([7.0], dtype=torch.float64))
    made.build = build  # type: ignore[attr-defined]
    yield made
    give_up.cancel()
    _fail(build)
    made.close()


def _fail(build: concurrent.futures.Future[object]) -> None:
    with contextlib.suppress(concurrent.futures.InvalidStateError):  # it completed
        build.set_exception(RuntimeError("the held build failed"))


def _built(node: StageInterpreter) -> FakeGloo:
    """Complete the build of dp-s1; returns the group it built."""
    group = FakeGloo()
    node.build.set_result(group)  # type: ignore[attr-defined]
    return group


def _joins(group: FakeGloo) -> int:
    """How many times the node joined the redo on `group`: each join sums its gradients and its loss."""
    assert len(group.posted) % 2 == 0
    return len(group.posted) // 2


def _interrupted_join(node: StageInterpreter) -> None:
    node.coordinator.event = OWN_PIPELINE_FAILS  # type: ignore[attr-defined]
    with pytest.raises(FailureNoticed):  # it gave way: it did not wait for the build (a PeerFailure at GIVE_UP_S)
        node.join_redone_allreduces(_redo_of_stage_1(), {1}, STEP, hosted=(1,))
    assert not node.build.done()  # type: ignore[attr-defined]  # nothing was posted: the group is not even built
    node.coordinator.event = None  # type: ignore[attr-defined]  # agreed on (the executor's failover)


def test_a_failure_outside_the_redos_group_interrupts_the_join_which_is_resumed_once(node: StageInterpreter) -> None:
    _interrupted_join(node)
    group = _built(node)
    node.join_owed_allreduces()  # after the agreement: the same group, so the join is resumed
    assert _joins(group) == 1
    assert torch.equal(group.posted[0], torch.full((4,), 3.0))  # the contribution kept for the redo
    node.join_owed_allreduces()
    assert _joins(group) == 1  # joined once: a second post would pair with the shadow's next all-reduce


def test_an_interrupted_join_whose_group_the_failure_rebuilt_is_dropped(node: StageInterpreter) -> None:
    _interrupted_join(node)
    group = _built(node)
    node.groups.set_members(3, {"pipe-d1": (3, 4), "dp-s1": (0, 4, 8)})  # a later event changed the redo's group
    node.join_owed_allreduces()  # the agreement that changed the group decided the redo: joined through its plan
    assert group.posted == [] and node._owed_joins == []


def test_the_failover_resumes_an_interrupted_join_after_the_next_agreement_without_a_plan_for_it(
    node: StageInterpreter,
) -> None:
    node.coordinator.event = OWN_PIPELINE_FAILS  # type: ignore[attr-defined]
    executor = SimpleNamespace(pipeline=1, interpreter=node)
    redo = Agreement(epoch=1, victims={0: frozenset({1})}, plans={0: PipelinePlan(_redo_of_stage_1(), {}, STEP)})
    failure = ExecutorFailover._join_redos(executor, redo, (1,))  # type: ignore[arg-type]
    assert isinstance(failure, FailureNoticed) and failure.event == OWN_PIPELINE_FAILS
    node.coordinator.event = None  # type: ignore[attr-defined]
    group = _built(node)
    own = Agreement(epoch=2, victims={1: frozenset({2})}, plans={})  # this pipeline's plan: no redo to join here
    assert ExecutorFailover._join_redos(executor, own, (1,)) is None  # type: ignore[arg-type]
    assert _joins(group) == 1 and node._owed_joins == []
