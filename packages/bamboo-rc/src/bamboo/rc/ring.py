"""Pure data parallelism with redundancy (P = 1): one node of the shadow ring.

With one stage there is no pipeline: each of the D nodes holds the whole model and trains its
*share* of the global batch (pipeline ``d``'s microbatches, a run of consecutive global indices: ``d·M ..
d·M+M-1`` when the D shares are even, and where D does not divide the global batch, the first ``G mod D`` shares one
longer than the others, as :func:`bamboo.reconfig.microbatch_shares` splits it).
The redundant copy of a node's work is its ring successor, the next live pipeline
(:meth:`bamboo.rc.layout.Layout.ring_shadow`; the launcher places consecutive pipelines in
different zones). Every node's parameters are identical after every step, so the shadow's own copy
is the victim's: what a failure loses is only the victim's gradients of the current step.

- **Lazy** (``lflb``): nothing redundant runs while nobody fails. When a node dies mid-step, its
  shadow computes the lost microbatches (the data is a function of ``(step, global index)``) and
  joins the all-reduce in its place: it contributes the victim's share as well as its own.
- **Eager, overbatching** (``eflb`` and ``efeb``: with no pipeline there is no stash, and the
  forward and the backward of the neighbour's microbatches both run every step): each node also
  computes the microbatches of the node it shadows, after posting its all-reduce (so the work
  overlaps the communication), and keeps their gradients aside. On a failure the ready gradients
  join the all-reduce: no recompute.

**Exact whatever the membership.** Floating-point addition is not associative, so the step's
gradients must be added in one fixed order, the single-process reference's: share 0, then share 1,
and so on, whichever node computed which share. The reduction does it in two phases, with the
bytes of an ordinary all-reduce (about twice the gradient per node, whatever D):

1. an all-to-all (posted by ``0AR``, so that the eager copies overlap it): the flat gradients are cut
   into one chunk per live node, and each node receives its chunk of every share's gradients;
2. at ``0OPT``, each node adds its chunk's shares in share order and sends the sum to every other
   node (a second all-to-all: every node hears from every node directly).

Element by element these are the reference's sums, associated the same way. (The losses, a few
numbers per microbatch, are summed in one slot per microbatch, zeros elsewhere.) The reduced
gradients of a step are therefore a function of the step's parameters and data alone, which
settles the reduction that a victim leaves half done (some survivors completed it, others did
not): the laggards receive the result from a survivor that completed it
(:class:`~bamboo.rc.agreement.RingAgreement`), identical to what a redo would give, instead of
anybody recomputing a step whose parameters are gone.

The node's stream uses bamboo-schedule's instructions with *global* microbatch indices: ``0L<g>``,
``0F<g>``, ``0B<g>`` for the shares it computes (its own, and those it took over), ``0AR`` (post the
reduction's all-to-all), ``0FR<g>``/``0BR<g>`` for the eager copy of its neighbour's share, ``0OPT``
(finish the reduction and step). Kill points name them (``--kill 0:1@0F5``: pipeline 1's second
microbatch at M = 4).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
from bamboo.rc.agreement import RingAgreement
from bamboo.rc.comm import GroupTable
from bamboo.rc.config import TrainingConfig
from bamboo.rc.coordinator import FailoverCoordinator
from bamboo.rc.device import to_device
from bamboo.rc.failures import FailureNoticed
from bamboo.rc.layout import Layout
from bamboo.rc.precision import autocast, backward
from bamboo.rc.records import CommitResult
from bamboo.rc.state import ReusedBuffers, TrainableSlice
from bamboo.schedule import Instruction, Kind

__all__ = ["EAGER_MODES", "GROUP", "MicrobatchSource", "RingNode", "fault_free_ring_stream", "share_instructions",
           "share_ranges"]

MicrobatchSource = Callable[[int, int], tuple[torch.Tensor, torch.Tensor]]
"""``(step, global microbatch index) -> (inputs, labels)``: the data, as a function of its position."""

EAGER_MODES = ("eflb", "efeb")
"""The redundancy modes that run the neighbour's microbatches every step (overbatching) when P = 1."""

GROUP = "dp-s0"
"""The gloo group of the all-reduce: every live node."""

Share = tuple[torch.Tensor, list[float]]
"""A share's gradients (flat, fp32) and the loss of each of its microbatches, in order."""


class _Reduction:
    """One posted reduction of a step's gradients: the group's members, the shares each computes, each
    member's chunk of the flat gradients, the first phase's works and its tensors (sent, received, losses)."""

    def __init__(self, members: tuple[int, ...], shares_of: dict[int, tuple[int, ...]],
                 bounds: list[tuple[int, int]], works: list[object], tensors: list[torch.Tensor]) -> None:
        self.members = members
        self.shares_of = shares_of
        self.bounds = bounds
        self.works = works
        self.tensors = tensors


def share_ranges(shares: Sequence[int]) -> tuple[range, ...]:
    """Each share's global microbatch indices, from the shares' lengths in share order
    (:meth:`bamboo.rc.config.TrainingConfig.shares`: 16 over 3 pipelines, 0..5, 6..10 and 11..15)."""
    ranges, first = [], 0
    for count in shares:
        ranges.append(range(first, first + count))
        first += count
    return tuple(ranges)


def share_instructions(indices: range, aside: bool = False) -> list[Instruction]:
    """The instructions that compute one share, its global microbatch ``indices``: ``L``/``F``/``B`` per
    microbatch (``FR``/``BR`` when it is the eager copy of a neighbour's share, kept aside)."""
    instructions: list[Instruction] = []
    for g in indices:
        if aside:
            instructions += [Instruction(Kind.FRC, 0, g), Instruction(Kind.BRC, 0, g)]
        else:
            instructions += [Instruction(Kind.LOAD, 0, g), Instruction(Kind.FORWARD, 0, g),
                             Instruction(Kind.BACKWARD, 0, g)]
    return instructions


def fault_free_ring_stream(pipeline: int, shares: Sequence[int], redundancy: str) -> list[Instruction]:
    """Node `pipeline`'s stream in a step without failures, each pipeline's share ``shares[d]`` microbatches long:
    its share, ``AR``, the eager copy of its ring predecessor's share (eager modes, D > 1), ``OPT``."""
    ranges = share_ranges(shares)
    stream = share_instructions(ranges[pipeline])
    stream.append(Instruction(Kind.ALLREDUCE, 0))
    if redundancy in EAGER_MODES and len(shares) > 1:
        stream += share_instructions(ranges[(pipeline - 1) % len(shares)], aside=True)
    stream.append(Instruction(Kind.OPTIMIZER, 0))
    return stream


class RingNode:
    """One node of a P = 1 ring (see the module docstring): its shares, its all-reduce, its commit.

    ``counters`` is the object whose ``step``, ``losses``, ``last_commit`` and ``kind_seconds`` are the
    executor's (the interpreter's, so that every reader of the executor sees one step counter).
    """

    def __init__(
        self,
        piece: TrainableSlice,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        config: TrainingConfig,
        layout: Layout,
        rank: int,
        groups: GroupTable,
        coordinator: FailoverCoordinator,
        counters: Any,
        redundancy: str,
        microbatch: MicrobatchSource | None,
        device: torch.device | None = None,
    ) -> None:
        if layout.stages != 1:
            raise ValueError(f"a ring node needs P = 1, got P = {layout.stages}")
        self.piece = piece
        self.loss_fn = loss_fn
        self.config = config
        self.layout = layout
        self.rank = rank
        self.groups = groups
        self.coordinator = coordinator
        self.counters = counters
        self.eager = redundancy in EAGER_MODES
        self.microbatch = microbatch
        self.device = device or torch.device("cpu")
        """Where the model and the activations live; the reduction's buffers are in host memory."""
        self.ranges = share_ranges(config.shares(layout.pipelines))
        """Each share's global microbatch indices (the first ``G mod D`` shares one longer than the others)."""
        self.global_microbatches = config.global_count(layout.pipelines)
        self._share_of = {g: share for share, indices in enumerate(self.ranges) for g in indices}
        self.last_result: tuple[int, torch.Tensor, torch.Tensor] | None = None
        """(step, reduced gradients, every microbatch's loss) of the last step this node committed."""
        self.done = 0
        """Instructions completed in the current step (published with the progress after a failure)."""
        self._own: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._grads_zero = False
        """Whether the slice's gradients are all zero (set by a zeroing or a commit, cleared by a backward),
        so that a step's first share does not zero them a second time after the commit did."""
        self._scratch = ReusedBuffers(self.device)
        """The gradient-sized buffers of the shares and the reduction, reused from step to step. From one
        fault-free step to the next, every operation posted on one has finished before it is used again;
        :meth:`abandon_posted` drops them all, since a given-up operation may still write into its buffer.
        The share buffers are only ever sent from."""
        self.reset_step()

    # ----------------------------------------------------------------------------- state
    def reset_step(self) -> None:
        """Forget the current step's tensors (its shares, the eager copies, the posted all-reduce)."""
        self.shares: dict[int, Share] = {}
        """Share -> its gradients and losses, for the shares this node contributes this step."""
        self.aside: dict[int, Share] = {}
        """Eager: share -> the neighbour's gradients and losses, kept aside (not contributed)."""
        self.posted: _Reduction | None = None
        self._loaded: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._pending_losses: dict[int, torch.Tensor] = {}
        self._losses: dict[int, float] = {}
        self.done = 0

    def set_microbatches(self, microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This step's (inputs, labels) of the node's own share, by index within the share."""
        self._own = microbatches

    def owned(self) -> tuple[int, ...]:
        """The shares this node computes and contributes, in share order."""
        return self.layout.ring_shares(self.rank, self.coordinator.dead)

    def shadowed(self) -> tuple[int, ...]:
        """The shares of the node this one shadows (eager: computed aside every step)."""
        neighbour = self.layout.ring_shadowed(self.rank, self.coordinator.dead)
        return () if neighbour is None else self.layout.ring_shares(neighbour, self.coordinator.dead)

    # ----------------------------------------------------------------------------- the stream
    def stream(self, recovering: bool) -> list[Instruction]:
        """What is left of this step: every owned share not yet computed (an eager copy becomes the
        contribution at once), the all-reduce, the eager copies (not in a failover's remainder), the
        commit."""
        for share in self.owned():
            if share not in self.shares and share in self.aside:
                self.shares[share] = self.aside.pop(share)
        instructions: list[Instruction] = []
        for share in self.owned():
            if share not in self.shares:
                instructions += share_instructions(self.ranges[share])
        instructions.append(Instruction(Kind.ALLREDUCE, 0))
        if self.eager and not recovering:
            for share in self.shadowed():
                if share not in self.aside:
                    instructions += share_instructions(self.ranges[share], aside=True)
        instructions.append(Instruction(Kind.OPTIMIZER, 0))
        return instructions

    def execute(self, instruction: Instruction) -> float | None:
        """Execute one instruction (its wall time goes to ``kind_seconds``); ``OPT`` returns the step's
        mean loss."""
        started = time.perf_counter()
        result: float | None = None
        kind, g = instruction.kind, instruction.microbatch
        if kind is Kind.LOAD:
            assert g is not None
            self._load(g)
        elif kind in (Kind.FORWARD, Kind.FRC):
            assert g is not None
            if kind is Kind.FRC:
                self._load(g)
            self._forward(g)
        elif kind in (Kind.BACKWARD, Kind.BRC):
            assert g is not None
            self._backward(g, aside=kind is Kind.BRC)
        elif kind is Kind.ALLREDUCE:
            self._post()
        elif kind is Kind.OPTIMIZER:
            result = self._wait_and_commit()
        else:
            raise RuntimeError(f"{instruction}: not an instruction of a P = 1 ring")
        self.done += 1
        seconds = self.counters.kind_seconds
        seconds[kind.value] = seconds.get(kind.value, 0.0) + time.perf_counter() - started
        return result

    # ----------------------------------------------------------------------------- compute
    def _load(self, g: int) -> None:
        share = self._share_of[g]
        k = g - self.ranges[share].start
        if share == self.layout.position(self.rank)[1] and k in self._own:
            tokens, labels = self._own[k]
        elif self.microbatch is not None:
            tokens, labels = self.microbatch(self.counters.step, g)
        else:
            raise RuntimeError(
                f"microbatch {g} belongs to pipeline {share}: computing another node's share needs the data as a "
                f"function of (step, global index) (initialize(..., microbatch=...))"
            )
        self._loaded[g] = (to_device(tokens, self.device), to_device(labels, self.device))

    def _forward(self, g: int) -> None:
        if g == self.ranges[self._share_of[g]].start and not self._grads_zero:  # a share's gradients start from zero
            self.piece.zero_grads()
            self._grads_zero = True
        tokens, labels = self._loaded.pop(g)
        with autocast(self.config, self.device):
            logits = self.piece.forward(tokens, step=self.counters.step, microbatch=g)
        loss = self.loss_fn(logits, labels)
        self._losses[g] = float(loss.detach())
        self._pending_losses[g] = loss / self.global_microbatches

    def _backward(self, g: int, aside: bool) -> None:
        self._grads_zero = False
        backward(self._pending_losses.pop(g), self.piece.loss_scale)
        share = self._share_of[g]
        if g == self.ranges[share][-1]:  # the share is complete: its gradients leave the buffers
            grads = self.piece.flat_grads(out=self._scratch.get(f"share-{share}", self.piece.numel()))
            done: Share = (grads, [self._losses.pop(i) for i in self.ranges[share]])
            (self.aside if aside else self.shares)[share] = done

    # ----------------------------------------------------------------------------- the reduction
    def _post(self) -> None:
        """Post the first phase of this step's reduction on the group of the live nodes: each member
        receives its chunk of every share's gradients (and the losses are summed in slots)."""
        n = self.piece.numel()
        d = self.layout.pipelines
        members = self.groups.members[GROUP]
        owners = self.layout.ring_owners(frozenset(range(d)) - set(members))
        shares_of = {m: tuple(s for s in range(d) if owners[s] == m) for m in members}
        owned = self.owned()
        if shares_of[self.rank] != owned:
            raise RuntimeError(
                f"rank {self.rank} computes shares {list(owned)}, but its all-reduce group {list(members)} gives it "
                f"{list(shares_of[self.rank])}"
            )
        missing = [share for share in owned if share not in self.shares]
        if missing:
            raise RuntimeError(f"rank {self.rank} posts its all-reduce without shares {missing}")
        size = len(members)
        bounds = [(j * n // size, (j + 1) * n // size) for j in range(size)]
        me = members.index(self.rank)
        chunk = bounds[me][1] - bounds[me][0]
        if len(owned) == 1:  # the chunks in member order are the gradients as they are
            sent = self.shares[owned[0]][0]
        else:
            pieces = [self.shares[share][0][start:end] for start, end in bounds for share in owned]
            sent = torch.cat(pieces, out=self._scratch.get("sent", len(owned) * n))
        received = self._scratch.get("received", d * chunk)
        losses = torch.zeros(self.global_microbatches, dtype=torch.float64)
        for share in owned:
            indices = self.ranges[share]
            losses[indices.start : indices.stop] = torch.tensor(self.shares[share][1], dtype=torch.float64)
        self._await_group()
        works = self.groups.post_all_to_all(
            GROUP, received, sent, [len(shares_of[m]) * chunk for m in members],
            [len(owned) * (end - start) for start, end in bounds], "0AR",
        )
        works += self.groups.post_allreduce(GROUP, [losses], "0AR")
        self.posted = _Reduction(members, shares_of, bounds, works, [sent, received, losses])

    def _await_group(self) -> None:
        """Before a group's first use in an epoch: wait until every member is about to build it, then for
        its build, which runs in the background; raises FailureNoticed on any confirmed failure
        meanwhile (a member may die before it announces the build, or after, before it joins it)."""
        members = self.groups.members[GROUP]
        if self.coordinator.watching and GROUP not in self.groups.groups and len(members) > 1:
            version = self.groups.versions[GROUP]
            self.groups.build_after_barrier(GROUP, f"the build of {GROUP}",
                                            lambda: self.coordinator.await_group(GROUP, version, members),
                                            self.coordinator.raise_if_noticed)

    def _interrupt(self) -> None:
        event = self.coordinator.pending_event()
        if event is not None and set(event.victims) & set(self.groups.members[GROUP]):
            raise FailureNoticed(event)

    def _wait_and_commit(self) -> float:
        """The second phase: add this member's chunk of every share in share order, send the sum to every
        member (and receive theirs), and step."""
        posted = self.posted
        if posted is None:
            raise RuntimeError(f"rank {self.rank}: the step's all-reduce was never posted")
        self.groups.wait_collective(GROUP, posted.works, "0OPT (the gradient exchange)", self._interrupt)
        _sent, received, losses = posted.tensors
        me = posted.members.index(self.rank)
        chunk = posted.bounds[me][1] - posted.bounds[me][0]
        by_share: dict[int, torch.Tensor] = {}
        offset = 0
        for member in posted.members:
            for share in posted.shares_of[member]:
                by_share[share] = received[offset : offset + chunk]
                offset += chunk
        # Every member sends its sum straight to every other (an all-to-all). gloo's ring all-gather, in
        # which each member forwards the others' sums, left members waiting until the group's timeout more
        # often after a failure (a member that gave the step up forwards nothing); see comm.keep_until_settled.
        size = len(posted.members)
        copies = self._scratch.get("copies", size * chunk)  # the sum, once for each member
        mine = copies[:chunk]
        d = self.layout.pipelines
        if d == 1:
            mine.copy_(by_share[0])
        else:  # share order, the reference's association: ((share 0 + share 1) + share 2) + ...
            torch.add(by_share[0], by_share[1], out=mine)
        for share in range(2, d):
            mine.add_(by_share[share])  # element by element the same rounding as `mine + ...`
        for j in range(1, size):
            copies[j * chunk : (j + 1) * chunk].copy_(mine)
        sizes = [end - start for start, end in posted.bounds]
        # Two buffers by step parity: the last step's result stays whole (last_result) while this one's
        # arrives, for a laggard of that step to take (settle_laggards).
        summed = self._scratch.get(f"summed-{self.counters.step % 2}", self.piece.numel())
        works = self.groups.post_all_to_all(GROUP, summed, copies, sizes, [chunk] * len(sizes), "0OPT")
        self.groups.wait_collective(GROUP, works, "0OPT (the sums' exchange)", self._interrupt)
        return self._commit(summed, losses)

    def _commit(self, summed: torch.Tensor, losses: torch.Tensor) -> float:
        """Step with the reduced gradients `summed` (the global batch's) and record the step."""
        self.piece.load_flat_grads(summed)
        squared = self.piece.step_whole(self.config)  # tied copies summed; skipped after an fp16 overflow
        self._grads_zero = True  # the step zeroes them: the next step's first share need not again
        total = 0.0
        for value in losses.tolist():  # in global order, as the reference adds them
            total += value
        step = self.counters.step
        self.last_result = (step, summed, losses)
        self.counters.last_commit = CommitResult(step, squared, total)
        mean = total / self.global_microbatches
        self.counters.losses.append(mean)
        self.counters.step = step + 1
        self.reset_step()
        return mean

    # ----------------------------------------------------------------------------- failover
    def abandon_posted(self) -> None:
        """Give up the posted all-reduce (its group lost a member): it is posted again on the new group."""
        # gloo's works hold the tensors they read and write, and the group table keeps the works of a
        # retired group until they have finished, so nothing here needs to outlive the reduction. The
        # reused buffers are dropped: a given-up operation may still write into them.
        self.posted = None
        self._scratch.drop()

    def settle_laggards(self, agreement: RingAgreement) -> float | None:
        """Every live node joins the broadcast of the last step's result from ``agreement.source``; a
        laggard commits its step with it (returns that step's mean loss), the others check that it
        equals their own (None)."""
        if agreement.source is None:
            return None
        n = self.piece.numel()
        lagging = self.rank in agreement.lagging
        if not lagging and (self.last_result is None or self.last_result[0] != agreement.step - 1):
            held = None if self.last_result is None else self.last_result[0]
            raise RuntimeError(f"rank {self.rank} is in step {agreement.step} but holds the result of step {held}")
        if lagging:
            grads = torch.zeros(n)
            losses = torch.zeros(self.global_microbatches, dtype=torch.float64)
        else:
            assert self.last_result is not None
            grads, losses = self.last_result[1].clone(), self.last_result[2].clone()
        self._await_group()
        what = f"the result of step {agreement.step - 1} from rank {agreement.source}"
        works = self.groups.post_broadcast(GROUP, [grads, losses], agreement.source, what)
        self.groups.wait_collective(GROUP, works, what, self._interrupt)
        if not lagging:
            assert self.last_result is not None
            if not (torch.equal(grads, self.last_result[1]) and torch.equal(losses, self.last_result[2])):
                raise RuntimeError(f"rank {self.rank}: {what} differs from its own result of that step")
            return None
        if self.counters.step != agreement.step - 1:
            raise RuntimeError(f"rank {self.rank} in step {self.counters.step} cannot commit step {agreement.step - 1}")
        self.abandon_posted()
        return self._commit(grads, losses)

