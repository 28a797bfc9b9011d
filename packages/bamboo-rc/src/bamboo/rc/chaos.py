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
"""

from __future__ import annotations

import random
from collections.abc import Callable

from bamboo.rc.faults import KillPoint
from bamboo.rc.timeouts import CHAOS_BUILD_S, CHAOS_CONFIRM_S, CHAOS_DEADLINE_S, CHAOS_GROUP_S, CommTimeouts
from bamboo.rc.verify import DEFAULT_CONFIG, VerifyResult, run_verify
from bamboo.schedule import Schedule, merged_schedule, one_f_one_b

__all__ = ["random_kill_points", "run_chaos"]


def random_kill_points(
    seed: int, count: int, stages: int, steps: int, redundancy: str = "eflb", second_failures: bool = False
) -> list[tuple[KillPoint, ...]]:
    """`count` seeded kill plans for a P=`stages`, D=1 pipeline (see the module docstring)."""
    rng = random.Random(seed)
    schedule = one_f_one_b(stages, DEFAULT_CONFIG["gradient_accumulation_steps"], rc=redundancy)
    if second_failures:
        if stages < 4 or steps < 2:
            raise ValueError(f"a second failure needs at least 4 stages and 2 steps, got {stages} and {steps}")
        return [_second_failure(rng, schedule, stages, steps) for _ in range(count)]
    plans = []
    for _ in range(count):
        step = rng.randrange(steps)
        first = rng.randrange(stages)
        victims = [first]
        if stages >= 4 and rng.random() < 0.5:
            others = [s for s in range(stages) if (s - first) % stages not in (0, 1, stages - 1)]
            victims.append(rng.choice(others))
        plan = tuple(
            KillPoint(v, 0, str(rng.randrange(len(schedule.streams[v]))), step) for v in sorted(victims)
        )
        plans.append(plan)
    return plans


def _second_failure(rng: random.Random, schedule: Schedule, stages: int, steps: int) -> tuple[KillPoint, ...]:
    first = rng.randrange(stages)
    second = rng.choice([s for s in range(stages) if (s - first) % stages not in (0, 1, stages - 1)])
    step = rng.randrange(steps - 1)
    kill = KillPoint(first, 0, str(rng.randrange(len(schedule.streams[first]))), step)
    if rng.random() < 0.5:  # during the recovery: the remainder is at most the whole stream
        again = KillPoint(second, 0, str(rng.randrange(len(schedule.streams[second]))), step, in_recovery=True)
    else:
        merged = merged_schedule(schedule, [first]).streams[second]
        again = KillPoint(second, 0, str(rng.randrange(len(merged))), rng.randrange(step + 1, steps))
    return (kill, again)


def run_chaos(
    plans: list[tuple[KillPoint, ...]],
    stages: int,
    steps: int,
    redundancy: str = "eflb",
    on_result: Callable[[tuple[KillPoint, ...], VerifyResult], None] | None = None,
) -> list[tuple[tuple[KillPoint, ...], VerifyResult]]:
    """Run every plan through verify; returns (plan, result) pairs."""
    timeouts = CommTimeouts(group=CHAOS_GROUP_S, build=CHAOS_BUILD_S, confirm=CHAOS_CONFIRM_S)
    outcomes = []
    for plan in plans:
        result = run_verify(stages, 1, steps, redundancy, timeouts=timeouts, deadline_s=CHAOS_DEADLINE_S, kills=plan,
                            kills_must_fire=False)
        outcomes.append((plan, result))
        if on_result is not None:
            on_result(plan, result)
    return outcomes
