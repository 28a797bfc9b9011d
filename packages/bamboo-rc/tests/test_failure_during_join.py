"""A failure noticed while this node joins another pipeline's redone all-reduce (waiting for the rebuilt group of
the redo, a member dies) is agreed on like any other, from the point where the node stands: the agreement then
judges whether the redo can still be exact. It used to escape `_fail_over` and end the worker with an error,
while every other survivor waited for its part in the new agreement until the group timeout."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from bamboo.rc.agreement import Agreement, PipelinePlan
from bamboo.rc.executor_failover import ExecutorFailover
from bamboo.rc.failures import FailureEvent, FailureNoticed, LostContribution

FIRST = FailureEvent(1, (5,))  # pipeline 1 loses its holder of stage 1
SECOND = FailureEvent(2, (1,))  # then pipeline 0 loses its holder of stage 1, a member of the redo's group


def _agreement(epoch: int, pipeline: int, victim: int) -> Agreement:
    plan = PipelinePlan(plan=SimpleNamespace(), cut={}, step=3)  # type: ignore[arg-type]
    return Agreement(epoch=epoch, victims={pipeline: frozenset({victim})}, plans={pipeline: plan})


class _Coordinator:
    """Agrees on the first event; on the second, returns `second` or raises it."""

    def __init__(self, second: Agreement | Exception) -> None:
        self.second = second
        self.agreed: list[FailureEvent] = []

    def agree(self, event: FailureEvent, done: int, step: int, **kwargs: object) -> Agreement:
        self.agreed.append(event)
        if event == FIRST:
            return _agreement(1, 1, 1)
        if isinstance(self.second, Exception):
            raise self.second
        return self.second


class _Interpreter:
    """Its join of the first redo is interrupted by the second event."""

    last_commit = None

    def __init__(self) -> None:
        self.joined: list[int] = []
        self.abandoned = False

    def completed_allreduces(self) -> dict[int, int]:
        return {}

    def join_redone_allreduces(self, plan: object, lost: frozenset[int], step: int, hosted: tuple[int, ...]) -> None:
        self.joined.append(step)
        if len(self.joined) == 1:
            raise FailureNoticed(SECOND)

    def join_owed_allreduces(self) -> None:
        return None  # the interrupted join is joined again through the second agreement's plan here

    def owe_redone_allreduces(self, plan: object, lost: frozenset[int], step: int, hosted: tuple[int, ...]) -> None:
        return None

    def finish_posted_commit(self, hosted: tuple[int, ...]) -> bool:
        return False  # it was not in its commit

    def abandon_iteration(self) -> None:
        self.abandoned = True


class _Node(ExecutorFailover):
    """Node 1 (stage 1) of pipeline 2: it holds the stage that pipeline 1 lost."""

    def __init__(self, coordinator: _Coordinator, clock: object) -> None:
        self.rank, self.node, self.pipeline, self.step = 9, 1, 2, 4
        self.redundancy = "lflb"
        self.clock = clock  # type: ignore[assignment]
        self.hosted = (1,)
        self.failovers = []
        self.kind_seconds = {}  # type: ignore[assignment]
        self.interpreter = _Interpreter()  # type: ignore[assignment]
        self.coordinator = coordinator  # type: ignore[assignment]

    def _leave_if_named(self, event: FailureEvent) -> None:
        return None


def test_a_failure_during_a_join_is_agreed_on_and_a_lost_contribution_refuses_cleanly(fake_clock) -> None:
    lost = LostContribution(1, 1, 3, 0, 4, {})
    coordinator = _Coordinator(lost)
    coordinator.announce_left = lambda: None  # type: ignore[attr-defined]
    node = _Node(coordinator, fake_clock)
    stream: list = []
    with pytest.raises(LostContribution):
        node._fail_over(FailureNoticed(FIRST), stream, 7)
    assert coordinator.agreed == [FIRST, SECOND]
    assert node.interpreter.abandoned  # type: ignore[attr-defined]


def test_a_failure_during_a_join_that_the_agreement_accepts_resumes_the_same_stream(fake_clock) -> None:
    coordinator = _Coordinator(_agreement(2, 0, 1))
    node = _Node(coordinator, fake_clock)
    stream: list = []
    assert node._fail_over(FailureNoticed(FIRST), stream, 7) is stream  # this pipeline lost nobody in either
    assert coordinator.agreed == [FIRST, SECOND]
    assert node.interpreter.joined == [3, 3]  # type: ignore[attr-defined]
    assert [record.epoch for record in node.failovers] == [1, 2]
