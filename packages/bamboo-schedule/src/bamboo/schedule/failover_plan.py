"""Who takes over after a failure: the victim rule, the new placement, the plan and the steady schedule.

`check_victims` is the one place of the rule "every stage a victim ran needs a live shadow" (else
`ConsecutiveFailure`); `placement_after` gives each stage's new owner and shadow; `merged_schedule` is
the schedule of the iterations after a failure, where each shadow runs its stage and the victim's;
`FailoverPlan` is what `bamboo.schedule.failover.failover_schedule` returns (that module's docstring
gives the meaning of each part).
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
from bamboo.schedule._gc import gc_paused
from bamboo.schedule._linearize import linearize
from bamboo.schedule._tasks import CostFn, build_lanes, compute_order, replica_lane, unit_cost
from bamboo.schedule.ir import Instruction, RCMode, Schedule
from bamboo.schedule.reduction_order import allreduces_before_syncs

__all__ = ["ConsecutiveFailure", "FailoverPlan", "check_victims", "merged_schedule", "placement_after"]


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
    """What `failover_schedule` returns; `bamboo.schedule.failover`'s docstring gives the meaning of each part."""

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
    return Schedule(P, M, schedule.policy, schedule.rc, placement, allreduces_before_syncs(linearize(tasks)), shadows)
