"""The failover merge: each survivor's lanes interleaved into one stream by running them all (a witness).

`merge_lanes` is the last step of `failover_schedule`: each survivor has its own remaining stream
(the re-sends first) and, on a shadow, the victim's recovery lane. Running every node's lanes with
blocking semantics, in the order of their cost clocks, and choosing by the merge rules whenever a
node has a choice (the victim's communication, its own communication, backward work, forward work)
gives streams that cannot deadlock.
"""

from __future__ import annotations

import heapq
from collections.abc import Mapping, Sequence

from bamboo.schedule._tasks import CostFn, KindStageCost, unit_cost
from bamboo.schedule.engine import counterpart, posted_before, received_ahead
from bamboo.schedule.ir import BUFFERED_SENDS, Instruction, Kind, Schedule
from bamboo.schedule.validate import ScheduleError, _provides, _requires

__all__ = ["merge_lanes"]


def _priority(instr: Instruction, lane: int) -> tuple[int, int]:
    """Merge rules: victim's communication, own communication, backward work, forward work."""
    if instr.is_comm:
        return (0, -lane)
    backwardish = instr.kind in (Kind.BACKWARD, Kind.BRC, Kind.SWAP_IN, Kind.ALLREDUCE, Kind.OPTIMIZER,
                                 Kind.SEND_GRAD, Kind.RECV_GRAD)
    return (1 if backwardish else 2, -lane)


def merge_lanes(
    lanes: Mapping[int, Sequence[Sequence[Instruction]]],
    executed: Mapping[int, Sequence[Instruction]],
    schedule: Schedule,
    cost: CostFn = unit_cost,
) -> dict[int, tuple[Instruction, ...]]:
    """Interleave each node's lanes by running all of them with blocking semantics (a witness order).

    Nodes advance in the order of their unit-cost clocks, so the interleaving follows time: a node
    does not run ahead with local work while a partner that is earlier in time could talk to it.
    """
    P, M, rc = schedule.stages, schedule.microbatches, schedule.rc
    nodes = list(lanes)
    pos = {n: [0] * len(lanes[n]) for n in nodes}
    # Only nodes with several lanes need to track what exists and to choose by priority: a single
    # lane keeps its own order, whose dependencies the validator checks.
    merged_nodes = {n for n in nodes if len(lanes[n]) > 1}
    have: dict[int, set[int]] = {}
    for n in merged_nodes:
        tokens: set[int] = set()
        for instr in executed[n]:
            tokens.update(_provides(instr, rc))
        have[n] = tokens
    out: dict[int, list[Instruction]] = {n: [] for n in nodes}
    by_kind_and_stage = cost is unit_cost or isinstance(cost, KindStageCost)
    costs: dict[tuple[Kind, int], float] = {}

    def cost_of(instr: Instruction) -> float:
        if not by_kind_and_stage:
            return cost(instr)
        key = (instr.kind, instr.stage)
        value = costs.get(key)
        if value is None:
            value = costs[key] = cost(instr)
        return value

    # per lane position: (instruction, what it requires, what it provides, merge priority, counterpart, cost)
    Info = tuple[Instruction, tuple, tuple, tuple[int, int] | None, Instruction | None, float]
    info: dict[int, list[list[Info]]] = {}
    for n in nodes:
        if n in merged_nodes:
            info[n] = [
                [
                    (
                        instr,
                        _requires(instr, P, M, rc),
                        _provides(instr, rc),
                        _priority(instr, li),
                        None if instr.peer is None else counterpart(instr, n),
                        cost_of(instr),
                    )
                    for instr in lane
                ]
                for li, lane in enumerate(lanes[n])
            ]
        else:
            info[n] = [
                [
                    (instr, (), (), None, None if instr.peer is None else counterpart(instr, n), cost_of(instr))
                    for instr in lane
                ]
                for lane in lanes[n]
            ]

    # (receiver, stage) of replica syncs posted and not yet received: those sends are buffered (`BUFFERED_SENDS`)
    posted = posted_before(executed)
    # (receiver, receive) of activations and gradients already sent into a receive posted ahead: each runs alone
    ahead = received_ahead({n: executed[n] for n in nodes})

    def satisfied(n: int, requires: tuple) -> bool:
        if not requires:
            return True
        mine = have[n]
        return all(t in mine for t in requires)

    clock = dict.fromkeys(nodes, 0.0)
    heap = [(0.0, n) for n in nodes]
    blocked: set[int] = set()
    waiting: dict[int, set[int]] = {}

    def heads(n: int) -> list[tuple[int, Info]]:
        position = pos[n]
        found = [(li, lane[position[li]]) for li, lane in enumerate(info[n]) if position[li] < len(lane)]
        if len(found) > 1:
            found.sort(key=lambda x: x[1][3])
        return found

    def step(n: int) -> int | None:
        """Run one instruction (or pair) on n by the merge rules; the partner, n itself, or None."""
        own = info[n]
        if len(own) == 1:
            lane = own[0]
            at = pos[n][0]
            candidates: Sequence[tuple[int, Info]] = ((0, lane[at]),) if at < len(lane) else ()
        else:
            candidates = heads(n)
        for li, entry in candidates:
            instr = entry[0]
            if entry[1] and not satisfied(n, entry[1]):
                continue
            m = instr.peer
            if m is not None and ahead and (n, instr) in ahead:
                ahead.discard((n, instr))
                m = None
            elif m is not None and instr.kind is Kind.SYNC_RECV:
                if (n, instr.stage) not in posted:
                    continue
                posted.discard((n, instr.stage))
                m = None
            elif m is not None and instr.kind in BUFFERED_SENDS:
                posted.add((m, instr.stage))
                m = None
            if m is None:
                out[n].append(instr)
                if entry[2]:
                    have[n].update(entry[2])
                pos[n][li] += 1
                clock[n] += entry[5]
                return n
            if m not in info:
                continue
            want = entry[4]
            position = pos[m]
            for lj, lane in enumerate(info[m]):
                if position[lj] < len(lane):
                    other = lane[position[lj]]
                    if (other[0] is want or other[0] == want) and (not other[1] or satisfied(m, other[1])):
                        out[n].append(instr)
                        if entry[2]:
                            have[n].update(entry[2])
                        pos[n][li] += 1
                        out[m].append(other[0])
                        if other[2]:
                            have[m].update(other[2])
                        position[lj] += 1
                        clock[n] = clock[m] = max(clock[n], clock[m]) + entry[5]
                        return m
        return None

    push, pop = heapq.heappush, heapq.heappop
    current: int | None = None  # the node to step next, when it is known to be the heap's minimum
    while current is not None or heap:
        if current is None:
            _t, n = pop(heap)
            if n in blocked:
                continue
        else:
            n, current = current, None
        partner = step(n)
        if partner is None:
            blocked.add(n)
            for _li, entry in heads(n):
                if entry[0].peer is not None:
                    waiting.setdefault(entry[0].peer, set()).add(n)
            continue
        if waiting:
            for changed in {n, partner}:
                woken = waiting.pop(changed, None)
                if not woken:
                    continue
                for q in sorted(woken):
                    if q in blocked:
                        blocked.discard(q)
                        clock[q] = max(clock[q], clock[n])
                        push(heap, (clock[q], q))
        if partner != n:
            blocked.discard(partner)
            push(heap, (clock[partner], partner))
        mine = (clock[n], n)
        if heap and heap[0] < mine:
            push(heap, mine)
        else:
            current = n  # pushing n and popping the minimum would give n back
    left = {n: [lane[pos[n][li]] for li, lane in enumerate(lanes[n]) if pos[n][li] < len(lane)] for n in nodes}
    if any(left.values()):
        stuck = "; ".join(f"node {n} at {', '.join(map(str, h))}" for n, h in left.items() if h)
        partial = {n: tuple(executed[n]) + tuple(out[n]) for n in nodes}
        raise ScheduleError(f"failover merge cannot finish: {stuck}", partial,
                            [(n, len(executed[n]) + len(out[n])) for n, h in left.items() if h])
    return {n: tuple(s) for n, s in out.items()}
