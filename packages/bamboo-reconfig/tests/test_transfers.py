"""Transfer rounds: always the minimum number, and never two sends or two receives per node per round."""

from __future__ import annotations

from collections import Counter

import pytest
from bamboo.reconfig import Transfer, TransferPlan, minimum_rounds
from bamboo.reconfig.transfers import schedule_rounds
from hypothesis import given, settings
from hypothesis import strategies as st


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 6), st.integers(0, 6), st.integers(1, 5)), max_size=40))
def test_rounds_reach_the_lower_bound(edges) -> None:
    transfers = [Transfer(f"n{s}", f"n{d}", [i], size) for i, (s, d, size) in enumerate(edges) if s != d]
    rounds = schedule_rounds(transfers)
    assert len(rounds) == minimum_rounds(transfers)
    assert Counter(t for r in rounds for t in r) == Counter(transfers)
    for round_ in rounds:
        assert len({t.source for t in round_}) == len(round_)
        assert len({t.destination for t in round_}) == len(round_)


def test_a_node_may_send_and_receive_in_the_same_round() -> None:
    ring = [Transfer("a", "b", [0], 1), Transfer("b", "c", [1], 1), Transfer("c", "a", [2], 1)]
    assert len(schedule_rounds(ring)) == 1


def test_plan_validation_names_the_bad_values() -> None:
    one = Transfer("a", "b", [0], 5)
    with pytest.raises(ValueError, match="bytes_moved is 4 but the transfers move 5"):
        TransferPlan(rounds=[[one]], bytes_moved=4, naive_bytes=10)
    with pytest.raises(ValueError, match="round 0: node\\(s\\) a appear as source more than once"):
        TransferPlan(rounds=[[one, Transfer("a", "c", [1], 5)]], bytes_moved=10, naive_bytes=10)
    with pytest.raises(ValueError, match="from 'a' to itself"):
        Transfer("a", "a", [0], 1)
    with pytest.raises(ValueError, match="names the stages that force it"):
        TransferPlan(rounds=[], bytes_moved=0, naive_bytes=10, restore_from_checkpoint=True)
    assert str(Transfer("a", "b", [0, 1, 2, 5], 7)) == "a -> b: layers 0-2,5 (7 B)"
