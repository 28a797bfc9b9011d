"""Make before break without processes: a pause broken down from the nodes' marks, the prepared attempts a
generation writes and closes (first writer wins), a prepared layout as it starts, and the report's view."""

from __future__ import annotations

from typing import Any

import attrs
import pytest
from bamboo.launch.accounting import TimeAccount
from bamboo.launch.event_records import Reconfiguration, Restore, RunStart, Startup, Step
from bamboo.launch.pauses import first_step_excess, pause_breakdown
from bamboo.launch.prepare import abandon_prepared, close_prepared, finalize, prepare_name, scan_prepared
from bamboo.launch.records import AttemptOutcome, NodeUp, PreparedLayout, RecordError
from bamboo.reconfig import JobLayout, LayerSpec, Layout, RestorePoint


def test_a_classic_pause_is_the_barrier_the_decision_the_builds_and_the_transfers_of_the_last_node_up() -> None:
    ups = [
        NodeUp("a", at=14.0, stopped=10.0, planned=11.0, built=12.0, state=13.0),
        NodeUp("b", at=16.0, stopped=10.5, planned=11.5, built=14.0, state=15.5),  # the critical node
        NodeUp("j", at=15.0, planned=11.2, built=13.0, state=14.5),  # a joiner: it never trained
    ]
    pause = pause_breakdown(t0=10.0, go=16.2, ups=ups, first_step_s=0.3, stages=2)
    assert pause.decide_s == pytest.approx(1.0)  # from the last holder stopping (10.5) to b's layout (11.5)
    assert pause.group_builds_s == pytest.approx(2.5)
    assert pause.transfers_s == pytest.approx(1.5)
    assert pause.barrier_s == pytest.approx(6.2 - 1.0 - 2.5 - 1.5)
    assert pause.total_s == pytest.approx(6.5) and pause.first_step_s == 0.3
    assert pause.nodes_s == 0.0  # every node was warm before the holders stopped
    assert pause.line() == ("6.50 s (nodes 0.00, decide 1.00, barrier 1.20, transfers 1.50, group builds 2.50, "
                            "first step 0.30)")


def test_a_prepared_pause_counts_neither_the_plan_nor_the_builds_done_while_training() -> None:
    ups = [NodeUp("a", at=20.4, stopped=20.0, planned=5.0, built=8.0, state=20.3),
           NodeUp("j", at=20.5, planned=5.1, built=9.0, state=20.45)]
    pause = pause_breakdown(t0=20.0, go=20.6, ups=ups, stages=2)
    assert (pause.decide_s, pause.group_builds_s) == (0.0, 0.0)
    assert pause.transfers_s == pytest.approx(0.45) and pause.total_s == pytest.approx(0.6)
    assert first_step_excess(0.9, [0.2, 0.3, 0.25]) == pytest.approx(0.65)
    assert first_step_excess(0.1, [0.2]) == 0.0 and first_step_excess(0.5, []) == 0.0


class _Decisions:
    """First-writer-wins decisions in memory, as ``MembershipStore`` keeps them in etcd."""

    @attrs.frozen
    class Decision:
        value: dict[str, Any]
        won: bool

    def __init__(self) -> None:
        self.values: dict[str, dict[str, Any]] = {}

    def decide(self, name: str, value: dict[str, Any]) -> Any:
        won = name not in self.values
        self.values.setdefault(name, value)
        return self.Decision(self.values[name], won)

    def get_decision(self, name: str) -> Any:
        return self.Decision(self.values[name], False) if name in self.values else None


def _layout(generation: int, attempt: int, start: int = 7) -> JobLayout:
    plan = Layout(stages=2, layers=[LayerSpec(4, 8, 1.0)] * 2, stage_layers=((0, 1), (1, 2)),
                  owners=[["a", "b"]], microbatches=(4,))
    return JobLayout(generation=generation + 1 + attempt, plan=plan, start_step=start, base_generation=generation,
                     attempt=attempt, survivors=("a", "b"), history=[(0, 1), (start, 1)], barrier_step=start)


def test_prepared_attempts_are_scanned_abandoned_and_closed_so_that_every_node_meets_at_one_index() -> None:
    decisions = _Decisions()
    assert scan_prepared(decisions, 3).next_attempt == 0
    decisions.decide(prepare_name(3, 0), PreparedLayout(layout=_layout(3, 0).to_dict(), epoch=2).to_dict())
    scan = scan_prepared(decisions, 3)
    assert scan.open is not None and scan.open.attempt == 0 and scan.open.epoch == 2
    assert scan.open.needs() == {"a", "b"}
    assert abandon_prepared(decisions, scan.open, "a failure")
    decisions.decide(prepare_name(3, 1), PreparedLayout(layout=_layout(3, 1).to_dict(), epoch=3).to_dict())
    assert scan_prepared(decisions, 3).open.attempt == 1  # type: ignore[union-attr]
    assert prepare_name(3, 1) == "g3-a1-prepare"
    # a node goes to the barrier: attempt 1 is aborted, index 2 closed; a second node gets the same index
    assert close_prepared(decisions, 3, "consecutive failure") == (2, None)
    assert close_prepared(decisions, 3, "consecutive failure") == (2, None)
    assert scan_prepared(decisions, 3).closed
    outcome = AttemptOutcome.from_dict(decisions.values["g5-outcome"])
    assert not outcome.go and outcome.reason == "consecutive failure"


def test_a_prepared_attempt_that_went_ahead_is_followed_not_closed() -> None:
    decisions = _Decisions()
    decisions.decide(prepare_name(0, 0), PreparedLayout(layout=_layout(0, 0).to_dict(), epoch=1).to_dict())
    decisions.decide("g1-outcome", AttemptOutcome(True, "every node is up").to_dict())
    attempt, went = close_prepared(decisions, 0, "consecutive failure")
    assert attempt == -1 and went is not None and went.layout.generation == 1


def test_a_prepared_layout_starts_at_the_switch_step_and_the_records_refuse_nonsense() -> None:
    started = finalize(_layout(0, 0, start=7), 12, 99.0)
    assert (started.start_step, started.barrier_step, started.barrier_unix) == (12, 12, 99.0)
    assert started.history == ((0, 1), (12, 1))
    with pytest.raises(ValueError, match="either closed or holds a layout"):
        PreparedLayout(layout=None, closed=False)
    with pytest.raises(RecordError, match="unknown key 'extra'"):
        NodeUp.from_dict({"v": 1, "node": "a", "extra": 1})
    point = RestorePoint(5, "", [1], memory={0: ["a"], 1: ["b", "c"]})
    assert point.source == "memory" and point.to_dict()["memory"] == {"0": ["a"], "1": ["b", "c"]}
    with pytest.raises(ValueError, match="checkpoint's folder or in-memory copies"):
        RestorePoint(5, "", [1])


def test_the_account_keeps_each_pause_apart_from_restores_and_the_first_workers_start() -> None:
    account = TimeAccount()
    events = [RunStart(t=0.0, job="j", unix_time=1.0, target_nodes=2, stages=2, pipelines=1),
              Step(t=10.0, step=1, samples=4, loss=1.0, nodes_active=2, duration_s=2.0),
              Startup(t=10.1, node="a", imports_s=3.0, first_step_s=2.0),
              Startup(t=10.2, node="b", imports_s=5.0, first_step_s=2.1),
              Reconfiguration(t=20.0, reason="r", pipelines=1, stages=2, standby=0, bytes_moved=0, duration_s=0.4,
                              barrier_s=0.1, transfers_s=0.3, prepared=True),
              Reconfiguration(t=30.0, reason="c", pipelines=1, stages=2, standby=0, bytes_moved=0, duration_s=3.0),
              Restore(t=30.0, step=5, path="memory", lost_stages="1", discarded_steps=1, source="memory",
                      duration_s=3.0),
              Startup(t=40.0, node="joiner", imports_s=9.0, first_step_s=1.0)]
    for event in events:
        account.apply(event)
    assert account.pauses == [0.4] and account.prepared == 1 and account.restores == [(3.0, "memory")]
    assert account.parts_s["transfers_s"] == pytest.approx(0.3) and account.restore_s == pytest.approx(3.0)
    assert [s.node for s in account.startups] == ["a", "b"]
    assert account.startup_parts()["imports_s"] == pytest.approx(4.0)


def test_every_decision_of_a_generation_is_under_the_prefix_a_waiting_worker_follows() -> None:
    from bamboo.launch.attempt import up_name
    from bamboo.launch.notices import epoch_decision
    from bamboo.launch.prepare import built_name
    from bamboo.launch.records import outcome_name
    from bamboo.launch.role_watch import GENERATION_DECISIONS
    from bamboo.launch.session import decision_prefix

    names = [prepare_name(3, 0), prepare_name(3, 2), built_name(3, "n1"), up_name(3, "n1"), outcome_name(4),
             epoch_decision(3, 1), decision_prefix(3, 0) + "layout", decision_prefix(3, 1) + "ready-n1"]
    assert all(name.startswith(GENERATION_DECISIONS) for name in names), names
    # the decisions written while a job trains do not wake a waiting worker
    assert not any(name.startswith(GENERATION_DECISIONS) for name in ("checkpoint-10-0", "warm-n1", "handover-n1",
                                                                        "error-n1", "preempted-n1", "end"))


def test_a_build_waiting_for_the_others_reports_the_nodes_not_built_once() -> None:
    """A joiner killed before it joined the groups' rendezvous leaves the others' builds waiting while the current
    layout trains on; once a build has waited STRAGGLER_S, its node reports the nodes not built yet (not itself,
    not the built ones), once."""
    from types import SimpleNamespace

    from bamboo.launch import timeouts
    from bamboo.launch.prepare import Preparation, Prepared, built_name

    reported: list[tuple[str, str]] = []
    built = [SimpleNamespace(key=f"/bamboo/job/decisions/{built_name(8, 'b')}")]
    membership = SimpleNamespace(
        keys=SimpleNamespace(decision=lambda name: f"/bamboo/job/decisions/{name}"),
        kv=SimpleNamespace(get_prefix=lambda prefix: [i for i in built if i.key.startswith(prefix)]))
    layout = _layout(7, 0)  # generation 8: owners a and b
    joined = attrs.evolve(layout, plan=attrs.evolve(layout.plan, owners=[["a", "b"], ["c", "d"]],
                                                    microbatches=(2, 2)), history=[(0, 1), (7, 2)])
    preparation = Preparation.__new__(Preparation)
    waited = [0.0]
    preparation.run = SimpleNamespace(node="a", membership=membership,
                                      report_suspect=lambda node, reason: reported.append((node, reason)))
    preparation.prepared, preparation.layout = Prepared(0, joined, 0), joined
    preparation.store = SimpleNamespace(waited_s=lambda: waited[0])
    preparation.reporter = None
    preparation.report_stragglers()
    assert reported == [] and preparation.reporter is None  # not waiting
    waited[0] = timeouts.STRAGGLER_S
    preparation.report_stragglers()
    reporter = preparation.reporter
    assert reporter is not None
    reporter.join(30)
    preparation.report_stragglers()
    assert preparation.reporter is reporter  # once
    assert [node for node, _ in reported] == ["c", "d"]
    assert reported[0][1] == f"not built in prepared generation 8 after {timeouts.STRAGGLER_S:g} s"


def test_a_restore_after_every_holder_was_lost_counts_the_wait_for_new_nodes_apart_from_the_decision() -> None:
    """Every holder lost at t0 = 10 (the lost layout's last step): machines came back, and the last new worker was
    warm at 20.6; the coordinator's layout reached the critical node at 20.7. The 10.6 s are the nodes' wait (their
    arrival and start), not the decision's."""
    ups = [NodeUp("n1", at=21.2, warm=19.8, planned=20.65, built=20.9, state=21.1),
           NodeUp("n2", at=21.3, warm=20.6, planned=20.7, built=21.0, state=21.25)]  # the critical node
    pause = pause_breakdown(t0=10.0, go=21.4, ups=ups, stages=2)
    assert pause.nodes_s == pytest.approx(10.6) and pause.decide_s == pytest.approx(0.1)
    assert pause.group_builds_s == pytest.approx(0.3) and pause.transfers_s == pytest.approx(0.25)
    assert pause.barrier_s == pytest.approx(11.4 - 10.6 - 0.1 - 0.3 - 0.25)
    assert pause.total_s == pytest.approx(11.4)
    # a layout planned before its last node was warm (a redo after its start): the wait ends at the plan
    early = pause_breakdown(t0=10.0, go=12.0, ups=[NodeUp("n1", at=11.9, warm=11.5, planned=11.0, built=11.6,
                                                           state=11.8)], stages=1)
    assert early.nodes_s == pytest.approx(1.0) and early.decide_s == 0.0


def test_a_joiner_warm_after_the_holders_stopped_is_not_a_wait_for_nodes() -> None:
    """Holders that form a pipeline on their own are planned for at once: a joiner that happened to be warm after
    they stopped leaves the decision's time to the decision."""
    ups = [NodeUp("a", at=14.0, stopped=10.0, planned=11.0, built=12.0, state=13.0),
           NodeUp("j", at=13.5, warm=10.5, planned=11.0, built=12.5, state=13.4)]
    pause = pause_breakdown(t0=10.0, go=14.0, ups=ups, stages=1)
    assert pause.nodes_s == 0.0 and pause.decide_s == pytest.approx(1.0)


def test_holders_fewer_than_a_pipeline_wait_for_new_nodes_and_that_wait_is_not_the_decision() -> None:
    """A consecutive failure left one holder of a 3-stage pipeline (as measured in an ec2-p3 churn run: decide
    1.81 s, of which about 1.6 s was the barrier's "waiting for more nodes"): a standby node was warm long before,
    the third node of the new layout only 1.6 s after the holder stopped. The barrier planned as soon as it could,
    0.2 s later; the layout's fourth node (a second joiner warm later still) does not lengthen the wait."""
    ups = [NodeUp("h", at=12.4, stopped=10.0, warm=1.0, planned=11.8, built=12.0, state=12.3),
           NodeUp("s", at=12.5, warm=2.0, planned=11.8, built=12.1, state=12.4),  # the critical node
           NodeUp("j", at=12.3, warm=11.6, planned=11.8, built=12.0, state=12.2),
           NodeUp("k", at=12.2, warm=11.7, planned=11.8, built=12.0, state=12.1)]
    pause = pause_breakdown(t0=10.0, go=12.6, ups=ups, stages=3)
    assert pause.nodes_s == pytest.approx(1.6) and pause.decide_s == pytest.approx(0.2)
    assert pause.total_s == pytest.approx(2.6)
    # the same nodes, with two holders: they and the standby node form the pipeline at once
    two = [NodeUp("g", at=12.2, stopped=9.9, planned=11.8, built=12.0, state=12.1), *ups]
    assert pause_breakdown(t0=9.9, go=12.6, ups=two, stages=3).nodes_s == 0.0
