"""An all-reduce that adds the members' tensors in member order, as the single-process reference does.

Floating-point addition is not associative. gloo's all-reduce of three members or more adds each piece of the
tensor in an order of its own (its ring starts each segment at another member), so a data-parallel group of
three pipelines or more summed their gradients differently from the reference, which adds pipeline 0's share,
then pipeline 1's, and so on: the parameters drifted from it a little at every step, past ``verify``'s tolerance
within a few steps (``test_three_pipelines_are_exact_past_the_first_steps`` in the package's ``test_verify.py``).
Two members need no care (``a + b == b + a`` exactly).

:func:`post_ordered_sum` gathers every member's tensor (one all-gather, posted whole, so that a member may post
it and go on as with any collective) and :meth:`OrderedSum.wait` adds them into the tensor in member order,
once. A data-parallel group lists its members in pipeline order (:meth:`bamboo.rc.layout.Layout.group_members`),
so the sum is the reference's element by element, whoever computed which share.

The cost is the gather: each member receives every other member's tensor (D - 1 of them, where the ring moves
about two), held in host memory until the sum. Gradient-sized gather buffers come from a pool (``spares``) and go
back to it once summed: a fresh one costs its page faults again at every step.
"""

from __future__ import annotations

import torch
from bamboo.rc.state import SpareBuffers
from torch.distributed.distributed_c10d import ProcessGroupGloo

__all__ = ["POOLED_FROM", "OrderedSum", "post_ordered_sum"]

POOLED_FROM = 1 << 16
"""Elements from which an fp32 tensor's gather buffers come from the pool (smaller ones are cheap to allocate)."""


class OrderedSum:
    """A posted all-reduce of ``tensor`` whose sum, in member order, is written into ``tensor`` by :meth:`wait`.

    It answers as a gloo work does (``is_completed``, ``get_future``, ``wait``): the interpreter waits on it,
    polls it and keeps it like any collective of its group."""

    def __init__(self, work: object, tensor: torch.Tensor, gathered: list[torch.Tensor],
                 spares: SpareBuffers | None = None) -> None:
        self._work = work
        self._tensor = tensor
        self._gathered: list[torch.Tensor] | None = gathered
        self._spares = spares
        """Where the gather buffers go back once summed (None: they were allocated for this sum alone)."""

    def is_completed(self) -> bool:
        return bool(self._work.is_completed())  # type: ignore[attr-defined]

    def get_future(self) -> object:
        return self._work.get_future()  # type: ignore[attr-defined]

    def wait(self, timeout: object = None) -> bool:
        """Wait for the gather (raising its error, as a gloo work does), then add the shares in member order."""
        self._work.wait()  # type: ignore[attr-defined]
        gathered, self._gathered = self._gathered, None
        if gathered is not None:
            self._tensor.copy_(gathered[0])
            for share in gathered[1:]:
                self._tensor.add_(share)
            if self._spares is not None:  # the gather is done and summed: nothing reads or writes them any more
                for slot, buffer in enumerate(gathered):
                    self._spares.give_back((buffer.numel(), slot), buffer)
        return True


def post_ordered_sum(pg: ProcessGroupGloo, tensor: torch.Tensor, members: int,
                     spares: SpareBuffers | None = None) -> OrderedSum:
    """Post the all-gather of ``tensor`` over ``pg`` (of ``members`` members); its :class:`OrderedSum`. An fp32
    tensor of :data:`POOLED_FROM` elements or more gathers into buffers of ``spares``, when given."""
    pooled = spares is not None and tensor.dtype == torch.float32 and tensor.numel() >= POOLED_FROM
    if pooled:
        assert spares is not None
        gathered = [spares.take((tensor.numel(), slot), tensor.numel()).view_as(tensor) for slot in range(members)]
    else:
        gathered = [torch.empty_like(tensor) for _ in range(members)]
    return OrderedSum(pg.allgather([gathered], [tensor]), tensor, gathered, spares if pooled else None)
