"""From per-node work orders to deadlock-free instruction streams (the linearizer).

A generator decides *what* each node computes and in which order (its *lanes*: one ordered list of
work items per stage it runs, plus one for its redundant work). This module decides where the
sends and receives go. It runs an event simulation with a simple cost model: a node starts the
head of one of its lanes as soon as that work's inputs exist, and a message is sent at the moment
its consumer starts. The send is appended to the producer's stream and the receive to the
consumer's stream at that same point of one global order. Every stream is therefore a projection
of one global sequence in which each send is immediately followed by its receive, so executing the
streams with blocking, rendezvous send/recv cannot deadlock: the global sequence is a witness.

Redundant lanes have the lowest priority: their work runs where the node would otherwise wait.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from bamboo.schedule.ir import Instruction, Kind, RCMode, make

Token = tuple[object, ...]
"""A fact produced on a node: ("act", s, k), ("grad", s, k), ("fwd", s, k), ("stash", s, k), ("reduced", s)."""

RANK_BACKWARD = 0
RANK_FORWARD = 1
RANK_REDUNDANT = 2


class Need(NamedTuple):
    """An input of a task: ``token`` made on node ``src``; a message pair when src is another node."""

    token: Token
    src: int
    send: Instruction | None = None
    recv: Instruction | None = None


class Task(NamedTuple):
    """Instructions that run back to back on one node once every need is met."""

    instrs: tuple[Instruction, ...]
    needs: tuple[Need, ...] = ()
    makes: tuple[Token, ...] = ()
    rank: int = RANK_FORWARD


def _need(token: Token, src: int, send: Instruction | None = None, recv: Instruction | None = None) -> Need:
    return tuple.__new__(Need, (token, src, send, recv))


def _task(instrs: tuple[Instruction, ...], needs: tuple[Need, ...], makes: tuple[Token, ...], rank: int) -> Task:
    return tuple.__new__(Task, (instrs, needs, makes, rank))


Work = tuple[object, ...]
"""A work item: ("F", s, k), ("B", s, k), ("TAIL", s), ("FRC", r, k), ("SO", r, k), ("BRC", r, k), ("SYNC", r)."""

CostFn = Callable[[Instruction], float]


def unit_cost(instr: Instruction) -> float:
    """The linearizer's default cost model: forward 1, backward 2, step 0.5, everything else free."""
    if instr.kind in (Kind.FORWARD, Kind.FRC):
        return 1.0
    if instr.kind in (Kind.BACKWARD, Kind.BRC):
        return 2.0
    if instr.kind in (Kind.ALLREDUCE, Kind.OPTIMIZER):
        return 0.25
    return 0.0


def compute_order(policy: str, stages: int, microbatches: int, stage: int) -> list[Work]:
    """The forward/backward order of one stage: GPipe (all F, then all B) or 1F1B (PipeDream-flush)."""
    if policy == "gpipe":
        return [("F", stage, k) for k in range(microbatches)] + [("B", stage, k) for k in range(microbatches)]
    if policy != "1f1b":
        raise ValueError(f"unknown policy {policy!r}; expected '1f1b' or 'gpipe'")
    warmup = min(stages - 1 - stage, microbatches)
    order: list[Work] = [("F", stage, k) for k in range(warmup)]
    for i in range(microbatches - warmup):
        order += [("F", stage, warmup + i), ("B", stage, i)]
    order += [("B", stage, k) for k in range(microbatches - warmup, microbatches)]
    return order


_MESSAGE_KINDS = {
    "act": (Kind.SEND_ACT, Kind.RECV_ACT),
    "grad": (Kind.SEND_GRAD, Kind.RECV_GRAD),
    "sync": (Kind.SYNC_SEND, Kind.SYNC_RECV),
}


def _message(token: Token, src: int, dst: int, kind: str, stage_src: int, stage_dst: int, k: int | None) -> Need:
    if src == dst:
        return _need(token, src)
    send_kind, recv_kind = _MESSAGE_KINDS[kind]
    return _need(token, src, make(send_kind, stage_src, k, dst), make(recv_kind, stage_dst, k, src))


def build_task(work: Work, node: int, placement: Sequence[int], stages: int) -> Task:
    """The task for one work item on ``node``, with the messages its inputs need under ``placement``."""
    tag = work[0]
    last = stages - 1
    if tag == "F":
        _, s, k = work
        assert isinstance(s, int) and isinstance(k, int)
        instrs = [make(Kind.LOAD, 0, k)] if s == 0 else []
        instrs.append(make(Kind.FORWARD, s, k))
        needs = () if s == 0 else (_message(("act", s - 1, k), placement[s - 1], node, "act", s - 1, s, k),)
        return _task(tuple(instrs), needs, (("act", s, k), ("fwd", s, k)), RANK_FORWARD)
    if tag == "B":
        _, s, k = work
        assert isinstance(s, int) and isinstance(k, int)
        needs = [_need(("fwd", s, k), node)]
        if s < last:
            needs.append(_message(("grad", s + 1, k), placement[s + 1], node, "grad", s + 1, s, k))
        return _task((make(Kind.BACKWARD, s, k),), tuple(needs), (("grad", s, k),), RANK_BACKWARD)
    if tag == "TAIL":
        _, s = work
        assert isinstance(s, int)
        instrs = (make(Kind.ALLREDUCE, s), make(Kind.OPTIMIZER, s))
        return _task(instrs, (), (("reduced", s),), RANK_BACKWARD)
    if tag in ("FRC", "SO"):
        _, r, k = work
        assert isinstance(r, int) and isinstance(k, int)
        instrs = []
        if tag == "FRC" and r == 0:
            instrs.append(make(Kind.LOAD, 0, k))
        if tag == "FRC":
            instrs.append(make(Kind.FRC, r, k))
        instrs.append(make(Kind.SWAP_OUT, r, k))
        needs = () if r == 0 else (_message(("act", r - 1, k), placement[r - 1], node, "act", r - 1, r, k),)
        return _task(tuple(instrs), needs, (("stash", r, k),), RANK_REDUNDANT)
    if tag == "BRC":
        _, r, k = work
        assert isinstance(r, int) and isinstance(k, int)
        needs = [_need(("stash", r, k), node)]
        if r < last:
            needs.append(_message(("grad", r + 1, k), placement[r + 1], node, "grad", r + 1, r, k))
        instrs = (make(Kind.SWAP_IN, r, k), make(Kind.BRC, r, k))
        return _task(instrs, tuple(needs), (), RANK_REDUNDANT)
    if tag == "SYNC":
        _, r = work
        assert isinstance(r, int)
        # After the node's own all-reduce, so the sync never delays it; the exchange then follows the
        # order in which nodes finish.
        own = tuple(_need(("reduced", s), node) for s, p in enumerate(placement) if p == node)
        needs = (*own, _message(("reduced", r), placement[r], node, "sync", r, r, None))
        return _task((), needs, (), RANK_REDUNDANT)
    raise ValueError(f"unknown work item {work!r}")


def replica_lane(policy: str, stages: int, microbatches: int, replica: int, rc: RCMode) -> list[Work]:
    """The redundant work a shadow does for ``replica`` in one iteration under ``rc``."""
    if rc is RCMode.NONE:
        return []
    lane: list[Work] = []
    if rc is RCMode.LFLB:
        if replica != 0:  # the input of stage 0 is re-loaded on failure, so it needs no stash
            lane = [("SO", replica, k) for k in range(microbatches)]
    elif rc is RCMode.EFLB:
        lane = [("FRC", replica, k) for k in range(microbatches)]
    else:
        mapping = {"F": "FRC", "B": "BRC"}
        lane = [(mapping[str(w[0])], w[1], w[2]) for w in compute_order(policy, stages, microbatches, replica)]
    return [*lane, ("SYNC", replica)]


def linearize(
    lanes: Mapping[int, Sequence[Sequence[Task]]],
    cost: CostFn = unit_cost,
) -> dict[int, tuple[Instruction, ...]]:
    """Streams for ``lanes`` (node -> ordered task lists), with every send/recv pair placed.

    The simulation follows blocking rendezvous semantics with ``cost`` as durations. A node that is
    free first exchanges a message with a partner that is free too and needs it next (push to a
    consumer, or pull from a producer), then starts its best ready task (lowest rank: backward,
    forward, redundant; then lane order), and otherwise waits. Redundant work is not started when
    it would delay a message exchange the node could otherwise make. The streams reproduce this
    simulation exactly when run with the same costs, and cannot deadlock in any case.

    Raises ValueError when the work cannot complete (a task needs a token nobody makes).
    """
    nodes = sorted(lanes)
    streams: dict[int, list[Instruction]] = {n: [] for n in nodes}
    free = dict.fromkeys(nodes, 0.0)
    heads = {n: [0] * len(lanes[n]) for n in nodes}
    local: dict[int, set[Token]] = {n: set() for n in nodes}
    inbox: dict[int, set[tuple[int, Token]]] = {n: set() for n in nodes}
    outbox: dict[int, dict[tuple[Token, int], Need]] = {n: {} for n in nodes}
    # (src, token) -> the lane head still missing that remote input (a dict: ordered, deterministic)
    want: dict[int, dict[tuple[int, Token], Task]] = {n: {} for n in nodes}
    consumers: dict[tuple[int, Token], list[tuple[int, Need]]] = {}
    for n in nodes:
        for lane in lanes[n]:
            for task in lane:
                for need in task.needs:
                    if need.send is not None:
                        consumers.setdefault((need.src, need.token), []).append((n, need))
    heap: list[tuple[float, int]] = [(0.0, n) for n in nodes]
    remaining = sum(len(lane) for n in nodes for lane in lanes[n])

    def enter(n: int, li: int) -> None:
        """Register the missing remote inputs of lane li's new head."""
        lane = lanes[n][li]
        index = heads[n][li]
        if index < len(lane):
            task = lane[index]
            for need in task.needs:
                if need.send is not None and (need.src, need.token) not in inbox[n]:
                    want[n][(need.src, need.token)] = task

    for n in nodes:
        for li in range(len(lanes[n])):
            enter(n, li)

    def pair(src: int, dst: int, token: Token) -> None:
        need = outbox[src].pop((token, dst))
        assert need.send is not None and need.recv is not None
        begin = max(free[src], free[dst])
        streams[src].append(need.send)
        streams[dst].append(need.recv)
        end = begin + cost(need.send)
        free[src] = free[dst] = end
        inbox[dst].add((src, token))
        want[dst].pop((src, token), None)
        heapq.heappush(heap, (end, src))
        heapq.heappush(heap, (end, dst))

    def communicate(n: int, t: float) -> bool:
        """Push a message to a free consumer that needs it next, or pull one from a free producer."""
        for token, dst in outbox[n]:
            if free[dst] <= t and (n, token) in want[dst]:
                pair(n, dst, token)
                return True
        mine = local[n]
        for (src, token), task in want[n].items():
            if (
                free[src] <= t
                and (token, n) in outbox[src]
                and all(need.token in mine for need in task.needs if need.send is None)
            ):
                pair(src, n, token)
                return True
        return False

    def next_exchange(n: int) -> float | None:
        """When the earliest exchange of a message that a main lane needs could happen."""
        soon = None
        for token, dst in outbox[n]:
            task = want[dst].get((n, token))
            if task is not None and task.rank != RANK_REDUNDANT and (soon is None or free[dst] < soon):
                soon = free[dst]
        for (src, token), task in want[n].items():
            if task.rank != RANK_REDUNDANT and (token, n) in outbox[src] and (soon is None or free[src] < soon):
                soon = free[src]
        return soon

    def ready(n: int) -> int | None:
        best = None
        best_rank = 99
        mine, received, position = local[n], inbox[n], heads[n]
        for li, lane in enumerate(lanes[n]):
            index = position[li]
            if index >= len(lane):
                continue
            task = lane[index]
            if task.rank >= best_rank:
                continue
            for token, src, send, _recv in task.needs:
                if (token not in mine) if send is None else ((src, token) not in received):
                    break
            else:
                best, best_rank = li, task.rank
        return best

    durations: dict[int, float] = {}

    def duration_of(task: Task) -> float:
        key = id(task)
        value = durations.get(key)
        if value is None:
            value = durations[key] = sum(cost(i) for i in task.instrs)
        return value

    while heap:
        t, n = heapq.heappop(heap)
        if t < free[n] or communicate(n, t):
            continue
        li = ready(n)
        if li is None:
            continue  # idle: a producer pushes to this node when it is free
        task = lanes[n][li][heads[n][li]]
        duration = duration_of(task)
        if task.rank == RANK_REDUNDANT:
            soon = next_exchange(n)
            if soon is not None and soon < t + duration:
                heapq.heappush(heap, (soon, n))  # redundant work must not delay the pipeline's messages
                continue
        streams[n].extend(task.instrs)
        free[n] = t + duration
        heads[n][li] += 1
        remaining -= 1
        enter(n, li)
        for token in task.makes:
            local[n].add(token)
            for dst, need in consumers.get((n, token), ()):
                outbox[n][(token, dst)] = need
        heapq.heappush(heap, (free[n], n))
    if remaining or any(outbox.values()):
        stuck = [
            f"node {n} lane {li} at {' '.join(map(str, lanes[n][li][heads[n][li]].instrs)) or 'a receive'}"
            for n in nodes
            for li in range(len(lanes[n]))
            if heads[n][li] < len(lanes[n][li])
        ]
        raise ValueError("work cannot be ordered, inputs never made: " + "; ".join(stuck[:4]))
    return {n: tuple(s) for n, s in streams.items()}
