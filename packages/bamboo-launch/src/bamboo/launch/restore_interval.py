"""``--checkpoint-every auto`` and ``--memory-copy-every auto``: the steps between a generation's restore points.

A restore point (the in-memory copies of every stage and, with a checkpoint folder, a checkpoint) costs time at
every step boundary that takes one, and saves time at every restore: the steps after the newest point are
trained again. At ``r`` restores a second, a point every ``T`` seconds that costs ``C`` seconds loses about
``C / T + r * T / 2`` seconds a second, which is least at ``T = sqrt(2 C / r)`` (Young's rule, as the
checkpoint/restart baseline's interval). Whoever decides a layout (:mod:`bamboo.launch.redundancy`) puts the
interval in steps in it (``JobLayout.restore_every``), from

- ``r``: the job's preemption rate (:func:`bamboo.launch.redundancy.observed_rate`, the same as ``--redundancy
  auto`` uses) times the layout's nodes. Every preemption counts as one that may need a restore, although only
  the loss of every live copy of a stage does: the interval errs short, towards more copies;
- ``C``: :func:`measured_boundary`, from the job's step records: the median step interval (from one ``step``
  record's ``t`` to the next's, in one generation) that held a restore point, less the median of those that did
  not, which counts the clones on the training thread and the serialising and sending that slow the next step;
  before any, :data:`ASSUMED_BOUNDARY_STEPS` steps;
- the step: the median of the step intervals that held no restore point, or the one ``auto`` assumed.

The interval is at least one step and at most :data:`~bamboo.launch.timeouts.RESTORE_EVERY_MAX_S` of steps. A
job's first layout knows no step of its own yet, so it assumes one of ``bamboo.rc.timeouts.ASSUMED_STEP_S`` and
takes at least :data:`UNMEASURED_MIN_STEPS`; every later layout (a reconfiguration, a restart) measures it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable

import attrs
from bamboo.launch.event_records import Event, Step
from bamboo.launch.timeouts import RESTORE_EVERY_MAX_S

__all__ = ["ASSUMED_BOUNDARY_STEPS", "UNMEASURED_MIN_STEPS", "BoundaryCost", "RestoreInterval", "choose_restore_every",
           "measured_boundary"]

ASSUMED_BOUNDARY_STEPS = 1.0
"""What a restore point costs before a job measured it, in steps: measured 0.7 to 0.85 of a step in the emulated
6-node P = 3, D = 2 job (the in-memory copies of every stage and a checkpoint, on two cores)."""

UNMEASURED_MIN_STEPS = 10
"""The fewest steps between restore points that ``auto`` chooses before a job measured its step (its first
layout): the fixed default's interval (``MEMORY_COPY_EVERY``). Young's rule in steps grows as the step shrinks, and
the assumed step (``ASSUMED_STEP_S``, 1 s) is longer than many: the emulated job's is about 0.09 s, for which
the rule with the assumed step gave 6 steps where the measured step gives about 19."""

SECONDS_PER_HOUR = 3600.0


@attrs.frozen
class BoundaryCost:
    """What the step records say of restore points: the extra seconds of an interval holding one (``cost_s``),
    the median interval without one (``step_s``), and how many intervals of each kind gave them."""

    cost_s: float
    step_s: float
    with_point: int
    without: int


def measured_boundary(events: Iterable[Event]) -> BoundaryCost | None:
    """The cost of a restore point measured in the job's ``step`` records (see the module docstring): the newest
    generation that has step intervals of both kinds; None before any. Each step's first record counts."""
    by_generation: dict[int | None, dict[int, Step]] = {}
    for event in sorted((e for e in events if isinstance(e, Step)), key=lambda e: e.t):
        by_generation.setdefault(event.generation, {}).setdefault(event.step, event)
    for generation in sorted(by_generation, key=lambda g: -1 if g is None else g, reverse=True):
        steps = by_generation[generation]
        holding, plain = [], []
        for number, record in steps.items():
            after = steps.get(number + 1)
            if after is not None and after.t > record.t:
                (holding if record.restore_point else plain).append(after.t - record.t)
        if holding and plain:
            step_s = statistics.median(plain)
            return BoundaryCost(cost_s=max(0.0, statistics.median(holding) - step_s), step_s=step_s,
                                with_point=len(holding), without=len(plain))
    return None


@attrs.frozen
class RestoreInterval:
    """The steps between a generation's restore points (``steps``), and why, in one line (``reason``)."""

    steps: int = attrs.field(validator=attrs.validators.and_(attrs.validators.instance_of(int),
                                                             attrs.validators.ge(1)))
    reason: str


def choose_restore_every(rate_per_node_hour: float, nodes: int, step_s: float,
                         boundary: BoundaryCost | None, *, step_assumed: bool = False) -> RestoreInterval:
    """Young's rule for a layout of ``nodes`` nodes at ``rate_per_node_hour`` preemptions per node-hour whose
    step is ``step_s`` seconds (used when ``boundary`` measured none); ``boundary`` None: a point costs
    :data:`ASSUMED_BOUNDARY_STEPS` steps. ``step_assumed``: ``step_s`` was not measured either; a step shorter
    than assumed would make the rule's interval longer in steps, so it is then at least
    :data:`UNMEASURED_MIN_STEPS`."""
    floor = 1
    if boundary is not None:
        step_s = boundary.step_s
    elif step_assumed:
        floor = UNMEASURED_MIN_STEPS
    if not (step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"step_s must be a positive number of seconds, got {step_s!r}")
    if boundary is None:
        cost_s, cost = ASSUMED_BOUNDARY_STEPS * step_s, f"an assumed {ASSUMED_BOUNDARY_STEPS:g} step"
    else:
        cost_s = boundary.cost_s
        cost = f"{cost_s:.3f} s measured over {boundary.with_point} boundaries"
    restores_per_s = max(0.0, rate_per_node_hour) * nodes / SECONDS_PER_HOUR
    interval_s = RESTORE_EVERY_MAX_S
    if restores_per_s > 0:
        interval_s = min(interval_s, math.sqrt(2.0 * cost_s / restores_per_s))
    longest = max(1, math.floor(RESTORE_EVERY_MAX_S / step_s))
    steps = max(floor, min(round(interval_s / step_s), longest))
    assumed = "an assumed " if floor > 1 else ""
    bound = f" (at least {floor} before a step is measured)" if floor > 1 and steps == floor else ""
    return RestoreInterval(steps=steps, reason=(
        f"every {steps} steps of {assumed}{step_s:.3f} s{bound}: a restore point costs {cost}, at "
        f"{rate_per_node_hour:g} preemptions per node-hour on {nodes} nodes"))
