"""What a generation does at a step boundary: go on, prepare the next layout, switch to it, stop at the barrier,
or end the job there.

After every step the lowest live rank of the generation (the *evaluator*) proposes what comes next:

- the job's end when someone asked for it (:mod:`bamboo.launch.finish`): the stop, :data:`STOP_AHEAD` steps ahead (decision
  ``g<g>-stop``, first writer wins, so that every node can still stop there), marked ``finish``;
- otherwise, when :func:`bamboo.reconfig.decide` wants a reconfiguration, the next layout *prepared* while
  this one trains (:mod:`bamboo.launch.prepare`); once every node of it is built, the stop that switches to
  it. While too few nodes are left for a pipeline, training goes on as it is and the evaluator asks again
  after the next step. A layout that cannot be prepared (the global batch cannot be split) is a plain stop:
  the nodes meet at the barrier and decide there.

Every node, after each of its steps, starts its own part of an open prepared layout (:class:`Boundary`),
abandons one planned before a failure event it has seen since, and reads the stop.

**Off the step's path.** What a boundary reads and writes in etcd (the prepared attempts, the stop, and the
evaluator's whole proposal: the membership, the standby nodes, a plan) takes several round trips, 4 to 11 ms
a step on a loopback etcd, which the next step used to wait for: most of the time a fault-free run spent
outside its steps. That work now runs in a background thread *during the next step*, and its result is
applied at the boundary after it: what a node reads at boundary s it acts on at boundary s+1. A stop is
proposed :data:`STOP_AHEAD` (4) steps ahead, and every node still reads it in time, with one boundary to
spare: the evaluator (stage 0 of pipeline 0) finishes its write at boundary s before it starts step s+2 (it
collects the work of boundary s at boundary s+1); no node completes step s+2 before the evaluator has started
it (the pipeline's activations, and each stage's all-reduce across the pipelines); so every node's read at
boundary s+2 sees the stop and acts on it at s+3, and a read that failed there (etcd restarting) is made
again at s+3 and acted on at s+4, the stop's step. (With the reads on the step's path, a stop two steps ahead
gave the same spare boundary.)
"""

from __future__ import annotations

import contextlib
import os
import queue
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, Generic, TypeVar

import attrs
from bamboo.launch.finish import finish_requested
from bamboo.launch.prepare import (
    BREAK_BEFORE_MAKE_ENV,
    ExecutorFacts,
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
    from bamboo.membership import MembershipStore
    from bamboo.rc import StageExecutor
    from bamboo.reconfig import ClusterView, JobLayout

__all__ = ["STOP_AHEAD", "Boundary", "StepFacts", "cluster_view", "reconfiguration_reason"]

T = TypeVar("T")

STOP_AHEAD: Final = 4
"""How many steps after the boundary where it is decided a stop falls (see the module docstring)."""


@attrs.frozen
class StepFacts:
    """The executor's step, dead ranks, failure epoch and rank at one boundary: what the background work of that
    boundary reads while the executor trains the next step."""

    step: int
    dead: frozenset[int]
    epoch: int
    rank: int

    @classmethod
    def of(cls, executor: ExecutorFacts) -> StepFacts:
        return cls(executor.step, frozenset(executor.dead), executor.epoch, executor.rank)


class _Job(Generic[T]):
    """One piece of work for a :class:`_BackgroundWorker`: its result or error once :meth:`wait` returns."""

    def __init__(self, work: Callable[[], T]) -> None:
        self._work = work
        self._done = threading.Event()
        self.result: T | None = None
        self.error: Exception | None = None

    def run(self) -> None:
        try:
            self.result = self._work()
        except Exception as error:  # handed to whoever waits
            self.error = error
        finally:
            self._done.set()

    def wait(self) -> T:
        """The work's result, once it ran; raises its error."""
        self._done.wait()
        if self.error is not None:
            raise self.error
        assert self.result is not None
        return self.result


class _BackgroundWorker:
    """One daemon thread that runs the work it is given, in order. Handing it work costs the caller a queue put
    (tens of microseconds); starting a thread per boundary cost the step ~3 ms, the time the new thread held
    the interpreter lock before its first etcd call let it go."""

    def __init__(self, name: str) -> None:
        self._jobs: queue.SimpleQueue[_Job[Any] | None] = queue.SimpleQueue()
        self._closed = False
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, work: Callable[[], T]) -> _Job[T]:
        if self._closed:
            raise RuntimeError("the boundary's background worker is closed: the generation ended on this node")
        job = _Job(work)
        self._jobs.put(job)
        return job

    def close(self) -> None:
        """End the thread once the work handed to it is done."""
        if not self._closed:
            self._closed = True
            self._jobs.put(None)

    def _loop(self) -> None:
        while (job := self._jobs.get()) is not None:
            job.run()


@attrs.frozen
class _Read:
    """What the background work of one boundary found: the prepared attempts and the stop."""

    scan: PreparedScan
    stop: StopDecision | None


class Boundary:
    """One node's step boundaries in one generation (``layout``, a ``JobLayout``): see the module docstring.

    ``preparation`` is this node's part of the open prepared layout (None: none, or not a part of it); ``stop``
    the stop once decided. Call :meth:`settle` (or :meth:`abandon`) when the generation ends on this node."""

    def __init__(self, run: WorkerSession, layout: JobLayout) -> None:
        self.run = run
        self.layout = layout
        self.cursor = 0
        """Prepared attempts before this index are known abandoned."""
        self.preparation: Preparation | None = None
        self.stop: StopDecision | None = None
        self._said = ""
        self._pending: tuple[StepFacts, _Job[_Read]] | None = None
        """The boundary work running in the background, and the facts it started from."""
        self._worker = _BackgroundWorker(f"bamboo-boundary-g{layout.generation}")
        """Its thread: a daemon, so that etcd calls that hang on an outage never hold the process up."""

    def after_step(self, executor: StageExecutor) -> StopDecision | None:
        """At the boundary after a step of ``executor``: act on what the previous boundary's work found (which
        ran during this step), then start this boundary's (see the module docstring); the stop once decided.
        An unreachable etcd only delays all of it to a later step."""
        if self.stop is None:
            self._collect(executor)
        if self.stop is None:
            facts, cursor = StepFacts.of(executor), self.cursor
            self._pending = facts, self._worker.submit(lambda: self._read(facts, cursor))
        return self.stop

    def settle(self) -> None:
        """The generation ended on this node: wait for the boundary work still running (its findings are
        dropped: nothing follows this generation's boundaries)."""
        if self._pending is not None:
            with contextlib.suppress(Exception):
                self._pending[1].wait()
            self._pending = None
        self._worker.close()

    def abandon(self) -> None:
        """The generation ends without switching to a prepared layout: settle, and let this node's part of one
        go."""
        self.settle()
        self._drop_preparation()

    def _drop_preparation(self) -> None:
        if self.preparation is not None:
            self.preparation.abandon()
            self.preparation = None

    def _collect(self, executor: StageExecutor) -> None:
        """Act on the previous boundary's findings: follow the open prepared layout, take the stop."""
        if self._pending is None:
            return
        facts, work = self._pending
        self._pending = None
        try:
            found = work.wait()
            self.cursor = found.scan.next_attempt
            self._follow(executor, found.scan)
            self.stop = found.stop
        except Exception as error:  # etcd restarting (or a record it could not read): again after the next step
            print(f"node {self.run.node}: at the boundary of step {facts.step}: {error}", file=sys.stderr, flush=True)

    def _read(self, facts: StepFacts, cursor: int) -> _Read:
        """The boundary's etcd work, in the background: the prepared attempts, the evaluator's proposal, the stop."""
        scan = scan_prepared(self.run.membership, self.layout.generation, cursor)
        if self._evaluates(facts):
            scan = self._propose(facts, scan)
        return _Read(scan, read_record(StopDecision, self.run.membership.get_decision(f"g{self.layout.generation}-stop")))

    def _evaluates(self, facts: ExecutorFacts) -> bool:
        ranks = self.layout.ranks.values()
        evaluator = min((r for r in ranks if r not in facts.dead), default=min(ranks))
        return bool(facts.rank == evaluator and facts.step + STOP_AHEAD <= self.run.spec.steps)

    def _follow(self, executor: StageExecutor, scan: PreparedScan) -> None:
        """This node's part of the open prepared layout: start it, or give it up."""
        run, prepared = self.run, scan.open
        if self.preparation is not None and (prepared is None or prepared.attempt != self.preparation.prepared.attempt):
            self._drop_preparation()
        if prepared is None:
            return
        if executor.epoch > prepared.epoch:  # the plan assumed the holders before this failure
            abandon_prepared(run.membership, prepared, f"generation {self.layout.generation} saw failure event "
                             f"{executor.epoch} after it was planned (at {prepared.epoch})")
            self._drop_preparation()
            return
        if self.preparation is None and run.node in prepared.needs():
            self.preparation = Preparation(run, prepared)
        if self.preparation is not None:
            self.preparation.report_stragglers()

    def _propose(self, facts: ExecutorFacts, scan: PreparedScan) -> PreparedScan:
        """The evaluator: the job's end, the stop that switches to a prepared layout built everywhere, or a new
        prepared layout when a reconfiguration is due. Returns the scan as it now is."""
        run, generation, step = self.run, self.layout.generation, facts.step
        name = f"g{generation}-stop"
        request = finish_requested(run.membership)
        if request is not None:  # each peer reads the decision in time (the module docstring)
            run.membership.decide(name, StopDecision(step + STOP_AHEAD, f"finish requested by {request.by or 'someone'}",
                                                     finish=True).to_dict())
            return scan
        if scan.closed or scan.went is not None:
            return scan
        if scan.open is not None:
            needs = scan.open.needs()
            gone = sorted(needs - set(run.membership.list_nodes(skip_malformed=True)))
            if gone:
                abandon_prepared(run.membership, scan.open, f"{', '.join(gone)} left the membership")
            elif needs <= _built(run.membership, scan.open.layout.generation):
                run.membership.decide(name, StopDecision(step + STOP_AHEAD, scan.open.layout.reason, attempt=scan.open.attempt,
                                                         at=time.time()).to_dict())
            return scan
        reason = reconfiguration_reason(run, self.layout, facts)
        if reason is None:
            return scan
        if os.environ.get(BREAK_BEFORE_MAKE_ENV) == "1":  # the baseline of the benchmarks: decide at the barrier
            run.membership.decide(name, StopDecision(step + STOP_AHEAD, reason).to_dict())
            return scan
        try:
            planned = plan_prepared(run, self.layout, facts, scan.next_attempt, reason)
        except NotEnoughNodes as shortage:  # train on as it is; asked again after the next step
            self._say(f"{reason}: {shortage}; training goes on as it is")
            return scan
        except ValueError as error:  # it cannot be prepared: the nodes meet at the barrier and decide there
            self._say(f"{reason}: the next layout cannot be prepared ({error}); stopping at step {step + STOP_AHEAD}")
            run.membership.decide(name, StopDecision(step + STOP_AHEAD, reason).to_dict())
            return scan
        won = run.membership.decide(prepare_name(generation, scan.next_attempt),
                                    PreparedLayout(layout=planned.to_dict(), epoch=facts.epoch).to_dict()).won
        if won:
            self._say(f"preparing generation {planned.generation} while generation {generation} trains ({reason}): "
                      f"ranks {planned.ranks}, {len(planned.transfers.transfers)} transfers of "
                      f"{planned.transfers.bytes_moved} bytes")
        return scan_prepared(run.membership, generation, scan.next_attempt)

    def _say(self, line: str) -> None:
        if line != self._said:
            print(f"node {self.run.node}: {line}", flush=True)
            self._said = line


def reconfiguration_reason(run: WorkerSession, layout: JobLayout, executor: ExecutorFacts) -> str | None:
    """Why :func:`bamboo.reconfig.decide` wants a reconfiguration now (None: carry on)."""
    from bamboo.reconfig import When, decide

    view = cluster_view(run, layout, executor)
    if view is None:
        return None
    decision = decide(view)  # after a failover: "rebuild redundancy after a failover", at least
    if decision.when is When.CARRY_ON:
        return None
    return ", ".join(r.value for r in decision.reasons)


def cluster_view(run: WorkerSession, layout: JobLayout, executor: ExecutorFacts) -> ClusterView | None:
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


def _built(membership: MembershipStore, generation: int) -> set[str]:
    """The nodes that wrote that their part of prepared layout ``generation`` is built, in one read (not one a node)."""
    prefix = built_name(generation, "")
    return {name.removeprefix(prefix) for name in membership.read_decisions(prefix)[0]}
