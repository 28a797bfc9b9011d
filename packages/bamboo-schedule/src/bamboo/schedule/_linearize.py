"""The linearizer: per-node lanes of tasks in, deadlock-free instruction streams out.

`linearize` runs an event simulation with the tasks' durations: a node starts the head of one of its lanes as
soon as that task's inputs exist, and a message is exchanged at the moment its consumer can take it. The send is
appended to the producer's stream and the receive to the consumer's stream at that same point of one global
order, so every stream is a projection of one global sequence in which each send is immediately followed by its
receive: executing the streams with blocking, rendezvous send/recv cannot deadlock, the sequence is a witness.

Normal work comes first: backward before forward, then lane order. Redundant work (the lowest rank) runs only
where the node would otherwise wait. Given the *busy* intervals of the same schedule without redundancy
(`busy_intervals`), it runs only where it fits whole before the node's next normal work is due, so that it never
delays the pipeline; what does not fit anywhere runs after the node's normal work.
"""

from __future__ import annotations

import heapq
from bisect import bisect_right
from collections.abc import Mapping, Sequence

from bamboo.schedule._tasks import _NODE, RANK_REDUNDANT, Need, Task, Token
from bamboo.schedule.ir import BUFFERED_SENDS, Instruction

__all__ = ["BusyIntervals", "busy_intervals", "linearize"]

BusyIntervals = Mapping[int, tuple[Sequence[float], Sequence[float]]]
"""Per node, the starts and the ends (ms, both ascending) of the intervals in which it computes or exchanges."""

_EPSILON = 1e-9


def linearize(lanes: Mapping[int, Sequence[Sequence[Task]]], busy: BusyIntervals | None = None) -> dict[int, tuple[Instruction, ...]]:
    """Streams for ``lanes`` (node -> ordered task lists, from `build_lanes`), with every send/recv pair placed.

    The simulation follows blocking rendezvous semantics with the tasks' durations (the cost
    model was applied when the tasks were built). A node that is free first exchanges a message with a
    partner that is free too and needs it next (push to a consumer, or pull from a producer), then
    starts its best ready task (lowest rank: backward, forward, redundant; then lane order), and
    otherwise waits. Redundant work is not started when it would delay a message exchange the node
    could otherwise make, nor, given ``busy`` (the same schedule's intervals without redundancy), when it
    would not end before the node's next normal work is due. The streams reproduce this simulation exactly
    when run with the same costs, and cannot deadlock in any case.

    Raises ValueError when the work cannot complete (a task needs a token nobody makes).
    """
    return _simulate(lanes, busy, None)


def busy_intervals(lanes: Mapping[int, Sequence[Sequence[Task]]]) -> BusyIntervals:
    """When each node computes or exchanges messages in the linearizer's simulation of ``lanes``."""
    record: dict[int, list[tuple[float, float]]] = {n: [] for n in lanes}
    _simulate(lanes, None, record)
    return {n: (tuple(b for b, _ in spans), tuple(e for _, e in spans)) for n, spans in record.items()}


def _retry_at(busy: BusyIntervals, n: int, t: float, duration: float) -> float | None:
    """None when work of ``duration`` started at ``t`` on node ``n`` ends before its next normal work is due;
    otherwise the end of that normal work, when the node looks again."""
    if duration <= _EPSILON or n not in busy:
        return None
    starts, ends = busy[n]
    due = bisect_right(ends, t + _EPSILON)  # the first interval that has not ended by t
    if due == len(starts) or t + duration <= starts[due] + _EPSILON:
        return None
    return ends[due]


def _simulate(
    lanes: Mapping[int, Sequence[Sequence[Task]]],
    busy: BusyIntervals | None,
    record: dict[int, list[tuple[float, float]]] | None,
) -> dict[int, tuple[Instruction, ...]]:
    """`linearize`'s simulation; appends every node's busy (start, end) to ``record`` when given."""
    nodes = sorted(lanes)
    size = nodes[-1] + 1 if nodes else 0
    # Per-node state in lists indexed by node (nodes are small ints; absent ones keep empty state).
    lanes_of: list[Sequence[Sequence[Task]]] = [lanes.get(n, ()) for n in range(size)]
    streams: list[list[Instruction]] = [[] for _ in range(size)]
    free = [0.0] * size
    heads = [[0] * len(lanes_of[n]) for n in range(size)]
    local: list[set[Token]] = [set() for _ in range(size)]
    inbox: list[set[int]] = [set() for _ in range(size)]
    # dst << 50 | token -> (dst, need): messages made on the node, not yet taken by their consumer
    outbox: list[dict[int, tuple[int, Need]]] = [{} for _ in range(size)]
    # src << 50 | token -> the lane head still missing that remote input (a dict: ordered, deterministic)
    want: list[dict[int, Task]] = [{} for _ in range(size)]
    # key -> when a posted (buffered) send's data lands on the node
    arrivals: list[dict[int, float]] = [{} for _ in range(size)]
    consumers: dict[int, list[tuple[int, Need]]] = {}
    for n in nodes:
        for lane in lanes_of[n]:
            for task in lane:
                for need in task.remote:
                    consumers.setdefault(need.key, []).append((n, need))
    heap: list[tuple[float, int]] = [(0.0, n) for n in nodes]
    remaining = sum(len(lane) for n in nodes for lane in lanes_of[n])
    mask = (1 << _NODE) - 1
    push, pop, pushpop = heapq.heappush, heapq.heappop, heapq.heappushpop
    no_consumers: tuple[tuple[int, Need], ...] = ()

    for n in nodes:  # register the missing remote inputs of every lane's first task
        for lane in lanes_of[n]:
            if lane and lane[0].remote:
                for need in lane[0].remote:
                    want[n][need.key] = lane[0]

    def next_exchange(n: int) -> float | None:
        """When the earliest exchange of a message that a main lane needs could happen."""
        soon = None
        for dst, need in outbox[n].values():
            task = want[dst].get(need.key)
            if task is not None and task.rank != RANK_REDUNDANT and (soon is None or free[dst] < soon):
                soon = free[dst]
        node_bits = n << _NODE
        for key, task in want[n].items():
            src = key >> _NODE
            if (
                task.rank != RANK_REDUNDANT
                and (node_bits | (key & mask)) in outbox[src]
                and (soon is None or free[src] < soon)
            ):
                soon = free[src]
        return soon

    # An event to push is kept back one step: pushing it and popping the minimum is one heappushpop,
    # which returns it at once when it is the minimum.
    pending: tuple[float, int] | None = None
    while True:
        if pending is not None:
            t, n = pushpop(heap, pending)
            pending = None
        elif heap:
            t, n = pop(heap)
        else:
            break
        if t < free[n]:
            continue
        # 1. exchange a message: push one to a free consumer that needs it next, or pull one from a
        # free producer (its own inputs on this node permitting)
        src = -1
        box = outbox[n]
        if box:
            for consumer, need in box.values():
                if free[consumer] <= t and need.key in want[consumer]:
                    src, dst, key = n, consumer, need.key
                    break
        if src < 0:
            wanted_here = want[n]
            if wanted_here:
                have = local[n]
                node_bits = n << _NODE
                for wanted_key, task in wanted_here.items():
                    producer = wanted_key >> _NODE
                    if free[producer] <= t and (node_bits | (wanted_key & mask)) in outbox[producer]:
                        for tok in task.local:
                            if tok not in have:
                                break
                        else:
                            src, dst, key = producer, n, wanted_key
                            break
        if src >= 0:
            _dst, need = outbox[src].pop((dst << _NODE) | (key & mask))
            begin = free[src] if free[src] >= free[dst] else free[dst]
            streams[src].append(need.send)
            streams[dst].append(need.recv)
            end = begin + need.cost
            free[src] = free[dst] = end
            if record is not None and end > begin:
                record[src].append((begin, end))
                record[dst].append((begin, end))
            inbox[dst].add(key)
            want[dst].pop(key, None)
            push(heap, (end, src))
            pending = (end, dst)
            continue
        # 2. otherwise start the best ready lane head: lowest rank, then lane order
        best = -1
        best_rank = 99
        mine, received, position = local[n], inbox[n], heads[n]
        node_lanes = lanes_of[n]
        for li, lane in enumerate(node_lanes):
            index = position[li]
            if index < len(lane):
                task = lane[index]
                if task.rank < best_rank:
                    for tok in task.local:
                        if tok not in mine:
                            break
                    else:
                        for need in task.remote:
                            if need.key not in received or arrivals[n].get(need.key, 0.0) > t + _EPSILON:
                                break
                        else:
                            best, best_rank, chosen = li, task.rank, task
        if best < 0:
            continue  # idle: a producer pushes to this node when it is free
        task = chosen
        duration = task.duration
        if best_rank == RANK_REDUNDANT:
            soon = next_exchange(n)
            if soon is not None and soon < t + duration:
                pending = (soon, n)  # redundant work must not delay the pipeline's messages
                continue
            if busy is not None:
                retry = _retry_at(busy, n, t, duration)
                if retry is not None:  # it would delay normal work: look again once that is due
                    pending = (retry, n)
                    continue
        for need in task.remote:
            if need.send.kind in BUFFERED_SENDS:  # a posted send: its receive is this task's first instruction
                streams[n].append(need.recv)
                del arrivals[n][need.key]
        streams[n].extend(task.instrs)
        end = free[n] = t + duration
        if record is not None and duration > 0:
            record[n].append((t, end))
        index = position[best] = position[best] + 1
        remaining -= 1
        lane = node_lanes[best]
        if index < len(lane):  # the lane's new head: register its missing remote inputs
            head = lane[index]
            if head.remote:
                wanted = want[n]
                for need in head.remote:
                    if need.key not in received:
                        wanted[need.key] = head
        if task.makes:
            node_bits = n << _NODE
            box = outbox[n]
            for tok in task.makes:
                mine.add(tok)
                for consumer, need in consumers.get(node_bits | tok, no_consumers):
                    if need.send.kind in BUFFERED_SENDS:  # posted at once; it lands after its transfer
                        streams[n].append(need.send)
                        landed = end + need.cost
                        arrivals[consumer][need.key] = landed
                        inbox[consumer].add(need.key)
                        want[consumer].pop(need.key, None)
                        push(heap, (max(landed, free[consumer]), consumer))
                    else:
                        box[(consumer << _NODE) | tok] = (consumer, need)
        pending = (end, n)
    if remaining or any(outbox):
        stuck = [
            f"node {n} lane {li} at {' '.join(map(str, lanes_of[n][li][heads[n][li]].instrs)) or 'a receive'}"
            for n in nodes
            for li in range(len(lanes_of[n]))
            if heads[n][li] < len(lanes_of[n][li])
        ]
        raise ValueError("work cannot be ordered, inputs never made: " + "; ".join(stuck[:4]))
    return {n: tuple(streams[n]) for n in nodes}
