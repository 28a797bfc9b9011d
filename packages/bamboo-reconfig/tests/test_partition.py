"""The layer split: balanced by compute cost (checked against brute force), within node memory."""

from __future__ import annotations

from itertools import combinations, pairwise

import pytest
from bamboo.reconfig import InfeasibleSplit, LayerSpec, node_state_bytes, split_layers, stage_costs
from hypothesis import given, settings
from hypothesis import strategies as st


def all_splits(count: int, stages: int):
    for cuts in combinations(range(1, count), stages - 1):
        edges = (0, *cuts, count)
        yield tuple(pairwise(edges))


def brute_force(layers, stages, memory):
    best = None
    for bounds in all_splits(len(layers), stages):
        if memory is not None and max(node_state_bytes(layers, bounds)) > memory:
            continue
        bottleneck = max(stage_costs(layers, bounds))
        best = bottleneck if best is None else min(best, bottleneck)
    return best


@settings(max_examples=120, deadline=None)
@given(data=st.data(), use_memory=st.booleans())
def test_split_is_optimal_and_fits_memory(strategies, data, use_memory) -> None:
    layers = data.draw(strategies.layers(min_size=2, max_size=9))
    stages = data.draw(st.integers(2, min(5, len(layers))))
    total = sum(layer.state_bytes for layer in layers)
    memory = data.draw(st.integers(0, 2 * total)) if use_memory else None
    expected = brute_force(layers, stages, memory)
    if expected is None:
        with pytest.raises(InfeasibleSplit):
            split_layers(layers, stages, memory)
        return
    bounds = split_layers(layers, stages, memory)
    assert len(bounds) == stages
    assert bounds[0][0] == 0 and bounds[-1][1] == len(layers)
    assert all(start < end for start, end in bounds)
    assert all(a[1] == b[0] for a, b in pairwise(bounds))
    assert max(stage_costs(layers, bounds)) == pytest.approx(expected)
    if memory is not None:
        assert max(node_state_bytes(layers, bounds)) <= memory


def test_uniform_layers_split_evenly() -> None:
    layers = [LayerSpec(1, 2, 1.0)] * 12
    assert split_layers(layers, 4) == ((0, 3), (3, 6), (6, 9), (9, 12))


def test_memory_moves_a_boundary_away_from_the_compute_optimum() -> None:
    # With P = 3 a node holds two of the three stages, so the lightest stage (in bytes) must be heavy
    # enough: compute alone splits 2|2|2 (stage bytes 80, 40, 0: node 0 holds 120 B).
    layers = [LayerSpec(40, 0, 1.0)] * 3 + [LayerSpec(0, 0, 1.0)] * 3
    assert split_layers(layers, 3) == ((0, 2), (2, 4), (4, 6))
    assert split_layers(layers, 3, 100) == ((0, 1), (1, 2), (2, 6))
    assert node_state_bytes(layers, ((0, 1), (1, 2), (2, 6))) == [80, 80, 80]
    with pytest.raises(InfeasibleSplit, match="node memory 79 bytes"):
        split_layers(layers, 3, 79)


def test_more_stages_than_layers_is_an_error() -> None:
    with pytest.raises(ValueError, match="P=5 is larger than the layer count 4"):
        split_layers([LayerSpec(1, 1, 1.0)] * 4, 5)
