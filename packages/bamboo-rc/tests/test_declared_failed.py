"""A failure event that names the node itself (declared failed while alive: its lease ran out while it was starved)
makes it leave with a typed error, before any agreement: the others' failover plan has no part for it (it used to
end in a KeyError on its own cut)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from bamboo.rc.executor_failover import ExecutorFailover
from bamboo.rc.failures import DeclaredFailed, FailureEvent, FailureNoticed


class _Agreeing(Exception):
    """Raised by the fake coordinator: the node went on to agree on a failover with the others."""


class _Coordinator:
    def agree(self, *args: object, **kwargs: object) -> None:
        raise _Agreeing

    def agree_ring(self, *args: object, **kwargs: object) -> None:
        raise _Agreeing


class _Node(ExecutorFailover):
    """Only what `_fail_over` reads up to the agreement, which the fake coordinator stops."""

    def __init__(self, rank: int, clock: object) -> None:
        self.rank = rank
        self.redundancy = "eflb"
        self.clock = clock  # type: ignore[assignment]
        self.hosted = (0,)
        self.step = 7
        self.interpreter = SimpleNamespace(last_commit=None, completed_allreduces=dict)  # type: ignore[assignment]
        self.coordinator = _Coordinator()  # type: ignore[assignment]


def test_an_event_naming_this_node_is_declared_failed_before_any_agreement(fake_clock) -> None:
    node = _Node(1, fake_clock)
    with pytest.raises(DeclaredFailed, match=r"rank 1\) was declared failed in epoch 3"):
        node._fail_over(FailureNoticed(FailureEvent(3, (1, 4))), [], 0)


def test_an_event_naming_others_goes_on_to_the_agreement(fake_clock) -> None:
    node = _Node(0, fake_clock)
    with pytest.raises(_Agreeing):
        node._fail_over(FailureNoticed(FailureEvent(3, (1,))), [], 0)


def test_a_ring_node_named_by_an_event_is_declared_failed_before_the_ring_agreement(fake_clock) -> None:
    node = _Node(0, fake_clock)
    with pytest.raises(DeclaredFailed, match=r"rank 0\) was declared failed in epoch 2"):
        node._fail_over_ring(SimpleNamespace(done=0), FailureNoticed(FailureEvent(2, (0,))))  # type: ignore[arg-type]
    with pytest.raises(_Agreeing):  # another victim: on to the ring's agreement
        node._fail_over_ring(SimpleNamespace(done=0), FailureNoticed(FailureEvent(2, (1,))))  # type: ignore[arg-type]
