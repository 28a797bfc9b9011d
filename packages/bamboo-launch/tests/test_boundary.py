"""A node's step boundaries (:class:`bamboo.launch.stop.Boundary`) in-process: the etcd work of boundary s runs in
the background during step s+1 and is acted on at boundary s+1, the evaluator proposes a stop
:data:`~bamboo.launch.stop.STOP_AHEAD` steps ahead, and a generation's end waits for the work still running.

No etcd: the membership is a stand-in holding decisions in a dict (first writer wins), which records the
thread that touched it.
"""

from __future__ import annotations

import threading
from types import SimpleNamespace
from typing import Any

import attrs
from bamboo.launch.records import FINISH_DECISION, FinishRequest, StopDecision
from bamboo.launch.stop import STOP_AHEAD, Boundary, StepFacts
from bamboo.membership.store import Decision
from bamboo.reconfig import JobLayout, LayerSpec, Layout

LAYERS = [LayerSpec(40, 80, 1.0) for _ in range(4)]
LAYOUT = JobLayout(generation=0, plan=Layout(stages=2, layers=LAYERS, stage_layers=((0, 2), (2, 4)),
                                             owners=[["a", "b"]], microbatches=(2,)),
                   start_step=0, history=[(0, 1)])


@attrs.define
class _Membership:
    decisions: dict[str, dict[str, Any]] = attrs.field(factory=dict)
    threads: set[str] = attrs.field(factory=set)
    gate: threading.Event = attrs.field(factory=threading.Event)

    def get_decision(self, name: str) -> Decision | None:
        self.threads.add(threading.current_thread().name)
        self.gate.wait(10)
        value = self.decisions.get(name)
        return None if value is None else Decision(name, value, won=False, revision=1)

    def decide(self, name: str, value: dict[str, Any]) -> Decision:
        won = name not in self.decisions
        self.decisions.setdefault(name, value)
        return Decision(name, self.decisions[name], won=won, revision=1)


def _boundary(node: str, membership: _Membership, steps: int = 100) -> Boundary:
    run = SimpleNamespace(membership=membership, spec=SimpleNamespace(steps=steps), node=node)
    return Boundary(run, LAYOUT)  # type: ignore[arg-type]


def _executor(step: int, rank: int) -> SimpleNamespace:
    return SimpleNamespace(step=step, dead=set(), epoch=0, rank=rank)


def test_a_stop_read_at_one_boundary_is_acted_on_at_the_next() -> None:
    membership = _Membership()
    membership.decide("g0-stop", StopDecision(9, "rebuild").to_dict())
    boundary = _boundary("b", membership)
    assert boundary.after_step(_executor(5, rank=1)) is None  # the read of boundary 5 starts, off the step's path
    membership.gate.set()  # ... and goes on while step 6 trains
    assert boundary.after_step(_executor(6, rank=1)) == StopDecision(9, "rebuild")  # acted on at boundary 6
    assert boundary.after_step(_executor(7, rank=1)) == StopDecision(9, "rebuild")  # no more reads once stopped
    assert membership.threads == {"bamboo-boundary-g0"}  # never on the training thread
    boundary.settle()


def test_the_evaluator_proposes_a_finish_stop_ahead_in_the_background() -> None:
    membership = _Membership()
    membership.decide(FINISH_DECISION, FinishRequest(by="a test", unix=1.0).to_dict())
    boundary = _boundary("a", membership)
    assert boundary.after_step(_executor(5, rank=0)) is None  # returns while the work waits on etcd
    assert "g0-stop" not in membership.decisions
    membership.gate.set()
    stop = boundary.after_step(_executor(6, rank=0))
    assert stop is not None and (stop.step, stop.finish) == (5 + STOP_AHEAD, True)
    assert "finish requested by a test" in stop.reason


def test_no_proposal_is_made_too_close_to_the_job_s_end() -> None:
    membership = _Membership()
    membership.gate.set()
    membership.decide(FINISH_DECISION, FinishRequest(by="a test", unix=1.0).to_dict())
    boundary = _boundary("a", membership, steps=5 + STOP_AHEAD - 1)
    boundary.after_step(_executor(5, rank=0))
    boundary.settle()
    assert "g0-stop" not in membership.decisions  # the job ends at its last step first


def test_settle_waits_for_the_work_still_running_and_ends_its_thread() -> None:
    membership = _Membership()
    boundary = _boundary("b", membership)
    boundary.after_step(_executor(5, rank=1))
    threading.Timer(0.05, membership.gate.set).start()
    boundary.settle()
    assert membership.gate.is_set()
    assert not [t for t in threading.enumerate() if t.name == "bamboo-boundary-g0" and t.is_alive()
                and not t.daemon]


def test_the_facts_of_a_boundary_are_a_snapshot_of_the_executor() -> None:
    executor = _executor(3, rank=2)
    executor.dead = {1}
    facts = StepFacts.of(executor)
    executor.dead.add(4)
    executor.step = 4
    assert facts == StepFacts(step=3, dead=frozenset({1}), epoch=0, rank=2)
