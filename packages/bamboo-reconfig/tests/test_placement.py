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


def test_the_assignment_solver_is_imported_on_first_use_or_when_preloaded() -> None:
    """scipy.optimize (about 1.3 CPU-s after torch) is not imported with bamboo.reconfig, which every agent imports, but by the first
    plan that needs it, or beforehand by ``preload_assignment``, which a worker calls while nothing waits on it (a
    measured reconfiguration had paid the import in its pause)."""
    import subprocess
    import sys

    probe = ("import sys, bamboo.reconfig as r; before = 'scipy.optimize' in sys.modules; r.preload_assignment(); "
             "print(before, 'scipy.optimize' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=120)
    assert done.stdout.split() == ["False", "True"]
