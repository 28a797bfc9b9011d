"""The bound's whole-FRC chains (`bamboo.schedule.bound.whole_frc_end`): what they add to the split packing, and that no
placement beats them."""

from __future__ import annotations

import random

import pytest
from bamboo.schedule import RCMode, Schedule, one_f_one_b, simulate
from bamboo.schedule.bound import least_chain_end
from bamboo.schedule.fill import _assemble, _items
from bamboo.schedule.simulate import Costs, StageCost


def test_bert_like_p4_m8_eflb_is_within_two_points_of_the_bound() -> None:
    """Issue 33's last point: the split packing's bound was 4.05% (the replica sync of stage 0), 2.24 points under
    the placement's 6.29%. Node 2 has room for 7 of its 8 whole FRCs of stage 3; the eighth delays the chain through
    node 3, the slowest stage, to node 0's all-reduce and the sync by 1.5 ms wherever it runs: 73.5 ms, 6.21%."""
    costs = Costs.bert_like(4)
    result = simulate(one_f_one_b(4, 8, "eflb", costs.linearizer_cost(), refine=True), costs)
    assert result.overhead_pct is not None and result.overhead_bound_pct is not None
    assert result.baseline_makespan == pytest.approx(69.2)
    assert result.overhead_bound_pct == pytest.approx(100.0 * 4.3 / 69.2)
    assert result.overhead_pct == pytest.approx(100.0 * 4.35 / 69.2)
    assert result.overhead_pct - result.overhead_bound_pct <= 2.0


def test_a_chain_places_whole_frcs_where_they_fit_and_the_rest_last() -> None:
    """One node, three instructions of 1 ms starting at 0, 3 and 10, each on a path that ends at 11 (the tails);
    FRCs of 2 ms whose inputs exist after the first instruction. One fits before the second instruction (1..3),
    three before the third (4..10); a fifth runs last (11..13). A 20 ms FRC ends the iteration soonest before the
    third instruction (4..24, then 25). With only one FRC's input there before the third instruction, the second
    FRC runs last."""
    starts, lengths, tails = [0.0, 3.0, 10.0], [1.0, 1.0, 1.0], [11.0, 8.0, 1.0]
    released = [0, 5, 5]
    assert least_chain_end(starts, lengths, tails, released, 4, 2.0, 0.0, 0.0) == pytest.approx(11.0, abs=1e-6)
    assert least_chain_end(starts, lengths, tails, released, 5, 2.0, 0.0, 0.0) == pytest.approx(13.0, abs=1e-6)
    assert least_chain_end(starts, lengths, tails, released, 1, 20.0, 0.0, 0.0) == pytest.approx(25.0, abs=1e-6)
    assert least_chain_end(starts, lengths, tails, [0, 1, 1], 2, 2.0, 0.0, 0.0) == pytest.approx(13.0, abs=1e-6)


@pytest.mark.parametrize("seed", range(6))
def test_no_placement_of_whole_frcs_beats_the_bound(seed: int) -> None:
    """Random costs and random FRC positions (each after its input, in release order): the iteration never ends
    before the bound."""
    rng = random.Random(seed)
    for _ in range(8):
        stages = rng.randint(2, 5)
        microbatches = rng.choice([1, stages, 2 * stages])
        costs = Costs(stages=tuple(StageCost(forward_ms=rng.uniform(0.5, 3.0), backward_ms=rng.uniform(1.0, 5.0),
                                             frc_ms=rng.uniform(0.2, 5.0), grad_mb=rng.choice([0.0, 8.0, 32.0]))
                                   for _ in range(stages)))
        plain = one_f_one_b(stages, microbatches, "none", costs.linearizer_cost())
        bound = simulate(one_f_one_b(stages, microbatches, "eflb", costs.linearizer_cost()), costs).overhead_bound_pct
        assert bound is not None
        items = {n: _items(plain, n, RCMode.EFLB) for n in range(stages)}
        for _ in range(4):
            streams = {}
            for n, node_items in items.items():
                positions: list[int] = []
                for after, _instrs in node_items:
                    low = max(after + 1, positions[-1] if positions else 0)
                    positions.append(rng.randint(low, len(plain.streams[n])))
                streams[n] = _assemble(plain, n, node_items, positions)
            placed = Schedule(stages, microbatches, "1f1b", RCMode.EFLB, plain.placement, streams)
            overhead = simulate(placed, costs).overhead_pct
            assert overhead is not None and overhead >= bound - 1e-7, (stages, microbatches, overhead, bound)
