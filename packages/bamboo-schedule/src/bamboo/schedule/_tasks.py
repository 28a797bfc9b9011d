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

from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from bamboo.schedule.ir import Instruction, Kind, RCMode, make, make_row

Token = int
"""A fact produced on a node, packed into an int: what << 40 | (stage + 1) << 20 | (microbatch + 1, or 0).

``what`` is one of `ACT`, `GRAD`, `FWD`, `STASH`, `REDUCED`; ints hash and compare much faster than tuples.
"""

ACT, GRAD, FWD, STASH, REDUCED = range(1, 6)
_NODE = 50
"""A (node, token) pair is packed as node << 50 | token."""

RANK_BACKWARD = 0
RANK_FORWARD = 1
RANK_REDUNDANT = 2


def token(what: int, stage: int, microbatch: int | None = None) -> Token:
    """The packed token for ``what`` of ``stage`` (and ``microbatch``)."""
    return (what << 40) | ((stage + 1) << 20) | (0 if microbatch is None else microbatch + 1)


class Need(NamedTuple):
    """A remote input of a task: ``token`` made on node ``src`` and sent by message ``send``/``recv``.

    ``key`` is ``src << 50 | token``; ``cost`` is the message's duration for the linearizer.
    """

    token: Token
    src: int
    send: Instruction
    recv: Instruction
    key: int
    cost: float


class Task(NamedTuple):
    """Instructions that run back to back on one node once every need is met."""

    instrs: tuple[Instruction, ...]
    local: tuple[Token, ...]
    """Tokens that must exist on the node itself."""
    remote: tuple[Need, ...]
    """Inputs that arrive by message from another node."""
    makes: tuple[Token, ...]
    rank: int
    duration: float


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


class KindStageCost:
    """A `CostFn` promised to depend only on an instruction's kind and stage.

    The linearizer then computes each kind of task's duration once per stage instead of once per task.
    """

    __slots__ = ("function",)

    def __init__(self, function: CostFn) -> None:
        self.function = function

    def __call__(self, instr: Instruction) -> float:
        return self.function(instr)


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


class _Durations:
    """Durations of instruction groups under one cost model, memoized per (tag, stage) when it allows."""

    def __init__(self, cost: CostFn) -> None:
        self.cost = cost
        self.by_kind_and_stage = cost is unit_cost or isinstance(cost, KindStageCost)
        self.memo: dict[tuple[object, int], float] = {}

    def of(self, tag: object, stage: int, instrs: tuple[Instruction, ...]) -> float:
        """Sum of the instructions' costs; ``(tag, stage)`` must determine their kinds and stages."""
        if not self.by_kind_and_stage:
            return sum(self.cost(i) for i in instrs)
        key = (tag, stage)
        value = self.memo.get(key)
        if value is None:
            value = self.memo[key] = sum(self.cost(i) for i in instrs)
        return value


def _microbatch_count(work: Mapping[int, Sequence[Sequence[Work]]]) -> int:
    """One more than the largest microbatch any work item names (0 when none does)."""
    top = -1
    for node_lanes in work.values():
        for lane in node_lanes:
            for w in lane:
                if len(w) > 2 and w[2] > top:  # type: ignore[operator]
                    top = w[2]  # type: ignore[assignment]
    return top + 1


class _Context(NamedTuple):
    """What every task of one (tag, stage) on one node shares; the per-microbatch parts are rows by k."""

    instrs: tuple[Sequence[Instruction], ...]
    """Rows of the task's own instructions, one row per instruction of the task, indexed by microbatch."""
    makes: tuple[int, ...]
    """Token bases (the microbatch bits are 0) of what the task makes."""
    local: int
    """Token base of a local input (0: none)."""
    remote: tuple[int, Sequence[Instruction], Sequence[Instruction], int, float] | None
    """(src, send row, recv row, token base, message cost) of a remote input; None when the input is local."""
    extra_local: int
    """Token base of a second local input (backward work: the gradient, when its producer is on this node)."""
    rank: int
    duration: float


def build_lanes(
    work: Mapping[int, Sequence[Sequence[Work]]], placement: Sequence[int], stages: int, cost: CostFn = unit_cost
) -> dict[int, list[list[Task]]]:
    """The tasks of every node's lanes of work items, with the messages their inputs need under ``placement``.

    A work item ("F", s, k) becomes the task ``[0Lk] sFk`` that needs the activation of (s-1, k),
    by message from node ``placement[s-1]`` unless that is this node; ("B", s, k) becomes ``sBk``
    after the forward of (s, k) and the gradient from stage s+1; ("TAIL", s) ``sAR sOPT``; ("FRC",
    r, k) ``[0Lk] rFRk rSOk`` and ("SO", r, k) ``rSOk`` after the activation of (r-1, k); ("BRC", r,
    k) ``rSIk rBRk`` after the stash and the gradient from stage r+1; ("SYNC", r) receives r's
    reduced gradients after the node's own all-reduces.

    Everything a task needs that does not depend on its microbatch is worked out once per (node,
    tag, stage) (a `_Context`); the instructions come from per-microbatch rows.
    """
    durations = _Durations(cost)
    last = stages - 1
    count = _microbatch_count(work)
    new = tuple.__new__

    def row(kind: Kind, stage: int, peer: int | None = None) -> Sequence[Instruction]:
        return make_row(kind, stage, peer, count)

    def context(node: int, tag: object, s: int) -> _Context:
        local = extra_local = 0
        remote = None
        base = (s + 1) << 20
        if tag == "F" or tag == "FRC" or tag == "SO":
            if tag == "F":
                instrs: tuple[Sequence[Instruction], ...] = (row(Kind.FORWARD, s),)
                makes: tuple[int, ...] = ((ACT << 40) | base, (FWD << 40) | base)
                rank = RANK_FORWARD
            else:
                so = row(Kind.SWAP_OUT, s)
                instrs = (so,) if tag == "SO" else (row(Kind.FRC, s), so)
                makes = ((STASH << 40) | base,)
                rank = RANK_REDUNDANT
            if s == 0:
                if tag != "SO":
                    instrs = (row(Kind.LOAD, 0), *instrs)
            else:
                src = placement[s - 1]
                tok = (ACT << 40) | (s << 20)
                if src == node:
                    local = tok
                else:
                    send = row(Kind.SEND_ACT, s - 1, node)
                    remote = (src, send, row(Kind.RECV_ACT, s, src), tok, durations.of(Kind.SEND_ACT, s - 1, (send[0],)))
        elif tag == "B" or tag == "BRC":
            if tag == "B":
                instrs = (row(Kind.BACKWARD, s),)
                local = (FWD << 40) | base
                makes = ((GRAD << 40) | base,)
                rank = RANK_BACKWARD
            else:
                instrs = (row(Kind.SWAP_IN, s), row(Kind.BRC, s))
                local = (STASH << 40) | base
                makes = ()
                rank = RANK_REDUNDANT
            if s < last:
                src = placement[s + 1]
                tok = (GRAD << 40) | ((s + 2) << 20)
                if src == node:
                    extra_local = tok
                else:
                    send = row(Kind.SEND_GRAD, s + 1, node)
                    remote = (src, send, row(Kind.RECV_GRAD, s, src), tok, durations.of(Kind.SEND_GRAD, s + 1, (send[0],)))
        else:
            raise ValueError(f"unknown work item tag {tag!r}")
        duration = durations.of(tag, s, tuple(r[0] for r in instrs))
        return _Context(instrs, makes, local, remote, extra_local, rank, duration)

    def per_iteration_task(node: int, w: Work) -> Task:
        tag, s = w[0], w[1]
        assert isinstance(s, int)
        local: tuple[Token, ...] = ()
        remote: tuple[Need, ...] = ()
        if tag == "TAIL":
            instrs: tuple[Instruction, ...] = (make(Kind.ALLREDUCE, s), make(Kind.OPTIMIZER, s))
            return new(Task, (instrs, local, remote, (token(REDUCED, s),), RANK_BACKWARD,
                              durations.of(tag, s, instrs)))
        # SYNC: after the node's own all-reduce, so the sync never delays it; the exchange then
        # follows the order in which nodes finish.
        local = tuple(token(REDUCED, own) for own, p in enumerate(placement) if p == node)
        src = placement[s]
        tok = token(REDUCED, s)
        if src == node:
            local += (tok,)
        else:
            send = make(Kind.SYNC_SEND, s, None, node)
            recv = make(Kind.SYNC_RECV, s, None, src)
            remote = (new(Need, (tok, src, send, recv, (src << _NODE) | tok,
                                 durations.of(Kind.SYNC_SEND, s, (send,)))),)
        return new(Task, ((), local, remote, (), RANK_REDUNDANT, durations.of(tag, s, ())))

    uniform = durations.by_kind_and_stage
    out: dict[int, list[list[Task]]] = {}
    for node, node_lanes in work.items():
        contexts: dict[tuple[object, object], _Context] = {}
        built: list[list[Task]] = []
        for lane in node_lanes:
            tasks: list[Task] = []
            append = tasks.append
            for w in lane:
                if len(w) < 3:
                    if w[0] != "TAIL" and w[0] != "SYNC":
                        raise ValueError(f"unknown work item {w!r}")
                    append(per_iteration_task(node, w))
                    continue
                tag, s, k = w
                key = (tag, s)
                ctx = contexts.get(key)
                if ctx is None:
                    ctx = contexts[key] = context(node, tag, s)  # type: ignore[arg-type]
                k1: int = k + 1  # type: ignore[operator]
                instr_rows = ctx[0]
                instrs = (instr_rows[0][k],) if len(instr_rows) == 1 else tuple([r[k] for r in instr_rows])  # type: ignore[index]
                local_base, remote, extra = ctx[2], ctx[3], ctx[4]
                if local_base:
                    local = (local_base | k1, extra | k1) if extra else (local_base | k1,)
                elif extra:
                    local = (extra | k1,)
                else:
                    local = ()
                if remote is None:
                    needs: tuple[Need, ...] = ()
                else:
                    src, send_row, recv_row, token_base, message_cost = remote
                    send = send_row[k]  # type: ignore[index]
                    if not uniform:
                        message_cost = cost(send)
                    tok = token_base | k1
                    needs = (new(Need, (tok, src, send, recv_row[k], (src << _NODE) | tok, message_cost)),)  # type: ignore[index]
                makes = ctx[1]
                if len(makes) == 2:
                    made: tuple[Token, ...] = (makes[0] | k1, makes[1] | k1)
                elif makes:
                    made = (makes[0] | k1,)
                else:
                    made = ()
                duration = ctx[6] if uniform else sum(cost(i) for i in instrs)
                append(new(Task, (instrs, local, needs, made, ctx[5], duration)))
            built.append(tasks)
        out[node] = built
    return out


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
