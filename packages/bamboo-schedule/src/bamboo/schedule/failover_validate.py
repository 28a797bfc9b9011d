"""`validate_failover`: a failover plan runs to completion and accounts for all work exactly once.

It uses the validator's machinery (`bamboo.schedule.validate`) on the survivors' whole failing iteration (each
completed prefix followed by the remainder) and validates the steady schedule with `validate`.
"""

from __future__ import annotations

from collections.abc import Iterable

from bamboo.schedule._gc import gc_paused
from bamboo.schedule.cut import cut_problem
from bamboo.schedule.engine import ExecutionError, check_execution, posted_before, received_ahead
from bamboo.schedule.failover_plan import FailoverPlan
from bamboo.schedule.ir import Kind
from bamboo.schedule.reduction_order import sync_problem
from bamboo.schedule.validate import ScheduleError, dependency_problem, shape_problem

__all__ = ["validate_failover"]


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
    problem = None if plan._cut_already_checked() else cut_problem(plan.executed, rc.receives_ahead)
    if problem:
        fail(f"inconsistent cut: the completed prefixes do not pair up: {problem}", [])
    found = shape_problem(remainder.streams, P, M)
    if found:
        fail(found[0], [(n, split[n] + i) for n, i in found[1]])
    found = sync_problem(remainder.streams)
    if found:
        fail(found[0], [(n, split[n] + i) for n, i in found[1]])
    for n, stream in remainder.streams.items():
        for i, instr in enumerate(stream):
            if instr.peer is not None and instr.peer not in remainder.streams:
                fail(f"node {n} {instr} talks to failed node {instr.peer}", [(n, split[n] + i)])
    try:
        check_execution(remainder.streams, posted_before(plan.executed),
                        received_ahead({n: plan.executed[n] for n in survivors}))
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
