"""Seeded random failures for the chaos test and the `soak` command.

A kill plan is one victim, or two non-adjacent victims (in the shadow ring), each at a random
instruction index of its stream in a random step. Every plan runs through `verify`, whose
survivors must fail over and match the single-process reference.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from bamboo.rc.comm import CommTimeouts
from bamboo.rc.executor import KillPoint
from bamboo.rc.verify import DEFAULT_CONFIG, VerifyResult, run_verify
from bamboo.schedule import one_f_one_b

__all__ = ["random_kill_points", "run_chaos"]


def random_kill_points(
    seed: int, count: int, stages: int, steps: int, redundancy: str = "eflb"
) -> list[tuple[KillPoint, ...]]:
    """`count` seeded kill plans for a P=`stages`, D=1 pipeline."""
    rng = random.Random(seed)
    schedule = one_f_one_b(stages, DEFAULT_CONFIG["gradient_accumulation_steps"], rc=redundancy)
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


def run_chaos(
    plans: list[tuple[KillPoint, ...]],
    stages: int,
    steps: int,
    redundancy: str = "eflb",
    on_result: Callable[[tuple[KillPoint, ...], VerifyResult], None] | None = None,
) -> list[tuple[tuple[KillPoint, ...], VerifyResult]]:
    """Run every plan through verify; returns (plan, result) pairs."""
    timeouts = CommTimeouts(group=30.0, build=30.0, confirm=15.0)
    outcomes = []
    for plan in plans:
        result = run_verify(stages, 1, steps, redundancy, timeouts=timeouts, deadline_s=120.0, kills=plan)
        outcomes.append((plan, result))
        if on_result is not None:
            on_result(plan, result)
    return outcomes
