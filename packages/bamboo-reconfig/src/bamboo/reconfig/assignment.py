"""The cheapest matching of nodes to slots when both come in few kinds: a small transportation problem.

A new layout places each zone's nodes at that zone's slots so that they fetch the fewest bytes
(``layout_plan``). A node's cost at a slot depends only on what it holds and on the slot's stage: the nodes
that owned one stage of the old layout hold the same layers, and a new node holds none. So however large the
zone, its square cost matrix has at most P + 1 distinct rows (kinds of node) and P distinct columns (kinds
of slot). :func:`cheapest_order` solves the problem between the kinds, a transportation problem with a
handful of sources and sinks, exactly, by the primal-dual (Hungarian) method: every node kind first fills the
slot kinds where it is cheapest, in order (the usual case ends there: holders stay where their state is, new
nodes take what is left); what is left is shipped along shortest paths of reduced cost, whose dual prices
prove the result least. Then it deals each kind's nodes out to slots in a fixed order. It is pure Python and
needs no solver library: a worker that plans the next layout at a barrier imports nothing for it.

Ties between equally cheap matchings are broken by the inputs' order alone (nodes in the order given, kinds
in the order they first appear), so every node that plans with the same inputs gets the same matching.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

__all__ = ["cheapest_order"]

_INFINITY = float("inf")


def cheapest_order(costs: Sequence[Sequence[int]], slot_kinds: Sequence[int]) -> list[int]:
    """``order[i]``, the node placed at slot ``i``, so that ``sum(costs[order[i]][slot_kinds[i]])`` is least.

    ``costs[n][k]`` is node ``n``'s cost at a slot of kind ``k``; there are as many slots as nodes, and each
    node takes exactly one slot.
    """
    if len(costs) != len(slot_kinds):
        raise ValueError(f"{len(costs)} nodes for {len(slot_kinds)} slots: a matching needs as many of each")
    kind_at: dict[tuple[int, ...], int] = {}
    kind_of_node = [kind_at.setdefault(tuple(row), len(kind_at)) for row in costs]
    columns = sorted(set(slot_kinds))
    column_at = {column: index for index, column in enumerate(columns)}
    rows = list(kind_at)
    supply = [0] * len(rows)
    for kind in kind_of_node:
        supply[kind] += 1
    demand = [0] * len(columns)
    for slot_kind in slot_kinds:
        demand[column_at[slot_kind]] += 1
    flow = _transport(supply, demand, [[row[column] for column in columns] for row in rows])
    waiting: list[deque[int]] = [deque() for _ in rows]
    for node, kind in enumerate(kind_of_node):
        waiting[kind].append(node)
    givers: list[deque[int]] = [deque() for _ in columns]
    for kind, sent in enumerate(flow):
        for column, count in enumerate(sent):
            if count:
                givers[column].extend([kind] * count)
    return [waiting[givers[column_at[slot_kind]].popleft()].popleft() for slot_kind in slot_kinds]


def _transport(supply: Sequence[int], demand: Sequence[int], cost: Sequence[Sequence[int]]) -> list[list[int]]:
    """The least-cost flow from node kinds (``supply``) to slot kinds (``demand``, the same total): ``flow[k][j]``.

    Prices ``row[k]`` and ``column[j]`` keep every reduced cost ``cost[k][j] + row[k] - column[j]`` at 0 or more
    and at exactly 0 wherever there is flow; a full flow with such prices is least (linear programming duality).
    They start at ``row[k] = -min(cost[k])`` and ``column[j] = 0``, and each kind first fills its zero-cost
    columns in order. While some kind has units left, a search (:class:`_Search`) finds the nearest column with
    room; the prices move by the distances (capped at that column's), which keeps them valid and makes the path
    cost 0, and as much as fits is shipped along it: forward arcs gain flow, backward ones lose it.
    """
    kinds, columns = len(supply), len(demand)
    flow = [[0] * columns for _ in range(kinds)]
    left, room = list(supply), list(demand)
    row_price = []
    column_price = [0] * columns
    for k, row in enumerate(cost):
        floor = min(row)
        row_price.append(-floor)
        units = left[k]
        for j, unit in enumerate(row):
            if unit == floor and room[j]:
                amount = units if units < room[j] else room[j]
                flow[k][j] = amount
                room[j] -= amount
                units -= amount
                if not units:
                    break
        left[k] = units
    while any(left):
        search = _Search(cost, flow, left, room, row_price, column_price)
        target, reach = search.nearest_room()
        for k in range(kinds):
            row_price[k] += int(min(search.to_kind[k], reach))
        for j in range(columns):
            column_price[j] += int(min(search.to_column[j], reach))
        path: list[tuple[int, int, int]] = []  # (kind, column, +1 forward or -1 backward)
        amount, j = room[target], target
        while True:
            k = search.kind_before[j]
            path.append((k, j, 1))
            if search.column_before[k] < 0:
                amount = min(amount, left[k])
                break
            j = search.column_before[k]
            path.append((k, j, -1))
            amount = min(amount, flow[k][j])
        for k, j, sign in path:
            flow[k][j] += sign * amount
        left[path[-1][0]] -= amount
        room[target] -= amount
    return flow


class _Search:
    """One Dijkstra search of :func:`_transport`: from every kind with units left (at distance 0), over forward
    arcs (kind to column, at the reduced cost) and backward ones (column to a kind that sends it flow, at 0: the
    forward arc it undoes is tight), to the nearest column with room. Ties go to kinds, then to lower indices."""

    def __init__(self, cost: Sequence[Sequence[int]], flow: list[list[int]], left: list[int], room: list[int],
                 row_price: list[int], column_price: list[int]) -> None:
        self.cost, self.flow, self.room = cost, flow, room
        self.row_price, self.column_price = row_price, column_price
        self.to_kind: list[float] = [0 if units else _INFINITY for units in left]
        self.to_column: list[float] = [_INFINITY] * len(room)
        self.kind_before = [-1] * len(room)  # the kind a column was reached from (a forward arc)
        self.column_before = [-1] * len(left)  # the column a kind was reached from (a backward arc)

    def nearest_room(self) -> tuple[int, int]:
        """The nearest column with room and its distance; the distances and the tree stay in ``self``."""
        kinds, columns = len(self.to_kind), len(self.to_column)
        kind_done, column_done = [False] * kinds, [False] * columns
        while True:
            nearest, is_kind, at = _INFINITY, True, -1
            for k in range(kinds):
                if not kind_done[k] and self.to_kind[k] < nearest:
                    nearest, is_kind, at = self.to_kind[k], True, k
            for j in range(columns):
                if not column_done[j] and self.to_column[j] < nearest:
                    nearest, is_kind, at = self.to_column[j], False, j
            if at < 0:
                raise ValueError(f"no column with room is reachable (room {self.room})")
            if is_kind:
                kind_done[at] = True
                base = nearest + self.row_price[at]
                for j in range(columns):
                    reduced = base + self.cost[at][j] - self.column_price[j]
                    if not column_done[j] and reduced < self.to_column[j]:
                        self.to_column[j] = reduced
                        self.kind_before[j] = at
                continue
            column_done[at] = True
            if self.room[at]:
                return at, int(nearest)
            for k in range(kinds):
                if not kind_done[k] and self.flow[k][at] and nearest < self.to_kind[k]:
                    self.to_kind[k] = nearest
                    self.column_before[k] = at
