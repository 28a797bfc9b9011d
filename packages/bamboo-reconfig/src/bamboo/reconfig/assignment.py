"""The cheapest matching of nodes to slots when both come in few kinds: a small transportation problem.

A new layout places each zone's nodes at that zone's slots so that they fetch the fewest bytes
(``layout_plan``). A node's cost at a slot depends only on what it holds and on the slot's stage: the nodes
that owned one stage of the old layout hold the same layers, and a new node holds none. So however large the
zone, its square cost matrix has at most P + 1 distinct rows (kinds of node) and P distinct columns (kinds
of slot). :func:`cheapest_order` solves the problem between the kinds, a transportation problem with a
handful of sources and sinks, exactly: when every node can sit at one of its own cheapest slots, by filling
them in order (the usual case: holders stay where their state is, new nodes take what is left); otherwise by
successive shortest paths over the residual network. Then it deals each kind's nodes out to slots in a fixed
order. It is pure Python and needs no solver library: a worker
that plans the next layout at a barrier imports nothing for it.

Ties between equally cheap matchings are broken by the inputs' order alone (nodes in the order given, kinds
in the order they first appear), so every node that plans with the same inputs gets the same matching.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["cheapest_order"]


def cheapest_order(costs: Sequence[Sequence[int]], slot_kinds: Sequence[int]) -> list[int]:
    """``order[i]``, the node placed at slot ``i``, so that ``sum(costs[order[i]][slot_kinds[i]])`` is least.

    ``costs[n][k]`` is node ``n``'s cost at a slot of kind ``k``; there are as many slots as nodes, and each
    node takes exactly one slot.
    """
    if len(costs) != len(slot_kinds):
        raise ValueError(f"{len(costs)} nodes for {len(slot_kinds)} slots: a matching needs as many of each")
    rows: list[tuple[int, ...]] = []
    kind_of_node: list[int] = []
    for row in costs:
        key = tuple(row)
        if key not in rows:
            rows.append(key)
        kind_of_node.append(rows.index(key))
    columns = sorted(set(slot_kinds))
    supply = [kind_of_node.count(k) for k in range(len(rows))]
    demand = [list(slot_kinds).count(column) for column in columns]
    cost = [[row[column] for column in columns] for row in rows]
    flow = _everyone_at_their_cheapest(supply, demand, cost) or _transport(supply, demand, cost)
    waiting = [deque(n for n, kind in enumerate(kind_of_node) if kind == k) for k in range(len(rows))]
    order = []
    for slot_kind in slot_kinds:
        column = columns.index(slot_kind)
        kind = next(k for k in range(len(rows)) if flow[k][column] > 0)
        flow[kind][column] -= 1
        order.append(waiting[kind].popleft())
    return order


def _everyone_at_their_cheapest(supply: Sequence[int], demand: Sequence[int],
                                cost: Sequence[Sequence[int]]) -> list[list[int]] | None:
    """A flow in which every node pays its own least cost, when one is found by filling each kind's cheapest
    slot kinds in order (kinds of node in order); None otherwise. No flow costs less than that, so it is a
    least-cost flow: the usual case (the holders stay, new nodes take what is left) needs no search."""
    left = list(demand)
    flow = [[0] * len(demand) for _ in supply]
    for kind, amount in enumerate(supply):
        cheapest = min(cost[kind])
        for column, unit in enumerate(cost[kind]):
            if unit == cheapest and amount:
                placed = min(amount, left[column])
                flow[kind][column] += placed
                left[column] -= placed
                amount -= placed
        if amount:
            return None
    return flow


def _transport(supply: Sequence[int], demand: Sequence[int], cost: Sequence[Sequence[int]]) -> list[list[int]]:
    """The least-cost flow from sources (``supply``) to sinks (``demand``, the same total): ``flow[i][j]``.

    Successive shortest paths: each round sends as much as it can along a cheapest path of the residual network
    (Bellman-Ford, as it may have negative arcs). The network has ``len(supply) + len(demand) + 2`` vertices.
    """
    sources, sinks = len(supply), len(demand)
    start, end = sources + sinks, sources + sinks + 1
    heads: list[int] = []  # arc a goes to heads[a]; arc a ^ 1 is its reverse
    room: list[int] = []
    price: list[int] = []
    arcs_of: list[list[int]] = [[] for _ in range(sources + sinks + 2)]

    def arc(tail: int, head: int, capacity: int, unit: int) -> None:
        for a, b, c, u in ((tail, head, capacity, unit), (head, tail, 0, -unit)):
            arcs_of[a].append(len(heads))
            heads.append(b)
            room.append(c)
            price.append(u)

    total = sum(supply)
    for i, amount in enumerate(supply):
        arc(start, i, amount, 0)
    for i in range(sources):
        for j in range(sinks):
            arc(i, sources + j, total, cost[i][j])
    for j, amount in enumerate(demand):
        arc(sources + j, end, amount, 0)

    sent = 0
    while sent < total:
        distance: list[float] = [float("inf")] * len(arcs_of)
        via = [-1] * len(arcs_of)
        distance[start] = 0
        for _ in range(len(arcs_of) - 1):  # Bellman-Ford, in the fixed arc order
            changed = False
            for tail, arcs in enumerate(arcs_of):
                if distance[tail] == float("inf"):
                    continue
                for a in arcs:
                    if room[a] > 0 and distance[tail] + price[a] < distance[heads[a]]:
                        distance[heads[a]] = distance[tail] + price[a]
                        via[heads[a]] = a
                        changed = True
            if not changed:
                break
        if via[end] < 0:
            raise ValueError(f"supply {list(supply)} cannot meet demand {list(demand)}")
        path = []
        vertex = end
        while vertex != start:
            path.append(via[vertex])
            vertex = heads[via[vertex] ^ 1]
        amount = min(room[a] for a in path)
        for a in path:
            room[a] -= amount
            room[a ^ 1] += amount
        sent += amount
    # the arc from source i to sink j is the (i * sinks + j)-th middle arc; its reverse holds the flow sent
    first_middle = 2 * sources
    return [[room[first_middle + 2 * (i * sinks + j) + 1] for j in range(sinks)] for i in range(sources)]
