"""Zone arrangements of one ring: every composition reaches the bound, checked by brute force."""

from __future__ import annotations

from collections import Counter
from itertools import permutations

import pytest
from bamboo.reconfig.placement import (
    interleave,
    minimum_same_zone_pairs,
    ring_arrangements,
    ring_cost,
    same_zone_pairs,
)


def compositions(total: int, parts: int):
    if parts == 1:
        yield (total,)
        return
    for first in range(total + 1):
        for rest in compositions(total - first, parts - 1):
            yield (first, *rest)


@pytest.mark.parametrize("stages", range(2, 8))
def test_ring_bound_is_exact_and_reached(stages: int) -> None:
    for counts in compositions(stages, 4):
        zone_counts = {zone: count for zone, count in zip("abcd", counts, strict=True) if count}
        sequence = [zone for zone, count in zone_counts.items() for _ in range(count)]
        brute = min(same_zone_pairs(order) for order in set(permutations(sequence)))
        assert ring_cost(zone_counts, stages) == brute, zone_counts
        arrangements = ring_arrangements(zone_counts, stages)
        assert arrangements, zone_counts
        for arrangement in arrangements:
            assert Counter(arrangement) == Counter(zone_counts)
            assert same_zone_pairs(arrangement) == brute


def test_interleave_fills_even_slots_first() -> None:
    assert interleave("abc", {"a": 2, "b": 1, "c": 1}, 4) == ["a", "b", "a", "c"]


def test_two_stage_ring_counts_both_directions() -> None:
    assert same_zone_pairs(["a", "a"]) == 2
    assert same_zone_pairs(["a", "b"]) == 0


def test_minimum_over_rings_spreads_each_zone_evenly() -> None:
    # 8 nodes of zone a and 4 of b in 3 rings of 4: rings (3a,1b), (3a,1b), (2a,2b) cost 2 + 2 + 0.
    assert minimum_same_zone_pairs({"a": 8, "b": 4}, 3, 4) == 4
    assert minimum_same_zone_pairs({"a": 6, "b": 6}, 3, 4) == 0


def test_planning_a_layout_with_holders_imports_no_solver_library() -> None:
    """The re-plan after a failure matches the holders to slots (``bamboo.reconfig.assignment``) in pure Python:
    neither numpy nor scipy is imported, so a worker that plans at a barrier has nothing to import there, and
    nothing to import beforehand while it trains."""
    import subprocess
    import sys

    probe = (
        "import sys\n"
        "from bamboo.reconfig import ClusterView, LayerSpec, Node, plan_layout\n"
        "import attrs\n"
        "nodes = [Node(f'n{i}', 'abc'[i % 3], 'active') for i in range(12)]\n"
        "layers = tuple(LayerSpec(100, 200, 1.0) for _ in range(16))\n"
        "first = plan_layout(ClusterView(nodes=nodes, target_stages=4, target_pipelines=3, global_batch=12,"
        " layers=layers))\n"
        "nodes[0] = attrs.evolve(nodes[0], state='preempted')\n"
        "again = plan_layout(ClusterView(nodes=nodes, target_stages=4, target_pipelines=3, global_batch=12,"
        " layers=layers, layout=first))\n"
        "print(again.num_pipelines, sorted(m for m in ('numpy', 'scipy') if m in sys.modules))\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["2", "[]"]
