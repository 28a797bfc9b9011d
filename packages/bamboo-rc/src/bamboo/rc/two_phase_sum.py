"""The data-parallel all-reduce of three pipelines or more, exact and at about a ring's cost.

The reference adds pipeline 0's gradients, then pipeline 1's, and so on; gloo's own all-reduce adds each piece
of the tensor in an order of its own, so three members or more must add in member order themselves
(:mod:`bamboo.rc.ordered_sum` says why). Gathering every member's whole tensor does that, but moves D - 1 tensors
into each member. Here the sum is split in two phases, as a ring's all-reduce is:

1. an all-to-all: member j receives piece j of every member's tensor, and adds those pieces in member order;
2. a second all-to-all: member j sends its summed piece to every member, which writes it into its tensor.

Each phase moves (D - 1) / D of the tensor in and out of each member, with no copy of the whole tensor
(gloo's all-gather would flatten its outputs and copy them back).

The second phase needs the first one's result on every member, and a member may post its part and never come
back (a node that joins another pipeline's redone all-reduce posts its stored contribution and goes on). So a
:class:`SumDispatcher`, one per group and its own thread, posts both phases of every sum of its group. The
thread also posts the small sums, whole (an all-gather, added in order). gloo matches a group's collectives in
posting order, so every member posts its sums in the same order, one after the other: phase 1 of a sum, then
(once it completed) its phase 2, then the next sum. Nothing else may be posted on a group a dispatcher posts
on. The caller's thread only queues the sum and waits for it.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading

import torch
from bamboo.rc.state import SpareBuffers
from torch.distributed.distributed_c10d import ProcessGroupGloo

__all__ = ["SPLIT_FROM", "SumDispatcher", "TwoPhaseSum"]

SPLIT_FROM = 1 << 16
"""Elements from which a sum is split in two phases; a smaller tensor is gathered whole and added in order."""


class TwoPhaseSum:
    """A queued sum of ``tensor`` over a group, in member order, written into ``tensor`` by :meth:`wait`.

    It answers as a gloo work does (``is_completed``, ``get_future``, ``wait``): the interpreter waits on it,
    polls it and keeps it like any collective of its group. It is completed once its last phase completed, or
    once a phase failed (then :meth:`wait` raises that phase's error)."""

    def __init__(self, tensor: torch.Tensor, members: int, rank: int, spares: SpareBuffers | None) -> None:
        self.tensor = tensor
        self.members, self.rank = members, rank
        numel = tensor.numel()
        self.split = numel >= SPLIT_FROM and tensor.is_contiguous()
        if self.split:  # pieces of ceil(numel / members), the last one shorter
            piece = -(-numel // members)
            self.sizes = [piece] * (members - 1) + [numel - piece * (members - 1)]
        else:  # gathered whole
            self.sizes = [numel] * members
        mine = self.sizes[rank] if self.split else numel
        pooled = spares is not None and tensor.dtype == torch.float32 and self.split
        self._spares = spares if pooled else None
        self._size = mine * members
        # Taken here, in the caller's thread, and given back in wait(), in the same thread: the pool is not shared.
        self.received = self._buffer("received")
        """Phase 1's output: this member's piece of every member's tensor, in member order (unsplit: every
        member's tensor)."""
        self.sending = self._buffer("sending") if self.split else self.received
        """Phase 2's input: the summed piece, once for each member."""
        self._last: object | None = None  # the work of the last phase posted
        self.error: Exception | None = None
        """Why the sum failed (raised by :meth:`wait`), or None."""
        self._future: concurrent.futures.Future[None] = concurrent.futures.Future()
        self._summed = False

    def _buffer(self, name: str) -> torch.Tensor:
        if self._spares is not None:
            return self._spares.take((name, self._size), self._size)
        return torch.empty(self._size, dtype=self.tensor.dtype)

    # -- run by the dispatcher's thread --------------------------------------------------------------------
    def run(self, pg: ProcessGroupGloo) -> None:
        """Post this sum's phases on ``pg``, waiting for phase 1 before phase 2. Never raises: an error is kept
        for :meth:`wait`, and marks the sum completed.

        Split, phase 1 sends piece j of the tensor to member j, and phase 2 writes every member's summed piece
        straight into the tensor (which the caller does not read before :meth:`wait`, as with gloo's own
        all-reduce)."""
        try:
            if not self.split:
                pieces = list(self.received.split(self.tensor.numel()))
                self._finish_with(pg.allgather([pieces], [self.tensor.reshape(-1)]))
                return
            flat = self.tensor.view(-1)
            mine = self.sizes[self.rank]
            pg.alltoall_base(self.received, flat, [mine] * self.members,
                             self.sizes).wait()  # type: ignore[attr-defined]
            shares = self.received.view(self.members, mine)
            rows = self.sending.view(self.members, mine)
            rows[0].copy_(shares[0])
            for share in shares[1:]:
                rows[0].add_(share)
            rows[1:].copy_(rows[0].expand(self.members - 1, mine))
            self._finish_with(pg.alltoall_base(flat, self.sending, self.sizes, [mine] * self.members))
        except Exception as error:  # kept for wait(): an error that ended the thread would leave the sum pending
            self.fail(error)

    def fail(self, error: Exception) -> None:
        """End this sum with ``error`` (raised by :meth:`wait`)."""
        self.error = error
        self._future.set_result(None)

    def _finish_with(self, work: object) -> None:
        self._last = work
        work.get_future().add_done_callback(lambda _future: self._future.set_result(None))  # type: ignore[attr-defined]

    # -- the caller's side ------------------------------------------------------------------------------------
    def is_completed(self) -> bool:
        return self._future.done() and (self._last is None or bool(self._last.is_completed()))  # type: ignore[attr-defined]

    def get_future(self) -> concurrent.futures.Future[None]:
        """Done once the sum completed or failed (for a done callback, as a gloo work's future is used)."""
        return self._future

    def wait(self, timeout: object = None) -> bool:
        """Wait for the last phase (raising a phase's error, as a gloo work does); unsplit, add the gathered
        tensors into the tensor in member order, once. Then give the buffers back."""
        self._future.result()
        if self.error is not None:
            raise self.error
        assert self._last is not None
        self._last.wait()  # type: ignore[attr-defined]
        if not self._summed:
            self._summed = True
            if not self.split:
                flat = self.tensor.view(-1)
                gathered = self.received.split(self.tensor.numel())
                flat.copy_(gathered[0])
                for share in gathered[1:]:
                    flat.add_(share)
            if self._spares is not None:  # nothing posted reads or writes them any more
                self._spares.give_back(("received", self._size), self.received)
                self._spares.give_back(("sending", self._size), self.sending)
        return True


class SumDispatcher:
    """Posts the sums of one group (``pg``, of ``members`` members, this process at ``rank``) on its own thread,
    in the order they were queued (:mod:`bamboo.rc.two_phase_sum`). :meth:`close` ends the thread once the
    sums queued before it were posted."""

    def __init__(self, pg: ProcessGroupGloo, members: int, rank: int, name: str,
                 spares: SpareBuffers | None = None) -> None:
        self.pg = pg
        self._pg: ProcessGroupGloo | None = pg  # None once closed
        self.members, self.rank, self.name = members, rank, name
        self._spares = spares
        self._queue: queue.SimpleQueue[TwoPhaseSum | None] = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def post(self, tensor: torch.Tensor) -> TwoPhaseSum:
        """Queue the sum of ``tensor`` (in place, at :meth:`TwoPhaseSum.wait`)."""
        if self._pg is None:
            raise RuntimeError(f"the sums of group {self.name} were closed")
        work = TwoPhaseSum(tensor, self.members, self.rank, self._spares)
        self._queue.put(work)
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, args=(self._pg,), name=f"bamboo-sums-{self.name}",
                                            daemon=True)
            self._thread.start()
        return work

    def close(self) -> None:
        """No more sums: the thread posts those queued and ends, and lets the group go."""
        self._pg = None
        self._queue.put(None)

    def _run(self, pg: ProcessGroupGloo) -> None:
        """Post each queued sum in turn. After a failed one, the rest fail at once, unposted: the members' posting
        orders may have parted there (one completed a phase that another did not), and a failure retires the
        group anyway."""
        failed: str | None = None
        while (work := self._queue.get()) is not None:
            if failed is not None:
                work.fail(RuntimeError(f"an earlier sum on {self.name} failed: {failed}"))
                continue
            work.run(pg)
            if work.error is not None:
                failed = str(work.error)
