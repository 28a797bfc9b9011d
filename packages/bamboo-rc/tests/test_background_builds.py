"""Group builds started in the background when a membership change is applied (`GroupTable.start_builds`).

Real gloo groups over a real TCPStore, with the ranks as threads of this process (each with its own
store client, as separate processes would have). No test sleeps for a fixed time: each waits for an
outcome, bounded by the group timeout.
"""

from __future__ import annotations

import datetime
import gc
import threading
from collections.abc import Callable, Iterator
from types import MethodType, SimpleNamespace

import pytest
import torch
from bamboo.rc.comm import CommTimeouts, GroupTable, own_client
from bamboo.rc.config import load_config
from bamboo.rc.failures import FailureNoticed, PeerFailure
from bamboo.rc.interpreter import StageInterpreter
from bamboo.rc.layout import Layout
from bamboo.rc.records import FailureEvent
from bamboo.rc.verify import DEFAULT_CONFIG
from torch.distributed import TCPStore

pytestmark = pytest.mark.slow

STORE_TIMEOUT = datetime.timedelta(seconds=60)


@pytest.fixture(autouse=True)
def no_build_outlives_its_test() -> Iterator[None]:
    """Let every build thread of a test end (each gives up by its group timeout, a few seconds here) and
    free the test's groups in this process: a gloo group or store client left to the garbage collector
    could otherwise be freed in a child that a later test forks (verify forks its workers), where its
    destructor would join threads the child does not have, and abort it."""
    yield
    for thread in threading.enumerate():
        if thread.name.startswith("bamboo-build-"):
            thread.join(60)
    gc.collect()


@pytest.fixture
def store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=STORE_TIMEOUT)


def _client(store: TCPStore) -> TCPStore:
    return TCPStore("127.0.0.1", store.port, is_master=False, timeout=STORE_TIMEOUT)


def _table(store: TCPStore, rank: int, group_timeout: float = 30.0) -> GroupTable:
    return GroupTable(_client(store), "job", rank, CommTimeouts(group=group_timeout, poll=0.05), {})


def _run_ranks(bodies: list[Callable[[], object]], limit: float = 60.0) -> list[object]:
    """Run each body in a thread of its own; their results (an exception is a result too)."""
    results: list[object] = [None] * len(bodies)

    def run(index: int) -> None:
        try:
            results[index] = bodies[index]()
        except BaseException as exc:
            results[index] = exc

    threads = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(bodies))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(limit)
    assert not any(thread.is_alive() for thread in threads), "a rank is still blocked"
    return results


def test_two_members_that_use_two_new_groups_in_opposite_orders_both_get_them(store: TCPStore) -> None:
    """Rank 0 uses group a first, rank 1 group b first: built in the foreground on first use, each would
    wait in its build for the other; started in the background, both builds complete."""
    members = {"a": [0, 1], "b": [0, 1]}

    def rank(me: int, order: list[str]) -> list[float]:
        table = _table(store, me)
        table.set_members(3, members)
        assert table.start_builds() == ["a", "b"]
        posted = {}
        for name in order:  # as a stream posts all-reduces: first use of the group, then on
            table.wait_built(name, f"first use of {name}")
            tensor = torch.tensor([float(me + 1)])
            posted[name] = (tensor, table.post_allreduce(name, [tensor], f"sum over {name}"))
        for name in order:
            tensor, works = posted[name]
            table.wait_collective(name, works, f"sum over {name}")
        assert not table.building and set(table.groups) == {"a", "b"}
        return [float(posted[name][0][0]) for name in order]

    assert _run_ranks([lambda: rank(0, ["a", "b"]), lambda: rank(1, ["b", "a"])]) == [[3.0, 3.0], [3.0, 3.0]]


def test_a_build_waiting_for_a_member_leaves_the_store_client_free_and_can_be_interrupted(store: TCPStore) -> None:
    """The member never comes. Meanwhile the table's store client still answers at once (the build
    waits on a client of its own), and a wait for the build gives way to its interrupt, leaving the
    build in flight; a membership change then drops it."""
    table = _table(store, 0, group_timeout=3.0)
    table.set_members(1, {"pair": [0, 1]})
    table.start_builds()
    future = table.building["pair"]
    table.store.set("progress", "published")  # would queue behind the build's wait on a shared client
    assert table.store.get("progress") == b"published"
    assert not future.done()

    class Noticed(Exception):
        pass

    def interrupt() -> None:
        raise Noticed

    with pytest.raises(Noticed):
        table.wait_built("pair", "1AR", interrupt)
    assert table.building["pair"] is future  # still building: a later use waits for the same build
    table.set_members(2, {})
    assert not table.building and "pair" not in table.groups


def test_a_failed_build_raises_a_peer_failure_naming_the_other_members(store: TCPStore) -> None:
    table = _table(store, 0, group_timeout=1.0)
    table.set_members(1, {"dp-s0": [0, 4, 8]})
    table.start_builds()
    with pytest.raises(PeerFailure) as raised:
        table.wait_built("dp-s0", "0AR")
    assert raised.value.peers == (4, 8) and raised.value.instruction == "0AR"
    assert "dp-s0" not in table.building and "dp-s0" not in table.groups


def test_a_build_keeps_the_membership_it_started_with(store: TCPStore) -> None:
    """Rank 0 starts building g as (0, 1) in epoch 1; epoch 2 makes it (0, 2) before rank 1 comes. The
    first build is dropped (it gives up on its own: nobody joins it), and the second is built under
    the new epoch's prefix with rank 2."""
    first = _table(store, 0, group_timeout=2.0)
    first.set_members(1, {"g": [0, 1]})
    first.start_builds()
    stale = first.building["g"]
    first.set_members(2, {"g": [0, 2]})
    assert not first.building
    first.start_builds()

    def rank0() -> float:
        first.wait_built("g", "use of g")
        tensor = torch.tensor([1.0])
        first.allreduce("g", [tensor], "sum")
        return float(tensor[0])

    def rank2() -> float:
        table = _table(store, 2)
        table.set_members(2, {"g": [0, 2]})
        table.start_builds()
        tensor = torch.tensor([5.0])
        table.allreduce("g", [tensor], "sum")  # group() waits for the build in flight
        return float(tensor[0])

    assert _run_ranks([rank0, rank2]) == [6.0, 6.0]
    assert stale.exception(timeout=30) is not None


def test_own_client_is_a_new_connection_for_a_tcp_store_and_the_store_itself_otherwise(store: TCPStore) -> None:
    client = own_client(store)
    assert client is not store
    client.set("written by the clone", "1")
    assert store.get("written by the clone") == b"1"

    class PythonStore(torch.distributed.Store):
        pass

    python_store = PythonStore()
    assert own_client(python_store) is python_store


def test_only_the_groups_an_epoch_changed_are_started_when_asked(store: TCPStore) -> None:
    table = _table(store, 0, group_timeout=1.0)
    table.set_members(0, {"p2p-0-5": [0, 5], "dp-s0": [0, 4]})
    table.set_members(1, {"p2p-0-5": [0, 5], "dp-s0": [0, 7]})  # epoch 1 changed dp-s0 only
    assert table.versions == {"p2p-0-5": 0, "dp-s0": 1}
    assert table.start_builds(changed_in=1) == ["dp-s0"]
    assert table.start_builds(changed_in=1) == []  # already in flight
    assert table.start_builds() == ["p2p-0-5"]  # unchanged and unused: only when every group is asked for


class _AnnouncedThenDied:
    """The coordinator of a node whose peer announced a group and died before it joined the build: its
    barrier passes, and the peer's failure is confirmed once this node's build is under way."""

    watching = True

    def __init__(self, table: GroupTable) -> None:
        self.table = table
        self.barriers: list[tuple[str, int, tuple[int, ...]]] = []

    def await_group(self, group: str, version: int, members: tuple[int, ...]) -> None:
        self.barriers.append((group, version, tuple(members)))

    def raise_if_noticed(self) -> None:
        if self.table.building:  # the build is waiting for the dead peer: its failure is confirmed now
            raise FailureNoticed(FailureEvent(epoch=2, victims=(1,)))


def test_a_first_use_build_gives_way_to_a_failure_confirmed_after_the_barrier(store: TCPStore) -> None:
    """A group no event changed is built on its first use, after the store barrier. The peer dies after
    the barrier, before it joins: the build runs in the background, so the confirmed failure is noticed.
    Built in the foreground, it would sit in gloo until the group timeout and fail there instead."""
    table = _table(store, 0, group_timeout=3.0)
    table.set_members(1, {"p2p-0-1": [0, 1]})
    node = SimpleNamespace(groups=table)
    node.coordinator = _AnnouncedThenDied(table)
    node._needs_barrier = MethodType(StageInterpreter._needs_barrier, node)
    node._poll = MethodType(StageInterpreter._poll, node)
    node._post_built = MethodType(StageInterpreter._post_built, node)
    node._post_waiting = MethodType(StageInterpreter._post_waiting, node)
    node._reducing = {}
    with pytest.raises(FailureNoticed, match=r"ranks \[1\]"):
        StageInterpreter._await_group_members(node, "p2p-0-1", "1SA0>0")
    assert node.coordinator.barriers == [("p2p-0-1", 1, (0, 1))]
    assert "p2p-0-1" in table.building  # left in flight: the membership change that follows drops it
    table.set_members(2, {})
    assert not table.building


class _WatchingCoordinator:
    """The coordinator of a node after a hand-over: no failure confirmed until `confirmed` is set."""

    watching = True

    def __init__(self) -> None:
        self.confirmed: FailureEvent | None = None
        self.announced: list[tuple[str, int]] = []

    def pending_event(self) -> FailureEvent | None:
        return self.confirmed

    def raise_if_noticed(self) -> None:
        if self.confirmed is not None:
            raise FailureNoticed(self.confirmed)

    def announce_group(self, group: str, version: int) -> None:
        self.announced.append((group, version))


def _interpreter(table: GroupTable, node: int, pipeline: int) -> StageInterpreter:
    """A node of stage `node` in pipeline `pipeline` (2 × 2 layout) over `table`; its slices are never used here."""
    return StageInterpreter({}, lambda *_: torch.zeros(()), load_config(DEFAULT_CONFIG), Layout(2, 2), node, pipeline,
                            table, _WatchingCoordinator())  # type: ignore[arg-type]


def _pending_allreduce(interpreter: StageInterpreter, stage: int, value: float, members: tuple[int, ...]) -> None:
    """As if stage `stage`'s all-reduce of step 5 had been posted on the group of `members` (with redundancy:
    the contribution kept apart)."""
    flat, loss = torch.full((3,), value), torch.tensor([value], dtype=torch.float64)
    interpreter._reducing[stage] = ([], flat, loss, (5, flat.clone(), loss.clone()), members)


def test_an_allreduce_posted_again_after_a_hand_over_never_blocks_the_event_and_gives_way_to_a_failure(
    store: TCPStore,
) -> None:
    """A hand-over changes dp-s0 from (0, 2) to (0, 3), and rank 3 dies before it joins the build. Applying the
    event returns at once, the all-reduce waiting for the build; where its result is needed, the wait gives way
    to the confirmed failure, and the all-reduce is still waiting to be posted. Before, the repost waited for
    the build inside the event's application, with nothing to notice the failure, until the group timeout."""
    table = _table(store, 0, group_timeout=3.0)
    table.set_members(1, {"dp-s0": [0, 2]})
    node = _interpreter(table, 0, 0)
    try:
        _pending_allreduce(node, 0, 1.0, (0, 2))
        table.set_members(2, {"dp-s0": [0, 3]})  # what the executor does when it applies the hand-over
        table.start_builds(changed_in=2)
        node.repost_changed_allreduces()
        works, flat, _, contribution, members = node._reducing[0]
        assert works is None and members == (0, 3)  # waiting for its group
        assert flat is not contribution[1] and torch.equal(flat, contribution[1])  # the kept contribution, copied
        assert "dp-s0" in table.building and not table.building["dp-s0"].done()
        node.coordinator.confirmed = FailureEvent(epoch=3, victims=(3,))  # type: ignore[attr-defined]
        with pytest.raises(FailureNoticed, match=r"ranks \[3\]"):
            node._wait_reduction(0)
        assert node._reducing[0][0] is None  # still to be posted: the failover decides what becomes of it
    finally:
        node.close()
        table.set_members(3, {})


def test_allreduces_posted_again_after_a_hand_over_are_posted_once_built_and_sum_the_kept_contributions(
    store: TCPStore,
) -> None:
    """Both members of the rebuilt dp-s1 post again what they had contributed; each posts without blocking as
    soon as its build is done, and the sum is that of the kept contributions, not of the all-reduced tensors."""

    def rank(me: int, pipeline: int, value: float) -> list[float]:
        table = _table(store, me)
        table.set_members(1, {"dp-s1": [me, 9]})
        node = _interpreter(table, 1, pipeline)
        try:
            _pending_allreduce(node, 1, value, (me, 9))
            node._reducing[1][1].fill_(-100.0)  # a half-done all-reduce scribbled on it: the repost must not use it
            table.set_members(2, {"dp-s1": [1, 3]})
            table.start_builds(changed_in=2)
            node.repost_changed_allreduces()
            while node._reducing[1][0] is None:  # as the stream's next instructions and waits do
                node._post_built()
            node.wait_posted_allreduces()
            return node._reducing[1][1].tolist()
        finally:
            node.close()
            table.release()

    assert _run_ranks([lambda: rank(1, 0, 1.0), lambda: rank(3, 1, 2.0)]) == [[3.0] * 3, [3.0] * 3]


def test_a_failed_eager_build_is_raised_at_the_groups_first_use_in_its_epoch_only(store: TCPStore) -> None:
    """A member that builds its side and dies at once fails the others' eager builds (`executor.connect`);
    that failure waits for the group's first use, where it is a PeerFailure naming the other members,
    and a later epoch's group forgets it."""
    table = _table(store, 0, group_timeout=1.0)
    table.set_members(0, {"a": [0, 1]})
    table.build_eagerly("a")  # rank 1 never joins: the build times out, and nothing is raised here
    assert "a" not in table.groups
    with pytest.raises(PeerFailure) as failure:
        table.group("a")
    assert failure.value.peers == (1,) and "the first build of a" in str(failure.value)
    table.build_eagerly("a")
    table.set_members(1, {"a": [0, 2]})
    assert table.failed_builds == {}
