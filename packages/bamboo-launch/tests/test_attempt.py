"""Unit tests of one reconfiguration attempt's outcome (`bamboo.launch.attempt`), on an in-memory membership (the
outcome's watch on a real etcd)."""

from __future__ import annotations

import datetime
import threading
import weakref
from typing import Any

import attrs
import pytest
import torch.distributed as dist
from bamboo.launch.attempt import (
    AbandonableStore,
    AttemptAbandonedError,
    AttemptWake,
    StartThread,
    await_outcome,
)
from bamboo.launch.records import AttemptOutcome, NodeUp, outcome_name
from bamboo.membership import MembershipStore


@attrs.frozen
class _Decision:
    value: dict[str, Any]
    won: bool


class _Membership:
    """``decide`` (first writer wins), ``get_decision``, ``read_decisions`` and ``list_nodes`` over dicts, each
    decision at its own revision; ``reads`` counts the requests by kind."""

    def __init__(self, nodes: set[str]) -> None:
        self.decisions: dict[str, dict[str, Any]] = {}
        self.revisions: dict[str, int] = {}
        self.nodes = set(nodes)
        self.time = 0.0
        self.reads: dict[str, int] = {"get_decision": 0, "read_decisions": 0, "list_nodes": 0}

    def decide(self, name: str, value: dict[str, Any]) -> _Decision:
        won = name not in self.decisions
        if won:
            self.decisions[name] = value
            self.revisions[name] = len(self.revisions) + 1
        return _Decision(self.decisions[name], won)

    def get_decision(self, name: str) -> _Decision | None:
        self.reads["get_decision"] += 1
        return _Decision(self.decisions[name], False) if name in self.decisions else None

    def read_decisions(self, prefix: str, changed_after: int = 0) -> tuple[dict[str, _Decision], int]:
        self.reads["read_decisions"] += 1
        found = {name: _Decision(value, False) for name, value in self.decisions.items()
                 if name.startswith(prefix) and self.revisions[name] > changed_after}
        return found, len(self.revisions)

    def list_nodes(self, *, skip_malformed: bool = False) -> dict[str, object]:
        self.reads["list_nodes"] += 1
        return dict.fromkeys(self.nodes, object())

    def clock(self) -> float:
        return self.time

    def sleep(self, seconds: float) -> None:
        self.time += seconds


def _await(membership: _Membership, node: str, progress: Any, owners: set[str], needed: set[str],
           timeout_s: float = 60.0) -> Any:
    return await_outcome(membership, 5, node, owners, needed, progress, timeout_s, clock=membership.clock,
                         sleep=membership.sleep)


def test_every_owner_up_is_go() -> None:
    membership = _Membership({"a", "b", "c"})
    membership.decide("g5-up-b", NodeUp("b").to_dict())
    outcome = _await(membership, "a", lambda: (True, None), {"a", "b"}, {"a", "b", "c"})
    assert outcome.go and outcome.won
    assert "g5-up-a" in membership.decisions
    assert membership.decisions["g5-outcome"]["go"] is True


def test_a_needed_node_gone_from_the_membership_aborts() -> None:
    membership = _Membership({"a", "b"})  # the source "c" has no record any more: its lease expired
    outcome = _await(membership, "a", lambda: (False, None), {"a", "b"}, {"a", "b", "c"})
    assert not outcome.go
    assert "c left the membership" in outcome.reason


def test_a_failed_part_aborts_with_its_error() -> None:
    membership = _Membership({"a", "b"})
    outcome = _await(membership, "a", lambda: (True, RuntimeError("Connection closed by peer")), {"a", "b"},
                     {"a", "b"})
    assert not outcome.go
    assert outcome.reason == "a could not start its part: RuntimeError: Connection closed by peer"
    assert "g5-up-a" not in membership.decisions


def test_an_owner_not_up_within_the_timeout_aborts() -> None:
    membership = _Membership({"a", "b"})
    outcome = _await(membership, "a", lambda: (True, None), {"a", "b"}, {"a", "b"}, timeout_s=3.0)
    assert not outcome.go
    assert outcome.reason == "b not up within 3 s"
    assert membership.time > 3.0


def test_the_written_outcome_wins_over_what_this_node_sees() -> None:
    membership = _Membership({"a", "b"})
    membership.decide("g5-outcome", AttemptOutcome(False, "b could not start its part").to_dict())
    membership.decide("g5-up-b", NodeUp("b").to_dict())
    outcome = _await(membership, "a", lambda: (True, None), {"a", "b"}, {"a", "b"})
    assert not outcome.go and not outcome.won
    assert outcome.reason == "b could not start its part"


def test_a_poll_reads_what_is_new_in_requests_that_do_not_grow_with_the_job() -> None:
    """A thousand owners, one of them slow: each poll is one read of the outcome and one of the up records written
    since the last (not a read of each owner not up yet), and every node's record is read only every poll_s."""
    owners = {f"n{index:04d}" for index in range(1000)}
    membership = _Membership(owners)
    for other in sorted(owners - {"n0000", "n0999"}):
        membership.decide(f"g5-up-{other}", NodeUp(other).to_dict())

    def sleep(seconds: float) -> None:
        membership.sleep(seconds)
        if membership.time >= 1.0:  # the slow one comes up a second later
            membership.decide("g5-up-n0999", NodeUp("n0999").to_dict())

    outcome = await_outcome(membership, 5, "n0000", owners, owners, lambda: (True, None), 60.0,
                            clock=membership.clock, sleep=sleep, poll_s=0.2, ready_poll_s=0.02)
    assert outcome.go
    polls = membership.reads["read_decisions"]
    assert 45 <= polls <= 60  # about one a ready poll (20 ms) for a second
    assert membership.reads["get_decision"] == polls  # the outcome, once a poll
    assert membership.reads["list_nodes"] <= 7  # every 0.2 s


def test_the_pause_of_a_reconfiguration_reads_every_up_record_in_one_request() -> None:
    from bamboo.launch.worker_records import reconfiguration_pause

    layout = _base_layout({"a": "a", "b": "b", "c": "c", "d": "a"})
    layout = attrs.evolve(layout, generation=5, start_step=7, barrier_step=7, history=[(0, 2), (7, 2)])
    membership = _Membership(set(layout.ranks))
    for index, node in enumerate(sorted(layout.ranks)):
        membership.decide(f"g5-up-{node}", NodeUp(node, at=104.0 + index, stopped=100.0, planned=101.0,
                                                  built=102.0, state=103.0).to_dict())
    membership.decide("g5-up-z", NodeUp("z", at=200.0, stopped=50.0).to_dict())  # not a node of the layout
    membership.decide("g5-outcome", AttemptOutcome(True, "every node is up", at=108.0).to_dict())
    pause = reconfiguration_pause(membership, layout, 0.0, [])  # type: ignore[arg-type]
    assert membership.reads["read_decisions"] == 1 and membership.reads["get_decision"] == 1  # the outcome
    assert pause.total_s == pytest.approx(8.0)  # from the first stop (100) to go (108): z's records are not read
    assert (pause.decide_s, pause.group_builds_s, pause.transfers_s) == (1.0, 1.0, 1.0)


def test_a_node_outside_the_layout_publishes_nothing_and_follows_the_owners() -> None:
    membership = _Membership({"a", "b", "s"})
    membership.decide("g5-up-a", NodeUp("a").to_dict())
    membership.decide("g5-up-b", NodeUp("b").to_dict())
    outcome = _await(membership, "s", lambda: (True, None), {"a", "b"}, {"a", "b", "s"})
    assert outcome.go
    assert "g5-up-s" not in membership.decisions


def test_an_owner_not_up_after_the_straggler_wait_is_reported_once_and_aborts_once_it_leaves() -> None:
    """A new owner killed before it was up fails no peer's operation: this node, up itself, reports it to its agent
    after ``straggler_s``; the probe finds it dead and revokes its lease, so it leaves the membership and the
    attempt is abandoned then, not at the lease's expiry."""
    membership = _Membership({"a", "b", "c"})
    membership.decide("g5-up-a", NodeUp("a").to_dict())
    reported: list[tuple[str, float]] = []

    def suspect(node: str) -> None:
        reported.append((node, membership.time))
        membership.nodes.discard(node)  # the agent's probe was refused: confirmed, its lease revoked

    outcome = await_outcome(membership, 5, "b", {"a", "b", "c"}, {"a", "b", "c"}, lambda: (True, None), 60.0,
                            clock=membership.clock, sleep=membership.sleep, suspect=suspect, straggler_s=0.5,
                            first_straggler_s=0.15)
    assert [node for node, _ in reported] == ["c"]
    assert 0.5 <= reported[0][1] < 0.6  # b is not the layout's first owner: it waits straggler_s
    assert not outcome.go and "c left the membership" in outcome.reason


def test_the_first_owner_reports_the_owners_not_up_sooner() -> None:
    """A joiner killed at the switch: the layout's first owner by name reports it ``first_straggler_s`` after its
    own part is done (one probe for each straggler), where every other node waits ``straggler_s``."""
    membership = _Membership({"a", "b", "c"})
    membership.decide("g5-up-b", NodeUp("b").to_dict())
    reported: list[tuple[str, float]] = []

    def suspect(node: str) -> None:
        reported.append((node, membership.time))
        membership.nodes.discard(node)

    outcome = await_outcome(membership, 5, "a", {"a", "b", "c"}, {"a", "b", "c"}, lambda: (True, None), 60.0,
                            clock=membership.clock, sleep=membership.sleep, suspect=suspect, straggler_s=0.5,
                            first_straggler_s=0.15)
    assert [node for node, _ in reported] == ["c"]
    assert 0.15 <= reported[0][1] < 0.25
    assert not outcome.go and "c left the membership" in outcome.reason


def test_a_part_that_ends_during_a_rounds_reads_publishes_its_up_record_without_waiting_a_poll() -> None:
    # A switch measured 0.2 s of its 0.25 s pause here: two owners' parts ended while their round read etcd, and
    # each slept the 0.2 s poll of a running part before it published that it was up.
    membership = _Membership({"a", "b"})
    membership.decide("g5-up-b", NodeUp("b").to_dict())
    progress_calls: list[float] = []

    def progress() -> tuple[bool, BaseException | None]:
        progress_calls.append(membership.time)
        return len(progress_calls) > 1, None  # running when the round asks, done by the time it would sleep

    outcome = await_outcome(membership, 5, "a", {"a", "b"}, {"a", "b"}, progress, 60.0, clock=membership.clock,
                            sleep=membership.sleep, poll_s=0.2, ready_poll_s=0.02)
    assert outcome.go and "g5-up-a" in membership.decisions
    assert membership.time == 0.0  # no sleep at all: the next round published and found every owner up


def test_a_node_whose_own_part_runs_reports_nobody() -> None:
    membership = _Membership({"a", "b"})
    reported: list[str] = []
    outcome = await_outcome(membership, 5, "a", {"a", "b"}, {"a", "b"}, lambda: (False, None), 3.0,
                            clock=membership.clock, sleep=membership.sleep, suspect=reported.append, straggler_s=0.5)
    assert not outcome.go and reported == []  # its own transfers may be what the others wait for


def test_a_node_waiting_for_the_others_reports_the_owners_not_up_once_before_its_part_is_done() -> None:
    """A new owner killed before it joined the group's rendezvous fails nobody's operation: the others' parts wait
    for it at the rendezvous and never finish. Waiting there over ``straggler_s`` reports it (measured: an attempt
    that waited 1.8 s for a dead owner's lease, and its coordinator died meanwhile)."""
    membership = _Membership({"a", "b", "c"})
    reported: list[tuple[str, float]] = []

    def suspect(node: str) -> None:
        reported.append((node, membership.time))
        if node == "b":
            membership.nodes.discard(node)  # refused: confirmed and its lease revoked; "c" answered the probe

    outcome = await_outcome(membership, 5, "a", {"a", "b", "c"}, {"a", "b", "c"}, lambda: (False, None), 60.0,
                            clock=membership.clock, sleep=membership.sleep, suspect=suspect, straggler_s=0.5,
                            waited_s=lambda: membership.time)  # waiting since the attempt began
    assert [node for node, _ in reported] == ["b", "c"]  # each once, both alike: this node cannot tell which
    assert 0.5 <= reported[0][1] < 0.5 + 0.2 + 1e-9  # within one running part's poll after the wait
    assert not outcome.go and "b left the membership" in outcome.reason


def test_short_waits_report_nobody() -> None:
    """A rendezvous that waits a moment for each of several live peers is not waiting for a dead one."""
    membership = _Membership({"a", "b"})
    reported: list[str] = []
    outcome = await_outcome(membership, 5, "a", {"a", "b"}, {"a", "b"}, lambda: (False, None), 3.0,
                            clock=membership.clock, sleep=membership.sleep, suspect=reported.append,
                            straggler_s=0.3, waited_s=lambda: membership.time % 0.25)
    assert reported == [] and not outcome.go and membership.time > 3.0


def test_a_node_waiting_then_done_reports_an_owner_still_not_up_again() -> None:
    """The report while waiting found the owner alive; once this node's part is done, the owner still not up after
    ``straggler_s`` is reported once more (it may have died since)."""
    membership = _Membership({"a", "b"})
    reported: list[tuple[str, float]] = []
    outcome = await_outcome(membership, 5, "b", {"a", "b"}, {"a", "b"}, lambda: (membership.time >= 1.0, None),
                            3.0, clock=membership.clock, sleep=membership.sleep,
                            suspect=lambda node: reported.append((node, membership.time)), straggler_s=0.5,
                            waited_s=lambda: membership.time)
    assert [node for node, _ in reported] == ["a", "a"]
    assert reported[0][1] < 1.0 <= reported[1][1] - 0.5
    assert not outcome.go


def _store() -> AbandonableStore:
    return AbandonableStore(dist.HashStore())


def test_abandonable_store_passes_calls_through() -> None:
    store = _store()
    store.set("k", b"v")
    assert store.get("k") == b"v"
    assert store.add("n", 2) == 2
    assert store.check(["k", "n"]) and not store.check(["missing"])
    store.wait(["k"], datetime.timedelta(seconds=1))


def test_abandonable_store_refuses_every_call_once_abandoned() -> None:
    store = _store()
    store.set("k", b"v")
    store.abandon()
    assert store.abandoned
    for call in (lambda: store.set("k", b"w"), lambda: store.get("k"), lambda: store.add("n", 1),
                 lambda: store.check(["k"]), lambda: store.num_keys(), lambda: store.delete_key("k")):
        with pytest.raises(AttemptAbandonedError, match="abandoned"):
            call()


def test_abandoning_ends_a_wait_in_progress() -> None:
    store = _store()
    waiting = threading.Event()

    def wait_for_a_key_nobody_sets() -> None:
        waiting.set()
        store.wait(["never"], datetime.timedelta(seconds=600))

    part = StartThread(wait_for_a_key_nobody_sets, name="test-wait")
    assert waiting.wait(30)
    store.abandon()
    assert part.join(30)
    done, error = part.progress()
    assert done and isinstance(error, AttemptAbandonedError)


def test_the_store_says_how_long_a_wait_for_a_key_not_set_yet_has_lasted() -> None:
    store = _store()
    store.set("here", b"1")
    store.wait(["here"])
    assert store.waited_s() == 0.0  # the key was there: no wait
    part = StartThread(lambda: store.get("later"), name="test-waiting")
    for _ in range(3000):
        if store.waited_s() > 0.05:
            break
        part.join(0.01)
    first = store.waited_s()
    assert first > 0.05 and store.waited_s() >= first  # it grows while the wait lasts
    store.set("later", b"2")
    assert part.join(30) and part.result == b"2"
    assert store.waited_s() == 0.0  # and is over when the wait ends


def test_a_wait_without_the_key_times_out() -> None:
    with pytest.raises(TimeoutError, match="not set within"):
        _store().wait(["never"], datetime.timedelta(seconds=0.05))


def test_start_thread_reports_its_result() -> None:
    part = StartThread(lambda: 42, name="test-result")
    assert part.join(30)
    assert part.progress() == (True, None) and part.result == 42


def test_start_thread_drops_its_work_once_done() -> None:
    """The work's closure holds the previous layout's executor in the launcher: it must not outlive the work."""

    class State:
        pass

    state = State()
    held = weakref.ref(state)
    part = StartThread(lambda state=state: 42, name="test-drop")
    del state
    assert part.join(30)
    part.thread.join(30)
    assert held() is None and part.result == 42


def test_an_abandoned_start_hands_its_result_to_the_cleanup_now_or_when_it_ends() -> None:
    cleaned: list[Any] = []
    finished = StartThread(lambda: "engine 1", name="test-abandon-done")
    assert finished.join(30)
    finished.abandon(cleaned.append)  # already done: cleaned up at once, not kept
    assert cleaned == ["engine 1"] and finished.result is None

    release = threading.Event()
    running = StartThread(lambda: release.wait(30) and "engine 2", name="test-abandon-running")
    running.abandon(cleaned.append)  # still starting: cleaned up by its thread when it ends
    assert cleaned == ["engine 1"]
    release.set()
    assert running.join(30)
    assert cleaned == ["engine 1", "engine 2"] and running.result is None

    failed = StartThread(lambda: 1 / 0, name="test-abandon-failed")
    failed.abandon(cleaned.append)  # no result: nothing to clean up
    assert failed.join(30) and isinstance(failed.progress()[1], ZeroDivisionError)
    assert cleaned == ["engine 1", "engine 2"]



def test_start_thread_sets_the_wakes_it_is_given_when_its_work_ends() -> None:
    release = threading.Event()
    running = StartThread(lambda: release.wait(30), name="test-wake-running")
    early = threading.Event()
    running.wake_on_end(early)
    assert not early.is_set()
    release.set()
    assert early.wait(30)
    late = threading.Event()
    running.wake_on_end(late)  # given after the end: set at once
    assert late.is_set()


def test_an_abort_written_by_another_node_ends_the_wait_of_a_node_whose_part_is_blocked(
    membership: MembershipStore,
) -> None:
    """A node's part blocked on a dead peer: the other node's ``abort`` reaches its wait through the outcome's
    watch, not its next poll (here a poll of 600 s, which the test would wait out)."""
    blocked = threading.Event()
    part = StartThread(lambda: blocked.wait(600), name="test-blocked-part")
    wake = AttemptWake(membership, 7, part)
    outcomes: list[Any] = []
    sleeping = threading.Event()

    def sleep(seconds: float) -> None:
        sleeping.set()
        wake.sleep(seconds)

    waiting = threading.Thread(target=lambda: outcomes.append(await_outcome(
        membership, 7, "b", {"a", "b"}, set(), part.progress, 3600.0, poll_s=600.0, sleep=sleep)))
    try:
        waiting.start()
        assert sleeping.wait(60)  # its first round found nothing to decide: it waits for the next
        membership.decide(outcome_name(7), AttemptOutcome(False, "a could not start its part").to_dict())
        waiting.join(60)
        assert not waiting.is_alive()
        assert outcomes[0].go is False and outcomes[0].reason == "a could not start its part"
        assert not part.progress()[0]  # its part still blocked: only the outcome ended the wait
    finally:
        blocked.set()
        wake.close()
        waiting.join(60)


def test_the_end_of_the_part_ends_a_sleep_and_wakes_once(membership: MembershipStore) -> None:
    release = threading.Event()
    part = StartThread(lambda: release.wait(600), name="test-ending-part")
    wake = AttemptWake(membership, 8, part)
    try:
        sleeper = threading.Thread(target=lambda: wake.sleep(600))
        sleeper.start()
        release.set()
        sleeper.join(60)
        assert not sleeper.is_alive()
        assert not wake._woken.is_set()  # that wake is spent: the next sleep lasts its poll
    finally:
        wake.close()


# ---- the redone decision (bamboo.launch.barrier.plan_next) ---------------------------------------------------


@attrs.frozen
class _Record:
    zone: str


class _Kv:
    def __init__(self, run: _Run) -> None:
        self.run = run

    def get_prefix(self, prefix: str) -> list[Any]:  # the warm records of the nodes alive; no in-memory copies
        if not prefix.startswith("/bamboo/j/decisions/warm-"):
            return []
        return [_Item(f"/bamboo/j/decisions/warm-{node}") for node in self.run.zones]


@attrs.frozen
class _Item:
    key: str


class _Keys:
    def decision(self, name: str) -> str:
        return f"/bamboo/j/decisions/{name}"


class _Run:
    """What ``_plan_next`` reads of a worker: the spec, the membership (nodes alive, warm records), the layers."""

    def __init__(self, zones: dict[str, str], checkpoint_dir: str | None = None) -> None:
        from bamboo.launch.spec import JobSpec

        self.spec = JobSpec(job="j", stages=2, pipelines=2, steps=10, micro_batches=4, created_unix=1.0,
                            layers=[layer.to_dict() for layer in _layers()], config={},
                            checkpoint_dir=checkpoint_dir)
        self.layers = self.spec.reconfig_layers()
        self.zones = zones
        self.membership = self
        self.kv = _Kv(self)
        self.keys = _Keys()
        self.event_reader = None  # the mode choice reads the log through ``kv``

    def list_nodes(self, *, skip_malformed: bool = False) -> dict[str, _Record]:
        return {node: _Record(zone) for node, zone in self.zones.items()}


def _layers() -> list[Any]:
    from bamboo.reconfig import LayerSpec

    return [LayerSpec(400 * (1 + i % 2), 800 * (1 + i % 2), 100.0 * (1 + i % 2)) for i in range(6)]


def _base_layout(zones: dict[str, str]) -> Any:
    """Generation 0 of 4 nodes, P=2, D=2, as the coordinator writes it."""
    from bamboo.launch.coordinator_layouts import first_layout

    return first_layout(_Run(zones).spec, zones)


def _ready(step: int, holds: list[int], at: float) -> Any:
    from bamboo.launch.records import BarrierReady

    return BarrierReady(step=step, holds=holds, at=at)


def _plan(run: _Run, base: Any, ready: dict[str, Any], attempt: int) -> Any:
    from bamboo.launch.barrier import plan_next as _plan_next

    return _plan_next(run, base, ready, attempt, "test")  # type: ignore[arg-type]


def test_a_redone_decision_takes_the_next_generation_and_another_surviving_copy() -> None:
    from bamboo.reconfig import JobLayout, StartMode

    zones = {"n0": "a", "n1": "b", "n2": "c", "n3": "a"}
    base = _base_layout(zones)
    owner = base.node_of_rank
    lost = owner[1]  # stage 1 of pipeline 0 failed over: its shadow holds stages 0 and 1
    survivors = {node: _ready(7, [0, 1], 100.0 + rank) for node, rank in base.ranks.items() if node != lost}
    run = _Run({**{n: z for n, z in zones.items() if n != lost}, "j1": "b"})  # a joiner, j1
    first = _plan(run, base, survivors, 0)
    assert JobLayout.from_json(first.to_json()) == first
    assert first.generation == 1 and first.attempt == 0 and first.mode is StartMode.PEERS
    assert first.survivors == tuple(sorted(survivors)) and first.barrier_unix == 100.0
    transfers = first.transfers.transfers
    assert "j1" in first.ranks and transfers and all(t.destination == "j1" for t in transfers)
    assert first.transfers.bytes_moved == sum(t.bytes for t in transfers)
    dead_source = transfers[0].source
    # the source dies while generation 1 starts: the holders decide again without it
    del run.zones[dead_source]
    again = _plan(run, base, {n: r for n, r in survivors.items() if n != dead_source}, 1)
    assert again.generation == 2 and again.attempt == 1 and again.base_generation == 0
    assert again.start_step == 7 and again.mode is StartMode.PEERS
    assert dead_source not in again.ranks and dead_source not in again.survivors
    assert all(t.source != dead_source for t in again.transfers.transfers)
    assert again.history == ((0, 2), (7, again.pipelines))


def test_the_transfer_plan_moves_whole_stages_round_by_round() -> None:
    zones = {"n0": "a", "n1": "b", "n2": "c", "n3": "a"}
    base = _base_layout(zones)
    lost = base.node_of_rank[3]  # stage 1 of pipeline 1
    ready = {node: _ready(4, [0, 1], 1.0) for node in base.ranks if node != lost}
    layout = _plan(_Run({**{n: z for n, z in zones.items() if n != lost}, "j1": "c"}), base, ready, 0)
    for round_ in layout.transfers.rounds:
        assert len({t.source for t in round_}) == len(round_) and len({t.destination for t in round_}) == len(round_)
        for transfer in round_:
            stages = layout.stages_of_layers(transfer.layers)  # whole stages, or it raises
            assert stages and set(stages) <= {0, 1}


def test_a_redone_decision_without_any_copy_of_a_stage_starts_over_from_the_initial_state(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No live holder, no in-memory copy and no checkpoint: the job is not lost, it starts over from step 0 (its
    seeded initial state, exactly), and the log says what was lost and what would have saved the steps done."""
    from bamboo.reconfig import StartMode

    zones = {"n0": "a", "n1": "b", "n2": "c", "n3": "a"}
    base = _base_layout(zones)
    holder = base.node_of_rank[2]  # only pipeline 1's stage 0 is left, holding stage 0 alone
    run = _Run({holder: zones[holder], "j1": "b", "j2": "c"})
    layout = _plan(run, base, {holder: _ready(7, [0], 1.0)}, 1)
    assert layout.mode is StartMode.CHECKPOINT and layout.start_step == 0 and layout.barrier_step == 7
    assert layout.restore is not None and layout.restore.initial and layout.restore.source == "initial"
    assert layout.history == ((0, layout.pipelines),)
    assert "every copy of stage(s) 1 is gone and the run writes no checkpoints" in capsys.readouterr().err


def test_a_holder_whose_lease_expired_after_the_barrier_is_no_source() -> None:
    zones = {"n0": "a", "n1": "b", "n2": "c", "n3": "a"}
    base = _base_layout(zones)
    owner = base.node_of_rank
    ready = {node: _ready(7, [0, 1], 1.0) for node in zones if node != owner[1]}
    gone = owner[2]  # published what it holds, then died before the layout was written
    run = _Run({**{n: z for n, z in zones.items() if n not in (owner[1], gone)}, "j1": "b", "j2": "c"})
    value = _plan(run, base, ready, 0)
    assert gone not in value.survivors and gone not in value.ranks
    assert all(gone not in (t.source, t.destination) for t in value.transfers.transfers)


class _Reported(Exception):
    """Ends a barrier's wait in a test once it reports a straggler."""


class _BarrierRun:
    """What :func:`bamboo.launch.barrier.next_layout` reads of a worker: three holders registered, none of the
    others at the barrier; reporting a suspect ends the wait (:class:`_Reported`)."""

    node = "a"

    def __init__(self) -> None:
        from bamboo.rc import CommTimeouts

        self.membership = self
        self.timeouts = CommTimeouts(build=30.0)
        self.reported: list[str] = []

    def get_decision(self, name: str) -> None:
        return None

    def read_decisions(self, prefix: str, changed_after: int = 0) -> tuple[dict[str, object], int]:
        return {}, 0

    def list_nodes(self, *, skip_malformed: bool = False) -> dict[str, object]:
        return dict.fromkeys(("a", "b", "c"), object())

    def report_suspect(self, node: str, reason: str) -> None:
        self.reported.append(node)
        if len(self.reported) == 2:
            raise _Reported(reason)


def test_holders_missing_from_the_barrier_are_reported_after_the_straggler_wait(monkeypatch: pytest.MonkeyPatch) -> None:
    from bamboo.launch import timeouts
    from bamboo.launch.barrier import next_layout

    monkeypatch.setattr(timeouts, "STRAGGLER_S", 0.05)
    run = _BarrierRun()
    base = _base_layout({"a": "a", "b": "b", "c": "c", "d": "a"})
    with pytest.raises(_Reported, match=r"not at the barrier of generation 0 after 0.05 s"):
        next_layout(run, base, lambda records: sorted(records), 0, "test")  # type: ignore[arg-type]
    assert run.reported == ["b", "c"]  # each other expected holder, not this node
