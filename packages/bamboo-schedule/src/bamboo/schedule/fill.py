"""Redundant work placed into the idle time of a plain schedule, so that it delays no normal work.

`fill_idle(plain, rc, cost)` is the redundancy pass for ``lflb`` and ``eflb``, whose redundant work is local to the
shadow (an FRC of the successor's stage on the node's own output, or a stash of that output): it runs the plain
schedule with the costs, reads each node's idle intervals off that timeline, and places every item where it
fits whole, first fit in the order in which the items' inputs appear:

- an eager FRC of stage ``r = n + 1``, microbatch ``k`` (with its swap-out, and the load of the samples when
  ``r`` is 0) needs node ``n``'s forward of ``k`` (stage 0's shadow needs nothing), and keeps that output until
  it runs;
- ``lflb``'s stash of the same output goes right after the forward (it moves a reference, or copies beside the
  computation).

Items that fit in no interval run after the node's own work. The replica sync goes where it delays nothing: the
owner posts ``SY`` right after its all-reduce (a buffered send: its node does not wait for the receive),
and the shadow receives ``RY`` last, after the replica's last use. Normal instructions keep their order and
their messages, so the result runs exactly like the plain schedule plus local work, which cannot deadlock; for
the same costs, the engine runs every normal instruction at the same time as in the plain schedule, except
where an item had to run after the node's own work.
"""

from __future__ import annotations

from collections.abc import Sequence

from bamboo.schedule._tasks import CostFn
from bamboo.schedule.engine import execute
from bamboo.schedule.ir import Instruction, Kind, RCMode, Schedule, make

__all__ = ["fill_idle"]

_EPSILON = 1e-9


def _items(plain: Schedule, node: int, rc: RCMode) -> list[tuple[int, tuple[Instruction, ...]]]:
    """The node's redundant items as (index of the forward whose output they need, or -1; instructions)."""
    P, M = plain.stages, plain.microbatches
    replica = (node + 1) % P
    forward_at = {instr.microbatch: i for i, instr in enumerate(plain.streams[node]) if instr.kind is Kind.FORWARD}
    items: list[tuple[int, tuple[Instruction, ...]]] = []
    for k in range(M):
        after = -1 if replica == 0 else forward_at[k]
        if rc is RCMode.EFLB:
            load = (make(Kind.LOAD, 0, k),) if replica == 0 else ()
            items.append((after, (*load, make(Kind.FRC, replica, k), make(Kind.SWAP_OUT, replica, k))))
        elif replica != 0:  # lflb: stage 0's input is loaded again on failure, so it needs no stash
            items.append((after, (make(Kind.SWAP_OUT, replica, k),)))
    return items


def _gaps(starts: Sequence[float], ends: Sequence[float]) -> list[list[float]]:
    """[begin, end, index]: the idle intervals of a node, each with the stream index it ends before."""
    gaps: list[list[float]] = []
    t = 0.0
    for index, (start, end) in enumerate(zip(starts, ends, strict=True)):
        if start > t + _EPSILON:
            gaps.append([t, start, float(index)])
        t = max(t, end)
    return gaps


def fill_idle(plain: Schedule, rc: RCMode, cost: CostFn) -> Schedule:
    """``plain`` (fault-free, no redundancy) with ``rc`` (lflb or eflb) placed into its idle time for ``cost``."""
    if rc not in (RCMode.LFLB, RCMode.EFLB):
        raise ValueError(f"fill_idle places lflb or eflb, got {rc.value}")
    P = plain.stages
    timeline = execute(plain.streams, lambda _node, instr: cost(instr))
    streams: dict[int, tuple[Instruction, ...]] = {}
    for n in range(P):
        stream = plain.streams[n]
        starts, ends = timeline.start[n], timeline.end[n]
        gaps = _gaps(starts, ends)
        placed: dict[int, list[tuple[float, tuple[Instruction, ...]]]] = {}
        tail: list[Instruction] = []
        for after, instrs in _items(plain, n, rc):
            duration = sum(cost(i) for i in instrs)
            release = ends[after] if after >= 0 else 0.0
            if duration <= _EPSILON:  # free: right after its input
                placed.setdefault(after + 1, []).append((release, instrs))
                continue
            for gap in gaps:
                begin = max(gap[0], release)
                if begin + duration <= gap[1] + _EPSILON:
                    gap[0] = begin + duration
                    placed.setdefault(int(gap[2]), []).append((begin, instrs))
                    break
            else:
                tail.extend(instrs)
        out: list[Instruction] = []
        for index, instr in enumerate(stream):
            for _begin, instrs in sorted(placed.get(index, ()), key=lambda item: item[0]):
                out.extend(instrs)
            out.append(instr)
            if instr.kind is Kind.ALLREDUCE and instr.stage == n:
                out.append(make(Kind.SYNC_SEND, n, None, (n - 1) % P))
        for _begin, instrs in placed.get(len(stream), ()):
            out.extend(instrs)
        out.extend(tail)
        replica = (n + 1) % P
        out.append(make(Kind.SYNC_RECV, replica, None, replica))
        streams[n] = tuple(out)
    return Schedule(P, plain.microbatches, plain.policy, rc, plain.placement, streams)
