"""The two-phase data-parallel sum adds in member order, the single-process reference's, on real gloo groups (four
ranks in threads of this process, over a TCPStore on port 0); a member that posts its part and never waits (a
node joining another pipeline's redone all-reduce) still completes the others' sums."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
from bamboo.rc.comm import build_gloo_group, own_client
from bamboo.rc.state import SpareBuffers
from bamboo.rc.two_phase_sum import SPLIT_FROM, SumDispatcher
from torch.distributed import TCPStore

MEMBERS = 4


def _shares(size: int) -> list[torch.Tensor]:
    """Four members' tensors whose sum depends on the order of the additions ((1 + 1e8) - 1e8 is 0 in fp32,
    1 + (1e8 - 1e8) is 1), each position's shares rotated."""
    values = torch.tensor([1.0, 1e8, -1e8, 0.25])
    rotation = torch.arange(size)
    return [values[(member + rotation) % MEMBERS].float() for member in range(MEMBERS)]


def _in_order(shares: list[torch.Tensor]) -> torch.Tensor:
    total = shares[0].clone()
    for share in shares[1:]:
        total += share
    return total


def _run_members(target) -> None:  # type: ignore[no-untyped-def]
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            group = build_gloo_group(own_client(store), "two-phase/", rank, MEMBERS, 30.0)
            target(rank, group)
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(MEMBERS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert not any(thread.is_alive() for thread in threads)


@pytest.mark.parametrize("size", [3000, SPLIT_FROM + 1, 4 * SPLIT_FROM])
def test_four_members_add_in_member_order_on_every_member(size: int) -> None:
    """Unsplit (small), split with padding, split without; two sums queued back to back before either is
    waited for (the dispatcher posts each one's phases before the next one's), then once more, from the pool."""
    shares = _shares(size)
    expected = _in_order(shares)
    assert not torch.equal(expected, (shares[0] + shares[1]) + (shares[2] + shares[3]))  # the data tells
    doubled = _in_order([2 * share for share in shares])
    results: dict[int, list[torch.Tensor]] = {}

    def member(rank: int, group: object) -> None:
        dispatcher = SumDispatcher(group, MEMBERS, rank, "dp-s0", SpareBuffers())  # type: ignore[arg-type]
        for _ in range(2):
            first, second = shares[rank].clone(), 2 * shares[rank]
            works = [dispatcher.post(first), dispatcher.post(second)]
            for work in works:
                work.wait()
                work.wait()  # a second wait writes nothing more
                assert work.is_completed() and work.get_future().done()
            results[rank] = [first, second]
        dispatcher.close()

    _run_members(member)
    for rank in range(MEMBERS):
        assert torch.equal(results[rank][0], expected), rank
        assert torch.equal(results[rank][1], doubled), rank


def test_a_member_that_posts_and_goes_on_completes_the_others_sums() -> None:
    """Member 3 posts its part and never waits, as a node joining a redo does: its dispatcher posts phase 2 on
    its own, and the other members' sums complete."""
    size = SPLIT_FROM * 2
    shares = _shares(size)
    expected = _in_order(shares)
    results: dict[int, torch.Tensor] = {}
    gone = threading.Event()

    def member(rank: int, group: object) -> None:
        dispatcher = SumDispatcher(group, MEMBERS, rank, "dp-s1")  # type: ignore[arg-type]
        tensor = shares[rank].clone()
        work = dispatcher.post(tensor)
        if rank == 3:
            gone.set()
            return  # never waits; the group and its dispatcher stay referenced by its thread
        assert gone.wait(30)
        work.wait()
        results[rank] = tensor

    _run_members(member)
    assert sorted(results) == [0, 1, 2]
    for rank in results:
        assert torch.equal(results[rank], expected), rank


class _BrokenGroup:
    """A group whose first all-to-all fails; it counts what is posted on it."""

    def __init__(self) -> None:
        self.posted = 0

    def alltoall_base(self, *args: object) -> object:
        self.posted += 1
        raise RuntimeError("Connection closed by peer")


def test_after_a_failed_sum_the_sums_queued_behind_it_fail_unposted() -> None:
    group = _BrokenGroup()
    dispatcher = SumDispatcher(group, MEMBERS, 0, "dp-s2")  # type: ignore[arg-type]
    works = [dispatcher.post(torch.zeros(SPLIT_FROM)) for _ in range(3)]
    for work in works:
        assert work.get_future().result(timeout=30) is None
        assert work.is_completed()
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        works[0].wait()
    for work in works[1:]:
        with pytest.raises(RuntimeError, match="an earlier sum on dp-s2 failed: Connection closed by peer"):
            work.wait()
    assert group.posted == 1
    dispatcher.close()
    with pytest.raises(RuntimeError, match="closed"):
        dispatcher.post(torch.zeros(4))
