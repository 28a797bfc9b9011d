"""The data-parallel sum of three members or more adds in member order, the single-process reference's, on real gloo
groups (three ranks in threads of this process, over a TCPStore on port 0)."""

from __future__ import annotations

import datetime
import threading

import pytest
import torch
from bamboo.rc.comm import build_gloo_group, own_client
from bamboo.rc.ordered_sum import POOLED_FROM, post_ordered_sum
from bamboo.rc.state import SpareBuffers
from torch.distributed import TCPStore


def _shares(size: int = 3000) -> list[torch.Tensor]:
    """Three members' tensors whose sum depends on the order of the additions: (1 + 1e8) - 1e8 is 0 in fp32,
    1 + (1e8 - 1e8) is 1, in every position of the tensor, each position's shares rotated."""
    values = torch.tensor([1.0, 1e8, -1e8])
    rotation = torch.arange(size)
    return [values[(member + rotation) % 3].float() for member in range(3)]


@pytest.mark.parametrize("size", [3000, POOLED_FROM + 1])
def test_three_members_add_in_member_order_on_every_member(size: int) -> None:
    """Twice in a row: a gradient-sized sum gathers into buffers of the pool, given back once summed and taken
    again by the next sum."""
    shares = _shares(size)
    expected = (shares[0] + shares[1]) + shares[2]
    other_order = shares[0] + (shares[1] + shares[2])
    assert not torch.equal(expected, other_order)  # the data tells the orders apart
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
    results: dict[int, torch.Tensor] = {}
    errors: list[BaseException] = []

    def member(rank: int) -> None:
        try:
            group = build_gloo_group(own_client(store), "ordered/", rank, 3, 30.0)  # a client each: one request at a time
            spares = SpareBuffers()
            for _ in range(2):
                tensor = shares[rank].clone()
                work = post_ordered_sum(group, tensor, 3, spares)
                assert torch.equal(tensor, shares[rank])  # nothing is written before the wait
                work.wait()
                work.wait()  # a second wait adds nothing more
                assert work.is_completed()
                assert spares.held((size, 0)) == (1 if size >= POOLED_FROM else 0)
                results[rank] = tensor
        except BaseException as error:  # reported by the main thread
            errors.append(error)

    threads = [threading.Thread(target=member, args=(rank,)) for rank in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert not errors, errors
    assert sorted(results) == [0, 1, 2]
    for rank in range(3):
        assert torch.equal(results[rank], expected), rank
