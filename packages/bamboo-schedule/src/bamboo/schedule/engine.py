"""Blocking execution of instruction streams: the one interpreter the validator and simulator share.

`execute(streams, duration)` runs every node's stream in order with rendezvous send/recv: a send
and its receive start together when both nodes have reached them, and end together. This is the
strictest blocking semantics (gloo's is looser: a small send may return before its receive is
posted), so streams that complete here complete under gloo too. Local instructions start as soon
as their node is free. The result is each instruction's start and end time.

The replica sync's send (``SY``, `BUFFERED_SENDS`) is the one exception: it is posted and not waited for. It
costs its node its own duration and the node goes on; the data lands after the transfer time (a `StageTable`'s
``buffered`` row, else the send's duration), and the receive (``RY``) starts once both its node and the data are
there. `check_execution` follows the same rules.

A failover's cut can hold one more kind of message in flight: an activation or a gradient whose send completed
while its receive had not run yet, because the receiver had posted that receive ahead (`received_ahead`). The data
waits in the posted receive; the receive then runs without its partner (`check_execution`'s ``ahead``).

Errors are typed and carry where they happened, so the validator can mark the bad cell:
`Deadlock` (some nodes wait forever; the blocked heads are given) and `Mismatch` (two nodes are at a
send and a receive towards each other, but for different tensors, so FIFO matching would pair the
wrong tensors).
"""

from __future__ import annotations

from bisect import bisect_left
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from operator import is_not

import attrs
from bamboo.schedule._gc import gc_paused
from bamboo.schedule.ir import BUFFERED_SENDS, SENDS, Instruction, Kind, make

__all__ = [
    "Deadlock",
    "ExecutionError",
    "Mismatch",
    "StageTable",
    "Timeline",
    "check_execution",
    "counterpart",
    "execute",
    "execute_from",
    "posted_before",
    "received_ahead",
]

Cell = tuple[int, int]
"""(node, index in that node's stream)."""

BufferedEvent = tuple[int, int, tuple[int, int], float | None]
"""A buffered send or receive that ran: (node, index, (receiver, stage), when the data lands; None for a receive)."""


class ExecutionError(ValueError):
    """Blocking execution cannot finish. ``cells`` are the (node, index) positions to mark."""

    def __init__(self, message: str, cells: Sequence[Cell]) -> None:
        super().__init__(message)
        self.cells = tuple(cells)


class Deadlock(ExecutionError):
    """Every unfinished node waits on a send or receive that never comes."""


class Mismatch(ExecutionError):
    """A send and a receive meet between two nodes but name different tensors."""


_PAIR = {Kind.SEND_ACT: Kind.RECV_ACT, Kind.SEND_GRAD: Kind.RECV_GRAD, Kind.SYNC_SEND: Kind.SYNC_RECV}
_PAIR.update({v: k for k, v in list(_PAIR.items())})
_BUFFERED = BUFFERED_SENDS
_BUFFERED_RECEIVES = frozenset(_PAIR[kind] for kind in BUFFERED_SENDS)
_BUFFERED_ANY = _BUFFERED | _BUFFERED_RECEIVES
_AHEAD_SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD})
_AHEAD_RECEIVES = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})
_OFFSET = {Kind.SEND_ACT: 1, Kind.RECV_ACT: -1, Kind.SEND_GRAD: -1, Kind.RECV_GRAD: 1}


def counterpart(instr: Instruction, node: int) -> Instruction:
    """The instruction that pairs with ``instr`` (executed on ``node``) on its peer.

    ``sSAk>m`` on n pairs with ``(s+1)RAk<n`` on m; ``sSGk>m`` with ``(s-1)RGk<n``; ``sSY>m`` with ``sRY<n``.
    """
    if instr.peer is None:
        raise ValueError(f"{instr} is not a send or receive")
    stage = instr.stage + _OFFSET.get(instr.kind, 0)
    return make(_PAIR[instr.kind], stage, instr.microbatch, node)


@attrs.frozen
class Timeline:
    """Start and end time of every instruction: ``start[node][i]``, ``end[node][i]``."""

    start: dict[int, list[float]]
    end: dict[int, list[float]]
    buffered: list[BufferedEvent] = attrs.field(factory=list)
    """The buffered instructions in the order they ran: ``(node, index, (receiver, stage), arrival)`` for a send
    (when its data lands), ``arrival`` None for a receive (what `execute_from` resumes with)."""

    @property
    def makespan(self) -> float:
        return max((e[-1] for e in self.end.values() if e), default=0.0)


Duration = Callable[[int, Instruction], float]


class StageTable:
    """A `Duration` given as a table: ``rows[kind][stage]`` ms, the same on every node.

    The engine reads the table directly instead of calling a function per instruction. A stage
    beyond a row's end is looked up through ``fallback`` (which may extend the rows).
    """

    __slots__ = ("buffered", "fallback", "rows")

    def __init__(
        self,
        rows: Mapping[Kind, list[float]],
        fallback: Duration | None = None,
        buffered: Mapping[Kind, list[float]] | None = None,
    ) -> None:
        self.rows = rows
        self.fallback = fallback
        self.buffered: Mapping[Kind, list[float]] = buffered or {}
        """The transfer time (ms) per stage of `BUFFERED_SENDS` kinds, when it differs from the send's duration."""

    def __call__(self, node: int, instr: Instruction) -> float:
        row = self.rows[instr.kind]
        if instr.stage < len(row) or self.fallback is None:
            return row[instr.stage]
        return self.fallback(node, instr)


def _zero(_node: int, _instr: Instruction) -> float:
    return 0.0


def _blocked_error(streams: Mapping[int, Sequence[Instruction]], pos: Mapping[int, int]) -> Deadlock | None:
    blocked = [(n, pos[n]) for n in streams if pos[n] < len(streams[n])]
    if not blocked:
        return None
    heads = ", ".join(f"node {n} waits at {streams[n][i]} (#{i})" for n, i in blocked)
    return Deadlock(f"blocking execution deadlocks: {heads}", blocked)


def _mismatch(n: int, i: int, instr: Instruction, m: int, j: int, other: Instruction) -> Mismatch:
    return Mismatch(
        f"node {n} runs {instr} while node {m} runs {other}: {instr} pairs with {counterpart(instr, n)}",
        [(n, i), (m, j)],
    )


def _no_stream(n: int, i: int, instr: Instruction, m: int) -> Deadlock:
    return Deadlock(f"node {n} instruction {i} ({instr}) talks to node {m}, which has no stream", [(n, i)])


def posted_before(executed: Mapping[int, Sequence[Instruction]]) -> set[tuple[int, int]]:
    """(receiver, stage) of the buffered sends in ``executed`` (completed prefixes) that no receive took yet."""
    posted = {(i.peer, i.stage) for stream in executed.values() for i in stream if i.kind in _BUFFERED}
    taken = {(n, i.stage) for n, stream in executed.items() for i in stream if i.kind in _BUFFERED_RECEIVES}
    return {(peer, stage) for peer, stage in posted - taken if peer is not None}


def received_ahead(executed: Mapping[int, Sequence[Instruction]]) -> set[tuple[int, Instruction]]:
    """(receiver, receive) of the activations and gradients sent in ``executed`` (completed prefixes) whose receive
    is not in its receiver's prefix.

    A runtime that posts a receive ahead of its turn (bamboo-rc's ``StageInterpreter.post_ahead``: a blocking send
    completes only once its receive is posted) lets such a send complete first: the data waits in the posted
    receive, which then runs without its partner. Only messages between nodes of ``executed`` count.
    """
    ahead: set[tuple[int, Instruction]] = set()
    done: dict[int, set[Instruction]] = {}
    for n, stream in executed.items():
        for instr in stream:
            m = instr.peer
            if m is None or instr.kind not in _AHEAD_SENDS or m not in executed:
                continue
            if m not in done:
                done[m] = set(executed[m])
            receive = counterpart(instr, n)
            if receive not in done[m]:
                ahead.add((m, receive))
    return ahead


@gc_paused
def check_execution(
    streams: Mapping[int, Sequence[Instruction]],
    posted: Collection[tuple[int, int]] = (),
    ahead: Collection[tuple[int, Instruction]] = (),
    receives_ahead: bool = False,
) -> None:
    """`execute` without durations or a timeline: only raise `Deadlock` or `Mismatch` (the validator's use).

    ``posted`` are buffered sends already posted before these streams start ((receiver, stage), from
    `posted_before`); ``ahead`` are receives whose data came before these streams start ((receiver, receive), from
    `received_ahead`): each runs without its partner. Nodes are visited in the same order as in `execute`, so the
    same error is raised.

    With ``receives_ahead``, each node has its next activation or gradient receive posted (its first from its
    current instruction on, as bamboo-rc's ``StageInterpreter.post_ahead`` does), and a send into it completes at
    once; the data waits there until the receiver gets to it. A cut's check (`bamboo.schedule.cut`) runs so.
    """
    pos = dict.fromkeys(streams, 0)
    work = deque(streams)
    pair_kind, offset = _PAIR, _OFFSET
    posted = set(posted)
    ahead = set(ahead)
    following: dict[int, list[int]] = {}  # with receives_ahead: node -> index -> the index of its next receive

    def posted_receive(m: int, j: int) -> Instruction | None:
        if m not in following:
            other_stream = streams[m]
            nexts = [len(other_stream)] * (len(other_stream) + 1)
            for index in range(len(other_stream) - 1, -1, -1):
                nexts[index] = index if other_stream[index].kind in _AHEAD_RECEIVES else nexts[index + 1]
            following[m] = nexts
        r = following[m][j]
        return streams[m][r] if r < len(streams[m]) else None
    while work:
        n = work.popleft()
        stream = streams[n]
        length = len(stream)
        i = pos[n]
        while i < length:
            instr = stream[i]
            m = instr.peer
            if m is None:
                i += 1
                continue
            if ahead and (n, instr) in ahead:
                ahead.discard((n, instr))
                i += 1
                continue
            other_stream = streams.get(m)
            if other_stream is None:
                raise _no_stream(n, i, instr, m)
            kind = instr.kind
            if kind in _BUFFERED:
                posted.add((m, instr.stage))
                work.append(m)
                i += 1
                continue
            if kind in _BUFFERED_RECEIVES:
                if (n, instr.stage) not in posted:
                    break
                posted.discard((n, instr.stage))
                i += 1
                continue
            j = pos[m]
            if receives_ahead and kind in _AHEAD_SENDS:
                receive = posted_receive(m, j)
                if receive is not None and (m, receive) not in ahead and receive == counterpart(instr, n):
                    ahead.add((m, receive))  # it lands in the receive posted ahead
                    work.append(m)
                    i += 1
                    continue
            if j >= len(other_stream):
                break
            other = other_stream[j]
            if other.peer != n or (kind in SENDS) == (other.kind in SENDS) or other.kind in _BUFFERED_ANY:
                break
            if ahead and (m, other) in ahead:
                break  # the peer first takes a message that came ahead
            if (
                other.kind is not pair_kind[kind]
                or other.stage != instr.stage + offset.get(kind, 0)
                or other.microbatch != instr.microbatch
            ):
                raise _mismatch(n, i, instr, m, j, other)
            pos[m] = j + 1
            work.append(m)
            i += 1
        pos[n] = i
    error = _blocked_error(streams, pos)
    if error is not None:
        raise error


def execute(streams: Mapping[int, Sequence[Instruction]], duration: Duration = _zero) -> Timeline:
    """Run ``streams`` with blocking rendezvous semantics (buffered replica-sync sends); raise `Deadlock` or
    `Mismatch`."""
    nodes = list(streams)
    start: dict[int, list[float]] = {n: [0.0] * len(streams[n]) for n in nodes}
    end: dict[int, list[float]] = {n: [0.0] * len(streams[n]) for n in nodes}
    return _run(streams, duration, dict.fromkeys(nodes, 0), dict.fromkeys(nodes, 0.0), start, end, {}, [])


def execute_from(
    streams: Mapping[int, Sequence[Instruction]],
    duration: Duration,
    base: Timeline,
    base_streams: Mapping[int, Sequence[Instruction]],
) -> Timeline:
    """`execute(streams, duration)`, reusing ``base`` (the timeline of ``base_streams`` for the same ``duration``)
    for the instructions that no change can reach: the same start and end times, at a fraction of the cost when
    the streams differ late (a local search's trial against the placement it starts from).

    A node's stream is changed from the first index where it and its base stream hold different instructions
    (compared by identity: equal instructions that are distinct objects only make the cut earlier). Where node
    ``n`` changes at ``d``, no new instruction can start before ``T_n``, the end of its base instruction ``d - 1``
    (0 when ``d`` is 0), and nothing that depends on a change starts before ``T = min T_n``. Every base instruction
    that starts before ``T`` depends on none (what it waits for starts no later than it), so it keeps its times:
    on each node those form a prefix (starts never decrease along a stream), and together a consistent cut (a
    send and its receive start together; a buffered receive starts after its send). Execution resumes there,
    with the buffered sends posted before the cut and not yet received.
    """
    if set(streams) != set(base_streams) or set(base.start) != set(base_streams):
        return execute(streams, duration)
    cut = float("inf")
    for n, stream in streams.items():
        old = base_streams[n]
        if stream is old:
            continue
        differs = list(map(is_not, stream, old))  # pairs up to the shorter stream's end
        d = differs.index(True) if True in differs else len(differs)
        if d == len(stream) == len(old):
            continue
        cut = min(cut, base.end[n][d - 1] if d else 0.0)
    if cut <= 0.0:
        return execute(streams, duration)
    pos: dict[int, int] = {}
    free: dict[int, float] = {}
    start: dict[int, list[float]] = {}
    end: dict[int, list[float]] = {}
    for n, stream in streams.items():
        kept = bisect_left(base.start[n], cut)
        pos[n] = kept
        free[n] = base.end[n][kept - 1] if kept else 0.0
        tail = [0.0] * (len(stream) - kept)
        start[n] = base.start[n][:kept] + tail
        end[n] = base.end[n][:kept] + tail
    posted: dict[tuple[int, int], list[float]] = {}
    received: dict[tuple[int, int], int] = {}
    kept_buffered: list[BufferedEvent] = []
    for event in base.buffered:
        node, index, key, arrival = event
        if index >= pos[node]:
            continue
        kept_buffered.append(event)
        if arrival is None:
            received[key] = received.get(key, 0) + 1
        else:
            posted.setdefault(key, []).append(arrival)
    arrivals: dict[tuple[int, int], float] = {}
    for key, times in posted.items():
        pending = len(times) - received.pop(key, 0)
        if pending == 1 and len(times) == 1:
            arrivals[key] = times[0]
        elif pending != 0:  # a key posted twice before the cut: replay from the start rather than guess its order
            return execute(streams, duration)
    if received:
        return execute(streams, duration)
    return _run(streams, duration, pos, free, start, end, arrivals, kept_buffered)


@gc_paused
def _run(
    streams: Mapping[int, Sequence[Instruction]],
    duration: Duration,
    pos: dict[int, int],
    free: dict[int, float],
    start: dict[int, list[float]],
    end: dict[int, list[float]],
    arrivals: dict[tuple[int, int], float],
    buffered: list[BufferedEvent],
) -> Timeline:
    """Execute ``streams`` from ``pos`` (each node free from ``free``), filling ``start`` and ``end`` in place;
    ``arrivals`` maps (receiver, stage) to when a buffered send posted before ``pos`` lands, ``buffered`` lists
    the buffered instructions executed before ``pos``."""
    work = deque(streams)
    timed = duration is not _zero
    rows = duration.rows if isinstance(duration, StageTable) else None
    transfers = duration.buffered if isinstance(duration, StageTable) else {}
    note = buffered.append
    pair_kind, offset = _PAIR, _OFFSET
    while work:
        n = work.popleft()
        stream = streams[n]
        length = len(stream)
        i = pos[n]
        t = free[n]
        starts, ends = start[n], end[n]
        while i < length:
            instr = stream[i]
            m = instr.peer
            if m is not None and instr.kind in _BUFFERED_ANY:
                if instr.kind in _BUFFERED:  # post the send and go on; the data lands later
                    row = transfers.get(instr.kind)
                    transfer = row[instr.stage] if row is not None else duration(n, instr)
                    arrivals[(m, instr.stage)] = t + transfer
                    note((n, i, (m, instr.stage), t + transfer))
                    work.append(m)
                    begin = t
                else:
                    arrived = arrivals.pop((n, instr.stage), None)
                    if arrived is None:
                        break  # the send is not posted yet: its node wakes this one
                    note((n, i, (n, instr.stage), None))
                    begin = t if t >= arrived else arrived
                starts[i] = begin
                t = begin + duration(n, instr)
                ends[i] = t
                i += 1
                continue
            if m is None:
                starts[i] = t
                if rows is not None:
                    try:
                        t += rows[instr.kind][instr.stage]
                    except IndexError:
                        t += duration(n, instr)
                elif timed:
                    t += duration(n, instr)
                ends[i] = t
                i += 1
                continue
            other_stream = streams.get(m)
            if other_stream is None:
                raise _no_stream(n, i, instr, m)
            j = pos[m]
            if j >= len(other_stream):
                break
            other = other_stream[j]
            kind = instr.kind
            if other.peer != n or (kind in SENDS) == (other.kind in SENDS):
                break
            if other.kind in _BUFFERED_ANY:
                break  # the peer waits for a buffered message, which this node posts later
            if (
                other.kind is not pair_kind[kind]
                or other.stage != instr.stage + offset.get(kind, 0)
                or other.microbatch != instr.microbatch
            ):
                raise _mismatch(n, i, instr, m, j, other)
            begin = t if t >= free[m] else free[m]
            if rows is not None:
                try:
                    t = begin + rows[kind][instr.stage]
                except IndexError:
                    t = begin + duration(n, instr)
            else:
                t = begin + duration(n, instr) if timed else begin
            starts[i] = start[m][j] = begin
            ends[i] = end[m][j] = t
            pos[m] = j + 1
            free[m] = t
            work.append(m)
            i += 1
        pos[n] = i
        free[n] = t
    error = _blocked_error(streams, pos)
    if error is not None:
        raise error
    return Timeline(start, end, buffered)
