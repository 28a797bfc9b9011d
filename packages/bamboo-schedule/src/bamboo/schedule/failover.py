"""Failover: merge a victim's work into its shadow's stream, mid-iteration and for the iterations after.

`failover_schedule(schedule, victims, progress)` takes a schedule (fault-free, or a failover's
steady schedule), the failed nodes and how many instructions each node had completed when the
failure struck (any index, forward or backward phase). It returns a `FailoverPlan`:

- ``executed[n]``: node n's completed prefix. Everything a **survivor** executed is kept. Everything
  a **victim** executed is lost, except what its shadow already holds: the FRC stashes of the
  victim's stage (and, in efeb, the BRCs already run). If the shadow had already received the
  victim's replica sync, the victim's stage had finished the iteration and nothing is redone.
- ``remainder``: the survivors' streams for the rest of the iteration (a `Schedule` keyed by
  survivor; ``placement[v]`` is the shadow). For each victim ``v`` with shadow ``h = (v-1) % P``
  and successor ``u = v+1``:

  1. messages that went between victim and shadow become local (they are dropped; the shadow
     uses its own tensors);
  2. the successor re-sends, first thing, the gradients it had already sent the victim this
     iteration (``SG`` to h), unless the shadow already has them (efeb);
  3. the shadow runs, for every microbatch of ``v`` in this iteration, the forward from the FRC
     stash (``SI``) or a fresh ``FR`` (with ``L`` for stage 0, and ``SI`` of the stashed input in
     lflb), sends the activations the successor has not received yet, then swaps the stash in and
     runs ``BR`` for every microbatch, in the victim's order;
  4. the all-reduce and optimizer step of ``v`` (``vAR``, ``vOPT``) move to the shadow; the
     replica syncs that involved the victim are dropped (stage v's copy on h is now the primary,
     and the successor's replica died with the victim).

  Redundant work that can no longer help is dropped for the rest of the iteration: the victim's
  own FRC/BRC for its successor, and (efeb) node v-2's eager BRC of stage v-1 that waited for the
  victim's gradient: it only guards against h failing too, which would be a consecutive failure.

  Survivors keep their own order; only the shadow's stream is a merge. The merge runs the streams
  with blocking semantics and picks, whenever the shadow has a choice: the victim's external
  communication first, then its own communication, then backward work before forward work (which
  frees memory first). The result is a witness execution, so it cannot deadlock.
- ``steady``: the schedule for the following iterations, where the shadow runs both stages (its
  own 1F1B/GPipe order for each, backward first) until a reconfiguration. It is built on first
  access, so that computing the remainder (the recovery's critical path) does not wait for it. It is also what a
  *preemption notice* hands over at an iteration boundary: no mid-iteration merge is needed then.

Several non-adjacent victims in one iteration work. Adjacent victims (including the last and the
first stage, adjacent through the shadow ring) raise `ConsecutiveFailure`.

A second failure after a failover works the same way (victims are always *nodes*):

- in a later iteration, ``failover_schedule(plan.steady, victims, progress)``: any schedule whose
  ``placement`` and ``shadows`` say who runs and who shadows each stage is accepted;
- during the recovery itself, ``failover_schedule(plan, victims, progress)`` with ``progress``
  indexing ``plan.remainder``: the new plan's ``schedule`` is the survivors' whole iteration so
  far, so its prefixes are the first plan's prefixes followed by the remainder's, and its
  ``earlier`` is the first plan. `validate_failover` then counts the work of every stage failed
  over in the iteration exactly once.

Every stage a victim ran must have a live shadow; otherwise (a victim next to a node that failed
earlier, or a shadow that already runs a taken-over stage) `ConsecutiveFailure` names the lost stages.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterable, Mapping, Sequence

import attrs
from bamboo.schedule._gc import gc_paused
from bamboo.schedule._linearize import linearize
from bamboo.schedule._tasks import (
    CostFn,
    KindStageCost,
    build_lanes,
    compute_order,
    replica_lane,
    unit_cost,
)
from bamboo.schedule.engine import (
    ExecutionError,
    StageTable,
    Timeline,
    check_execution,
    counterpart,
    execute,
    posted_before,
)
from bamboo.schedule.ir import BUFFERED_SENDS, COMM_KINDS, Instruction, Kind, RCMode, Schedule, make
from bamboo.schedule.validate import (
    ScheduleError,
    _provides,
    _requires,
    dependency_problem,
    shape_problem,
)

__all__ = [
    "ConsecutiveFailure",
    "FailoverPlan",
    "check_victims",
    "failover_schedule",
    "merged_schedule",
    "placement_after",
    "progress_at",
    "validate_failover",
]


class ConsecutiveFailure(ValueError):
    """A stage lost every copy in its pipeline: its node and its shadow are both gone.

    ``pair`` is (shadow node, stage): the stage whose replica is gone too (in a fault-free schedule,
    two adjacent victims in the shadow ring). ``lost`` names every stage hosted on a victim, and
    ``earlier`` the nodes that had failed before (a failover schedule already ran without them).
    The pipeline must be reconfigured.
    """

    def __init__(
        self,
        victims: Iterable[int],
        pair: tuple[int, int],
        lost: Iterable[int] = (),
        earlier: Iterable[int] = (),
    ) -> None:
        self.victims = tuple(sorted(victims))
        self.pair = pair
        self.lost = tuple(sorted(lost))
        self.earlier = tuple(sorted(earlier))
        context = f"victims {list(self.victims)}"
        if self.earlier:
            context += f", failed earlier {list(self.earlier)}"
        if self.lost:
            context += f", lost stages {list(self.lost)}"
        super().__init__(
            f"consecutive failure: stages {pair[0]} and {pair[1]} both failed ({context}); "
            f"stage {pair[1]}'s shadow is node {pair[0]}, so the pipeline must be reconfigured"
        )


@attrs.frozen
class FailoverPlan:
    """What `failover_schedule` returns; see the module docstring for the meaning of each part."""

    schedule: Schedule
    victims: frozenset[int]
    progress: dict[int, int]
    executed: dict[int, tuple[Instruction, ...]]
    remainder: Schedule
    resent: dict[int, tuple[Instruction, ...]]
    persisted: frozenset[int]
    """Victim stages whose iteration had completed (their shadow had applied the replica sync)."""
    cost: CostFn = attrs.field(default=unit_cost, eq=False, repr=False)
    earlier: FailoverPlan | None = attrs.field(default=None, eq=False, repr=False)
    """The plan whose remainder was running when these victims failed (a second failure in the same
    iteration), or None. ``schedule`` then holds the survivors' whole iteration up to the failure."""
    _steady: Schedule | None = attrs.field(default=None, eq=False, repr=False)
    _checked_cut: tuple[tuple[int, tuple[Instruction, ...]], ...] | None = attrs.field(
        default=None, init=False, eq=False, repr=False
    )
    """The (node, prefix) pairs that `failover_schedule` found to be a consistent cut; prefixes are
    immutable, so while ``executed`` holds the very same tuples the check need not run again."""

    def _cut_already_checked(self) -> bool:
        checked = self._checked_cut
        return (
            checked is not None
            and len(checked) == len(self.executed)
            and all(self.executed.get(n) is prefix for n, prefix in checked)
        )

    @property
    def steady(self) -> Schedule:
        """The schedule for the following iterations (`merged_schedule`), built on first use.

        The runtime needs ``remainder`` at once, on the critical path of the recovery, but the
        steady schedule only at the next iteration boundary, so it is not built before then.
        """
        if self._steady is None:
            object.__setattr__(self, "_steady", merged_schedule(self.schedule, self.victims, self.cost))
        assert self._steady is not None
        return self._steady

    @property
    def survivors(self) -> tuple[int, ...]:
        return self.remainder.nodes

    @property
    def recovered(self) -> frozenset[int]:
        """Stages failed over in this iteration whose work the shadows redo (this plan's victims and
        the earlier plans', less the persisted ones): their FRC and BRC count as forward and backward."""
        mine = self.victims - self.persisted
        return mine if self.earlier is None else mine | self.earlier.recovered

    @property
    def finished(self) -> frozenset[int]:
        """Failed stages (this plan's and the earlier plans') whose iteration had completed."""
        return self.persisted if self.earlier is None else self.persisted | self.earlier.finished

    def iteration_streams(self) -> dict[int, tuple[Instruction, ...]]:
        """Survivors' whole failing iteration: executed prefix followed by the remainder."""
        return {n: self.executed[n] + self.remainder.streams[n] for n in self.survivors}


def check_victims(schedule: Schedule, victims: Iterable[int]) -> frozenset[int]:
    """The victims (nodes) as a set, after checking that the pipeline can fail over without them.

    This is the one place of the rule "every stage a victim ran needs a live shadow". ``schedule``
    may be fault-free or a failover schedule (``placement`` and ``shadows`` say who runs and who
    shadows each stage; the nodes without a stream failed earlier). Raises `ConsecutiveFailure`
    when a stage a victim ran has no shadow, or its shadow is a victim too or failed earlier (two
    adjacent victims, a victim next to an earlier victim, or a shadow that already runs a stage it
    took over), and ``ValueError`` for no victims, victims out of range, victims that had already
    failed, or a schedule without redundancy.
    """
    P = schedule.stages
    chosen = frozenset(victims)
    if not chosen:
        raise ValueError("at least one victim stage is needed")
    bad = sorted(v for v in chosen if not isinstance(v, int) or not 0 <= v < P)
    if bad:
        raise ValueError(f"victim stages {bad} out of range 0..{P - 1}")
    if schedule.rc is RCMode.NONE:
        raise ValueError("a schedule without redundancy (rc=none) has no shadows to fail over to")
    earlier = frozenset(range(P)) - frozenset(schedule.streams)
    gone = sorted(chosen & earlier)
    if gone:
        raise ValueError(f"victims {gone} had already failed (this schedule runs without them)")
    dead = chosen | earlier
    lost = [s for s in range(P) if schedule.placement[s] in chosen]
    unprotected = sorted(((s - 1) % P, s) for s in lost if schedule.shadows[s] is None or schedule.shadows[s] in dead)
    if unprotected:
        raise ConsecutiveFailure(chosen, unprotected[0], lost, earlier)
    return chosen


def placement_after(
    schedule: Schedule, victims: Iterable[int]
) -> tuple[tuple[int, ...], tuple[int | None, ...]]:
    """``(placement, shadows)`` once ``victims`` failed: the new owner and the new shadow of every stage.

    A victim's stages move to their shadows; a stage that moved, or whose shadow died, has no
    shadow (None) until a reconfiguration. ``victims`` must pass `check_victims` (call it first:
    this function does not check again).
    """
    chosen = frozenset(victims)
    P = schedule.stages
    before, shadows_before = schedule.placement, schedule.shadows
    placement = tuple(shadows_before[s] if before[s] in chosen else before[s] for s in range(P))
    shadows = tuple(
        None if placement[s] != before[s] or shadows_before[s] in chosen else shadows_before[s] for s in range(P)
    )
    return placement, shadows  # type: ignore[return-value]


@gc_paused
def merged_schedule(schedule: Schedule, victims: Iterable[int], cost: CostFn = unit_cost) -> Schedule:
    """The steady-state schedule after ``victims`` failed: each shadow runs its stage and the victim's.

    Stages whose shadow is gone (the victims' and their successors') run without redundancy until
    a reconfiguration; every other stage keeps its shadow, FRC and replica sync. ``schedule`` may
    itself be a merged schedule (a second failure after a failover): the result is the same as
    merging every failed node into the fault-free schedule at once.
    """
    chosen = check_victims(schedule, victims)
    P, M = schedule.stages, schedule.microbatches
    placement, shadows = placement_after(schedule, chosen)
    lanes: dict[int, list[list[tuple[object, ...]]]] = {}
    for n in schedule.nodes:
        if n in chosen:
            continue
        lanes[n] = [
            [*compute_order(schedule.policy, P, M, s), ("TAIL", s)] for s in range(P) if placement[s] == n
        ]
        for replica in range(P):
            if shadows[replica] == n:
                lanes[n].append(replica_lane(schedule.policy, P, M, replica, schedule.rc))
    tasks = build_lanes(lanes, placement, P, cost)
    return Schedule(P, M, schedule.policy, schedule.rc, placement, linearize(tasks), shadows)


@gc_paused
def progress_at(
    schedule: Schedule,
    failures: Mapping[int, int],
    timeline: Timeline | None = None,
) -> dict[int, int]:
    """A consistent cut: how many instructions each node had completed when ``failures`` struck.

    ``failures[v] = i`` means stage v fails just before its instruction ``i``. All victims fail at
    the same moment: the earliest of those start times on ``timeline`` (default: the unit-cost
    execution). A node has completed an instruction if it started before that moment and ended by
    it; a send and its receive share their times, so the cut never splits a message.
    """
    if timeline is None:
        unit = {kind: [0.0 if kind in COMM_KINDS else 1.0] * schedule.stages for kind in Kind}
        timeline = execute(schedule.streams, StageTable(unit, lambda _n, i: 0.0 if i.is_comm else 1.0))
    moments = []
    for v, index in failures.items():
        if v not in schedule.streams:
            raise ValueError(f"stage {v} has no stream in this schedule")
        length = len(schedule.streams[v])
        if not 0 <= index <= length:
            raise ValueError(f"failure index {index} for stage {v} out of range 0..{length}")
        if index < length:
            moments.append(timeline.start[v][index])
        else:  # after its last instruction (a victim with nothing left to do fails at once)
            moments.append(timeline.end[v][-1] + 1.0 if length else 0.0)
    moment = min(moments)
    progress = {}
    for n, stream in schedule.streams.items():
        done = 0
        while done < len(stream) and timeline.start[n][done] < moment and timeline.end[n][done] <= moment:
            done += 1
        progress[n] = done
    for v, index in failures.items():
        progress[v] = min(progress[v], index)
    return progress


def _cut_problem(executed: Mapping[int, Sequence[Instruction]]) -> str | None:
    """Why the completed prefixes are not a consistent cut (a message received but never sent), or None.

    Messages with nodes whose progress is unknown (victims without an entry) are left out.
    """
    prefixes = {n: tuple(i for i in s if i.peer is None or i.peer in executed) for n, s in executed.items()}
    try:
        check_execution(prefixes)
    except ExecutionError as error:
        return str(error)
    return None


@gc_paused
def failover_schedule(
    schedule: Schedule | FailoverPlan,
    victims: Iterable[int],
    progress: Mapping[int, int],
    cost: CostFn = unit_cost,
) -> FailoverPlan:
    """The survivors' merged streams for the rest of the iteration, and the steady schedule after.

    ``schedule`` is what the pipeline was running when ``victims`` (nodes) failed:

    - a `Schedule`, fault-free or a failover's steady schedule (``placement``/``shadows`` say who
      runs and who shadows each stage); ``progress[n]`` is how many instructions of
      ``schedule.streams[n]`` node n had completed;
    - a `FailoverPlan` whose remainder was running (a second failure during the recovery of the
      same iteration); ``progress[n]`` then counts completed instructions of
      ``plan.remainder.streams[n]``. The new plan's ``earlier`` is that plan, its ``schedule`` holds
      the survivors' whole iteration so far (``plan.iteration_streams()``) and its ``progress`` and
      ``executed`` index those streams: the first plan's prefixes, then the remainder's prefixes.

    Survivors' progress is required; victims' entries are optional and only used to check the cut.
    Every stage a victim ran needs a live shadow, else `ConsecutiveFailure`.
    """
    earlier: FailoverPlan | None = None
    if isinstance(schedule, FailoverPlan):
        earlier = schedule
        remainder = earlier.remainder
        for n in remainder.nodes:
            if n in progress:
                index = progress[n]
                if not isinstance(index, int) or not 0 <= index <= len(remainder.streams[n]):
                    raise ValueError(
                        f"progress {index!r} of node {n} out of range 0..{len(remainder.streams[n])} (its remainder)"
                    )
        progress = {n: len(earlier.executed[n]) + i for n, i in progress.items() if n in remainder.streams}
        schedule = Schedule(
            remainder.stages, remainder.microbatches, remainder.policy, remainder.rc, remainder.placement,
            earlier.iteration_streams(), remainder.shadows,
        )
    chosen = check_victims(schedule, victims)
    P, rc = schedule.stages, schedule.rc
    survivors = [n for n in schedule.nodes if n not in chosen]
    done: dict[int, int] = {}
    for n in schedule.nodes:
        if n not in progress:
            if n in chosen:
                continue
            raise ValueError(f"progress of surviving node {n} is missing")
        index = progress[n]
        if not isinstance(index, int) or not 0 <= index <= len(schedule.streams[n]):
            raise ValueError(f"progress {index!r} of node {n} out of range 0..{len(schedule.streams[n])}")
        done[n] = index
    executed = {n: schedule.streams[n][:i] for n, i in done.items()}
    problem = _cut_problem(executed)
    if problem:
        raise ValueError(f"inconsistent cut: the completed prefixes do not pair up: {problem}")
    ran = {n: set(executed[n]) for n in survivors}  # what each survivor completed, for lookups
    placement, shadows = placement_after(schedule, chosen)
    # Every victim runs exactly its own stage here: a victim that also ran a stage it had taken
    # over before would leave that stage without a shadow (`check_victims` raised).
    assert all(schedule.stages_on(v) == (v,) for v in chosen), "a victim hosts more than its own stage"
    persisted = frozenset(
        v for v in chosen if make(Kind.SYNC_RECV, v, None, v) in ran[schedule.shadows[v]]  # type: ignore[index]
    )

    # 1. Survivors' own remaining instructions, with messages to victims re-routed or dropped.
    remaining: dict[int, list[Instruction]] = {}
    for n in survivors:
        kept: list[Instruction] = []
        orphaned: set[tuple[int, int | None]] = set()
        for instr in schedule.streams[n][done[n]:]:
            p = instr.peer
            if p in chosen:
                other = counterpart(instr, n)
                if other.stage != p or placement[p] == n:
                    continue  # the victim's replica work died with it, or the message became local
                if instr.kind is Kind.RECV_GRAD:
                    # efeb: node v-2 waited for v's gradient to run BRC of stage v-1 eagerly. That BRC
                    # only protects against v-1 failing too, which would now be a consecutive failure
                    # (reconfiguration), so it is dropped for the rest of this iteration.
                    orphaned.add((instr.stage, instr.microbatch))
                    continue
                kept.append(instr.sent_to(placement[p]))
                continue
            if instr.kind in (Kind.SWAP_IN, Kind.BRC) and (instr.stage, instr.microbatch) in orphaned:
                continue
            stage_victim = instr.stage in chosen and instr.stage not in persisted
            if stage_victim and placement[instr.stage] == n and instr.kind in (
                Kind.FRC, Kind.SWAP_OUT, Kind.SWAP_IN, Kind.BRC, Kind.LOAD
            ):
                continue  # the shadow's redundant work for the victim: the recovery lane redoes it
            if (
                instr.kind is Kind.RECV_GRAD and p is not None and instr.stage in chosen
                and instr.stage not in persisted and placement[instr.stage] == n
            ):
                continue  # efeb copy of the successor's gradient: the re-routed original replaces it
            if instr.kind is Kind.SEND_GRAD and p is not None and (instr.stage - 1) in chosen:
                v = instr.stage - 1
                if v not in persisted and p == placement[v] and p != v:
                    continue  # the matching efeb copy on the sender's side
            kept.append(instr)
        remaining[n] = kept

    # 2. Re-sends and 3. recovery lanes.
    resent: dict[int, list[Instruction]] = {n: [] for n in survivors}
    recovery: dict[int, list[Instruction]] = {}
    for v in sorted(chosen - persisted):
        h = placement[v]
        u = v + 1 if v + 1 < P else None
        shadow_ran = ran[h]
        if u is not None and u != h:
            for instr in executed[u]:
                if instr.kind is Kind.SEND_GRAD and instr.peer == v and instr.stage == u:
                    k = instr.microbatch
                    if make(Kind.BRC, v, k) in shadow_ran or make(Kind.RECV_GRAD, v, k, u) in shadow_ran:
                        continue
                    resent[u].append(instr.sent_to(h))
        lane: list[Instruction] = []
        in_memory: set[int | None] = set()
        for instr in schedule.streams[v]:
            kind, k = instr.kind, instr.microbatch
            if instr.peer is not None:
                p = instr.peer
                if instr.stage != v or p in chosen or p == h or kind is Kind.SEND_GRAD or p not in ran:
                    continue  # replica traffic, a dead peer, now local, or an efeb copy nobody awaits
                partner_ran = ran[p]
                if instr.is_send:
                    if counterpart(instr, v) in partner_ran:
                        continue  # the partner already has it
                    if kind is Kind.SEND_ACT and k not in in_memory:
                        lane.append(make(Kind.SWAP_IN, v, k))
                        in_memory.add(k)
                    lane.append(instr)
                else:
                    sent = counterpart(instr, v)
                    if sent in partner_ran and sent.sent_to(h) not in resent.get(p, []):
                        continue  # already delivered before the failure and not needed again
                    lane.append(instr)
                continue
            if instr.stage != v:
                continue  # the victim's own replica lane (FRC/SO/SI/BRC/RY of stage v+1, LOAD for it)
            if kind is Kind.LOAD:
                continue  # emitted together with the forward below
            if kind is Kind.FORWARD:
                if make(Kind.FRC, v, k) in shadow_ran:
                    if make(Kind.SWAP_OUT, v, k) not in shadow_ran or make(Kind.SWAP_IN, v, k) in shadow_ran:
                        in_memory.add(k)  # never swapped out, or already swapped back in
                    continue
                if v == 0:
                    lane.append(make(Kind.LOAD, 0, k))
                if (rc is RCMode.LFLB and make(Kind.SWAP_OUT, v, k) in shadow_ran
                        and make(Kind.SWAP_IN, v, k) not in shadow_ran):
                    lane.append(make(Kind.SWAP_IN, v, k))
                lane.append(make(Kind.FRC, v, k))
                in_memory.add(k)
            elif kind is Kind.BACKWARD:
                if make(Kind.BRC, v, k) in shadow_ran:
                    continue
                if k not in in_memory:
                    lane.append(make(Kind.SWAP_IN, v, k))
                    in_memory.add(k)
                lane.append(make(Kind.BRC, v, k))
            elif kind in (Kind.ALLREDUCE, Kind.OPTIMIZER):
                lane.append(instr)
        recovery[h] = lane

    lanes = {
        n: [resent[n] + remaining[n]] + ([recovery[n]] if n in recovery else []) for n in survivors
    }
    merged = _merge(lanes, executed, schedule, cost)
    remainder = Schedule(P, schedule.microbatches, schedule.policy, rc, placement, merged, shadows)
    plan = FailoverPlan(
        schedule,
        chosen,
        dict(done),
        executed,
        remainder,
        {n: tuple(r) for n, r in resent.items() if r},
        persisted,
        cost,
        earlier=earlier,
    )
    object.__setattr__(plan, "_checked_cut", tuple(executed.items()))
    return plan


def _priority(instr: Instruction, lane: int) -> tuple[int, int]:
    """Merge rules: victim's communication, own communication, backward work, forward work."""
    if instr.is_comm:
        return (0, -lane)
    backwardish = instr.kind in (Kind.BACKWARD, Kind.BRC, Kind.SWAP_IN, Kind.ALLREDUCE, Kind.OPTIMIZER,
                                 Kind.SEND_GRAD, Kind.RECV_GRAD)
    return (1 if backwardish else 2, -lane)


def _merge(
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
            if m is not None and instr.kind is Kind.SYNC_RECV:
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


@gc_paused
def validate_failover(plan: FailoverPlan) -> None:
    """Raise `ScheduleError` unless the plan is executable and accounts for all work exactly once.

    Checks: the cut is consistent (completed prefixes pair up), the remainder only talks among
    survivors and runs to completion with blocking semantics, every survivor's whole iteration
    (prefix then remainder) respects dependencies, and each (stage, microbatch) has exactly one
    forward and one backward (FRC/BRC count for victim stages), each stage one all-reduce and one
    optimizer step. The steady schedule is validated with `validate`.
    """
    from bamboo.schedule.validate import validate

    schedule, remainder = plan.schedule, plan.remainder
    P, M, rc = schedule.stages, schedule.microbatches, schedule.rc
    survivors = plan.survivors
    full = plan.iteration_streams()
    split = {n: len(plan.executed[n]) for n in survivors}

    def fail(problem: str, cells: Iterable[tuple[int, int]]) -> None:
        error = ScheduleError(problem, full, cells)
        from bamboo.schedule.export import text_grid

        error.grid = text_grid(full, error.cells, split)
        error.args = (f"{problem}\n{error.grid}",)
        raise error

    # the cut: survivors' prefixes (and victims', when known) must pair up among themselves
    problem = None if plan._cut_already_checked() else _cut_problem(plan.executed)
    if problem:
        fail(f"inconsistent cut: the completed prefixes do not pair up: {problem}", [])
    found = shape_problem(remainder.streams, P, M)
    if found:
        fail(found[0], [(n, split[n] + i) for n, i in found[1]])
    for n, stream in remainder.streams.items():
        for i, instr in enumerate(stream):
            if instr.peer is not None and instr.peer not in remainder.streams:
                fail(f"node {n} {instr} talks to failed node {instr.peer}", [(n, split[n] + i)])
    try:
        check_execution(remainder.streams, posted_before(plan.executed))
    except ExecutionError as error:
        fail(str(error), [(n, split[n] + i) for n, i in error.cells])
    found = dependency_problem(full, P, M, rc)
    if found:
        fail(found[0], found[1])
    counted = plan.recovered
    always = {Kind.FORWARD: "forward", Kind.BACKWARD: "backward", Kind.ALLREDUCE: "all-reduce",
              Kind.OPTIMIZER: "optimizer step"}
    redundant = {Kind.FRC: "forward", Kind.BRC: "backward"}  # count only for the victims' stages
    # tallies: forward and backward per (stage, microbatch), all-reduce and optimizer step per stage
    per_microbatch = {"forward": [[0] * M for _ in range(P)], "backward": [[0] * M for _ in range(P)]}
    per_stage = {"all-reduce": [0] * P, "optimizer step": [0] * P}
    placement = plan.remainder.placement
    for n, stream in full.items():
        for i, instr in enumerate(stream):
            kind, s = instr.kind, instr.stage
            what = always.get(kind)
            if what is None:
                what = redundant.get(kind)
                if what is None or s not in counted:
                    continue
            k = instr.microbatch
            if s < P:  # anything else was reported by the shape check, or is never asked for
                if k is None:
                    if what in per_stage:
                        per_stage[what][s] += 1
                elif what in per_microbatch and k < M:
                    per_microbatch[what][s][k] += 1
            if s in counted and n != placement[s]:
                fail(f"{instr} of failed stage {s} runs on node {n}, not on its shadow", [(n, i)])

    def cells_of(key: tuple[str, int, int | None]) -> list[tuple[int, int]]:
        what, s, k = key
        kinds = {kind for kind, name in always.items() if name == what}
        if s in counted:
            kinds |= {kind for kind, name in redundant.items() if name == what}
        return [(n, i) for n, stream in full.items() for i, instr in enumerate(stream)
                if instr.kind in kinds and instr.stage == s and instr.microbatch == k]

    finished = plan.finished
    for s in range(P):
        if s in finished:
            continue
        forwards, backwards = per_microbatch["forward"][s], per_microbatch["backward"][s]
        if forwards.count(1) == M and backwards.count(1) == M and per_stage["all-reduce"][s] == 1 \
                and per_stage["optimizer step"][s] == 1:
            continue
        keys = [(w, s, k) for w in ("forward", "backward") for k in range(M)]
        keys += [("all-reduce", s, None), ("optimizer step", s, None)]
        for key in keys:
            what, _s, k = key
            count = per_stage[what][s] if k is None else per_microbatch[what][s][k]
            if count != 1:
                label = f"{what} of stage {s}" + ("" if k is None else f" microbatch {k}")
                fail(f"{label} happens {count} times in the failing iteration, expected once", cells_of(key))
    validate(plan.steady)
