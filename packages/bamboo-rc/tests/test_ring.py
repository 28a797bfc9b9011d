"""P = 1 (pure data parallelism): the shadow ring's owners, the ring agreement and the reduction's buffers, in-process.

No processes, no sleeps: a dictionary for the store and a clock that only moves when slept on .
"""

from __future__ import annotations

import itertools
from typing import TYPE_CHECKING

import pytest
from bamboo.rc.config import load_config
from bamboo.rc.coordinator import FailoverCoordinator
from bamboo.rc.failures import AgreementError, FailureEvent, StoreFailureNotices
from bamboo.rc.layout import Layout
from bamboo.rc.records import CommitResult, ProgressRecord
from bamboo.rc.ring import RingNode
from bamboo.rc.timeouts import CommTimeouts
from bamboo.schedule import one_f_one_b

if TYPE_CHECKING:
    from conftest import FakeClock

JOB = "job"
TIMEOUTS = CommTimeouts(group=5.0, build=5.0, confirm=2.0)


class FakeStore:
    """A c10d store's set/get/check over a dictionary."""

    def __init__(self) -> None:
        self.data: dict[str, bytes] = {}

    def set(self, key: str, value: str | bytes) -> None:
        self.data[key] = value.encode() if isinstance(value, str) else value

    def get(self, key: str) -> bytes:
        return self.data[key]

    def check(self, keys: list[str]) -> bool:
        return all(key in self.data for key in keys)


@pytest.fixture
def clock(fake_clock: FakeClock) -> FakeClock:
    """The suite's :class:`FakeClock`, started at 0: a test reads its time as the time since the start."""
    fake_clock.t = 0.0
    return fake_clock


class Ring:
    """D coordinators of a P = 1 job over one fake store, and the authority that publishes events."""

    def __init__(self, pipelines: int, clock: FakeClock) -> None:
        self.store = FakeStore()
        self.clock = clock
        self.layout = Layout(1, pipelines)
        schedule = one_f_one_b(1, 4, rc="none")
        self.authority = StoreFailureNotices(self.store, JOB)
        self.nodes = {
            d: FailoverCoordinator(self.store, JOB, self.layout, d, 0, schedule,
                                   StoreFailureNotices(self.store, JOB, self.clock), TIMEOUTS, self.clock)
            for d in range(pipelines)
        }

    def publish(self, epoch: int, victims: list[int], handover: bool = False) -> None:
        self.authority.publish(FailureEvent(epoch, victims, handover))


def test_a_dead_nodes_share_goes_to_the_next_live_node_of_the_ring() -> None:
    layout = Layout(1, 4)
    assert layout.ring_owners(set()) == {0: 0, 1: 1, 2: 2, 3: 3}
    assert layout.ring_owners({1}) == {0: 0, 1: 2, 2: 2, 3: 3}
    assert layout.ring_owners({3}) == {0: 0, 1: 1, 2: 2, 3: 0}  # last to first
    assert layout.ring_owners({1, 2}) == {0: 0, 1: 3, 2: 3, 3: 3}  # a node and its shadow: the next one
    assert layout.ring_shares(3, {1, 2}) == (1, 2, 3)
    assert layout.ring_shadow(0, {1, 2}) == 3 and layout.ring_shadowed(0, {1, 2}) == 3
    assert layout.ring_shadow(2, set()) == 3 and layout.ring_shadowed(2, set()) == 1
    assert layout.ring_shadow(0, {1, 2, 3}) is None and layout.ring_owners({1, 2, 3}) == dict.fromkeys(range(4), 0)
    with pytest.raises(ValueError, match=r"every node of the 4 pipelines is dead"):
        layout.ring_owner(0, {0, 1, 2, 3})
    with pytest.raises(ValueError, match=r"P = 1 only, got P = 2"):
        Layout(2, 2).ring_owners(set())


@pytest.mark.parametrize("pipelines", [2, 3, 4, 5])
def test_the_owners_depend_on_the_dead_alone_whatever_the_order_of_the_deaths(pipelines: int) -> None:
    layout = Layout(1, pipelines)
    for count in range(1, pipelines):
        for dead in itertools.combinations(range(pipelines), count):
            together = layout.ring_owners(set(dead))
            for order in itertools.permutations(dead):
                owners = {share: share for share in range(pipelines)}  # one by one: each victim's shares move on
                gone: set[int] = set()
                for victim in order:
                    gone.add(victim)
                    shadow = layout.ring_shadow(victim, gone)  # the next live node after the victim
                    owners = {share: shadow if owner == victim else owner for share, owner in owners.items()}
                assert owners == together, (dead, order)
            assert set(together.values()) == set(range(pipelines)) - set(dead)


def test_survivors_in_one_step_agree_without_laggards_and_every_share_has_an_owner(clock: FakeClock) -> None:
    ring = Ring(4, clock)
    ring.publish(1, [2])
    seen: list[tuple[int, dict[int, tuple[int, ...]]]] = []
    pending = {
        d: ring.nodes[d].begin_ring(FailureEvent(1, [2]), 10 + d, 3,
                                    on_event=lambda _e, d=d: seen.append((d, dict(ring.nodes[d].placements))))
        for d in (0, 1)
    }
    assert pending[0].poll() is None and pending[0].missing() == (-1, [3])
    pending[3] = ring.nodes[3].begin_ring(FailureEvent(1, [2]), 13, 3)
    for d, p in pending.items():
        agreement = p.poll()
        assert agreement is not None, d
        assert agreement.epoch == 1 and agreement.victims == {2} and agreement.step == 3
        assert agreement.lagging == frozenset() and agreement.source is None and agreement.commit is None
        assert agreement.owners == {0: 0, 1: 1, 2: 3, 3: 3}
        assert agreement.progress == {0: 10, 1: 11, 3: 13}
        assert ring.nodes[d].dead == {2} and sorted(ring.nodes[d].placements) == [0, 1, 3]
    assert seen == [(0, {0: (0,), 1: (0,), 3: (0,)}), (1, {0: (0,), 1: (0,), 3: (0,)})]  # groups rebuilt per event
    assert ProgressRecord.from_json(ring.store.get(ring.nodes[0].ring_progress_key(1, 3))) == ProgressRecord(13, 3)


def test_laggards_of_an_all_reduce_the_victim_left_half_done_take_the_result_from_a_node_ahead(
    clock: FakeClock
) -> None:
    ring = Ring(4, clock)
    result = CommitResult(4, 2.5, 17.0)
    ring.publish(1, [0])
    pending = {
        1: ring.nodes[1].begin_ring(FailureEvent(1, [0]), 14, 4, last_commit=CommitResult(3, 1.0, 2.0)),
        2: ring.nodes[2].begin_ring(FailureEvent(1, [0]), 3, 5, last_commit=result),  # completed step 4
        3: ring.nodes[3].begin_ring(FailureEvent(1, [0]), 0, 5, last_commit=result),
    }
    agreements = {d: p.poll() for d, p in pending.items()}
    for agreement in agreements.values():
        assert agreement is not None
        assert agreement.step == 5 and agreement.lagging == {1} and agreement.source == 2
        assert agreement.commit == result and agreement.owners == {0: 1, 1: 1, 2: 2, 3: 3}


def test_survivors_two_steps_apart_or_with_different_results_are_a_clear_error(clock: FakeClock) -> None:
    ring = Ring(3, clock)
    ring.nodes[1].begin_ring(FailureEvent(1, [0]), 0, 3, last_commit=CommitResult(2, 1.0, 1.0))
    with pytest.raises(AgreementError, match=r"the survivors of the ring are in steps \[1, 3\]"):
        ring.nodes[2].agree_ring(FailureEvent(1, [0]), 0, 1)

    ring = Ring(4, clock)
    ring.nodes[1].begin_ring(FailureEvent(1, [0]), 0, 3, last_commit=CommitResult(2, 1.0, 1.0))
    ring.nodes[2].begin_ring(FailureEvent(1, [0]), 0, 3, last_commit=CommitResult(2, 1.5, 1.0))
    with pytest.raises(AgreementError, match=r"publish no single result of step 2"):
        ring.nodes[3].agree_ring(FailureEvent(1, [0]), 5, 2)


def test_nodes_that_learn_of_two_deaths_together_or_one_by_one_agree_under_the_last_epoch(
    clock: FakeClock
) -> None:
    ring = Ring(5, clock)
    ring.publish(1, [1])
    early = {d: ring.nodes[d].begin_ring(FailureEvent(1, [1]), 0, 2) for d in (0, 3)}
    ring.publish(2, [2])
    late = ring.nodes[4].begin_ring(FailureEvent(1, [1]), 0, 2)  # learns of both while it agrees
    assert late.poll() is None  # absorbs epoch 2 and publishes under it
    for d, p in early.items():
        assert p.poll() is None, d  # node 2 never publishes under epoch 1: they absorb epoch 2
    for p in [*early.values(), late]:
        agreement = p.poll()
        assert agreement is not None and agreement.epoch == 2 and agreement.victims == {1, 2}
        assert agreement.owners == {0: 0, 1: 3, 2: 3, 3: 3, 4: 4}


def test_a_leaver_handed_over_at_a_boundary_leaves_the_ring(clock: FakeClock) -> None:
    ring = Ring(3, clock)
    ring.nodes[1].announce_handover(4)
    assert ring.nodes[0].ring_handover_announced(4) and not ring.nodes[0].ring_handover_announced(5)
    ring.nodes[0].apply_handover(FailureEvent(1, [1], handover=True))
    assert ring.nodes[0].dead == {1} and sorted(ring.nodes[0].placements) == [0, 2]
    assert ring.nodes[0].ring_owners() == {0: 0, 1: 2, 2: 2}


def test_a_node_that_never_publishes_times_the_ring_agreement_out_on_the_injected_clock(
    clock: FakeClock
) -> None:
    ring = Ring(3, clock)
    with pytest.raises(AgreementError, match=r"survivors \[2\] \(global ranks\) of the ring did not publish their progress in epoch 1"):
        ring.nodes[0].agree_ring(FailureEvent(1, [1]), 0, 1)
    assert TIMEOUTS.confirm < ring.clock.t < TIMEOUTS.confirm + 0.01


def test_the_ring_agreement_refuses_a_pipeline_with_stages(clock: FakeClock) -> None:
    store = FakeStore()
    coordinator = FailoverCoordinator(store, JOB, Layout(2, 2), 0, 0, one_f_one_b(2, 4, rc="eflb"),
                                      StoreFailureNotices(store, JOB, clock), TIMEOUTS, clock)
    with pytest.raises(RuntimeError, match=r"the ring agreement is for P = 1, this job has P = 2"):
        coordinator.begin_ring(FailureEvent(1, [1]), 0, 0)


def test_the_reduction_reuses_its_buffers_until_a_reduction_is_given_up(clock: FakeClock) -> None:
    ring = Ring(2, clock)
    config = load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 4})
    node = RingNode(None, None, config, ring.layout, 0, None, ring.nodes[0], None, "lflb", None)  # type: ignore[arg-type]
    received = node._scratch.get("received", 8)
    assert node._scratch.get("received", 8) is received  # the next step's reduction writes into the same tensor
    assert node._scratch.get("summed-1", 8) is not node._scratch.get("summed-0", 8)  # the last step's result stays whole
    assert node._scratch.get("received", 12) is not received  # another size (fewer members): a new buffer
    in_flight = node._scratch.get("received", 12)
    node.abandon_posted()  # a given-up all-to-all may still write into `in_flight`
    assert node._scratch.get("received", 12) is not in_flight


def test_the_shares_of_the_global_batch_are_runs_of_consecutive_microbatches_in_share_order() -> None:
    """16 microbatches over 3 pipelines: 6, 5 and 5 (the first ``G mod D`` one longer); the fault-free streams
    compute each node's own run, then (eager) its ring predecessor's, kept aside."""
    from bamboo.rc.ring import fault_free_ring_stream, share_ranges

    assert share_ranges([6, 5, 5]) == (range(0, 6), range(6, 11), range(11, 16))
    lazy = [str(i) for i in fault_free_ring_stream(1, [6, 5, 5], "lflb")]
    assert lazy == [f"0{kind}{g}" for g in range(6, 11) for kind in "LFB"] + ["0AR", "0OPT"]
    eager = [str(i) for i in fault_free_ring_stream(0, [6, 5, 5], "eflb")]
    aside = [f"0{kind}{g}" for g in range(11, 16) for kind in ("FR", "BR")]  # node 0 shadows the last node
    assert eager == [f"0{kind}{g}" for g in range(6) for kind in "LFB"] + ["0AR", *aside, "0OPT"]
