"""Schedule generators (GPipe, 1F1B) and the redundant-computation pass.

`gpipe(P, M)` and `one_f_one_b(P, M)` give a plain fault-free schedule. `add_redundancy(schedule,
mode)` is a pure pass that makes node ``n`` also work for stage ``(n + 1) % P``:

- ``lflb``: node n stashes the replica's input (its own output of microbatch k) right after
  computing it; nothing else runs until a failure. Stage 0's input is simply re-loaded on failure.
- ``eflb``: node n runs FRC of stage n+1 for every microbatch, in its bubbles: the linearizer gives
  redundant work the lowest priority, so it fills the time the node would otherwise wait before
  talking to its successor (FRC of k-1 lands next to the forward of k). Each FRC is followed by the
  swap-out of its stash. The last node shadows stage 0 and loads that stage's input itself.
- ``efeb``: as eflb, plus BRC of stage n+1 for every microbatch (swap-in, then BRC) once the
  gradient w.r.t. the replica's output has arrived (node n+2 sends it to node n as well as to n+1).

With any redundancy, every stage sends its reduced gradients to its shadow after the all-reduce
(``SY``/``RY``), and the shadow applies the identical optimizer step to the replica.
"""

from __future__ import annotations

import attrs
from bamboo.schedule._gc import gc_paused
from bamboo.schedule._linearize import busy_intervals, linearize
from bamboo.schedule._tasks import (
    CostFn,
    Work,
    build_lanes,
    compute_order,
    replica_lane,
    unit_cost,
)
from bamboo.schedule.fill import fill_idle
from bamboo.schedule.ir import COMPUTE_KINDS, Kind, RCMode, Schedule

__all__ = ["add_redundancy", "generate", "gpipe", "one_f_one_b"]

_FILLED = (RCMode.LFLB, RCMode.EFLB)
"""Modes whose redundant work is local to the shadow: placed into the plain schedule's idle time (`fill_idle`)."""


def _check_shape(stages: int, microbatches: int) -> None:
    if not isinstance(stages, int) or stages < 1:
        raise ValueError(f"stages must be an int >= 1, got {stages!r}")
    if not isinstance(microbatches, int) or microbatches < 1:
        raise ValueError(f"microbatches must be an int >= 1, got {microbatches!r}")


def _mode(rc: RCMode | str) -> RCMode:
    try:
        return RCMode(rc) if isinstance(rc, str) else rc
    except ValueError:
        raise ValueError(f"unknown redundancy mode {rc!r}; expected one of none, lflb, eflb, efeb") from None


def _build(lanes_of: dict[int, list[list[Work]]], schedule: Schedule, cost: CostFn) -> Schedule:
    """Streams for the lanes; redundant work (any lane after a node's first) only where it delays nothing."""
    placement, P = schedule.placement, schedule.stages
    lanes = build_lanes(lanes_of, placement, P, cost)
    busy = None
    if any(len(node_lanes) > 1 for node_lanes in lanes.values()):
        busy = busy_intervals({n: node_lanes[:1] for n, node_lanes in lanes.items()})
    return Schedule(P, schedule.microbatches, schedule.policy, schedule.rc, placement, linearize(lanes, busy))


@gc_paused
def _fault_free(policy: str, stages: int, microbatches: int, rc: RCMode | str, cost: CostFn,
                refine: bool = False) -> Schedule:
    _check_shape(stages, microbatches)
    mode = _mode(rc)
    if mode is not RCMode.NONE and stages < 2:
        raise ValueError(f"redundancy needs at least 2 stages, got {stages}")
    if mode in _FILLED:
        return fill_idle(_fault_free(policy, stages, microbatches, RCMode.NONE, cost), mode, cost, refine=refine)
    lanes: dict[int, list[list[Work]]] = {}
    for s in range(stages):
        lanes[s] = [[*compute_order(policy, stages, microbatches, s), ("TAIL", s)]]
        if mode is not RCMode.NONE:
            lanes[s].append(replica_lane(policy, stages, microbatches, (s + 1) % stages, mode))
    empty = Schedule(stages, microbatches, policy, mode, tuple(range(stages)), {})
    return _build(lanes, empty, cost)


def gpipe(stages: int, microbatches: int, rc: RCMode | str = RCMode.NONE, cost: CostFn = unit_cost, *,
          refine: bool = False) -> Schedule:
    """GPipe: every stage runs all forwards, then all backwards, then all-reduce and optimizer step. ``refine``:
    see :func:`generate`."""
    return _fault_free("gpipe", stages, microbatches, rc, cost, refine)


def one_f_one_b(
    stages: int, microbatches: int, rc: RCMode | str = RCMode.NONE, cost: CostFn = unit_cost, *, refine: bool = False
) -> Schedule:
    """1F1B (PipeDream-flush): stage s runs min(P-1-s, M) warm-up forwards, then alternates F and B. ``refine``:
    see :func:`generate`."""
    return _fault_free("1f1b", stages, microbatches, rc, cost, refine)


def generate(
    policy: str, stages: int, microbatches: int, rc: RCMode | str = RCMode.NONE, cost: CostFn = unit_cost, *,
    refine: bool = False,
) -> Schedule:
    """``gpipe`` or ``one_f_one_b`` by name (``"gpipe"`` or ``"1f1b"``).

    ``refine``: with a cost model, let ``lflb``/``eflb``'s placement search for where its redundant work ends the
    iteration soonest (:func:`bamboo.schedule.fill.fill_idle`). It costs up to seconds (about 0.2 s at P=4 M=8,
    10 s at P=16 M=128), so it is asked for where a schedule is studied (``bamboo-schedule show``, the overhead
    sweep), not where one is needed at once (``choose_redundancy`` at every layout, the runtime)."""
    if policy == "gpipe":
        return gpipe(stages, microbatches, rc, cost, refine=refine)
    if policy == "1f1b":
        return one_f_one_b(stages, microbatches, rc, cost, refine=refine)
    raise ValueError(f"unknown policy {policy!r}; expected '1f1b' or 'gpipe'")


def _main_lane(schedule: Schedule, node: int) -> list[Work]:
    """A node's own compute order, read back from its stream (forwards, backwards, then tails)."""
    work: list[Work] = []
    tails: list[Work] = []
    for instr in schedule.streams[node]:
        if instr.kind is Kind.FORWARD:
            work.append(("F", instr.stage, instr.microbatch))
        elif instr.kind is Kind.BACKWARD:
            work.append(("B", instr.stage, instr.microbatch))
        elif instr.kind is Kind.ALLREDUCE:
            tails.append(("TAIL", instr.stage))
    return work + tails


@gc_paused
def add_redundancy(schedule: Schedule, rc: RCMode | str, cost: CostFn = unit_cost) -> Schedule:
    """The pass: ``schedule`` (plain, fault-free) with node n also covering stage (n+1) % P under ``rc``.

    The nodes' own compute order is kept; the redundant work goes in a lowest-priority lane and all
    sends/receives are placed again so that the result still cannot deadlock.
    """
    mode = _mode(rc)
    if schedule.rc is not RCMode.NONE:
        raise ValueError(f"add_redundancy needs a plain schedule, got one with rc={schedule.rc.value}")
    if mode is RCMode.NONE:
        return schedule
    if schedule.placement != tuple(range(schedule.stages)):
        raise ValueError(f"add_redundancy needs the fault-free placement, got {schedule.placement}")
    if schedule.stages < 2:
        raise ValueError(f"redundancy needs at least 2 stages, got {schedule.stages}")
    if any(i.kind in COMPUTE_KINDS - {Kind.FORWARD, Kind.BACKWARD} for s in schedule.streams.values() for i in s):
        raise ValueError("add_redundancy needs a schedule without redundant work")
    if mode in _FILLED:
        return fill_idle(schedule, mode, cost)
    P, M = schedule.stages, schedule.microbatches
    lanes = {
        node: [_main_lane(schedule, node), replica_lane(schedule.policy, P, M, (node + 1) % P, mode)]
        for node in range(P)
    }
    return _build(lanes, attrs.evolve(schedule, rc=mode), cost)
