"""Which redundancy mode pays: the expected throughput of each mode for a step profile and a preemption rate.

`choose_redundancy(costs, stages, microbatches, step_s, failures)` is what ``--redundancy auto`` runs. For each mode
it estimates, per hour of wall time, the seconds of training lost against a run with no redundancy and no
failures, and picks the mode that loses least:

- **the fault-free step**: the simulator's makespan of the mode's schedule for ``costs`` (`simulate`), scaled so
  that ``none`` takes the measured ``step_s``;
- **each preemption** (``preemptions_per_node_hour · nodes`` an hour) costs, with redundancy: the detection
  (``detect_s``), the extra time of the iteration that fails over (the simulator's failing iteration against
  the fault-free one, for a failure of the middle stage halfway through its stream), the slower merged schedule
  until the reconfiguration that rebuilds redundancy (``rebuild_after_s``), and that reconfiguration's pause
  (``reconfigure_s``); with probability ``1 - exp(-2 · rate · rebuild_after_s / 3600)`` (a Poisson arrival at
  either neighbour in the shadow ring before then) a second loss costs what a failure without redundancy costs.
  That probability stays below one at any rate, so redundancy keeps the edge it has (the failures it does
  absorb) where failures come faster than redundancy is rebuilt, instead of tying with ``none``;
- **without redundancy** a preemption in a job of one pipeline costs a restore from the newest checkpoint
  (``restore_s``) and the work since it (half the checkpoint interval, on average), and with no spare node
  (``pipelines``, ``spare_nodes``) it stops until a replacement starts (``rebuild_after_s``), where a redundant mode
  trains on through its merged schedule meanwhile. With other pipelines (``pipelines >= 2``) the lost stage's
  state is held by its data-parallel peers: the survivors meet at a barrier and take it from a peer
  (``reconfigure_s``), the step in flight is trained again (half a step, on average), and without a spare node
  one pipeline's share of the training is lost until a replacement starts (``rebuild_after_s / pipelines``); only
  when that stage's peer in every other pipeline is lost too before then (probability ``(1 - exp(-rate ·
  rebuild_after_s / 3600)) ** (pipelines - 1)``) does it cost a restore.

A mode whose fault-free step the job has measured at the layout's pipelines (``measured_steps``) takes that step
instead of the simulated proportion: the simulator prices what the schedule places (FRC, the bubbles), not what a
mode costs where it runs (a replica's optimizer step and sync on cores that the nodes share cost the emulated
6- and 8-node jobs 16% to 33% of their throughput, where the model sees none).

A mode's expected step is its fault-free step stretched by the preemptions' time, ``step · (1 + rate · loss /
3600)``, and what it loses per hour is ``3600 · (1 - step_none / expected step)`` (the throughput it gives up
against ``none`` without failures). A loss of more than the hour itself still ranks the modes.

Only the ratios of the simulated makespans are used, so the costs need the right proportions (per-instruction
times measured on the job, or the defaults), not the right units. The choice is deterministic: the same inputs
give the same mode everywhere, which is what lets every node of a job derive it on its own.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import attrs
from attrs import validators
from bamboo.schedule.cut import progress_at
from bamboo.schedule.engine import execute
from bamboo.schedule.failover import failover_schedule
from bamboo.schedule.failover_plan import merged_schedule
from bamboo.schedule.generate import generate
from bamboo.schedule.ir import RCMode
from bamboo.schedule.simulate import Costs, StageCost, simulate
from bamboo.schedule.timeouts import (
    CHECKPOINT_INTERVAL_S,
    DETECT_S,
    REBUILD_AFTER_S,
    RECONFIGURE_S,
    RESTORE_S,
    SECONDS_PER_HOUR,
)

__all__ = ["FailureModel", "ModeEstimate", "RedundancyChoice", "choose_redundancy", "stage_work_costs"]

_NON_NEGATIVE = validators.ge(0.0)


@attrs.frozen
class FailureModel:
    """How often nodes are lost and what the system's reactions cost, in seconds (defaults: this system's
    measured order of magnitude on a small job; every one is a knob)."""

    preemptions_per_node_hour: float = attrs.field(validator=_NON_NEGATIVE)
    """The preemption rate of one node: the market's, or the job's own history."""
    nodes: int = attrs.field(validator=validators.ge(1))
    """Nodes of the job (stages x pipelines)."""
    detect_s: float = attrs.field(default=DETECT_S, validator=_NON_NEGATIVE)
    """From a kill to every survivor of the pipeline knowing the confirmed failure."""
    reconfigure_s: float = attrs.field(default=RECONFIGURE_S, validator=_NON_NEGATIVE)
    """The pause of the reconfiguration that rebuilds redundancy after a failover."""
    rebuild_after_s: float = attrs.field(default=REBUILD_AFTER_S, validator=_NON_NEGATIVE)
    """How long a pipeline runs its merged schedule before that reconfiguration (a replacement node's start)."""
    restore_s: float = attrs.field(default=RESTORE_S, validator=_NON_NEGATIVE)
    """A restart from the newest checkpoint, when a stage has no live copy."""
    checkpoint_interval_s: float = attrs.field(default=CHECKPOINT_INTERVAL_S, validator=validators.gt(0.0))
    """Time between checkpoints; a restore redoes half of it on average."""
    pipelines: int = attrs.field(default=1, validator=validators.ge(1))
    """Data-parallel pipelines of the layout."""
    spare_nodes: int = attrs.field(default=0, validator=validators.ge(0))
    """Nodes on standby, ready to take a lost node's place at once."""

    @property
    def preemptions_per_hour(self) -> float:
        return self.preemptions_per_node_hour * self.nodes

    def without_redundancy_s(self, step_s: float) -> float:
        """What a loss costs under ``none`` (see the module docstring): :attr:`unprotected_s` with one pipeline;
        with more, a barrier that takes the lost stage from a data-parallel peer, unless every peer is lost too."""
        if self.pipelines == 1:
            return self.unprotected_s
        every_peer = (-math.expm1(-self.preemptions_per_node_hour * self.rebuild_after_s / SECONDS_PER_HOUR)
                      ) ** (self.pipelines - 1)
        short = self.rebuild_after_s / self.pipelines if self.spare_nodes == 0 else 0.0
        from_peer = self.reconfigure_s + step_s / 2 + short
        return (1 - every_peer) * from_peer + every_peer * self.unprotected_s

    @property
    def unprotected_s(self) -> float:
        """What a loss that no shadow absorbs costs: a restore from the newest copy and the work since it; and in
        a job of one pipeline with no spare node, the wait for a replacement, during which nothing trains (with
        a spare, it takes the place at once; with other pipelines, they train on)."""
        wait = self.rebuild_after_s if self.pipelines == 1 and self.spare_nodes == 0 else 0.0
        return self.restore_s + self.checkpoint_interval_s / 2 + wait


@attrs.frozen
class ModeEstimate:
    """What one mode is expected to cost. Seconds lost are per hour of wall time, against a run with no
    redundancy and no failures."""

    mode: str
    step_s: float
    overhead_pct: float
    """The fault-free step's increase over `none`'s."""
    per_failure_s: float
    """Seconds lost per preemption."""
    lost_s_per_hour: float
    """Overhead and preemptions together."""

    def as_dict(self) -> dict[str, float | str]:
        return {"mode": self.mode, "step_s": round(self.step_s, 6), "overhead_pct": round(self.overhead_pct, 3),
                "per_failure_s": round(self.per_failure_s, 3), "lost_s_per_hour": round(self.lost_s_per_hour, 3)}


@attrs.frozen
class RedundancyChoice:
    """The mode to run and why: every candidate's estimate, the chosen one first."""

    mode: str
    estimates: tuple[ModeEstimate, ...]
    failures: FailureModel

    @property
    def reason(self) -> str:
        """One line: the rate it assumed and each mode's expected loss per hour."""
        losses = ", ".join(f"{e.mode} {e.lost_s_per_hour:.1f} s" for e in self.estimates)
        return (f"{self.mode}: least training lost per hour at {self.failures.preemptions_per_node_hour:g} "
                f"preemptions per node-hour on {self.failures.nodes} nodes ({losses})")

    def as_dict(self) -> dict[str, object]:
        return {"mode": self.mode, "reason": self.reason,
                "preemptions_per_node_hour": self.failures.preemptions_per_node_hour, "nodes": self.failures.nodes,
                "estimates": [e.as_dict() for e in self.estimates]}


def _failover_costs(costs: Costs, policy: str, stages: int, microbatches: int, rc: RCMode) -> tuple[float, float]:
    """(the failing iteration's extra time, the merged schedule's makespan), in the costs' unit, when the middle
    stage fails halfway through its stream."""
    cost = costs.linearizer_cost()
    duration = costs.duration(rc, stages)
    schedule = generate(policy, stages, microbatches, rc, cost)
    fault_free = execute(schedule.streams, duration)
    victim = stages // 2
    progress = progress_at(schedule, {victim: len(schedule.streams[victim]) // 2}, fault_free)
    plan = failover_schedule(schedule, [victim], progress, cost)
    streams = dict(plan.iteration_streams())
    streams[victim] = plan.executed.get(victim, ())  # what the victim ran before it died
    failing = execute(streams, duration).makespan
    merged = execute(merged_schedule(schedule, [victim], cost).streams, duration).makespan
    return max(0.0, failing - fault_free.makespan), merged


def stage_work_costs(work: Sequence[float]) -> Costs:
    """Costs in the proportions of each stage's compute ``work`` (any unit: a parameter count, FLOPs): a
    forward of ``work``, a backward of twice that, relative to the largest stage. No transfer or optimizer
    time: only the ratios of the makespans matter to `choose_redundancy`."""
    if not work or any(w < 0 for w in work):
        raise ValueError(f"work must be one non-negative figure per stage, got {list(work)}")
    largest = max(work) or 1.0
    stages = tuple(StageCost(forward_ms=w / largest, backward_ms=2 * w / largest, optimizer_ms=0.0,
                             activation_mb=0.0, stash_mb=0.0, grad_mb=0.0) for w in work)
    return Costs(default=stages[0], stages=stages, latency_ms=0.0)


def choose_redundancy(
    costs: Costs,
    stages: int,
    microbatches: int,
    step_s: float,
    failures: FailureModel,
    policy: str = "1f1b",
    modes: Sequence[str] = ("none", "lflb", "eflb", "efeb"),
    measured_mode: str = "none",
    measured_steps: Mapping[str, float] | None = None,
) -> RedundancyChoice:
    """The mode among ``modes`` that is expected to lose the least training per hour (see the module docstring).

    ``step_s`` is the measured fault-free step (seconds) of ``measured_mode`` (default ``none``: a job that
    measured its step under another mode gives that one, and ``none``'s step is inferred from the simulated
    ratio); ``costs`` give the proportions of the instructions. ``measured_steps`` (mode -> seconds) are the
    fault-free steps the job measured for this layout's shape: each one replaces its mode's simulated step (and
    ``none``'s is the reference every loss is counted against). Redundancy needs ``stages >= 2``; with one stage
    only ``none`` is considered here (pure data parallelism has its own ring). Ties go to the mode listed first.
    """
    if step_s <= 0:
        raise ValueError(f"step_s must be > 0, got {step_s!r}")
    candidates = [m for m in modes if m == "none" or stages >= 2]
    if not candidates:
        raise ValueError(f"no redundancy mode to choose from among {list(modes)} with {stages} stage(s)")
    plain = simulate(generate(policy, stages, microbatches, "none", costs.linearizer_cost()), costs).makespan
    if RCMode(measured_mode) is not RCMode.NONE and stages >= 2:
        measured = simulate(generate(policy, stages, microbatches, RCMode(measured_mode), costs.linearizer_cost()),
                            costs).makespan
        step_s = step_s * plain / measured  # none's step, in the measured mode's proportion
    scale = step_s / plain
    measured_steps = {mode: float(seconds) for mode, seconds in (measured_steps or {}).items() if seconds > 0}
    step_s = measured_steps.get("none", step_s)
    rate = failures.preemptions_per_hour
    unprotected = failures.unprotected_s
    consecutive = -math.expm1(-2.0 * failures.preemptions_per_node_hour * failures.rebuild_after_s / SECONDS_PER_HOUR)
    estimates = []
    for mode in candidates:
        rc = RCMode(mode)
        if rc is RCMode.NONE:
            makespan, per_failure = plain, failures.without_redundancy_s(step_s)
        else:
            makespan = simulate(generate(policy, stages, microbatches, rc, costs.linearizer_cost()), costs).makespan
            extra, merged = _failover_costs(costs, policy, stages, microbatches, rc)
            degraded = failures.rebuild_after_s * max(0.0, merged / makespan - 1.0)
            recovered = failures.detect_s + scale * extra + degraded + failures.reconfigure_s
            per_failure = (1 - consecutive) * recovered + consecutive * unprotected
        mode_step = measured_steps.get(mode, makespan * scale)
        expected_step = mode_step * (1.0 + rate * per_failure / SECONDS_PER_HOUR)  # failures' time spread over the steps
        lost = SECONDS_PER_HOUR * (1.0 - step_s / expected_step)
        estimates.append(ModeEstimate(mode, mode_step, 100.0 * (mode_step / step_s - 1.0), per_failure, lost))
    best = min(estimates, key=lambda e: (e.lost_s_per_hour, candidates.index(e.mode)))
    ordered = (best, *[e for e in estimates if e is not best])
    return RedundancyChoice(best.mode, ordered, failures)
