"""How one simulated run reacts to events: the strategies' layouts, failures and reconfiguration decisions, the
checks of every placement and decision against bamboo-reconfig (``check_policy``), and the event loop.

The model is described in `bamboo.bench.simulator`; the state and its bookkeeping are `bamboo.bench.sim_state`'s.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Iterable, Iterator

from bamboo.bench.placement import NOT_A_HOLDER, plan_placement, plan_replica_ring
from bamboo.bench.policy import (
    decision,
    is_consecutive_failure,
    is_consecutive_replica_failure,
    reconfigures,
    system_view,
)
from bamboo.bench.results import RunResult
from bamboo.bench.sim_state import (
    CREATING,
    EV_DECIDE,
    EV_PAUSE_END,
    EV_READY,
    PAUSED,
    REGISTERED,
    RUNNING,
    STOPPED,
    RunState,
)
from bamboo.bench.strategy import PolicyMismatch, Strategy
from bamboo.reconfig import ClusterView, InfeasibleSplit, Reason, When, decide, plan_layout

__all__ = ["SimulatedRun"]


class SimulatedRun(RunState):
    """One run of one strategy; `run()` walks the merged external and internal events."""

    # ------------------------------------------------------------ decisions
    def schedule_decide(self) -> None:
        """After a change: if the policy now calls for a reconfiguration, decide at the next step boundary.

        The conditions change only at events, so when they do not hold now nothing needs scheduling:
        the next event checks again.
        """
        if not self.decide_pending and self.phase == RUNNING and self.should_reconfigure():
            self.decide_pending = True
            at = self.t + self.step_duration()
            if self.dead and self.failover_at is not None:  # the rebuild is prepared while training goes on
                at = max(at, self.failover_at + self.timing.rebuild_delay_s)
            self.push(at, EV_DECIDE, self.version)

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
            self.set_phase(STOPPED)
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
        self.set_phase(RUNNING)
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
        self.state[node] = CREATING
        self.allocated += 1
        at_start = self.timing.startup_s is not None and not self.formed_once and self.t == 0.0
        self.push(self.t + (0.0 if at_start else self.timing.instance_creation_s), EV_READY, node)

    def on_ready(self, node: int) -> None:
        if self.state.get(node) != CREATING:
            return
        self.state[node] = REGISTERED
        self.registered.add(node)
        self.ready.add(node)
        if self.phase == STOPPED:
            if len(self.ready) + len(self.slot_of) >= self.stages:
                startup = self.timing.startup_s
                first = startup is not None and not self.formed_once
                self.start_pause(max(0.0, startup - self.t) if first else self.global_restart_s(), forms=True)
        elif self.phase == PAUSED and self.pause_forms and self.restart_on_every_join:
            # torchrun: a node that arrives while the workers restart waits, and its agent restarts them again.
            self.start_pause(self.pause_length, forms=True)
        elif self.phase == RUNNING:
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
        if state == CREATING:
            return
        self.registered.discard(node)
        if node in self.ready:
            self.ready.discard(node)
            if self.phase == PAUSED and self.pause_forms:
                self.start_pause(self.pause_length, forms=True)  # a member left: the rendezvous starts over
            return
        d, s = self.slot_of.pop(node)
        if self.phase == STOPPED:
            # The job waits for nodes; a holder's loss matters only if a stage loses its last copy.
            self.dead.add((d, s))
            if self.layout_intact and not self.every_stage_has_a_copy():
                self.fatal += 1
                self.rollback()
                self.layout_intact = False
            return
        if self.phase == PAUSED and self.pause_forms:
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
            self.restart_after_fatal()
            return
        self.failover_at = self.t
        pause = self.timing.failover_pause_s
        if pause > 0.0:
            if self.phase == PAUSED:
                self.start_pause(max(self.pause_length, pause), forms=False)
            else:
                self.start_pause(pause, forms=False)
        else:
            self.rate = self.current_rate()
            self.schedule_decide()

    def restart_after_fatal(self) -> None:
        """A failure no survivor can absorb: count it, roll back to the last checkpoint when some stage has no
        copy left, and pause for a global restart that forms a new layout."""
        self.fatal += 1
        if not self.every_stage_has_a_copy():
            self.rollback()
            self.layout_intact = False
        self.start_pause(self.global_restart_s(), forms=True)

    def dropping_failure(self, d: int, s: int) -> None:
        self.dead.add((d, s))
        self.broken.add(d)
        if len(self.broken) == self.pipelines:
            self.restart_after_fatal()
            return
        self.rate = self.current_rate()
        pause = self.timing.failover_pause_s
        if pause > 0.0 and self.phase == RUNNING:
            self.start_pause(pause, forms=False)
        else:
            self.schedule_decide()

    def on_pause_end(self, version: int) -> None:
        if version != self.version or self.phase != PAUSED:
            return
        if self.pause_forms:
            self.form()
        else:
            self.set_phase(RUNNING)
            self.schedule_decide()

    def on_decide(self, version: int) -> None:
        if version != self.version or self.phase != RUNNING:
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
                if kind == EV_READY:
                    self.on_ready(payload)
                elif kind == EV_PAUSE_END:
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
