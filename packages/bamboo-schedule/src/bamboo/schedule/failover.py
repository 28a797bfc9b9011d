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

This module derives the remainder; the parts it builds on live beside it, and it re-exports their public
names: `failover_plan` (the victim check, the placement after a failure, `FailoverPlan` and the steady
`merged_schedule`), `cut` (`progress_at` and the consistent-cut check), `_merge` (the witness merge of the
lanes) and `failover_validate` (`validate_failover`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

from bamboo.schedule._gc import gc_paused
from bamboo.schedule._merge import merge_lanes
from bamboo.schedule._tasks import CostFn, unit_cost
from bamboo.schedule.cut import cut_problem, progress_at
from bamboo.schedule.engine import ExecutionError, check_execution, counterpart, posted_before, received_ahead
from bamboo.schedule.failover_plan import (
    ConsecutiveFailure,
    FailoverPlan,
    check_victims,
    merged_schedule,
    placement_after,
)
from bamboo.schedule.failover_validate import validate_failover
from bamboo.schedule.ir import Instruction, Kind, RCMode, Schedule, make
from bamboo.schedule.reduction_order import allreduces_before_syncs, syncs_after_allreduces, syncs_last

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
    problem = cut_problem(executed, rc.receives_ahead)
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
    merged = _syncs_late_where_safe(allreduces_before_syncs(merge_lanes(lanes, executed, schedule, cost)), executed)
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


def _syncs_late_where_safe(streams: dict[int, tuple[Instruction, ...]],
                           executed: Mapping[int, Sequence[Instruction]]) -> dict[int, tuple[Instruction, ...]]:
    """The remainder with each survivor's replica syncs after its other work (`syncs_last`), else after its last
    all-reduce (`syncs_after_allreduces`), the first of them where blocking execution of the remainder still
    completes; else as it is. A node waits at its ``SY`` for its stage's reduction, which may need another pipeline
    to get past a redone all-reduce of this one: under ``efeb`` that pipeline's nodes wait for the redo through
    the eager gradient messages, and the shadow that redoes it waits for what this node does after its ``SY``
    (`bamboo.schedule.reduction_order`)."""
    for later in (syncs_last(streams), syncs_after_allreduces(streams)):
        if later == streams:
            return streams
        try:
            check_execution(later, posted_before(executed), received_ahead({n: executed[n] for n in streams}))
        except ExecutionError:
            continue
        return later
    return streams
