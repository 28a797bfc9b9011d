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
  over ``T0``, in percent;
- for ``eflb``, where it is later, the least end of the chains through whole FRCs (`whole_frc_end`: one
  node's FRCs at a time, each whole, their delay followed through the other nodes along the baseline's paths).

Why it is a lower bound: every schedule runs each node's normal work in the same order and no earlier than the
baseline does (the baseline starts everything as soon as its inputs exist), and redundant work cannot start
before its release. Splitting items and ignoring the order among redundant items only relax the problem. So no
placement of the same redundant work, for the same costs, ends an iteration sooner than ``T0`` plus the
largest excess; the schedule README derives it at more length.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from bamboo.schedule.engine import StageTable, Timeline, counterpart
from bamboo.schedule.ir import Instruction, Kind, RCMode, Schedule

__all__ = ["chain_tails", "idle_intervals", "least_chain_end", "node_excess", "overhead_bound", "packed_end",
           "whole_frc_end"]

_EPSILON = 1e-9
_BISECTIONS = 60

Cell = tuple[int, int]
"""(node, index in its stream)."""

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
    ``duration`` (the cost model's table for ``rc``). 0.0 for ``none``. For ``eflb`` also the least end of the
    chains through whole FRCs (`whole_frc_end`), where it is later.
    """
    excess = node_excess(baseline, timeline, rc, duration)
    makespan = timeline.makespan
    if makespan <= 0:
        return 0.0
    end = makespan + max(excess.values(), default=0.0)
    if rc is RCMode.EFLB:
        end = max(end, whole_frc_end(baseline, timeline, duration, end))
    return 100.0 * (end - makespan) / makespan


# The second part for eflb: whole FRCs, one node at a time, their delay followed along the baseline's paths.


def chain_tails(baseline: Schedule, timeline: Timeline, duration: StageTable) -> dict[int, list[float]]:
    """``tail[n][q]``: the longest path from the start of node ``n``'s instruction ``q`` to the end of the iteration
    in the baseline's timeline, through rendezvous messages and the replica syncs after the all-reduces (ms)."""
    streams = baseline.streams
    index = {n: {instr: i for i, instr in enumerate(stream)} for n, stream in streams.items()}
    partner: dict[Cell, Cell] = {}
    for n, stream in streams.items():
        for i, instr in enumerate(stream):
            if instr.peer is not None and instr.peer in index:
                j = index[instr.peer].get(counterpart(instr, n))
                if j is not None:
                    partner[(n, i)] = (instr.peer, j)
    transfer = duration.buffered.get(Kind.SYNC_SEND)
    tail: dict[int, list[float]] = {n: [-1.0] * len(stream) for n, stream in streams.items()}
    for root in ((n, i) for n, stream in streams.items() for i in range(len(stream))):
        stack = [root]
        while stack:
            n, i = cell = stack[-1]
            if tail[n][i] >= 0.0:
                stack.pop()
                continue
            group = (cell, partner[cell]) if cell in partner else (cell,)
            pending = [(m, j + 1) for m, j in group if j + 1 < len(streams[m]) and tail[m][j + 1] < 0.0]
            if pending:
                stack.extend(pending)
                continue
            after = 0.0
            for m, j in group:
                instr = streams[m][j]
                if j + 1 < len(streams[m]):
                    after = max(after, tail[m][j + 1])
                if instr.kind is Kind.ALLREDUCE and instr.stage == m:  # the sync lands, the shadow receives it
                    sync = transfer[instr.stage] if transfer is not None else duration(m, instr)
                    after = max(after, sync + duration.rows[Kind.SYNC_RECV][instr.stage])
            value = timeline.end[n][i] - timeline.start[n][i] + after
            for m, j in group:
                tail[m][j] = value
            stack.pop()
    return tail


def _fits(
    target: float, starts: Sequence[float], lengths: Sequence[float], tails: Sequence[float],
    released: Sequence[int], count: int, item: float, last: float,
) -> bool:
    """Whether ``count`` FRCs of ``item`` ms each fit on the node's chain so that nothing ends after ``target``:
    placed as early as fits (``released[q]``: how many may come before instruction ``q``), the rest after the
    node's own work, followed by ``last`` (its replica's sync receive)."""
    limit = [0.0] * len(starts)  # the latest start of each instruction for which the chain still ends in time
    latest = float("inf")
    for q in range(len(starts) - 1, -1, -1):
        latest = min(target - tails[q], latest - lengths[q])
        if starts[q] > latest + _EPSILON:
            return False
        limit[q] = latest
    free, placed = 0.0, 0
    for q, start in enumerate(starts):
        room = limit[q] + _EPSILON - free
        fit = min(released[q], count) - placed
        if fit > 0 and room >= item:
            fit = min(fit, int(room // item))
            placed += fit
            free += fit * item
        free = max(start, free) + lengths[q]
    return free + (count - placed) * item + last <= target + _EPSILON


def least_chain_end(
    starts: Sequence[float], lengths: Sequence[float], tails: Sequence[float], released: Sequence[int],
    count: int, item: float, last: float, at_least: float,
) -> float:
    """The least end (no less than ``at_least``) of the node's chain over every placement of its FRCs (`_fits`),
    by bisection (what it returns is at most the least end).

    A candidate end is reachable when, position by position, as many FRCs as fit go in without any later
    instruction starting after ``end - tail`` (with none placed later), and those left run after the node's own
    work in time. Placing as early as fits is optimal: an FRC moved from a later position to an earlier one where
    it fits delays the instructions in between within their limits, and those from the later position on by no
    more than before."""
    if _fits(at_least, starts, lengths, tails, released, count, item, last):
        return at_least
    low = at_least
    high = max([at_least, *(s + t for s, t in zip(starts, tails, strict=True))])
    high = max(high, (starts[-1] + lengths[-1] if starts else 0.0) + count * item + last)
    for _ in range(_BISECTIONS):
        middle = (low + high) / 2
        if _fits(middle, starts, lengths, tails, released, count, item, last):
            high = middle
        else:
            low = middle
        if high - low <= _EPSILON:
            break
    return low


def whole_frc_end(baseline: Schedule, timeline: Timeline, duration: StageTable, at_least: float = 0.0) -> float:
    """The least end of an ``eflb`` iteration over every placement of whole FRCs into the ``baseline``'s streams, by
    the chains of one node's FRCs at a time; ``at_least`` when no chain must end later.

    With ``c_q`` FRCs (each ``d``: the FRC and its swap-out) right before node ``n``'s instruction ``q``, that
    instruction starts no sooner than ``max(S_q, e_{q-1} + c_q d)`` (``S_q``: its baseline start, ``e``: ends), and
    the iteration ends no sooner than that plus ``chain_tails``'s ``tail[n][q]`` (adding work never shortens a
    path); the FRCs after the node's own work, then its replica's sync receive, end no sooner than ``e_last +
    c_tail d + RY``. An FRC of microbatch ``k`` comes after the node's forward of ``k`` (stage 0's shadow: anywhere).
    `least_chain_end` finds each node's least end over every placement; no placement of the same FRCs, in the
    baseline's order of each node's instructions and messages (that of every schedule `fill_idle` makes for the
    same costs), ends sooner than the latest of them."""
    P, M = baseline.stages, baseline.microbatches
    tails = chain_tails(baseline, timeline, duration)
    end = at_least
    for n, stream in baseline.streams.items():
        replica = (n + 1) % P
        item = duration.rows[Kind.FRC][replica] + duration.rows[Kind.SWAP_OUT][replica]
        if item <= _EPSILON or not stream:
            continue
        released: list[int] = []
        forwards = 0
        for instr in stream:
            released.append(M if replica == 0 else forwards)
            forwards += instr.kind is Kind.FORWARD
        lengths = [e - s for s, e in zip(timeline.start[n], timeline.end[n], strict=True)]
        last = duration.rows[Kind.SYNC_RECV][replica]
        end = least_chain_end(timeline.start[n], lengths, tails[n], released, M, item, last, end)
    return end
