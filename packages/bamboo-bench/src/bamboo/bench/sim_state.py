"""One simulated run's state and its bookkeeping: the clock, the samples trained, periodic checkpoints and
rollbacks, pauses and the job's phase, the queue of internal events, the timeline, and the `RunResult` it adds
up to.

`RunState` holds what every strategy shares; `bamboo.bench.sim_engine.SimulatedRun` adds how each strategy
reacts to events (layouts, failures, reconfiguration decisions) and the event loop.
"""

from __future__ import annotations

import heapq
import math

import numpy as np
from bamboo.bench.profile import ModelProfile
from bamboo.bench.results import RunResult, Timeline
from bamboo.bench.strategy import Policy, Strategy

__all__ = [
    "CREATING",
    "EV_DECIDE",
    "EV_PAUSE_END",
    "EV_READY",
    "PAUSED",
    "REGISTERED",
    "RUNNING",
    "STOPPED",
    "RunState",
]

# Node states and job phases (plain ints: this is the hot loop). A registered node is an owner of the
# current layout when it is in `slot_of`, and waiting (standby) when it is in `ready`.
CREATING, REGISTERED = 0, 1
STOPPED, RUNNING, PAUSED = 0, 1, 2
# Internal event kinds.
EV_READY, EV_PAUSE_END, EV_DECIDE = 0, 1, 2


class RunState:
    """One run of one strategy: its state, clock, progress and checkpoints (``SimulatedRun`` drives it)."""

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
        self.failover_at: float | None = None  # Bamboo's latest failover: its rebuild comes timing.rebuild_delay_s later
        self.broken: set[int] = set()
        self.allocated = 0
        # Job.
        self.phase = STOPPED
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
        if self.phase != RUNNING or self.pipelines == 0:
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
        self.set_phase(PAUSED)
        self.push(self.t + length, EV_PAUSE_END, self.version)

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

    # ------------------------------------------------------------ outcome
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

