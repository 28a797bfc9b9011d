"""``cheapest_order``: the least-cost matching of nodes to slots, checked against every matching."""

from __future__ import annotations

import itertools
import random

import pytest
from bamboo.reconfig.assignment import cheapest_order


def total(costs: list[list[int]], kinds: list[int], order: list[int]) -> int:
    return sum(costs[node][kind] for node, kind in zip(order, kinds, strict=True))


def test_by_hand_the_holders_stay_and_the_new_node_takes_what_is_left() -> None:
    # node 0 holds stage 1's layers, node 1 stage 0's, node 2 nothing; slots: stage 0, stage 1, stage 0
    costs = [[5, 0, 9], [0, 4, 9], [5, 4, 9]]
    order = cheapest_order(costs, [0, 1, 0])
    assert total(costs, [0, 1, 0], order) == 5
    assert order[1] == 0 and sorted(order) == [0, 1, 2]


@pytest.mark.parametrize("seed", range(40))
def test_it_is_as_cheap_as_the_best_of_every_matching(seed: int) -> None:
    rng = random.Random(seed)
    nodes = rng.randint(1, 7)
    stages = rng.randint(1, 4)
    kinds_of_node = [[rng.choice([0, 1, 2, 5, 8, 13]) for _ in range(stages)] for _ in range(rng.randint(1, 4))]
    costs = [list(rng.choice(kinds_of_node)) for _ in range(nodes)]
    kinds = [rng.randrange(stages) for _ in range(nodes)]
    order = cheapest_order(costs, kinds)
    assert sorted(order) == list(range(nodes))
    best = min(total(costs, kinds, list(p)) for p in itertools.permutations(range(nodes)))
    assert total(costs, kinds, order) == best


def test_a_large_zone_is_matched_in_kinds_and_the_answer_does_not_depend_on_the_run() -> None:
    rng = random.Random(7)
    rows = [[rng.randrange(10**9) for _ in range(16)] for _ in range(17)]
    costs = [rows[rng.randrange(17)] for _ in range(400)]
    kinds = [rng.randrange(16) for _ in range(400)]
    order = cheapest_order(costs, kinds)
    assert sorted(order) == list(range(400))
    assert cheapest_order(costs, kinds) == order


def test_unequal_counts_are_refused_with_both_numbers() -> None:
    with pytest.raises(ValueError, match="2 nodes for 3 slots"):
        cheapest_order([[0], [1]], [0, 0, 0])


def test_it_costs_what_a_general_assignment_solver_finds_on_many_zones() -> None:
    """300 random zones of up to 60 nodes, of up to 12 kinds with small costs (many ties, where a wrong price
    update shows), against scipy's ``linear_sum_assignment`` on the whole square matrix."""
    optimize = pytest.importorskip("scipy.optimize")  # a dev dependency of bamboo-reconfig only
    for seed in range(300):
        rng = random.Random(seed)
        stages = rng.randint(1, 10)
        rows = [[rng.choice([0, 1, 2, rng.randrange(100)]) for _ in range(stages)] for _ in range(rng.randint(1, 12))]
        nodes = rng.randint(1, 60)
        costs = [rows[rng.randrange(len(rows))] for _ in range(nodes)]
        kinds = [rng.randrange(stages) for _ in range(nodes)]
        matrix = [[costs[node][kind] for kind in kinds] for node in range(nodes)]
        node_index, slot_index = optimize.linear_sum_assignment(matrix)
        best = sum(matrix[n][s] for n, s in zip(node_index, slot_index, strict=True))
        assert total(costs, kinds, cheapest_order(costs, kinds)) == best, seed
