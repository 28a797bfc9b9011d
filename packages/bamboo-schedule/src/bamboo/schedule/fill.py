"""Redundant work placed into the idle time of a plain schedule, and, for a cost model, where it ends the iteration
soonest.

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

When asked (``refine=True``: the schedule is studied, not needed at once), some items run after their node's work
and ``cost`` is a cost model (not `unit_cost`), a local search (`_refine`) then moves items, even where they do not fit whole and delay normal work, whenever the iteration ends
sooner for ``cost``; the streams are still the plain schedule plus local work.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import attrs
from bamboo.schedule._tasks import CostFn, KindStageCost, unit_cost
from bamboo.schedule.engine import StageTable, Timeline, execute, execute_from
from bamboo.schedule.ir import Instruction, Kind, RCMode, Schedule, make

__all__ = ["fill_idle"]

_EPSILON = 1e-9

REFINE_BUDGET = 24_000_000
"""How many instructions `_refine` may execute in all, over its starts (its trial runs times their instructions,
counted whole, though a trial resumes its base's timeline at the first change): it ends the search for large
pipelines (P = 8, M = 32 and P = 16, M = 128), and allows every trial for small ones (P = 4, M = 8)."""

SPREAD_STARTS = (0.5, 0.75)
"""Besides first fit, `_refine` also starts from these `_spread` placements, each with and without pushes; the best
result is kept."""

REFINE_MIN_TRIALS = 50
"""Below this many trials (large pipelines) `_refine` does not start: too few to move anything, and each costs."""


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


def _first_fit(
    plain: Schedule, node: int, items: list[tuple[int, tuple[Instruction, ...]]], timeline: Timeline, cost: CostFn
) -> list[int]:
    """For each item, the index of the plain stream's instruction it goes before (the stream's length: the tail).

    Each item goes into the first idle interval after its input exists where it fits whole; a free item right after
    its input; an item that fits nowhere after the node's own work.
    """
    stream = plain.streams[node]
    starts, ends = timeline.start[node], timeline.end[node]
    gaps = _gaps(starts, ends)
    positions: list[int] = []
    for after, instrs in items:
        duration = sum(cost(i) for i in instrs)
        release = ends[after] if after >= 0 else 0.0
        if duration <= _EPSILON:  # free: right after its input
            positions.append(after + 1)
            continue
        for gap in gaps:
            begin = max(gap[0], release)
            if begin + duration <= gap[1] + _EPSILON:
                gap[0] = begin + duration
                positions.append(int(gap[2]))
                break
        else:
            positions.append(len(stream))
    return positions


def _assemble(
    plain: Schedule, node: int, items: list[tuple[int, tuple[Instruction, ...]]], positions: Sequence[int]
) -> tuple[Instruction, ...]:
    """The node's stream: its plain stream with every item before the instruction its position names (items at one
    position in item order), the tail items after the node's own work, ``SY`` right after its all-reduce and ``RY``
    last."""
    return _assemble_marked(plain, node, items, positions).stream


@attrs.frozen
class _Marked:
    """A node's assembled stream, with where its own (plain) instructions and its forwards landed in it."""

    stream: tuple[Instruction, ...]
    own_at: list[int]
    """The stream index of each instruction of the plain stream, in order."""
    forward_at: dict[int, int]
    """Microbatch -> the stream index of the node's forward of it."""


def _plain_marks(plain: Schedule, node: int) -> tuple[list[int], list[tuple[int, int]]]:
    """Where ``node``'s plain stream holds its own all-reduces (``SY`` goes right after each) and its forwards
    (index, microbatch): what `_assemble_marked` needs of the stream besides its instructions."""
    stream = plain.streams[node]
    allreduces = [i for i, instr in enumerate(stream) if instr.kind is Kind.ALLREDUCE and instr.stage == node]
    forwards = [(i, instr.microbatch) for i, instr in enumerate(stream)
                if instr.kind is Kind.FORWARD and instr.microbatch is not None]
    return allreduces, forwards


def _assemble_marked(
    plain: Schedule, node: int, items: list[tuple[int, tuple[Instruction, ...]]], positions: Sequence[int],
    marks: tuple[list[int], list[tuple[int, int]]] | None = None,
) -> _Marked:
    """`_assemble`, and where the node's own instructions landed. ``marks`` is `_plain_marks` of the node, where
    the caller keeps it. The plain stream is copied a slice at a time, between the places where something goes in
    (items before a position, ``SY`` after an all-reduce)."""
    P = plain.stages
    stream = plain.streams[node]
    allreduces, forwards = marks if marks is not None else _plain_marks(plain, node)
    before: dict[int, list[Instruction]] = {}
    for (_after, instrs), position in zip(items, positions, strict=True):
        before.setdefault(position, []).extend(instrs)
    syncs = {i + 1 for i in allreduces}
    out: list[Instruction] = []
    own_at = [0] * len(stream)
    done = 0
    for cut in sorted(syncs.union(before, (len(stream),))):
        shift = len(out) - done
        out.extend(stream[done:cut])
        own_at[done:cut] = range(done + shift, cut + shift)
        if cut in syncs:
            out.append(make(Kind.SYNC_SEND, node, None, (node - 1) % P))
        out.extend(before.get(cut, ()))
        done = cut
    replica = (node + 1) % P
    out.append(make(Kind.SYNC_RECV, replica, None, replica))
    return _Marked(tuple(out), own_at, {microbatch: own_at[i] for i, microbatch in forwards})


def _trial_duration(cost: CostFn, stages: int) -> StageTable:
    """``cost`` for `_refine`'s trial runs, with the replica sync's send buffered as the linearizer has it: it
    takes its node no time and its data lands ``cost(SY)`` later."""
    memo: dict[Instruction, float] = {}

    def duration(_node: int, instr: Instruction) -> float:
        value = memo.get(instr)
        if value is None:
            value = memo[instr] = 0.0 if instr.kind is Kind.SYNC_SEND else cost(instr)
        return value

    transfers = [cost(make(Kind.SYNC_SEND, s, None, (s - 1) % stages)) for s in range(stages)]
    rows: dict[Kind, list[float]] = {kind: [] for kind in Kind}
    if cost is unit_cost or isinstance(cost, KindStageCost):  # a table the engine reads without calls
        rows = {kind: [duration(0, make(kind, s, 0, 0)) for s in range(stages)] for kind in Kind}
    return StageTable(rows, duration, {Kind.SYNC_SEND: transfers})


def _ends(timeline: Timeline) -> dict[int, float]:
    """Every node's end."""
    return {n: ends[-1] if ends else 0.0 for n, ends in timeline.end.items()}


def _score(ends: dict[int, float]) -> tuple[float, ...]:
    """`_refine`'s score (lower is better): the nodes' ends, latest first."""
    return tuple(sorted(ends.values(), reverse=True))


def _refill(
    plain: Schedule,
    items: dict[int, list[tuple[int, tuple[Instruction, ...]]]],
    positions: dict[int, list[int]],
    marked: dict[int, _Marked],
    timeline: Timeline,
    duration: StageTable,
) -> bool:
    """Move the items that run after their node's own work into idle intervals of ``timeline`` (of ``streams``, the
    items at ``positions``) where they fit whole, first fit in item order; True when any moved.

    An item that ends before the node's next normal instruction starts delays nothing (the node only waited there),
    so every other instruction keeps its time and the nodes' ends can only come sooner.
    """
    moved = False
    for n, node_items in items.items():
        mine = positions[n]
        tail = len(plain.streams[n])
        if tail not in mine:
            continue
        starts, ends = timeline.start[n], timeline.end[n]
        forward_at = marked[n].forward_at
        gaps: list[list[float]] = []
        for index, a in enumerate(marked[n].own_at):  # a node's ends never decrease: it was free from ends[a - 1]
            free = ends[a - 1] if a else 0.0
            if starts[a] > free + _EPSILON:
                gaps.append([free, starts[a], float(index)])
        for j, (after, instrs) in enumerate(node_items):
            if mine[j] != tail:
                continue
            length = sum(duration(n, i) for i in instrs)
            release = 0.0 if after < 0 else ends[forward_at[instrs[-1].microbatch]]
            earliest = mine[j - 1] if j else 0
            for gap in gaps:
                begin = max(gap[0], release)
                if gap[2] >= earliest and begin + length <= gap[1] + _EPSILON:
                    gap[0] = begin + length
                    mine[j] = int(gap[2])
                    moved = True
                    break
            else:
                break  # later items may not come before this one
    return moved


@attrs.frozen
class _Run:
    """One trial run of `_refine`: the nodes' streams, their timeline, and each node's end."""

    streams: dict[int, tuple[Instruction, ...]]
    timeline: Timeline
    ends: dict[int, float]


class _Streams:
    """The nodes' streams for given positions (`_assemble_marked`), remembered: a trial of `_refine` moves the items
    of one node or a few, so the other nodes' streams are the ones of the placement it started from. At most
    ``4 * nodes`` streams are kept (then forgotten all at once)."""

    def __init__(self, plain: Schedule, items: dict[int, list[tuple[int, tuple[Instruction, ...]]]]) -> None:
        self._plain, self._items = plain, items
        self._marks = {n: _plain_marks(plain, n) for n in items}
        self._known: dict[tuple[int, tuple[int, ...]], _Marked] = {}
        self._limit = 4 * max(plain.stages, 1)

    def __call__(self, positions: dict[int, list[int]]) -> dict[int, _Marked]:
        marked: dict[int, _Marked] = {}
        for n, mine in positions.items():
            key = (n, tuple(mine))
            found = self._known.get(key)
            if found is None:
                if len(self._known) >= self._limit:
                    self._known.clear()
                found = self._known[key] = _assemble_marked(self._plain, n, self._items[n], mine, self._marks[n])
            marked[n] = found
        return marked


def _trial(
    plain: Schedule,
    items: dict[int, list[tuple[int, tuple[Instruction, ...]]]],
    positions: dict[int, list[int]],
    duration: StageTable,
    assemble: _Streams | None = None,
    base: _Run | None = None,
) -> _Run:
    """Run the items at ``positions`` (refilled in place, `_refill`): the streams, their timeline and the nodes'
    ends. ``base`` is a run of the same items at other positions, whose times are reused up to the first change
    (`execute_from`)."""
    assemble = assemble or _Streams(plain, items)
    marked = assemble(positions)
    streams = {n: m.stream for n, m in marked.items()}
    timeline = execute_from(streams, duration, base.timeline, base.streams) if base else execute(streams, duration)
    if _refill(plain, items, positions, marked, timeline, duration):
        refilled = {n: m.stream for n, m in assemble(positions).items()}
        timeline = execute_from(refilled, duration, timeline, streams)
        streams = refilled
    return _Run(streams, timeline, _ends(timeline))


def _trials(plain: Schedule, items: dict[int, list[tuple[int, tuple[Instruction, ...]]]]) -> int:
    """How many trial runs each of `_refine`'s starts may make: `REFINE_BUDGET` shared by the starts (a trial runs
    the streams up to twice)."""
    size = sum(len(plain.streams[n]) + len(node_items) for n, node_items in items.items())
    return REFINE_BUDGET // (2 + 2 * len(SPREAD_STARTS)) // max(2 * size, 1)


def _refine(
    plain: Schedule,
    items: dict[int, list[tuple[int, tuple[Instruction, ...]]]],
    positions: dict[int, list[int]],
    timeline: Timeline,
    cost: CostFn,
    pushes: bool = True,
) -> dict[int, list[int]]:
    """``positions`` improved by local search: each pass first pulls the late nodes' items together
    (`_joint_pulls`; only without ``pushes``: they spend the budget, and the starts with pushes then search as
    before, the best start being kept), then each item in turn tries every idle interval after its input (and the
    tail), keeping item order on its node; after each move, items that run after their node's work move into idle
    time that the move opened (`_refill`); a move stays when the iteration ends sooner (node ends compared latest
    first). Passes repeat until none improves or `REFINE_BUDGET` is spent; the result is never worse than the start.

    Running an item where it does not fit whole delays the node's next normal work; where that work has slack, or
    where the delay lets other nodes fill the wait with their own items, this still ends the iteration sooner than
    running the item after the node's own work.
    """
    duration = _trial_duration(cost, plain.stages)
    trials = _trials(plain, items)
    if trials < REFINE_MIN_TRIALS:
        return positions
    assemble = _Streams(plain, items)
    current = _trial(plain, items, positions, duration, assemble)
    best = _score(current.ends)
    candidates = {n: sorted({int(gap[2]) for gap in _gaps(timeline.start[n], timeline.end[n])}
                            | {len(plain.streams[n])}) for n in positions}
    receives = _gradient_receives(plain)
    improved = True

    def keep_if_sooner(trial: dict[int, list[int]]) -> None:
        """Spend a trial on ``trial``'s positions; they replace ``positions`` where the iteration ends sooner."""
        nonlocal trials, best, current, improved
        trials -= 1
        run = _trial(plain, items, trial, duration, assemble, current)
        score = _score(run.ends)
        if score < best:
            best, current, improved = score, run, True
            for m, p in trial.items():
                positions[m][:] = p

    while improved and trials > 0:
        improved = False
        for trial in () if pushes else _joint_pulls(plain, items, positions, current.ends, receives):  # see the docstring
            if trials <= 0:
                break
            keep_if_sooner(trial)
        for pulls in (True, False):  # the pulls of every node first: they move the most, and cost the fewest trials
            for n in sorted(items, key=lambda node: -current.ends[node]):  # the nodes that end last first
                moves = _moves(positions[n], items[n], candidates[n], len(plain.streams[n]), duration, n, pulls, pushes)
                for moved in moves:
                    if trials <= 0:
                        break
                    keep_if_sooner({**{m: list(p) for m, p in positions.items()}, n: moved})
    return positions


def _gradient_receives(plain: Schedule) -> dict[int, dict[int, int]]:
    """Per node, the index of its receive of each microbatch's gradient in the plain stream (none on the last
    stage's node, which computes the loss)."""
    return {n: {instr.microbatch: index for index, instr in enumerate(stream) if instr.kind is Kind.RECV_GRAD
                and instr.microbatch is not None} for n, stream in plain.streams.items()}


def _joint_pulls(
    plain: Schedule,
    items: dict[int, list[tuple[int, tuple[Instruction, ...]]]],
    positions: dict[int, list[int]],
    ends: dict[int, float],
    receives: dict[int, dict[int, int]],
) -> Iterator[dict[int, list[int]]]:
    """`_refine`'s joint moves, each a new placement: for a microbatch ``k`` and each ``j`` >= 2, on each of the
    ``j`` latest-ending nodes that have items after their own work, the last such item moves before the node's
    receive of ``k``'s gradient (the node's items then taking the positions in release order), where every item
    stays after its input.

    One node's pull delays the pipeline's bottleneck, and so every node's end: the nodes whose items also end the
    iteration late then end later still, and a single pull is not kept. The delay reaches the node upstream as a
    longer wait for the gradient of the same microbatch, which its own pulled item fills, so pulled together they
    end the iteration sooner.
    """
    late = [n for n in sorted(items, key=lambda node: -ends[node])
            if positions[n] and positions[n][-1] == len(plain.streams[n])]
    if len(late) < 2:
        return
    for k in range(plain.microbatches):
        group = [n for n in late if k in receives[n]]
        for j in range(2, len(group) + 1):
            trial: dict[int, list[int]] = {}
            for n in group[:j]:
                moved = sorted([*positions[n][:-1], receives[n][k]])
                if moved != positions[n] and all(p > after for p, (after, _instrs)
                                                  in zip(moved, items[n], strict=True)):
                    trial[n] = moved
            if trial:
                yield {m: trial.get(m, list(p)) for m, p in positions.items()}


def _moves(
    mine: list[int], node_items: list[tuple[int, tuple[Instruction, ...]]], candidates: list[int], tail: int,
    duration: StageTable, node: int, pulls: bool, pushes: bool,
) -> Iterator[list[int]]:
    """`_refine`'s trial moves on one node, each a new list of positions (``mine`` is read as it changes).

    With ``pulls``, the last item (one that runs after the node's work) pulled forward to a candidate, the items
    then taking the positions in release order (they are alike: same work on the same stage), when each is after
    its input; with ``pushes`` too, one item from an interval back to the tail (a way out of a local optimum).
    Otherwise one item to another candidate, between its neighbours.
    """
    if pulls:
        if mine and all(sum(duration(node, i) for i in instrs) > _EPSILON for _after, instrs in node_items):
            yield from _pulls(mine, node_items, candidates, tail, pushes)
        return
    for j, (after, instrs) in enumerate(node_items):
        if sum(duration(node, i) for i in instrs) <= _EPSILON:
            continue
        for position in candidates:
            low = max(after + 1, mine[j - 1] if j else 0)
            high = mine[j + 1] if j + 1 < len(mine) else tail
            if low <= position <= high and position != mine[j]:
                moved = list(mine)
                moved[j] = position
                yield moved


def _pulls(
    mine: list[int], node_items: list[tuple[int, tuple[Instruction, ...]]], candidates: list[int], tail: int,
    pushes: bool,
) -> Iterator[list[int]]:
    """`_moves`' pulls: the last item from the tail to each candidate, the items re-sorted; then the pushes."""
    for position in candidates:
        if mine[-1] != tail:
            break
        moved = sorted([*mine[:-1], position])
        if moved != mine and all(p > after for p, (after, _instrs) in zip(moved, node_items, strict=True)):
            yield moved
    for taken in sorted(set(mine) - {tail}) if pushes else ():  # push: one item from an interval to the tail
        moved = list(mine)
        moved.remove(taken)
        moved.append(tail)
        if all(p > after for p, (after, _instrs) in zip(moved, node_items, strict=True)):
            yield moved


def _spread(
    plain: Schedule, items: dict[int, list[tuple[int, tuple[Instruction, ...]]]], timeline: Timeline, share: float
) -> dict[int, list[int]]:
    """Another start for `_refine`: on every node, the first ``share`` of the items each in the next idle interval
    after its input that no earlier item took (whether it fits or not: spread over the pipeline's cycles), the rest
    after the node's own work."""
    positions: dict[int, list[int]] = {}
    for n, node_items in items.items():
        tail = len(plain.streams[n])
        gaps = [int(gap[2]) for gap in _gaps(timeline.start[n], timeline.end[n])]
        mine: list[int] = []
        taken = -1
        for j, (after, _instrs) in enumerate(node_items):
            position = tail
            if j < int(share * len(node_items)):
                position = next((g for g in gaps if g > after and g > taken), tail)
                taken = position
            mine.append(max(position, mine[-1]) if mine else position)
        positions[n] = mine
    return positions


def fill_idle(plain: Schedule, rc: RCMode, cost: CostFn, *, refine: bool = False) -> Schedule:
    """``plain`` (fault-free, no redundancy) with ``rc`` (lflb or eflb) placed into its idle time for ``cost``.

    Items go first fit into idle intervals where they fit whole. With ``refine``, when some fit nowhere and ``cost``
    is a cost model (not the generators' default `unit_cost`, which stands for costs nobody measured: the runtime's
    schedules stay first fit, and quick to build), `_refine` moves items to where they end the iteration soonest for ``cost``
    (possibly delaying normal work), from first fit and from the `SPREAD_STARTS` placements, each with and without
    pushes; the best is kept.
    """
    if rc not in (RCMode.LFLB, RCMode.EFLB):
        raise ValueError(f"fill_idle places lflb or eflb, got {rc.value}")
    P = plain.stages
    timeline = execute(plain.streams, lambda _node, instr: cost(instr))
    items = {n: _items(plain, n, rc) for n in range(P)}
    positions = {n: _first_fit(plain, n, items[n], timeline, cost) for n in range(P)}
    overflow = any(len(plain.streams[n]) in positions[n] for n in range(P))
    if refine and overflow and cost is not unit_cost and _trials(plain, items) >= REFINE_MIN_TRIALS:
        duration = _trial_duration(cost, P)
        best = None
        firsts = [positions, *(_spread(plain, items, timeline, share) for share in SPREAD_STARTS)]
        starts = [({n: list(p) for n, p in first.items()}, pushes) for first in firsts for pushes in (False, True)]
        for start, pushes in starts:
            refined = _refine(plain, items, start, timeline, cost, pushes)
            score = _score(_trial(plain, items, {n: list(p) for n, p in refined.items()}, duration).ends)
            if best is None or score < best[0]:
                best = (score, refined)
        positions = best[1]
    streams = {n: _assemble(plain, n, items[n], positions[n]) for n in range(P)}
    return Schedule(P, plain.microbatches, plain.policy, rc, plain.placement, streams)
