"""The trace-driven discrete-event simulator: throughput, cost and value of a training job on spot.

One run replays a stream of spot events (a `Trace`, or the endless synthetic stream) against one
strategy, and integrates the training progress between events: while the job runs with a given
configuration its throughput is constant, so no per-step events are needed. Strategies:

- ``bamboo``: the system's policy (``bamboo.bench.policy``, which is bamboo-reconfig's ``decide`` and
  ``plan_layout`` on integers). A preempted node's shadow (its predecessor in the pipeline) takes over
  after `failover_pause_s`; while any stage is taken over, steps are `fallback_slowdown` times slower.
  Losing a stage together with its shadow is a *fatal failure*: the job re-forms at once after a global
  rendezvous, and it rolls back to the last checkpoint only if some stage has no copy left in any
  pipeline. At the end of the step in progress it reconfigures (local rendezvous plus `reconfiguration_s`)
  after any failover, to rebuild redundancy, and when the waiting nodes let more pipelines run. Every
  layout is the planner's: depth P, ``min(D, usable // P)`` pipelines, the fewest same-zone neighbours,
  holders kept at their stages, the rest on standby.
- Pure data parallelism (a profile with P = 1): every node is one replica, and the replicas form one ring;
  a replica's shadow is its ring successor, which also computes its share (eager: overbatching). Losing a
  replica whose ring neighbours are alive is a failover like any other (the pause, then the rebuild at the
  step boundary); losing one next to a lost one is the consecutive failure (fatal): the job re-forms after a
  global rendezvous, and rolls back to the checkpoint only if no replica is left. The ring is placed by
  ``policy.plan_replica_ring`` (bamboo-reconfig plans P >= 2 only).
- ``checkpoint``: every preemption of a working node restarts the job (global rendezvous plus
  `restart_s`) from the last checkpoint; new nodes that allow another pipeline trigger a restart
  after a fresh checkpoint (no rollback). With a profile's ``checkpoint_restart_on_join`` of
  ``every-join`` (torchrun's elastic agents), every node that joins (also while a restart is under way, which
  then starts over) restarts the job from the last
  checkpoint instead, whether or not it allows another pipeline.
- ``sample-dropping``: a pipeline that loses a node drops out (its samples are dropped, the others
  go on) until a reconfiguration re-forms pipelines (placed by the same planner); when no pipeline is
  left it re-forms after a global rendezvous, rolling back only if some stage lost every copy.
- ``on-demand``: the profile's on-demand cluster, never preempted, at on-demand prices; it trains from
  ``on_demand_startup_s`` on (0 by default) and is billed from the start.

A profile's ``timing.startup_s`` (measured profiles set it) replaces the first start: the nodes present at
time 0 are ready at once and the first layout forms ``startup_s`` after the start, instead of after
`instance_creation_s` and the global rendezvous (which every later start still takes).

How many of a trace's instances a strategy holds: by default every one (the published simulator's replay,
and what the emulated cluster does). With ``desired_nodes`` (``simulate --trace --hold desired``), a
strategy asks the market for its own cluster only, as in the synthetic model: it takes a trace's new
instance only while it holds fewer than `desired_nodes`, and never the declined ones later (a replacement
is the trace's next new instance). This matters where the strategies want clusters of different sizes
(the pure data-parallel profiles): without it, a strategy that wants 20 nodes is billed for every node
of a 32-node trace.

Periodic checkpoints that stop training (``timing.checkpoint_s``) slow every spot strategy's progress by
the share of training time they take, ``checkpoint_s / checkpoint_interval_s``.

The strategies without redundancy (checkpoint, sample dropping) run on the profile's cluster without
redundancy (``ModelProfile.pipelines_for(redundancy=False)`` and its step times), Bamboo on the profile's own.

Outputs per run (`RunResult`) and averaged over seeds (`average_results`).
"""

from __future__ import annotations

import enum
import heapq
import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import attrs
import numpy as np
from bamboo.bench.policy import (
    NOT_A_HOLDER,
    decision,
    is_consecutive_failure,
    is_consecutive_replica_failure,
    plan_placement,
    plan_replica_ring,
    reconfigures,
    system_view,
)
from bamboo.bench.profile import ModelProfile
from bamboo.bench.synthetic import SyntheticSpec, SyntheticTraceGenerator
from bamboo.bench.trace import Trace
from bamboo.reconfig import ClusterView, InfeasibleSplit, Reason, When, decide, plan_layout

__all__ = [
    "AveragedResult",
    "Policy",
    "PolicyMismatch",
    "RunResult",
    "Strategy",
    "Timeline",
    "average_results",
    "holding_at_most",
    "run_many",
    "simulate_run",
    "simulate_synthetic",
]


class Strategy(enum.Enum):
    """How a training job reacts to preemptions."""

    BAMBOO = "bamboo"
    CHECKPOINT = "checkpoint"
    ON_DEMAND = "on-demand"
    SAMPLE_DROPPING = "sample-dropping"

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """The strategy named `text` (``bamboo``, ``checkpoint``, ``on-demand``, ``sample-dropping``)."""
        try:
            return cls(text.strip())
        except ValueError:
            raise ValueError(f"unknown strategy {text!r}; choose from {', '.join(s.value for s in cls)}") from None


@attrs.frozen
class Policy:
    """What the simulated cluster tells the planner about zones.

    `zone_aware` (default): nodes report their zones, and the planner (bamboo-reconfig's ``plan_layout``)
    keeps neighbouring stages in different zones wherever the zones allow. ``zone_aware=False`` is the same
    planner on a view where every node is in one zone, as when nodes register without a zone (the launcher
    files them all under ``default``): the ablation of zone-aware placement. The reconfiguration decisions
    are the system's (``bamboo.reconfig.decide``) and have no knob.
    """

    zone_aware: bool = True


class PolicyMismatch(AssertionError):
    """``check_policy``: the simulator's placement or decision differs from bamboo-reconfig's on the same state."""


@attrs.frozen
class Timeline:
    """Step functions over a run: after `time_s[i]`, `nodes[i]` allocated nodes and throughput `rate[i]` samples/s."""

    time_s: np.ndarray
    nodes: np.ndarray
    rate: np.ndarray


@attrs.frozen
class RunResult:
    """The outcome of one simulated run.

    `interval_h` is the mean time between consecutive preemptions (NaN with fewer than two);
    `lifetime_h` the mean lifetime of the instances (survivors count until the end); `nodes` the
    time-averaged allocated nodes; `throughput` trained samples per second of wall time (rolled
    back work does not count); `cost_per_hour` the mean $/h; `value` = throughput / cost_per_hour;
    `progress_share` the share of wall time spent on training steps that were kept.
    """

    strategy: Strategy
    completed: bool
    duration_h: float
    samples: float
    preemptions: int
    interval_h: float
    lifetime_h: float
    fatal_failures: int
    reconfigurations: int
    nodes: float
    throughput: float
    cost_per_hour: float
    value: float
    progress_share: float
    timeline: Timeline | None = attrs.field(default=None, repr=False)

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict (NaN becomes None)."""
        out: dict[str, object] = {}
        for field in attrs.fields(RunResult):
            if field.name == "timeline":
                continue
            value = getattr(self, field.name)
            if isinstance(value, Strategy):
                value = value.value
            elif isinstance(value, float):
                value = None if math.isnan(value) else round(value, 6)
            out[field.name] = value
        return out


@attrs.frozen
class AveragedResult:
    """Means over several runs of one strategy (NaN intervals are left out of the interval mean)."""

    strategy: Strategy
    runs: int
    completed_runs: int
    duration_h: float
    preemptions: float
    interval_h: float
    lifetime_h: float
    fatal_failures: float
    nodes: float
    throughput: float
    cost_per_hour: float
    value: float
    progress_share: float

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict (NaN becomes None)."""
        out: dict[str, object] = {}
        for field in attrs.fields(AveragedResult):
            value = getattr(self, field.name)
            if isinstance(value, Strategy):
                value = value.value
            elif isinstance(value, float):
                value = None if math.isnan(value) else round(value, 6)
            out[field.name] = value
        return out


def average_results(results: Sequence[RunResult]) -> AveragedResult:
    """Average per-run results (all of one strategy)."""
    if not results:
        raise ValueError("average_results needs at least one result")
    strategies = {r.strategy for r in results}
    if len(strategies) != 1:
        raise ValueError(f"average_results mixes strategies {sorted(s.value for s in strategies)}")

    def mean(name: str) -> float:
        values = np.array([getattr(r, name) for r in results], dtype=np.float64)
        values = values[~np.isnan(values)]
        return float(values.mean()) if len(values) else math.nan

    return AveragedResult(
        strategy=results[0].strategy,
        runs=len(results),
        completed_runs=sum(r.completed for r in results),
        duration_h=mean("duration_h"),
        preemptions=mean("preemptions"),
        interval_h=mean("interval_h"),
        lifetime_h=mean("lifetime_h"),
        fatal_failures=mean("fatal_failures"),
        nodes=mean("nodes"),
        throughput=mean("throughput"),
        cost_per_hour=mean("cost_per_hour"),
        value=mean("value"),
        progress_share=mean("progress_share"),
    )


# Node states and job phases (plain ints: this is the hot loop). A registered node is an owner of the
# current layout when it is in `slot_of`, and waiting (standby) when it is in `ready`.
_CREATING, _REGISTERED = 0, 1
_STOPPED, _RUNNING, _PAUSED = 0, 1, 2
# Internal event kinds.
_EV_READY, _EV_PAUSE_END, _EV_DECIDE = 0, 1, 2


class _Run:
    """One run of one strategy; `run()` walks the merged external and internal events."""

    def __init__(
        self,
        profile: ModelProfile,
        strategy: Strategy,
        policy: Policy,
        target_samples: float,
        until_s: float,
        record: bool,
        check_policy: bool = False,
    ) -> None:
        self.profile = profile
        self.strategy = strategy
        self.policy = policy
        self.check_policy = check_policy
        if check_policy and (strategy is not Strategy.BAMBOO or profile.stages < 2):
            raise ValueError(
                f"check_policy compares the bamboo strategy with bamboo-reconfig, which plans pipelines of at "
                f"least 2 stages; got strategy {strategy.value!r} with {profile.stages} stage(s)"
            )
        self.timing = profile.timing
        self.stages = profile.stages
        redundancy = strategy is Strategy.BAMBOO
        self.max_pipelines = profile.pipelines_for(redundancy)
        self.step_s = [0.0] + [profile.step_time_s(d, redundancy=redundancy) for d in range(1, self.max_pipelines + 1)]
        # Synchronous checkpoints take this share of the time spent training.
        self.progress_factor = 1.0 - self.timing.checkpoint_share
        self.restart_on_every_join = (
            strategy is Strategy.CHECKPOINT and profile.checkpoint_restart_on_join == "every-join"
        )
        # Whether a layout has formed yet (until then a profile's startup_s times the first start).
        self.formed_once = False
        self.target = target_samples
        self.until_s = until_s
        self.record = record
        # Clock and progress.
        self.t = 0.0
        self.samples = 0.0
        self.run_clock = 0.0
        self.wasted_run = 0.0
        self.ckpt_samples = 0.0
        self.ckpt_clock = 0.0
        self.ckpt_wall = 0.0
        self.next_ckpt = self.timing.checkpoint_interval_s
        self.node_seconds = 0.0
        # Nodes. `owners` is the current layout (dead owners included; empty before the first one),
        # `slot_of` its live owners, `dead` its lost slots, `ready` the live nodes outside it (standby).
        self.zone_of: dict[int, int] = {}
        self.start_of: dict[int, float] = {}
        self.state: dict[int, int] = {}
        self.registered: set[int] = set()
        self.owners: list[list[int]] = []
        self.slot_of: dict[int, tuple[int, int]] = {}
        self.ready: set[int] = set()
        self.dead: set[tuple[int, int]] = set()
        self.broken: set[int] = set()
        self.allocated = 0
        # Job.
        self.phase = _STOPPED
        self.pipelines = 0
        self.rate = 0.0
        self.pause_forms = False
        self.pause_length = 0.0
        # Whether training goes on from the current layout's state (false once it has been rolled back).
        self.layout_intact = False
        self.version = 0
        self.decide_pending = False
        self.heap: list[tuple[float, int, int, int]] = []
        self.seq = 0
        # Statistics.
        self.removal_times: list[float] = []
        self.lifetimes: list[float] = []
        self.fatal = 0
        self.reconfigurations = 0
        self.times: list[float] = []
        self.node_counts: list[int] = []
        self.rates: list[float] = []

    # ------------------------------------------------------------ helpers
    def push(self, when: float, kind: int, payload: int) -> None:
        self.seq += 1
        heapq.heappush(self.heap, (when, self.seq, kind, payload))

    def step_duration(self) -> float:
        """Seconds per training step now (Bamboo runs `fallback_slowdown` slower while a slot is taken over)."""
        step = self.step_s[self.pipelines]
        if self.strategy is Strategy.BAMBOO and self.dead:
            step *= self.timing.fallback_slowdown
        return step

    def current_rate(self) -> float:
        if self.phase != _RUNNING or self.pipelines == 0:
            return 0.0
        step = self.step_duration()
        if self.strategy is Strategy.SAMPLE_DROPPING:
            working = self.pipelines - len(self.broken)
            return self.profile.samples_per_step * working / self.pipelines / step * self.progress_factor
        return self.profile.samples_per_step / step * self.progress_factor

    def advance(self, when: float) -> None:
        dt = when - self.t
        if dt <= 0.0:
            return
        self.node_seconds += self.allocated * dt
        rate = self.rate
        if rate > 0.0:
            end_clock = self.run_clock + dt
            while self.next_ckpt <= end_clock:
                self.ckpt_samples = self.samples + rate * (self.next_ckpt - self.run_clock)
                self.ckpt_wall = self.t + (self.next_ckpt - self.run_clock)
                self.ckpt_clock = self.next_ckpt
                self.next_ckpt += self.timing.checkpoint_interval_s
            self.samples += rate * dt
            self.run_clock = end_clock
        self.t = when

    def set_phase(self, phase: int) -> None:
        self.phase = phase
        self.rate = self.current_rate()

    def note(self) -> None:
        if self.record:
            self.times.append(self.t)
            self.node_counts.append(self.allocated)
            self.rates.append(self.rate)

    def rollback(self) -> None:
        """Restore the last checkpoint: the work since then is lost (and shown as no progress in the timeline)."""
        if self.record and self.run_clock > self.ckpt_clock:
            times, rates = self.times, self.rates
            i = len(times) - 1
            while i > 0 and times[i] > self.ckpt_wall:
                i -= 1
            if times[i] < self.ckpt_wall:
                i += 1
                times.insert(i, self.ckpt_wall)
                self.node_counts.insert(i, self.node_counts[i - 1])
                rates.insert(i, 0.0)
            for j in range(i, len(rates)):
                rates[j] = 0.0
        self.wasted_run += self.run_clock - self.ckpt_clock
        self.samples = self.ckpt_samples
        self.ckpt_clock = self.run_clock
        self.ckpt_wall = self.t
        self.next_ckpt = self.run_clock + self.timing.checkpoint_interval_s

    def checkpoint_now(self) -> None:
        self.ckpt_samples = self.samples
        self.ckpt_clock = self.run_clock
        self.ckpt_wall = self.t
        self.next_ckpt = self.run_clock + self.timing.checkpoint_interval_s

    def start_pause(self, length: float, forms: bool) -> None:
        """Stop training for `length` seconds; if `forms`, re-form the pipelines at the end."""
        self.version += 1
        self.pause_forms = forms
        self.pause_length = length
        self.decide_pending = False
        self.set_phase(_PAUSED)
        self.push(self.t + length, _EV_PAUSE_END, self.version)

    def schedule_decide(self) -> None:
        """After a change: if the policy now calls for a reconfiguration, decide at the next step boundary.

        The conditions change only at events, so when they do not hold now nothing needs scheduling:
        the next event checks again.
        """
        if not self.decide_pending and self.phase == _RUNNING and self.should_reconfigure():
            self.decide_pending = True
            self.push(self.t + self.step_duration(), _EV_DECIDE, self.version)

    def every_stage_has_a_copy(self) -> bool:
        """Whether every stage still exists somewhere (its own node or, for Bamboo, its shadow).

        With P = 1 every replica holds the whole model, so it exists while any replica is alive.
        """
        stages = self.stages
        dead = self.dead
        shadows = self.strategy is Strategy.BAMBOO
        for k in range(stages):
            for d in range(len(self.owners)):
                if (d, k) not in dead or (shadows and stages > 1 and (d, (k - 1) % stages) not in dead):
                    break
            else:
                return False
        return True

    def global_restart_s(self) -> float:
        if self.strategy is Strategy.CHECKPOINT:
            return self.timing.global_rendezvous_s + self.timing.restart_s
        return self.timing.global_rendezvous_s + self.timing.reconfiguration_s

    def local_reconfigure_s(self) -> float:
        return self.timing.local_rendezvous_s + self.timing.reconfiguration_s

    # ------------------------------------------------------------ pipelines
    def placement(self, members: list[int]) -> list[list[int]]:
        """The new layout's owners grid for the live registered `members` (no pipeline: an empty grid)."""
        stages = self.stages
        if self.strategy is Strategy.CHECKPOINT:
            # Checkpoint/restart restarts every process from the checkpoint, so where a node ran before
            # does not matter.
            order = sorted(members)
            return [order[d * stages:(d + 1) * stages] for d in range(min(self.max_pipelines, len(order) // stages))]
        zone_aware = self.policy.zone_aware
        zone_of = self.zone_of
        slot_of = self.slot_of
        usable = [
            (node, zone_of[node] if zone_aware else 0, slot_of[node][1] if node in slot_of else NOT_A_HOLDER)
            for node in members
        ]
        if stages == 1:
            return plan_replica_ring(usable, self.max_pipelines)
        owners = plan_placement(usable, stages, self.max_pipelines)
        if self.check_policy:
            self.check_plan(members, owners)
        return owners

    def form(self) -> None:
        """End of a rendezvous: the new layout, as many whole pipelines as the live nodes allow.

        With too few nodes for one pipeline no layout forms: the job waits, and the live owners of the
        current layout keep their state (Bamboo, sample dropping) until the next attempt.
        """
        members = list(self.registered)
        owners = self.placement(members)
        if not owners:
            if self.strategy is Strategy.CHECKPOINT:
                self.owners, self.slot_of = [], {}
                self.dead.clear()
                self.ready = set(members)
            self.pipelines = 0
            self.set_phase(_STOPPED)
            return
        self.reconfigurations += 1
        self.formed_once = True
        self.owners = owners
        slot_of: dict[int, tuple[int, int]] = {}
        for d, row in enumerate(owners):
            for s, node in enumerate(row):
                slot_of[node] = (d, s)
        self.slot_of = slot_of
        self.ready = self.registered - slot_of.keys()
        self.dead.clear()
        self.broken.clear()
        self.pipelines = len(owners)
        self.layout_intact = True
        self.set_phase(_RUNNING)
        self.schedule_decide()

    def should_reconfigure(self) -> bool:
        waiting = len(self.ready)
        working = len(self.slot_of)
        if self.strategy is Strategy.BAMBOO:
            dead, layout_pipelines = self.dead, len(self.owners)
            reconfigure = reconfigures(dead, layout_pipelines, self.stages, self.max_pipelines, working + waiting, waiting)
            if self.check_policy:
                when, reasons = decision(dead, layout_pipelines, self.stages, self.max_pipelines, working + waiting, waiting)
                self.check_decision(when, reasons)
                if reconfigure != (when is not When.CARRY_ON):
                    raise PolicyMismatch(f"at t={self.t:g} s reconfigures() says {reconfigure}, the decision {when.value}")
            return reconfigure
        if self.strategy is Strategy.SAMPLE_DROPPING:
            possible = min(self.max_pipelines, (working + waiting) // self.stages)
            return possible > self.pipelines - len(self.broken)
        # Checkpoint/restart: only a whole new pipeline is worth a restart.
        return self.pipelines < self.max_pipelines and (working + waiting) // self.stages > self.pipelines

    # ------------------------------------------------------------ checks against bamboo-reconfig
    def system_view(self, alive: Iterable[int]) -> ClusterView:
        return system_view(self.owners, alive, self.zone_of, self.stages, self.max_pipelines, self.policy.zone_aware)

    def check_plan(self, members: list[int], owners: list[list[int]]) -> None:
        view = self.system_view(members)
        try:
            expected = [[int(name[1:]) for name in row] for row in plan_layout(view).owners]
        except InfeasibleSplit:
            expected = []
        if owners != expected:
            raise PolicyMismatch(
                f"at t={self.t:g} s the simulator placed {owners}, bamboo-reconfig's plan_layout {expected}, "
                f"for the view {view.to_json()}"
            )

    def check_decision(self, when: When, reasons: tuple[Reason, ...]) -> None:
        view = self.system_view([*self.slot_of, *self.ready])
        expected = decide(view)
        if (when, reasons) != (expected.when, expected.reasons):
            raise PolicyMismatch(
                f"at t={self.t:g} s the simulator decided {when.value} {[r.value for r in reasons]}, bamboo-reconfig's "
                f"decide {expected.when.value} {[r.value for r in expected.reasons]} ({expected.detail}), "
                f"for the view {view.to_json()}"
            )

    # ------------------------------------------------------------ events
    def on_add(self, node: int, zone: int) -> None:
        self.zone_of[node] = zone
        self.start_of[node] = self.t
        self.state[node] = _CREATING
        self.allocated += 1
        at_start = self.timing.startup_s is not None and not self.formed_once and self.t == 0.0
        self.push(self.t + (0.0 if at_start else self.timing.instance_creation_s), _EV_READY, node)

    def on_ready(self, node: int) -> None:
        if self.state.get(node) != _CREATING:
            return
        self.state[node] = _REGISTERED
        self.registered.add(node)
        self.ready.add(node)
        if self.phase == _STOPPED:
            if len(self.ready) + len(self.slot_of) >= self.stages:
                startup = self.timing.startup_s
                first = startup is not None and not self.formed_once
                self.start_pause(max(0.0, startup - self.t) if first else self.global_restart_s(), forms=True)
        elif self.phase == _PAUSED and self.pause_forms and self.restart_on_every_join:
            # torchrun: a node that arrives while the workers restart waits, and its agent restarts them again.
            self.start_pause(self.pause_length, forms=True)
        elif self.phase == _RUNNING:
            if self.restart_on_every_join:
                # torchrun's agents restart every worker when a node waits: back to the last checkpoint.
                self.rollback()
                self.start_pause(self.global_restart_s(), forms=True)
            elif self.strategy is Strategy.CHECKPOINT:
                if self.should_reconfigure():
                    self.checkpoint_now()
                    self.start_pause(self.global_restart_s(), forms=True)
            else:
                self.schedule_decide()

    def on_remove(self, node: int) -> None:
        state = self.state.pop(node, None)
        if state is None:
            raise ValueError(f"remove of node {node}, which is not alive")
        self.allocated -= 1
        self.removal_times.append(self.t)
        self.lifetimes.append(self.t - self.start_of.pop(node))
        if state == _CREATING:
            return
        self.registered.discard(node)
        if node in self.ready:
            self.ready.discard(node)
            if self.phase == _PAUSED and self.pause_forms:
                self.start_pause(self.pause_length, forms=True)  # a member left: the rendezvous starts over
            return
        d, s = self.slot_of.pop(node)
        if self.phase == _STOPPED:
            # The job waits for nodes; a holder's loss matters only if a stage loses its last copy.
            self.dead.add((d, s))
            if self.layout_intact and not self.every_stage_has_a_copy():
                self.fatal += 1
                self.rollback()
                self.layout_intact = False
            return
        if self.phase == _PAUSED and self.pause_forms:
            # A member left during a rendezvous: it starts over. A reconfiguration rebuilds every
            # stage from whichever copy is left, so the loss is fatal only if a stage lost every copy.
            if self.layout_intact and self.strategy is not Strategy.CHECKPOINT:
                self.dead.add((d, s))
                if not self.every_stage_has_a_copy():
                    self.fatal += 1
                    self.rollback()
                    self.layout_intact = False
                    self.start_pause(self.global_restart_s(), forms=True)
                    return
            self.start_pause(self.pause_length, forms=True)
            return
        if self.strategy is Strategy.BAMBOO:
            self.bamboo_failure(d, s)
        elif self.strategy is Strategy.CHECKPOINT:
            self.fatal += 1
            self.rollback()
            self.start_pause(self.global_restart_s(), forms=True)
        else:
            self.dropping_failure(d, s)

    def bamboo_failure(self, d: int, s: int) -> None:
        stages = self.stages
        if stages == 1:
            fatal = is_consecutive_replica_failure(self.dead, d, len(self.owners))
        else:
            fatal = is_consecutive_failure(self.dead, d, s, stages)
        self.dead.add((d, s))
        if self.check_policy:
            waiting = len(self.ready)
            when, reasons = decision(self.dead, len(self.owners), stages, self.max_pipelines,
                                     len(self.slot_of) + waiting, waiting)
            if (when is When.NOW) != fatal:
                raise PolicyMismatch(f"at t={self.t:g} s slot {(d, s)} lost: fatal={fatal} but the decision is {when.value}")
            self.check_decision(when, reasons)
        if fatal:
            # A stage and its shadow are gone: reconfigure now, from whichever copy is left.
            self.fatal += 1
            if not self.every_stage_has_a_copy():
                self.rollback()
                self.layout_intact = False
            self.start_pause(self.global_restart_s(), forms=True)
            return
        pause = self.timing.failover_pause_s
        if pause > 0.0:
            if self.phase == _PAUSED:
                self.start_pause(max(self.pause_length, pause), forms=False)
            else:
                self.start_pause(pause, forms=False)
        else:
            self.rate = self.current_rate()
            self.schedule_decide()

    def dropping_failure(self, d: int, s: int) -> None:
        self.dead.add((d, s))
        self.broken.add(d)
        if len(self.broken) == self.pipelines:
            self.fatal += 1
            if not self.every_stage_has_a_copy():
                self.rollback()
                self.layout_intact = False
            self.start_pause(self.global_restart_s(), forms=True)
            return
        self.rate = self.current_rate()
        pause = self.timing.failover_pause_s
        if pause > 0.0 and self.phase == _RUNNING:
            self.start_pause(pause, forms=False)
        else:
            self.schedule_decide()

    def on_pause_end(self, version: int) -> None:
        if version != self.version or self.phase != _PAUSED:
            return
        if self.pause_forms:
            self.form()
        else:
            self.set_phase(_RUNNING)
            self.schedule_decide()

    def on_decide(self, version: int) -> None:
        if version != self.version or self.phase != _RUNNING:
            return
        self.decide_pending = False
        if self.should_reconfigure():
            if self.strategy is Strategy.CHECKPOINT:
                self.checkpoint_now()
                self.start_pause(self.global_restart_s(), forms=True)
            else:
                self.start_pause(self.local_reconfigure_s(), forms=True)

    # ------------------------------------------------------------ main loop
    def run(self, events: Iterator[tuple[float, bool, int, int]]) -> RunResult:
        heap = self.heap
        upcoming = next(events, None)
        completed = False
        inf = math.inf
        record = self.record
        self.note()
        while True:
            te = upcoming[0] if upcoming is not None else inf
            ti = heap[0][0] if heap else inf
            tn = min(te, ti, self.until_s)
            if self.rate > 0.0:
                finish = self.t + (self.target - self.samples) / self.rate
                if finish <= tn:
                    self.advance(finish)
                    self.samples = self.target
                    completed = True
                    break
            if tn == inf:
                break
            self.advance(tn)
            if tn >= self.until_s and tn < te and tn < ti:
                break
            if ti < te or (ti == te and ti <= tn and heap and upcoming is None):
                _, _, kind, payload = heapq.heappop(heap)
                if kind == _EV_READY:
                    self.on_ready(payload)
                elif kind == _EV_PAUSE_END:
                    self.on_pause_end(payload)
                else:
                    self.on_decide(payload)
            else:
                assert upcoming is not None
                _, is_add, node, zone = upcoming
                if is_add:
                    self.on_add(node, zone)
                else:
                    self.on_remove(node)
                upcoming = next(events, None)
            if record:
                self.note()
        self.note()
        return self.result(completed)

    def result(self, completed: bool) -> RunResult:
        end = self.t
        lifetimes = self.lifetimes + [end - start for start in self.start_of.values()]
        removals = self.removal_times
        interval = (removals[-1] - removals[0]) / (len(removals) - 1) / 3600.0 if len(removals) > 1 else math.nan
        nodes = self.node_seconds / end if end > 0 else float(self.allocated)
        cost = nodes * self.profile.spot_price_per_node_hour
        throughput = self.samples / end if end > 0 else 0.0
        timeline = None
        if self.record:
            timeline = Timeline(np.array(self.times), np.array(self.node_counts), np.array(self.rates))
        return RunResult(
            strategy=self.strategy,
            completed=completed,
            duration_h=end / 3600.0,
            samples=self.samples,
            preemptions=len(removals),
            interval_h=interval,
            lifetime_h=float(np.mean(lifetimes)) / 3600.0 if lifetimes else math.nan,
            fatal_failures=self.fatal,
            reconfigurations=self.reconfigurations,
            nodes=nodes,
            throughput=throughput,
            cost_per_hour=cost,
            value=throughput / cost if cost > 0 else 0.0,
            progress_share=(self.run_clock - self.wasted_run) / end if end > 0 else 0.0,
            timeline=timeline,
        )


def _on_demand_result(profile: ModelProfile, target_samples: float, until_s: float, record: bool) -> RunResult:
    rate = profile.on_demand_samples_per_second
    startup = profile.on_demand_startup_s
    end = min(startup + target_samples / rate, until_s)
    samples = max(0.0, end - startup) * rate
    throughput = samples / end if end > 0 else 0.0
    cost = profile.on_demand_cost_per_hour
    timeline = None
    if record:
        nodes = profile.on_demand_nodes
        if startup > 0 and end > startup:
            timeline = Timeline(np.array([0.0, startup, end]), np.array([nodes, nodes, nodes]), np.array([0.0, rate, rate]))
        else:
            timeline = Timeline(np.array([0.0, end]), np.array([nodes, nodes]),
                                np.array([rate if startup == 0 else 0.0] * 2))
    return RunResult(
        strategy=Strategy.ON_DEMAND,
        completed=startup + target_samples / rate <= until_s,
        duration_h=end / 3600.0,
        samples=samples,
        preemptions=0,
        interval_h=math.nan,
        lifetime_h=end / 3600.0,
        fatal_failures=0,
        reconfigurations=0,
        nodes=float(profile.on_demand_nodes),
        throughput=throughput,
        cost_per_hour=cost,
        value=throughput / cost,
        progress_share=max(0.0, end - startup) / end if end > 0 else 0.0,
        timeline=timeline,
    )


def _trace_events(trace: Trace) -> Iterator[tuple[float, bool, int, int]]:
    return iter(zip(trace.time_s.tolist(), trace.is_add.tolist(), trace.node.tolist(), trace.zone.tolist(), strict=True))


def holding_at_most(
    events: Iterable[tuple[float, bool, int, int]], desired_nodes: int
) -> Iterator[tuple[float, bool, int, int]]:
    """The events of the instances a cluster that wants `desired_nodes` takes from `events`.

    A new instance is taken only while fewer than `desired_nodes` are held; a declined instance is never
    taken later, and its removal is dropped.
    """
    if desired_nodes < 1:
        raise ValueError(f"desired_nodes must be >= 1, got {desired_nodes!r}")
    held: set[int] = set()
    for event in events:
        _, is_add, node, _ = event
        if is_add:
            if len(held) < desired_nodes:
                held.add(node)
                yield event
        elif node in held:
            held.discard(node)
            yield event


def simulate_run(
    source: Trace | Iterable[tuple[float, bool, int, int]],
    profile: ModelProfile,
    strategy: Strategy,
    *,
    policy: Policy | None = None,
    target_samples: float | None = None,
    until_s: float | None = None,
    record: bool = False,
    check_policy: bool = False,
    desired_nodes: int | None = None,
) -> RunResult:
    """Simulate one run of `strategy` on `source` until `target_samples` are trained or `until_s` passes.

    `source` is a `Trace` or an iterable of (time_s, is_add, node id, zone index) in time order
    (e.g. `SyntheticTraceGenerator.events()`). `target_samples` defaults to the profile's
    `job_samples`; `until_s` defaults to no limit. With `record`, the result carries a `Timeline`.
    `desired_nodes` None: the strategy holds every instance of `source`; a number: at most that many
    (`holding_at_most`; e.g. ``profile.desired_nodes_for(redundancy=...)``, the cluster the strategy asks for).
    With `check_policy` (bamboo only; slow), every placement and decision is also computed by
    bamboo-reconfig's ``plan_layout`` and ``decide`` on the same state, and a difference raises
    `PolicyMismatch`.
    """
    target = profile.job_samples if target_samples is None else target_samples
    limit = math.inf if until_s is None else until_s
    if not target > 0:
        raise ValueError(f"target_samples must be > 0, got {target!r}")
    if not limit > 0:
        raise ValueError(f"until_s must be > 0, got {limit!r}")
    if strategy is Strategy.ON_DEMAND:
        return _on_demand_result(profile, target, limit, record)
    events = _trace_events(source) if isinstance(source, Trace) else iter(source)
    if desired_nodes is not None:
        events = holding_at_most(events, desired_nodes)
    return _Run(profile, strategy, policy or Policy(), target, limit, record, check_policy).run(events)


def simulate_synthetic(
    spec: SyntheticSpec,
    seed: int,
    profile: ModelProfile,
    strategy: Strategy,
    *,
    policy: Policy | None = None,
    target_samples: float | None = None,
    max_hours: float = 1000.0,
    record: bool = False,
    check_policy: bool = False,
) -> RunResult:
    """One run "until completion" on the synthetic stream for `seed` (given up after `max_hours`)."""
    events = SyntheticTraceGenerator(spec, seed).events(until_s=max_hours * 3600.0)
    return simulate_run(
        events, profile, strategy, policy=policy, target_samples=target_samples, until_s=max_hours * 3600.0,
        record=record, check_policy=check_policy,
    )


def run_many(
    spec: SyntheticSpec,
    seeds: Sequence[int],
    profile: ModelProfile,
    strategy: Strategy,
    policy: Policy | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[RunResult]:
    """Run `simulate_synthetic` for each seed in this process, calling `progress(1)` after each."""
    results = []
    for seed in seeds:
        results.append(simulate_synthetic(spec, seed, profile, strategy, policy=policy))
        if progress is not None:
            progress(1)
    return results
