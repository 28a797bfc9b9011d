"""A lower bound on what redundancy must add to an iteration, for given costs.

The fault-free schedule without redundancy fixes when each node computes; its idle time is all that redundant work
can use without delaying the pipeline. `overhead_bound` takes that timeline (the *baseline*) and asks, for every
node, how much of its redundant work cannot be done inside its idle time once the work's input exists:

- each redundant item has a *release* (when its input exists on the node in the baseline) and a duration:
  - eager FRC of stage ``r = n + 1`` on node ``n``, microbatch ``k``: released when the node's own forward of
    ``k`` ends (its output is the FRC's input; stage 0's shadow only loads the samples, so at once), lasting
    the FRC plus its swap-out (nothing when swaps overlap);
  - ``lflb``'s stash of that input: released at the same moment, lasting the swap-out;
  - ``efeb``'s eager BRC: released when the gradient of the replica's output has arrived (the owner of
    ``r + 1`` ended its backward of ``k``, plus the message), lasting the swap-in and the BRC; its sender pays
    the extra message too;
  - the replica sync: the owner pays the send once its all-reduce ended; the shadow pays the receive once the
    data is there (with ``sync_overlaps``, the all-reduce's end plus the latency and the transfer);
- the items of a node are packed into its idle intervals in release order, splitting an item across intervals
  where needed (with preemption, packing in release order ends the last item as early as any order can);
- whatever ends after the baseline's makespan ``T0`` is the node's excess, and the bound is the largest excess
  over ``T0``, in percent.

Why it is a lower bound: every schedule runs each node's normal work in the same order and no earlier than the
baseline does (the baseline starts everything as soon as its inputs exist), and redundant work cannot start
before its release. Splitting items and ignoring the order among redundant items only relax the problem. So no
placement of the same redundant work, for the same costs, ends an iteration sooner than ``T0`` plus the
largest excess; the schedule README derives it at more length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from bamboo.schedule.engine import StageTable, Timeline
from bamboo.schedule.ir import Instruction, Kind, RCMode, Schedule

__all__ = ["idle_intervals", "node_excess", "overhead_bound", "packed_end"]

_EPSILON = 1e-9

Item = tuple[float, float]
"""(release, duration) of one piece of redundant work, in ms."""


def idle_intervals(starts: Sequence[float], ends: Sequence[float]) -> list[tuple[float, float]]:
    """A node's idle intervals between its busy ones, ending with an unbounded one after its last instruction."""
    idle: list[tuple[float, float]] = []
    t = 0.0
    for start, end in zip(starts, ends, strict=True):
        if start > t + _EPSILON:
            idle.append((t, start))
        t = max(t, end)
    idle.append((t, float("inf")))
    return idle


def packed_end(items: Iterable[Item], idle: Sequence[tuple[float, float]]) -> float:
    """When the last of ``items`` ends, packed in release order into ``idle``, split across intervals as needed."""
    free = [list(interval) for interval in idle]
    end = 0.0
    first = 0
    for release, duration in sorted(items):
        left = duration
        for index in range(first, len(free)):
            begin, stop = free[index]
            begin = max(begin, release)
            if begin >= stop:
                continue
            take = min(left, stop - begin)
            free[index][0] = begin + take
            left -= take
            if left <= _EPSILON:
                end = max(end, begin + take)
                break
        while first < len(free) and free[first][0] >= free[first][1]:
            first += 1
    return end


def _cell_ends(schedule: Schedule, timeline: Timeline) -> dict[tuple[int, Instruction], float]:
    return {(n, instr): timeline.end[n][i] for n, stream in schedule.streams.items() for i, instr in enumerate(stream)}


def _redundant_items(
    baseline: Schedule, timeline: Timeline, rc: RCMode, duration: StageTable
) -> dict[int, list[Item]]:
    """Every node's redundant work under ``rc`` as (release, duration), read off the baseline's timeline."""
    P, M = baseline.stages, baseline.microbatches
    ends = _cell_ends(baseline, timeline)
    items: dict[int, list[Item]] = {n: [] for n in range(P)}

    def cost(kind: Kind, stage: int) -> float:
        return duration.rows[kind][stage]

    def forward_end(stage: int, k: int) -> float:
        return ends[(stage, Instruction(Kind.FORWARD, stage, k))]

    def backward_end(stage: int, k: int) -> float:
        return ends[(stage, Instruction(Kind.BACKWARD, stage, k))]

    for n in range(P):
        r = (n + 1) % P
        for k in range(M):
            release = 0.0 if r == 0 else forward_end(n, k)
            if rc in (RCMode.EFLB, RCMode.EFEB):
                items[n].append((release, cost(Kind.FRC, r) + cost(Kind.SWAP_OUT, r)))
            elif r != 0:  # lflb stashes the replica's input; stage 0's is loaded again instead
                items[n].append((release, cost(Kind.SWAP_OUT, r)))
            if rc is RCMode.EFEB:
                if r == P - 1:  # the loss gives the gradient: the FRC is the only input
                    arrived = release
                else:
                    message = cost(Kind.SEND_GRAD, r + 1)
                    arrived = backward_end(r + 1, k) + message
                    items[r + 1].append((backward_end(r + 1, k), message))
                items[n].append((arrived, cost(Kind.SWAP_IN, r) + cost(Kind.BRC, r)))
        reduced = ends[(r, Instruction(Kind.ALLREDUCE, r))]
        items[r].append((reduced, cost(Kind.SYNC_SEND, r)))
        transfer = duration.buffered.get(Kind.SYNC_SEND)
        landed = reduced + transfer[r] if transfer is not None else reduced
        items[n].append((landed, cost(Kind.SYNC_RECV, r)))
    return items


def node_excess(
    baseline: Schedule, timeline: Timeline, rc: RCMode, duration: StageTable
) -> dict[int, float]:
    """Per node, how far past the baseline's makespan its redundant work must run at the least (ms)."""
    if baseline.rc is not RCMode.NONE or baseline.placement != tuple(range(baseline.stages)):
        raise ValueError("the bound needs the fault-free schedule without redundancy as its baseline")
    if rc is RCMode.NONE:
        return dict.fromkeys(range(baseline.stages), 0.0)
    items = _redundant_items(baseline, timeline, rc, duration)
    return {
        n: max(0.0, packed_end(work, idle_intervals(timeline.start[n], timeline.end[n])) - timeline.makespan)
        for n, work in items.items()
    }


def overhead_bound(baseline: Schedule, timeline: Timeline, rc: RCMode, duration: StageTable) -> float:
    """The least overhead (percent of the baseline's makespan) that redundancy ``rc`` can add, for these costs.

    ``baseline`` is the fault-free schedule without redundancy and ``timeline`` its execution under
    ``duration`` (the cost model's table for ``rc``). 0.0 for ``none``.
    """
    excess = node_excess(baseline, timeline, rc, duration)
    makespan = timeline.makespan
    return 100.0 * max(excess.values(), default=0.0) / makespan if makespan > 0 else 0.0
