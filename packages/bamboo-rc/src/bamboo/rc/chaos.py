"""Seeded random failures for the chaos test and the `soak` command.

A kill plan is one victim, or two non-adjacent victims (in the shadow ring), each at a random
instruction index of its stream in a random step. With ``second_failures`` every plan is a first
victim and then a second, non-adjacent one after the pipeline has failed over: either during the
recovery of the same step (a random index into its remainder, which fires only if the remainder is
that long) or in a later step (a random index into its merged schedule). Every plan runs through
`verify`, whose survivors must fail over and match the single-process reference. A random kill
point may not fire (its node may be in a failover's remainder by then, or the remainder may be
shorter than its index), so these runs do not require every kill point to fire; the results say
which did (``VerifyResult.unfired_kills``).

With D > 1 pipelines of P stages, each victim is in a random pipeline: two victims in one pipeline are
not adjacent in its shadow ring, victims in different pipelines may be at any stages (each pipeline fails
over on its own, and the data-parallel all-reduces go on without the victims). A second failure in another
pipeline than the first fires during the recovery (an index into the remainder, if that node runs one) or
in a later step (an index into its fault-free stream: that pipeline has not failed over).

With one stage (P = 1, D pipelines: the shadow ring of :mod:`bamboo.rc.ring`) a plan kills one node,
or two different nodes (neighbours in the ring too: the next live node takes both shares over), at
random indices of their fault-free streams; with ``second_failures`` a first node, then another one
during the recovery or in a later step. At least one node always survives.

`random_handover_plans` mixes a planned hand-over with a failure: a random node is told at the start of
a random step (from step 1, so that an iteration time is known, and before the last) that it will be
preempted in 60 s, which leaves time to hand its role over at the step's end; a node of another
pipeline (of the ring, with P = 1) dies at a random instruction of the same step or a later one. The
pipelines do not keep in step, so the failure may be confirmed before the leaver has gone, while it is
leaving, or after. With ``same_pipeline`` the node killed is in the leaver's own pipeline: in the leaver's
last step (its pipeline fails over with the leaver still there: it withdraws its hand-over and stays), or
after the hand-over, in the merged schedule, at a stage not adjacent to the leaver's.

``global_microbatches`` splits a global batch of that many microbatches over the pipelines unevenly where they do
not divide it (as bamboo-launch does after a loss): each victim's kill point is an index into its own pipeline's
stream, which runs that pipeline's share.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

from bamboo.rc.faults import KillPoint, NoticePoint
from bamboo.rc.gpt_size import GPTSize
from bamboo.rc.reference import ReferenceResult
from bamboo.rc.ring import fault_free_ring_stream
from bamboo.rc.timeouts import (
    CHAOS_BUILD_S,
    CHAOS_CONFIRM_S,
    CHAOS_DEADLINE_S,
    CHAOS_GROUP_S,
    NOTICE_LEAD_S,
    CommTimeouts,
)
from bamboo.rc.verify import DEFAULT_CONFIG, VerifyResult, run_verify
from bamboo.reconfig import microbatch_shares
from bamboo.schedule import Schedule, merged_schedule, one_f_one_b

__all__ = ["pipeline_shares", "random_handover_plans", "random_kill_points", "run_chaos"]

HANDOVER_LEAD_S = NOTICE_LEAD_S
"""Seconds between a chaos notice and its deadline: ample time to hand over after the step it comes in."""

ScheduleOf = Callable[[int], Schedule]
"""A pipeline's fault-free schedule, from its share of the global batch."""


def pipeline_shares(pipelines: int, global_microbatches: int | None = None) -> list[int]:
    """Each pipeline's microbatches: verify's gradient accumulation steps each, or its share of
    ``global_microbatches`` (the first ``G mod D`` one longer)."""
    if global_microbatches is None:
        return [int(DEFAULT_CONFIG["gradient_accumulation_steps"])] * pipelines
    return list(microbatch_shares(global_microbatches, pipelines))


def _schedules(stages: int, shares: Sequence[int], redundancy: str) -> ScheduleOf:
    """Each pipeline's schedule, built once per distinct share."""
    built = {count: one_f_one_b(stages, count, rc=redundancy) for count in sorted(set(shares))}
    return lambda pipeline: built[shares[pipeline]]


def random_kill_points(
    seed: int, count: int, stages: int, steps: int, redundancy: str = "eflb", second_failures: bool = False,
    pipelines: int = 1, global_microbatches: int | None = None,
) -> list[tuple[KillPoint, ...]]:
    """`count` seeded kill plans for D=`pipelines` pipelines of P=`stages` stages, or for a ring of `pipelines`
    nodes when `stages` is 1 (see the module docstring)."""
    rng = random.Random(seed)
    shares = pipeline_shares(pipelines, global_microbatches)
    if stages == 1:
        return [_ring_plan(rng, shares, steps, redundancy, second_failures) for _ in range(count)]
    schedule_of = _schedules(stages, shares, redundancy)
    pick = _pipeline_picker(rng, pipelines)
    if second_failures:
        if stages < 4 or steps < 2:
            raise ValueError(f"a second failure needs at least 4 stages and 2 steps, got {stages} and {steps}")
        return [_second_failure(rng, schedule_of, stages, steps, pick) for _ in range(count)]
    plans = []
    for _ in range(count):
        step = rng.randrange(steps)
        first = (rng.randrange(stages), pick())
        victims = [first]
        if (stages >= 4 or pipelines > 1) and rng.random() < 0.5:
            pipeline = pick()
            if pipeline != first[1]:
                victims.append((rng.randrange(stages), pipeline))
            elif stages >= 4:
                victims.append((rng.choice(_not_adjacent(first[0], stages)), pipeline))
        plan = tuple(
            KillPoint(v, p, str(rng.randrange(len(schedule_of(p).streams[v]))), step) for v, p in sorted(victims)
        )
        plans.append(plan)
    return plans


def _pipeline_picker(rng: random.Random, pipelines: int) -> Callable[[], int]:
    """A random pipeline each call; with one pipeline always 0, drawing nothing (so D = 1 plans stay what
    they were for a seed before D > 1 existed)."""
    if pipelines < 1:
        raise ValueError(f"pipelines must be >= 1, got {pipelines}")
    return (lambda: rng.randrange(pipelines)) if pipelines > 1 else (lambda: 0)


def _not_adjacent(stage: int, stages: int) -> list[int]:
    """The stages of a pipeline that are neither `stage` nor its neighbours in the shadow ring."""
    return [s for s in range(stages) if (s - stage) % stages not in (0, 1, stages - 1)]


def _second_failure(
    rng: random.Random, schedule_of: ScheduleOf, stages: int, steps: int, pick: Callable[[], int]
) -> tuple[KillPoint, ...]:
    first, pipeline = rng.randrange(stages), pick()
    other = pick()
    schedule, others = schedule_of(pipeline), schedule_of(other)
    second = rng.choice(_not_adjacent(first, stages)) if other == pipeline else rng.randrange(stages)
    step = rng.randrange(steps - 1)
    kill = KillPoint(first, pipeline, str(rng.randrange(len(schedule.streams[first]))), step)
    if rng.random() < 0.5:  # during the recovery: the remainder is at most the whole stream
        again = KillPoint(second, other, str(rng.randrange(len(others.streams[second]))), step, in_recovery=True)
    else:
        later = merged_schedule(schedule, [first]).streams[second] if other == pipeline else others.streams[second]
        again = KillPoint(second, other, str(rng.randrange(len(later))), rng.randrange(step + 1, steps))
    return (kill, again)


def _ring_plan(
    rng: random.Random, shares: Sequence[int], steps: int, redundancy: str, second_failures: bool
) -> tuple[KillPoint, ...]:
    pipelines = len(shares)
    if pipelines < 2:
        raise ValueError(f"kills in a P = 1 ring need at least 2 pipelines (one survives), got {pipelines}")

    def point(pipeline: int, step: int, in_recovery: bool = False) -> KillPoint:
        length = len(fault_free_ring_stream(pipeline, shares, redundancy))
        return KillPoint(0, pipeline, str(rng.randrange(length)), step, in_recovery=in_recovery)

    first, second = rng.sample(range(pipelines), 2)
    if second_failures:
        if steps < 2 or pipelines < 3:
            raise ValueError(f"a second failure in a ring needs 2 steps and 3 pipelines, got {steps} and {pipelines}")
        step = rng.randrange(steps - 1)
        if rng.random() < 0.5:  # during the recovery: an index into the remainder, which may be shorter
            return (point(first, step), point(second, step, in_recovery=True))
        return (point(first, step), point(second, rng.randrange(step + 1, steps)))
    step = rng.randrange(steps)
    if pipelines >= 3 and rng.random() < 0.5:
        return tuple(point(v, step) for v in sorted((first, second)))
    return (point(first, step),)


def random_handover_plans(
    seed: int, count: int, stages: int, steps: int, redundancy: str = "eflb", pipelines: int = 2,
    same_pipeline: bool = False, global_microbatches: int | None = None,
) -> list[tuple[NoticePoint, KillPoint]]:
    """`count` seeded (notice, kill) pairs for D=`pipelines` pipelines of P=`stages` stages, or a ring of
    `pipelines` nodes when `stages` is 1 (see the module docstring); with `same_pipeline` (P >= 3), the kill
    is in the leaver's own pipeline."""
    if steps < 3:
        raise ValueError(f"a hand-over between a first and a last step needs at least 3 steps, got {steps}")
    if same_pipeline:
        if stages < 3:
            raise ValueError(f"a kill in the leaver's own pipeline needs at least 3 stages, got {stages}")
    elif pipelines < (3 if stages == 1 else 2):
        raise ValueError(f"a hand-over and a failure in another pipeline need at least {3 if stages == 1 else 2} "
                         f"pipelines with P = {stages}, got {pipelines}")
    rng = random.Random(seed)
    shares = pipeline_shares(pipelines, global_microbatches)
    schedule_of = _schedules(stages, shares, redundancy) if stages > 1 else None
    plans = []
    for _ in range(count):
        if same_pipeline:
            assert schedule_of is not None
            plans.append(_same_pipeline_plan(rng, schedule_of, stages, steps, pipelines))
            continue
        leaver, victim = rng.sample(range(pipelines), 2)
        notice = NoticePoint(rng.randrange(stages), leaver, rng.randrange(1, steps - 1), lead_s=HANDOVER_LEAD_S)
        stage = rng.randrange(stages)
        if schedule_of is not None:
            length = len(schedule_of(victim).streams[stage])
        else:
            length = len(fault_free_ring_stream(victim, shares, redundancy))
        kill = KillPoint(stage, victim, str(rng.randrange(length)), rng.randrange(notice.step, steps))
        plans.append((notice, kill))
    return plans


def _same_pipeline_plan(
    rng: random.Random, schedule_of: ScheduleOf, stages: int, steps: int, pipelines: int
) -> tuple[NoticePoint, KillPoint]:
    """A notice to a node and a kill of another node of its pipeline: in the leaver's last step (the pipeline
    fails over with the leaver still there, so it withdraws and stays), or, half the time when P >= 4, in a
    later step, after the hand-over, at a stage not adjacent to the leaver's (the merged schedule's
    failover)."""
    pipeline, leaver = rng.randrange(pipelines), rng.randrange(stages)
    schedule = schedule_of(pipeline)
    notice = NoticePoint(leaver, pipeline, rng.randrange(1, steps - 1), lead_s=HANDOVER_LEAD_S)
    later = _not_adjacent(leaver, stages)
    if later and rng.random() < 0.5:
        stage = rng.choice(later)
        stream = merged_schedule(schedule, [leaver]).streams[stage]
        return notice, KillPoint(stage, pipeline, str(rng.randrange(len(stream))), rng.randrange(notice.step + 1, steps))
    stage = rng.choice([s for s in range(stages) if s != leaver])
    return notice, KillPoint(stage, pipeline, str(rng.randrange(len(schedule.streams[stage]))), notice.step)


def run_chaos(
    plans: list[tuple[KillPoint, ...]],
    stages: int,
    steps: int,
    redundancy: str = "eflb",
    on_result: Callable[[tuple[KillPoint, ...], VerifyResult], None] | None = None,
    pipelines: int = 1,
    notices: list[tuple[NoticePoint, ...]] | None = None,
    size: GPTSize | None = None,
    global_microbatches: int | None = None,
) -> list[tuple[tuple[KillPoint, ...], VerifyResult]]:
    """Run every plan through verify (P=`stages`, D=`pipelines`, the example model of `size`, default the
    smallest), with `notices[i]` given during plan i when given; returns (plan, result) pairs."""
    if notices is not None and len(notices) != len(plans):
        raise ValueError(f"{len(notices)} sets of notices for {len(plans)} kill plans")
    timeouts = CommTimeouts(group=CHAOS_GROUP_S, build=CHAOS_BUILD_S, confirm=CHAOS_CONFIRM_S)
    outcomes = []
    references: dict[int, ReferenceResult] = {}  # one configuration: its reference is trained once per step
    for index, plan in enumerate(plans):
        result = run_verify(stages, pipelines, steps, redundancy, size=size, timeouts=timeouts, deadline_s=CHAOS_DEADLINE_S,
                            kills=plan, kills_must_fire=False, notice_points=notices[index] if notices else (),
                            references=references, global_microbatches=global_microbatches)
        outcomes.append((plan, result))
        if on_result is not None:
            on_result(plan, result)
    return outcomes
