"""The balanced split of a model's layers into P pipeline stages, with node memory as a constraint.

A stage is a contiguous run of layers. The split minimises the largest stage compute cost (the
pipeline's bottleneck). Memory is a hard constraint: the node at stage ``s`` holds the state of stage
``s`` and of its successor ``(s + 1) mod P`` (its replica), so for every ``s`` the state bytes of those
two stages must fit in one node's memory. Among the splits with the smallest bottleneck, the one chosen
is the first found by a fixed search order, so the same input always gives the same split.

The search is a binary search over the candidate bottlenecks (every contiguous run's cost). Without a
memory bound, feasibility is the classic greedy check. With one, it is a dynamic programme over the last
stage's bounds; the set of feasible first-stage ends rides along as a bitmask, so the wrap-around pair
(last stage, first stage) is checked without enumerating the first stage.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from itertools import accumulate

from bamboo.reconfig.model import LayerSpec

#: The compute cost, or the state bytes, of the layers in the half-open range [start, end).
RangeCost = Callable[[int, int], float]
RangeBytes = Callable[[int, int], int]
#: One dynamic-programme level: the last stage's (start, end) mapped to a bitmask of first-stage ends.
Level = dict[tuple[int, int], int]


class InfeasibleSplit(ValueError):
    """No split of the layers into P stages fits the node memory."""


def stage_costs(layers: Sequence[LayerSpec], bounds: Sequence[tuple[int, int]]) -> list[float]:
    """The compute cost of each stage of a split."""
    return [sum(layer.compute_cost for layer in layers[start:end]) for start, end in bounds]


def node_state_bytes(layers: Sequence[LayerSpec], bounds: Sequence[tuple[int, int]]) -> list[int]:
    """The state bytes each stage's owner holds: its stage plus its successor's replica."""
    stage_bytes = [sum(layer.state_bytes for layer in layers[start:end]) for start, end in bounds]
    count = len(bounds)
    return [stage_bytes[s] + stage_bytes[(s + 1) % count] for s in range(count)]


def split_layers(
    layers: Sequence[LayerSpec], stages: int, node_memory_bytes: int | None = None
) -> tuple[tuple[int, int], ...]:
    """Half-open layer ranges, one per stage, minimising the largest stage cost within node memory.

    Raises ``InfeasibleSplit`` when no split fits, and ``ValueError`` when there are fewer layers than
    stages.
    """
    count = len(layers)
    if stages < 1:
        raise ValueError(f"stages must be positive, got {stages}")
    if stages > count:
        raise ValueError(f"P={stages} is larger than the layer count {count}")
    cost_prefix = [0.0, *accumulate(layer.compute_cost for layer in layers)]
    byte_prefix = [0, *accumulate(layer.state_bytes for layer in layers)]

    def cost(start: int, end: int) -> float:
        return cost_prefix[end] - cost_prefix[start]

    def size(start: int, end: int) -> int:
        return byte_prefix[end] - byte_prefix[start]

    candidates = sorted({cost(start, end) for start in range(count) for end in range(start + 1, count + 1)})

    if node_memory_bytes is None:
        def feasible(limit: float) -> bool:
            return _greedy_stage_count(count, cost, limit) <= stages
    else:
        if stages == 1 and size(0, count) > node_memory_bytes:
            raise InfeasibleSplit(f"the model's {size(0, count)} state bytes exceed node memory {node_memory_bytes}")

        def feasible(limit: float) -> bool:
            return _memory_feasible(count, stages, cost, size, limit, node_memory_bytes) is not None

    low, high = 0, len(candidates) - 1
    if not feasible(candidates[high]):
        raise InfeasibleSplit(
            f"no split of {count} layers into {stages} stages keeps every node's state (its stage plus its "
            f"successor's replica) within node memory {node_memory_bytes} bytes"
        )
    while low < high:
        middle = (low + high) // 2
        if feasible(candidates[middle]):
            high = middle
        else:
            low = middle + 1
    limit = candidates[low]
    if node_memory_bytes is None:
        return _greedy_exact_split(count, stages, cost, limit)
    bounds = _memory_feasible(count, stages, cost, size, limit, node_memory_bytes)
    assert bounds is not None
    return bounds


def _greedy_stage_count(count: int, cost: RangeCost, limit: float) -> int:
    """How many stages the greedy fill needs so that no stage costs more than ``limit``."""
    used, start = 0, 0
    while start < count:
        end = start + 1
        if cost(start, end) > limit:
            return count + 1
        while end < count and cost(start, end + 1) <= limit:
            end += 1
        used += 1
        start = end
    return used


def _greedy_exact_split(count: int, stages: int, cost: RangeCost, limit: float) -> tuple[tuple[int, int], ...]:
    """Exactly ``stages`` stages of cost at most ``limit``, filling from the last stage backwards.

    Filling from the back leaves any slack in the first stages (the last stage also runs the loss), and
    each stage leaves at least one layer for every stage still to come.
    """
    bounds: list[tuple[int, int]] = []
    end = count
    for remaining in range(stages, 0, -1):
        start = end - 1
        while start > remaining - 1 and cost(start - 1, end) <= limit:
            start -= 1
        if remaining == 1:
            start = 0
        bounds.append((start, end))
        end = start
    bounds.reverse()
    return tuple(bounds)


def _memory_feasible(
    count: int, stages: int, cost: RangeCost, size: RangeBytes, limit: float, memory: int
) -> tuple[tuple[int, int], ...] | None:
    """A split with every stage cost <= ``limit`` and every node's state within ``memory``, or None."""
    # Level k maps the last stage's bounds (start, end) to a bitmask of feasible first-stage ends.
    level: Level = {}
    for end in range(1, count - stages + 2):
        if cost(0, end) <= limit:
            level[(0, end)] = 1 << end
    history = [level]
    for k in range(1, stages):
        nxt: Level = {}
        last_possible_end = count - (stages - 1 - k)
        for (start, end), mask in level.items():
            for new_end in range(end + 1, last_possible_end + 1):
                if cost(end, new_end) > limit:
                    break
                if size(start, end) + size(end, new_end) > memory:
                    continue
                key = (end, new_end)
                nxt[key] = nxt.get(key, 0) | mask
        level = nxt
        history.append(level)
        if not level:
            return None
    # Close the ring: the last stage's owner holds the first stage's replica.
    finals = sorted(key for key in level if key[1] == count)
    for last in finals:
        mask = level[last]
        first_end = 1
        while mask >> first_end:
            if (mask >> first_end) & 1 and size(*last) + size(0, first_end) <= memory:
                path = _trace_back(history, last, first_end, size, memory)
                if path is not None:
                    return path
            first_end += 1
    return None


def _trace_back(
    history: list[Level], last: tuple[int, int], first_end: int, size: RangeBytes, memory: int
) -> tuple[tuple[int, int], ...] | None:
    """Walk the levels backwards from ``last`` to a first stage ending at ``first_end``."""
    bit = 1 << first_end
    path = [last]
    current = last
    for k in range(len(history) - 2, -1, -1):
        start = current[0]
        previous = sorted(
            key for key, mask in history[k].items()
            if key[1] == start and mask & bit and size(*key) + size(*current) <= memory
        )
        if not previous:
            return None
        current = previous[0]
        path.append(current)
    path.reverse()
    return tuple(path) if path[0] == (0, first_end) else None
