"""Tests of the emulated spot market: the pure plan, the scheduler on a fake clock, real SIGKILLs."""

from __future__ import annotations

import re
import signal
from pathlib import Path

import attrs
import pytest
from bamboo.bench.emulated.market import (
    ActionKind,
    MarketAction,
    SpotMarket,
    market_rate,
    plan_market,
)
from bamboo.bench.emulated.processes import ProcessCluster, kill_process_group
from bamboo.bench.preemptions import assign_zones
from hypothesis import given, settings
from hypothesis import strategies as st


@attrs.frozen
class Ev:
    """A trace event of the minimal shape the market reads."""

    time_s: float
    kind: str
    node: str
    zone: str


def compact(plan) -> list[str]:
    return [str(action) for action in plan]


TRACE = [
    Ev(0, "add", "n0", "a"),
    Ev(0, "add", "n1", "b"),
    Ev(600, "remove", "n1", "b"),
    Ev(900, "add", "n2", "c"),
    Ev(1200, "remove", "n0", "a"),
    Ev(1200, "add", "n3", "a"),
    Ev(1230, "remove", "n3", "a"),  # removed before its delayed start: never runs
]


def test_plan_by_hand() -> None:
    plan = plan_market(TRACE, time_scale=60, allocation_delay_s=1.0, notice_s=2.0)
    assert compact(plan) == [
        "add n0@a@0s",
        "add n1@b@0s",
        "notify n1@b@8s",
        "kill n1@b@10s",
        "add n2@c@16s",
        "notify n0@a@18s",
        "kill n0@a@20s",
        # n3: added at 1200 s (20 s + 1 s delay) but removed at 20.5 s: never started.
    ]
    notice = plan[2]
    assert notice.kind is ActionKind.NOTIFY and notice.deadline_s == 10.0


def test_plan_without_notice_and_with_zones_override() -> None:
    zones = assign_zones(TRACE, ["z1", "z2"])
    assert zones == {"n0": "z1", "n1": "z2", "n2": "z1", "n3": "z2"}
    plan = plan_market(TRACE, time_scale=60, zone_of=zones)
    assert compact(plan) == [
        "add n0@z1@0s",
        "add n1@z2@0s",
        "kill n1@z2@10s",
        "add n2@z1@15s",
        "add n3@z2@20s",
        "kill n0@z1@20s",
        "kill n3@z2@20.5s",
    ]


def test_notice_longer_than_life_comes_at_start() -> None:
    plan = plan_market(
        [Ev(0, "add", "n0", "a"), Ev(60, "add", "n1", "a"), Ev(90, "remove", "n1", "a")],
        time_scale=1,
        notice_s=100,
    )
    assert compact(plan) == ["add n0@a@0s", "add n1@a@60s", "notify n1@a@60s", "kill n1@a@90s"]


@pytest.mark.parametrize(
    ("events", "message"),
    [
        ([Ev(5, "remove", "ghost", "a")], "removes node 'ghost' at 5s but it is not alive"),
        ([Ev(0, "add", "n0", "a"), Ev(1, "add", "n0", "a")], "adds node 'n0' at 1s but it is already alive"),
        ([Ev(0, "explode", "n0", "a")], "'add' or 'remove', got 'explode'"),
    ],
)
def test_plan_rejects_impossible_traces(events: list[Ev], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_market(events)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"time_scale": 0}, "time_scale must be > 0, got 0"),
        ({"allocation_delay_s": -1}, "allocation_delay_s must be >= 0, got -1"),
        ({"notice_s": -2}, "notice_s must be >= 0, got -2"),
    ],
)
def test_plan_rejects_bad_parameters(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        plan_market(TRACE, **kwargs)


@st.composite
def traces(draw) -> list[Ev]:
    """Valid random traces: nodes are added, some removed later, times sorted."""
    events = []
    alive: list[str] = []
    t = 0.0
    for index in range(draw(st.integers(0, 25))):
        t += draw(st.sampled_from([0.0, 30.0, 60.0, 600.0]))
        if alive and draw(st.booleans()):
            node = alive.pop(draw(st.integers(0, len(alive) - 1)))
            events.append(Ev(t, "remove", node, "z"))
        else:
            node = f"n{index}"
            alive.append(node)
            events.append(Ev(t, "add", node, draw(st.sampled_from("abc"))))
    return events


@settings(deadline=None, max_examples=60)
@given(traces(), st.sampled_from([1.0, 60.0]), st.sampled_from([0.0, 5.0, 45.0]), st.sampled_from([0.0, 2.0]))
def test_plan_invariants(events: list[Ev], scale: float, delay: float, notice: float) -> None:
    plan = plan_market(events, time_scale=scale, allocation_delay_s=delay, notice_s=notice)
    times = [a.at_s for a in plan]
    assert times == sorted(times)
    seen: dict[str, list[ActionKind]] = {}
    for action in plan:
        seen.setdefault(action.node, []).append(action.kind)
    for node, kinds in seen.items():
        assert kinds[0] is ActionKind.ADD, node
        assert kinds in (
            [ActionKind.ADD],
            [ActionKind.ADD, ActionKind.KILL],
            [ActionKind.ADD, ActionKind.NOTIFY, ActionKind.KILL],
        ), (node, kinds)
    removed = {e.node for e in events if e.kind == "remove"}
    killed = {a.node for a in plan if a.kind is ActionKind.KILL}
    assert killed <= removed
    if delay == 0:
        # Without an allocation delay every node that lived a while is replayed.
        lived = {e.node for e in events if e.kind == "remove"} - {
            e.node
            for e in events
            for f in events
            if e.kind == "add" and f.kind == "remove" and f.node == e.node and f.time_s == e.time_s
        }
        assert killed == lived


class RecordingActions:
    """MarketActions that record calls with the clock's time."""

    def __init__(self, clock) -> None:
        self.clock = clock
        self.calls: list[tuple[float, str, str]] = []
        self.counter = 0

    def add(self, zone: str) -> str:
        node = f"live{self.counter}"
        self.counter += 1
        self.calls.append((self.clock.now(), "add", f"{node}@{zone}"))
        return node

    def kill(self, node: str) -> None:
        self.calls.append((self.clock.now(), "kill", node))

    def notify(self, node: str, deadline: float) -> None:
        self.calls.append((self.clock.now(), "notify", f"{node} until {deadline:g}"))


def test_market_runs_the_plan_on_its_clock(fake_clock) -> None:
    plan = plan_market(TRACE, time_scale=60, allocation_delay_s=1.0, notice_s=2.0)
    actions = RecordingActions(fake_clock)
    executed = []
    market = SpotMarket(plan, actions, clock=fake_clock, on_action=executed.append)
    market.run()
    assert market.done and not market.failures
    assert actions.calls == [
        (1000.0, "add", "live0@a"),
        (1000.0, "add", "live1@b"),
        (1008.0, "notify", "live1 until 1010"),
        (1010.0, "kill", "live1"),
        (1016.0, "add", "live2@c"),
        (1018.0, "notify", "live0 until 1020"),
        (1020.0, "kill", "live0"),
    ]
    assert [e.executed_at_s for e in executed] == [0, 0, 8, 10, 16, 18, 20]
    assert market.live_nodes == {"n2": "live2"}


def test_run_due_only_runs_what_is_due(fake_clock) -> None:
    plan = plan_market(TRACE, time_scale=60)
    actions = RecordingActions(fake_clock)
    market = SpotMarket(plan, actions, clock=fake_clock)
    assert market.run_due() == 10.0
    assert len(actions.calls) == 2
    fake_clock.advance(9.999)
    assert market.run_due() == 10.0
    fake_clock.advance(0.001)
    assert market.run_due() == 15.0
    assert actions.calls[-1] == (1010.0, "kill", "live1")


def test_failing_action_is_recorded_and_replay_goes_on(fake_clock) -> None:
    class Flaky(RecordingActions):
        def kill(self, node: str) -> None:
            raise OSError("boom")

    market = SpotMarket(plan_market(TRACE, time_scale=60), Flaky(fake_clock), clock=fake_clock)
    market.run()
    assert market.done
    assert [str(a) for a, _ in market.failures] == ["kill n1@b@10s", "kill n0@a@20s", "kill n3@a@20.5s"]


def test_kill_process_group_of_dead_group_is_false() -> None:
    import subprocess

    process = subprocess.Popen(["true"], start_new_session=True)
    process.wait()
    assert kill_process_group(process.pid) is False


def test_real_processes_whole_group_dies(fake_clock, proc_helpers, tmp_path: Path) -> None:
    # Each node is a shell that starts a background grandchild: both are in the node's group.
    def command(node: str, zone: str) -> list[str]:
        marker = tmp_path / f"{node}.noticed"
        return [
            "sh",
            "-c",
            # Written, then renamed: the marker appears only once it holds the zone.
            f'trap "echo $BAMBOO_ZONE > {marker}.part && mv {marker}.part {marker}" TERM; '
            "sleep 1000 & while true; do sleep 0.05; done",
        ]

    trace = [
        Ev(0, "add", "t0", "a"),
        Ev(0, "add", "t1", "b"),
        Ev(60, "remove", "t0", "a"),
        Ev(120, "add", "t2", "c"),
    ]
    with ProcessCluster(command, log_dir=tmp_path / "logs") as cluster:
        market = SpotMarket(plan_market(trace, time_scale=60, notice_s=0.5), cluster, clock=fake_clock)
        assert market.run_due() == 0.5
        assert sorted(cluster.processes) == ["node0", "node1"]
        leader = cluster.processes["node0"].pid
        assert proc_helpers.wait(lambda: len(proc_helpers.group_members(leader)) >= 2), (
            "grandchild not started"
        )
        fake_clock.advance(0.5)
        market.run_due()  # notice: SIGTERM to the leader, which traps it and lives on
        assert proc_helpers.wait(lambda: (tmp_path / "node0.noticed").exists())
        assert (tmp_path / "node0.noticed").read_text().strip() == "a"
        assert cluster.processes["node0"].poll() is None
        fake_clock.advance(0.5)
        market.run_due()  # the kill: SIGKILL to the whole group
        assert cluster.processes["node0"].returncode == -signal.SIGKILL
        assert proc_helpers.wait(lambda: proc_helpers.group_members(leader) == []), "grandchild survived"
        assert cluster.alive() == ["node1"]
        market.run()
        assert cluster.alive() == ["node1", "node2"] and cluster.zones["node2"] == "c"
        survivor = cluster.processes["node1"].pid
        assert cluster.notices[0][0] == "node0"
    # Closing the cluster kills the rest, groups included.
    assert proc_helpers.wait(lambda: proc_helpers.group_members(survivor) == [])


def test_action_string_form() -> None:
    assert str(MarketAction(1.5, ActionKind.KILL, "node3", "us-east-1a")) == "kill node3@us-east-1a@1.5s"
    with pytest.raises(ValueError, match=re.escape("'at_s' must be >= 0.0: -1")):
        MarketAction(-1, ActionKind.ADD, "n", "z")


def test_market_rate_is_the_plans_kills_per_node_hour_of_wall_time() -> None:
    """4 nodes for an hour, one killed at 30 min (3.5 node-hours) and one added at 45 min (+0.25): 1 kill over
    3.75 node-hours; a plan without kills has rate 0; actions after the span are left out."""
    plan = [*(MarketAction(0.0, ActionKind.ADD, f"n{i}", "a") for i in range(4)),
            MarketAction(1800.0, ActionKind.KILL, "n1", "a"), MarketAction(2700.0, ActionKind.ADD, "n4", "b"),
            MarketAction(7200.0, ActionKind.KILL, "n2", "a")]
    assert market_rate(plan, 3600.0) == pytest.approx(1 / 3.75)
    assert market_rate(plan[:4], 3600.0) == 0.0
    with pytest.raises(ValueError, match="duration_s must be > 0, got 0"):
        market_rate(plan, 0)


def test_adds_pending_says_whether_the_plan_still_starts_a_node(fake_clock) -> None:
    market = SpotMarket(plan_market(TRACE, time_scale=60), RecordingActions(fake_clock), clock=fake_clock)
    assert market.adds_pending
    market.run_due()
    fake_clock.advance(15.0)
    market.run_due()
    assert market.adds_pending  # n2 has started; n3 starts at 20 s
    fake_clock.advance(5.0)
    market.run_due()
    assert not market.adds_pending  # only n3's kill is left
    market.run()
    assert market.done and not market.adds_pending
