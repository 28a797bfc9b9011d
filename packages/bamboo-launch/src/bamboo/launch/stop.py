"""What a generation does at a step boundary: go on, prepare the next layout, switch to it, stop at the barrier,
or end the job there.

After every step the lowest live rank of the generation (the *evaluator*) proposes what comes next:

- the job's end when someone asked for it (:mod:`bamboo.launch.finish`): the stop, two steps ahead (decision
  ``g<g>-stop``, first writer wins, so that every node can still stop there), marked ``finish``;
- otherwise, when :func:`bamboo.reconfig.decide` wants a reconfiguration, the next layout *prepared* while
  this one trains (:mod:`bamboo.launch.prepare`); once every node of it is built, the stop that switches to
  it. While too few nodes are left for a pipeline, training goes on as it is and the evaluator asks again
  after the next step. A layout that cannot be prepared (the global batch cannot be split) is a plain stop:
  the nodes meet at the barrier and decide there.

Every node, after each of its steps, starts its own part of an open prepared layout (:class:`Boundary`),
abandons one planned before a failure event it has seen since, and reads the stop.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING

from bamboo.launch.finish import finish_requested
from bamboo.launch.prepare import (
    BREAK_BEFORE_MAKE_ENV,
    Preparation,
    PreparedScan,
    abandon_prepared,
    built_name,
    plan_prepared,
    prepare_name,
    scan_prepared,
)
from bamboo.launch.records import PreparedLayout, StopDecision, read_record
from bamboo.launch.session import NotEnoughNodes, WorkerSession

if TYPE_CHECKING:
    from bamboo.rc import StageExecutor
    from bamboo.reconfig import ClusterView, JobLayout

__all__ = ["Boundary", "cluster_view", "reconfiguration_reason"]


class Boundary:
    """One node's step boundaries in one generation (``layout``, a ``JobLayout``): see the module docstring.

    ``preparation`` is this node's part of the open prepared layout (None: none, or not a part of it); ``stop``
    the stop once decided."""

    def __init__(self, run: WorkerSession, layout: JobLayout) -> None:
        self.run = run
        self.layout = layout
        self.cursor = 0
        """Prepared attempts before this index are known abandoned."""
        self.preparation: Preparation | None = None
        self.stop: StopDecision | None = None
        self._said = ""

    def after_step(self, executor: StageExecutor) -> StopDecision | None:
        """What this node does after a step of ``executor`` (see the module docstring); the stop once decided.
        An unreachable etcd only delays all of it to a later step."""
        if self.stop is not None:
            return self.stop
        try:
            scan = scan_prepared(self.run.membership, self.layout.generation, self.cursor)
            self.cursor = scan.next_attempt
            if self._evaluates(executor):
                scan = self._propose(executor, scan)
            self._follow(executor, scan)
            self.stop = read_record(StopDecision, self.run.membership.get_decision(f"g{self.layout.generation}-stop"))
        except Exception as error:  # etcd restarting (or a record it could not read): again after the next step
            print(f"node {self.run.node}: at the boundary of step {executor.step}: {error}", file=sys.stderr, flush=True)
        return self.stop

    def abandon(self) -> None:
        """Let this node's part of a prepared layout go (the generation ends without switching to it)."""
        if self.preparation is not None:
            self.preparation.abandon()
            self.preparation = None

    def _evaluates(self, executor: StageExecutor) -> bool:
        ranks = self.layout.ranks.values()
        evaluator = min((r for r in ranks if r not in executor.dead), default=min(ranks))
        return bool(executor.rank == evaluator and executor.step + 2 <= self.run.spec.steps)

    def _follow(self, executor: StageExecutor, scan: PreparedScan) -> None:
        """This node's part of the open prepared layout: start it, or give it up."""
        run, prepared = self.run, scan.open
        if self.preparation is not None and (prepared is None or prepared.attempt != self.preparation.prepared.attempt):
            self.abandon()
        if prepared is None:
            return
        if executor.epoch > prepared.epoch:  # the plan assumed the holders before this failure
            abandon_prepared(run.membership, prepared, f"generation {self.layout.generation} saw failure event "
                             f"{executor.epoch} after it was planned (at {prepared.epoch})")
            self.abandon()
            return
        if self.preparation is None and run.node in prepared.needs():
            self.preparation = Preparation(run, prepared)

    def _propose(self, executor: StageExecutor, scan: PreparedScan) -> PreparedScan:
        """The evaluator: the job's end, the stop that switches to a prepared layout built everywhere, or a new
        prepared layout when a reconfiguration is due. Returns the scan as it now is."""
        run, generation, step = self.run, self.layout.generation, executor.step
        name = f"g{generation}-stop"
        request = finish_requested(run.membership)
        if request is not None:  # each peer reads the decision within the two steps
            run.membership.decide(name, StopDecision(step + 2, f"finish requested by {request.by or 'someone'}",
                                                     finish=True).to_dict())
            return scan
        if scan.closed or scan.went is not None:
            return scan
        if scan.open is not None:
            needs = scan.open.needs()
            gone = sorted(needs - set(run.membership.list_nodes(skip_malformed=True)))
            if gone:
                abandon_prepared(run.membership, scan.open, f"{', '.join(gone)} left the membership")
            elif all(run.membership.get_decision(built_name(scan.open.layout.generation, n)) for n in needs):
                run.membership.decide(name, StopDecision(step + 2, scan.open.layout.reason, attempt=scan.open.attempt,
                                                         at=time.time()).to_dict())
            return scan
        reason = reconfiguration_reason(run, self.layout, executor)
        if reason is None:
            return scan
        if os.environ.get(BREAK_BEFORE_MAKE_ENV) == "1":  # the baseline of the benchmarks: decide at the barrier
            run.membership.decide(name, StopDecision(step + 2, reason).to_dict())
            return scan
        try:
            planned = plan_prepared(run, self.layout, executor, scan.next_attempt, reason)
        except NotEnoughNodes as shortage:  # train on as it is; asked again after the next step
            self._say(f"{reason}: {shortage}; training goes on as it is")
            return scan
        except ValueError as error:  # it cannot be prepared: the nodes meet at the barrier and decide there
            self._say(f"{reason}: the next layout cannot be prepared ({error}); stopping at step {step + 2}")
            run.membership.decide(name, StopDecision(step + 2, reason).to_dict())
            return scan
        won = run.membership.decide(prepare_name(generation, scan.next_attempt),
                                    PreparedLayout(layout=planned.to_dict(), epoch=executor.epoch).to_dict()).won
        if won:
            self._say(f"preparing generation {planned.generation} while generation {generation} trains ({reason}): "
                      f"ranks {planned.ranks}, {len(planned.transfers.transfers)} transfers of "
                      f"{planned.transfers.bytes_moved} bytes")
        return scan_prepared(run.membership, generation, scan.next_attempt)

    def _say(self, line: str) -> None:
        if line != self._said:
            print(f"node {self.run.node}: {line}", flush=True)
            self._said = line


def reconfiguration_reason(run: WorkerSession, layout: JobLayout, executor: StageExecutor) -> str | None:
    """Why :func:`bamboo.reconfig.decide` wants a reconfiguration now (None: carry on)."""
    from bamboo.reconfig import When, decide

    view = cluster_view(run, layout, executor)
    if view is None:
        return None
    decision = decide(view)  # after a failover: "rebuild redundancy after a failover", at least
    if decision.when is When.CARRY_ON:
        return None
    return ", ".join(r.value for r in decision.reasons)


def cluster_view(run: WorkerSession, layout: JobLayout, executor: StageExecutor) -> ClusterView | None:
    """bamboo-reconfig's view of generation ``layout`` as ``executor`` sees it (None when etcd cannot be read)."""
    from bamboo.launch.reconfigure import build_view, warm_standby

    try:
        records = run.membership.list_nodes(skip_malformed=True)
        alive = warm_standby(run.membership, records)
    except Exception:
        return None
    ranks = layout.ranks
    dead = [n for n, r in ranks.items() if r in executor.dead]
    alive = sorted(set(alive) | {n for n in ranks if n in records})
    zones = {**layout.zones, **{n: record.zone for n, record in records.items()}}
    return build_view(layout, zones, alive, dead, run.layers, run.spec.pipelines)
