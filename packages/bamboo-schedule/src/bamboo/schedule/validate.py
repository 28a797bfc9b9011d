"""The validator: a schedule must run to completion under blocking execution and do its work once.

`validate(schedule)` checks, in this order, and raises `ScheduleError` on the first problem, with
the whole grid printed and the bad cell marked:

1. shape: stages, microbatches and peers are in range, nobody sends to itself;
2. dependencies: every instruction's inputs exist on its node when it runs (a forward after its
   input arrived, a backward after its forward and its output gradient, a send after the tensor
   was made, a swap-in after its swap-out, the all-reduce after every backward of the stage, the
   replica's sync after the replica's last use);
3. accounting: every (stage, microbatch) has exactly one forward and one backward, on the node
   that runs the stage; each stage has one all-reduce and one optimizer step; redundant work is
   what the mode says (one FRC per microbatch in eager modes, one BRC in efeb);
4. a node posts every all-reduce whose gradients are ready before a replica sync, where it waits
   for one (`bamboo.schedule.reduction_order`: across pipelines, that wait can deadlock);
5. execution: sends and receives pair up in order and blocking execution cannot deadlock.

Failover plans are checked by `bamboo.schedule.failover_validate.validate_failover`, on the same machinery.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence

from bamboo.schedule._gc import gc_paused
from bamboo.schedule.engine import ExecutionError, check_execution
from bamboo.schedule.export import text_grid
from bamboo.schedule.ir import Instruction, Kind, RCMode, Schedule
from bamboo.schedule.reduction_order import sync_problem

__all__ = ["ScheduleError", "dependency_problem", "shape_problem", "validate"]

Cell = tuple[int, int]
Token = int


class ScheduleError(ValueError):
    """A schedule is wrong. ``cells`` are the marked (node, index) positions, ``grid`` the drawing."""

    def __init__(self, problem: str, streams: Mapping[int, Sequence[Instruction]], cells: Iterable[Cell]) -> None:
        self.problem = problem
        self.cells = tuple(cells)
        self.grid = text_grid(streams, self.cells)
        super().__init__(f"{problem}\n{self.grid}")


# Tokens are facts that exist on a node ("the output activation of stage s, microbatch k"), packed
# into ints for speed: what << 40 | (stage + 1) << 20 | (microbatch + 1, or 0 for none).
ACT, FWD, GIN, WGRAD, STASHED, REDUCED = range(1, 7)
_NAMES = {
    ACT: "the output activation of stage {} microbatch {}",
    FWD: "the forward state of stage {} microbatch {}",
    GIN: "the gradient w.r.t. the input of stage {} microbatch {}",
    WGRAD: "the weight gradients of stage {} microbatch {}",
    STASHED: "the swapped-out stash of stage {} microbatch {}",
    REDUCED: "the reduced gradients of stage {}",
}


def _token(what: int, stage: int, microbatch: int | None = None) -> Token:
    return (what << 40) | ((stage + 1) << 20) | (0 if microbatch is None else microbatch + 1)


def _provides(instr: Instruction, rc: RCMode) -> tuple[Token, ...]:
    """What exists on the executing node once ``instr`` ran."""
    kind, s, k = instr.kind, instr.stage, instr.microbatch
    base = ((s + 1) << 20) | (0 if k is None else k + 1)
    if kind is Kind.FORWARD or kind is Kind.FRC:
        return ((ACT << 40) | base, (FWD << 40) | base)
    if kind is Kind.BACKWARD or kind is Kind.BRC:
        return ((GIN << 40) | base, (WGRAD << 40) | base)
    if kind is Kind.RECV_ACT:
        return ((ACT << 40) | (base - (1 << 20)),)
    if kind is Kind.RECV_GRAD:
        return ((GIN << 40) | (base + (1 << 20)),)
    if kind is Kind.LOAD:
        return ((ACT << 40) | (k + 1),)  # type: ignore[operator]
    if kind is Kind.SWAP_OUT:
        return ((STASHED << 40) | base,)
    if kind is Kind.SWAP_IN:
        if rc is RCMode.LFLB:
            return ((ACT << 40) | (base - (1 << 20)),)
        return ((FWD << 40) | base, (ACT << 40) | base)
    if kind is Kind.ALLREDUCE:
        return ((REDUCED << 40) | base,)
    return ()


def _requires(instr: Instruction, stages: int, microbatches: int, rc: RCMode) -> tuple[Token, ...]:
    """What must exist on the executing node before ``instr`` can run."""
    kind, s, k = instr.kind, instr.stage, instr.microbatch
    base = ((s + 1) << 20) | (0 if k is None else k + 1)
    if kind is Kind.FORWARD or kind is Kind.FRC:
        return ((ACT << 40) | (base - (1 << 20)),)
    if kind is Kind.BACKWARD or kind is Kind.BRC:
        if s < stages - 1:
            return ((FWD << 40) | base, (GIN << 40) | (base + (1 << 20)))
        return ((FWD << 40) | base,)
    if kind is Kind.SEND_ACT:
        return ((ACT << 40) | base,)
    if kind is Kind.SEND_GRAD:
        return ((GIN << 40) | base,)
    if kind is Kind.SWAP_OUT:
        return ((ACT << 40) | (base - (1 << 20)),) if rc is RCMode.LFLB else ((FWD << 40) | base,)
    if kind is Kind.SWAP_IN:
        return ((STASHED << 40) | base,)
    if kind is Kind.ALLREDUCE:
        return tuple(_token(WGRAD, s, j) for j in range(microbatches))
    if kind is Kind.OPTIMIZER or kind is Kind.SYNC_SEND:
        return ((REDUCED << 40) | base,)
    return ()


_REPLICA_USE = (Kind.FRC, Kind.BRC, Kind.SWAP_OUT, Kind.SWAP_IN)


def shape_problem(
    streams: Mapping[int, Sequence[Instruction]], stages: int, microbatches: int
) -> tuple[str, list[Cell]] | None:
    """The first out-of-range stage, microbatch or peer, or a send to oneself."""
    for n, stream in streams.items():
        for i, instr in enumerate(stream):
            if instr.stage >= stages:
                return f"node {n} #{i} {instr}: stage {instr.stage} out of range 0..{stages - 1}", [(n, i)]
            if instr.microbatch is not None and instr.microbatch >= microbatches:
                return (f"node {n} #{i} {instr}: microbatch {instr.microbatch} out of range "
                        f"0..{microbatches - 1}", [(n, i)])
            if instr.kind is Kind.LOAD and instr.stage != 0:
                return f"node {n} #{i} {instr}: only stage 0 loads input", [(n, i)]
            if instr.peer is not None and instr.peer == n:
                return f"node {n} #{i} {instr}: a node cannot send to or receive from itself", [(n, i)]
    return None


_STAGE = 1 << 20
_NEXT, _SAME, _PREV = _STAGE, 0, -_STAGE


def _offsets(*pairs: tuple[int, int]) -> tuple[int, ...]:
    """Token offsets from an instruction's own ``(stage + 1) << 20 | (microbatch + 1)`` part."""
    return tuple((what << 40) + delta for what, delta in pairs)


_BACKWARDS = (Kind.BACKWARD, Kind.BRC)
_LAST_STAGE = {kind: ((FWD << 40) + _SAME,) for kind in _BACKWARDS}
"""Requirement offsets of the backward kinds on the last stage (no gradient from a successor)."""


def _dependency_tables(rc: RCMode) -> tuple[dict[Kind, tuple[int, ...] | None], dict[Kind, tuple[int, ...] | None]]:
    """`_requires` and `_provides` as token offsets per kind (None: worked out per instruction).

    Backward kinds on the last stage need no gradient from a successor: see `_LAST_STAGE`.
    """
    lflb = rc is RCMode.LFLB
    requires: dict[Kind, tuple[int, ...] | None] = dict.fromkeys(Kind, ())
    provides: dict[Kind, tuple[int, ...] | None] = dict.fromkeys(Kind, ())
    requires.update({
        Kind.FORWARD: _offsets((ACT, _PREV)),
        Kind.FRC: _offsets((ACT, _PREV)),
        Kind.BACKWARD: _offsets((FWD, _SAME), (GIN, _NEXT)),
        Kind.BRC: _offsets((FWD, _SAME), (GIN, _NEXT)),
        Kind.SEND_ACT: _offsets((ACT, _SAME)),
        Kind.SEND_GRAD: _offsets((GIN, _SAME)),
        Kind.SWAP_OUT: _offsets((ACT, _PREV)) if lflb else _offsets((FWD, _SAME)),
        Kind.SWAP_IN: _offsets((STASHED, _SAME)),
        Kind.ALLREDUCE: None,
        Kind.OPTIMIZER: _offsets((REDUCED, _SAME)),
        Kind.SYNC_SEND: _offsets((REDUCED, _SAME)),
    })
    provides.update({
        Kind.FORWARD: _offsets((ACT, _SAME), (FWD, _SAME)),
        Kind.FRC: _offsets((ACT, _SAME), (FWD, _SAME)),
        Kind.BACKWARD: _offsets((GIN, _SAME), (WGRAD, _SAME)),
        Kind.BRC: _offsets((GIN, _SAME), (WGRAD, _SAME)),
        Kind.RECV_ACT: _offsets((ACT, _PREV)),
        Kind.RECV_GRAD: _offsets((GIN, _NEXT)),
        Kind.LOAD: None,
        Kind.SWAP_OUT: _offsets((STASHED, _SAME)),
        Kind.SWAP_IN: _offsets((ACT, _PREV)) if lflb else _offsets((FWD, _SAME), (ACT, _SAME)),
        Kind.ALLREDUCE: _offsets((REDUCED, _SAME)),
    })
    return requires, provides


def _missing(n: int, i: int, instr: Instruction, token: Token) -> tuple[str, list[Cell]]:
    return f"node {n} #{i} {instr} runs before its input {_describe(token)} exists on node {n}", [(n, i)]


def dependency_problem(
    streams: Mapping[int, Sequence[Instruction]], stages: int, microbatches: int, rc: RCMode
) -> tuple[str, list[Cell]] | None:
    """The first instruction that runs before one of its inputs exists on its node."""
    requires_of, provides_of = _dependency_tables(rc)
    requires_last = {**requires_of, **_LAST_STAGE}
    last = stages - 1
    replica_use = frozenset(_REPLICA_USE)
    for n, stream in streams.items():
        have: set[Token] = set()
        add = have.add
        synced: set[int] = set()
        for i, instr in enumerate(stream):
            kind, k = instr.kind, instr.microbatch
            base = ((instr.stage + 1) << 20) | (0 if k is None else k + 1)
            offsets = requires_of[kind] if instr.stage < last else requires_last[kind]
            if offsets:
                for offset in offsets:
                    if base + offset not in have:
                        return _missing(n, i, instr, base + offset)
            elif offsets is None:
                for token in _requires(instr, stages, microbatches, rc):
                    if token not in have:
                        return _missing(n, i, instr, token)
            if synced and kind in replica_use and instr.stage in synced:
                return f"node {n} #{i} {instr} uses the replica of stage {instr.stage} after its sync step", [(n, i)]
            if kind is Kind.SYNC_RECV:
                synced.add(instr.stage)
            offsets = provides_of[kind]
            if offsets is None:
                have.update(_provides(instr, rc))
            else:
                for offset in offsets:
                    add(base + offset)
    return None


def _describe(token: Token) -> str:
    what, stage, microbatch = token >> 40, ((token >> 20) & 0xFFFFF) - 1, (token & 0xFFFFF) - 1
    if what == ACT and stage == -1:
        return f"the loaded input of microbatch {microbatch}"
    return _NAMES[what].format(stage, microbatch)


_PER_MICROBATCH = {Kind.FORWARD: 0, Kind.BACKWARD: 1, Kind.FRC: 2, Kind.BRC: 3}
_PER_STAGE = (Kind.ALLREDUCE, Kind.OPTIMIZER, Kind.SYNC_SEND, Kind.SYNC_RECV)


def _cells_of(schedule: Schedule, kind: Kind, stage: int, microbatch: int | None) -> list[Cell]:
    return [
        (n, i)
        for n, stream in schedule.streams.items()
        for i, instr in enumerate(stream)
        if instr.kind is kind and instr.stage == stage and instr.microbatch == microbatch
    ]


_Counts = tuple[list[list[list[int]]], list[list[list[int]]], Counter[tuple[Kind, int]], dict[tuple[Kind, int], int]]


def _new_counts(stages: int, microbatches: int) -> _Counts:
    """Empty tallies: per-microbatch kinds (count and first node), per-stage kinds (count and first node)."""
    counts = [[[0] * microbatches for _ in range(stages)] for _ in _PER_MICROBATCH]
    first = [[[-1] * microbatches for _ in range(stages)] for _ in _PER_MICROBATCH]
    return counts, first, Counter(), {}


def _accounting_problem(schedule: Schedule) -> tuple[str, list[Cell]] | None:
    """The first (kind, stage, microbatch) that runs a wrong number of times or on the wrong node."""
    tallies = _new_counts(schedule.stages, schedule.microbatches)
    counts, first, stage_counts, stage_first = tallies
    index_of = _PER_MICROBATCH.get
    for n, stream in schedule.streams.items():
        for instr in stream:
            idx = index_of(instr.kind)
            if idx is not None:
                s, k = instr.stage, instr.microbatch
                counts[idx][s][k] += 1  # type: ignore[index]
                if first[idx][s][k] < 0:  # type: ignore[index]
                    first[idx][s][k] = n  # type: ignore[index]
            elif instr.kind in _PER_STAGE:
                key = (instr.kind, instr.stage)
                stage_counts[key] += 1
                stage_first.setdefault(key, n)
    return _count_problem(schedule, tallies)


def _count_problem(schedule: Schedule, tallies: _Counts) -> tuple[str, list[Cell]] | None:
    """The first wrong tally (see `_accounting_problem`)."""
    P, M, rc = schedule.stages, schedule.microbatches, schedule.rc
    counts, first, stage_counts, stage_first = tallies
    eager = rc in (RCMode.EFLB, RCMode.EFEB)
    for s in range(P):
        shadow = schedule.shadow_of(s)
        wanted = [
            (Kind.FORWARD, schedule.placement[s], True),
            (Kind.BACKWARD, schedule.placement[s], True),
            (Kind.FRC, shadow, shadow is not None and eager),
            (Kind.BRC, shadow, shadow is not None and rc is RCMode.EFEB),
        ]
        for kind, owner, present in wanted:
            idx = _PER_MICROBATCH[kind]
            expected = 1 if present else 0
            for k in range(M):
                count = counts[idx][s][k]
                if count != expected:
                    label = _label((kind, s, k))
                    return f"{label} runs {count} times, expected {expected}", _cells_of(schedule, kind, s, k)
                if count and first[idx][s][k] != owner:
                    label = _label((kind, s, k))
                    return (f"{label} runs on node {first[idx][s][k]}, expected node {owner}",
                            _cells_of(schedule, kind, s, k))
        synced = rc is not RCMode.NONE and shadow is not None
        for kind, owner, present in (
            (Kind.ALLREDUCE, schedule.placement[s], True),
            (Kind.OPTIMIZER, schedule.placement[s], True),
            (Kind.SYNC_SEND, schedule.placement[s], synced),
            (Kind.SYNC_RECV, shadow, synced),
        ):
            count = stage_counts[(kind, s)]
            expected = 1 if present else 0
            if count != expected:
                cells = _cells_of(schedule, kind, s, None)
                return f"{_label((kind, s, None))} runs {count} times, expected {expected}", cells
            if count and stage_first[(kind, s)] != owner:
                cells = _cells_of(schedule, kind, s, None)
                return f"{_label((kind, s, None))} runs on node {stage_first[(kind, s)]}, expected node {owner}", cells
    return None


def _label(key: tuple[Kind, int, int | None]) -> str:
    kind, s, k = key
    return f"{kind.name} of stage {s}" + ("" if k is None else f" microbatch {k}")


def _all_clear(schedule: Schedule) -> bool:
    """Shape, dependency and accounting checks fused into one pass: True when none finds a problem.

    Only a yes/no: on False the separate checks run again to name the first problem.
    """
    P, M = schedule.stages, schedule.microbatches
    requires_of, provides_of = _dependency_tables(schedule.rc)
    requires_last = {**requires_of, **_LAST_STAGE}
    last = P - 1
    replica_use = frozenset(_REPLICA_USE)
    per_stage = frozenset(_PER_STAGE)
    tallies = _new_counts(P, M)
    counts, first, stage_counts, stage_first = tallies
    index_of = _PER_MICROBATCH.get
    load, sync_recv = Kind.LOAD, Kind.SYNC_RECV
    for n, stream in schedule.streams.items():
        have: set[Token] = set()
        add = have.add
        synced: set[int] = set()
        for instr in stream:
            kind, s, k = instr.kind, instr.stage, instr.microbatch
            if s >= P or instr.peer == n or (kind is load and s != 0):
                return False
            if k is None:
                base = (s + 1) << 20
            elif k >= M:
                return False
            else:
                base = ((s + 1) << 20) | (k + 1)
            offsets = requires_of[kind] if s < last else requires_last[kind]
            if offsets:
                for offset in offsets:
                    if base + offset not in have:
                        return False
            elif offsets is None:
                for token in _requires(instr, P, M, schedule.rc):
                    if token not in have:
                        return False
            if synced and kind in replica_use and s in synced:
                return False
            idx = index_of(kind)
            if idx is not None:
                row = counts[idx][s]
                row[k] += 1  # type: ignore[index]
                if row[k] == 1:  # type: ignore[index]
                    first[idx][s][k] = n  # type: ignore[index]
            elif kind in per_stage:
                key = (kind, s)
                stage_counts[key] += 1
                stage_first.setdefault(key, n)
                if kind is sync_recv:
                    synced.add(s)
            offsets = provides_of[kind]
            if offsets is None:
                have.update(_provides(instr, schedule.rc))
            else:
                for offset in offsets:
                    add(base + offset)
    return _count_problem(schedule, tallies) is None


@gc_paused
def validate(schedule: Schedule) -> None:
    """Raise `ScheduleError` (whole grid, bad cell marked) unless ``schedule`` is correct."""
    P, M = schedule.stages, schedule.microbatches
    if not _all_clear(schedule):
        for check in (
            lambda: shape_problem(schedule.streams, P, M),
            lambda: dependency_problem(schedule.streams, P, M, schedule.rc),
            lambda: _accounting_problem(schedule),
        ):
            found = check()
            if found is not None:
                raise ScheduleError(found[0], schedule.streams, found[1])
    found = sync_problem(schedule.streams)
    if found is not None:
        raise ScheduleError(found[0], schedule.streams, found[1])
    try:
        check_execution(schedule.streams)
    except ExecutionError as error:
        raise ScheduleError(str(error), schedule.streams, error.cells) from None
