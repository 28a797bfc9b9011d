"""The instruction interpreter: one node's `bamboo.schedule` instructions, executed with real tensors.

:class:`StageInterpreter` holds a node's slices (its stage and the replica it shadows), the
per-microbatch tensors of the current iteration, the FRC stash and the posted all-reduces, and
executes one instruction at a time (see `packages/bamboo-schedule/README.md`, "Executing a
schedule"):

- `L`, `F`, `B`, `SA`/`RA`, `SG`/`RG`: the pipeline itself. Sends and receives wait for
  completion; while one waits, a confirmed failure event raises
  :class:`~bamboo.rc.failures.FailureNoticed` and the transfer stays posted, so the same
  instruction of the failover schedule resumes it instead of posting it again. One whose peer was
  a victim is dropped once the failover is agreed (:meth:`StageInterpreter.forget_transfers_with`),
  and the commit refuses a step that still leaves one posted: it would pair with the next step's
  transfer of the same text. A replica sync over 256 MiB goes in messages of 256 MiB, one after the
  other, and resumes at the message it stopped at.
- `FR`, `SO`, `SI`, `BR`: redundant work on the replica, with the FRC stash kept in
  :class:`~bamboo.rc.stash.FrcStash`.
- `AR`: posts the data-parallel all-reduce of the stage's gradients (and the loss); its result is
  awaited where it is needed (collectives of different groups never wait on each other in stream
  order). With redundancy it keeps a copy of what it contributed, for a redo or a repost after a
  failure; without, a failure ends the run and no copy is made.
- `OPT`, `SY`, `RY`: the step is recorded, and applied at the commit (:meth:`commit`: one small
  all-reduce over the pipeline of the squared gradient norm and the loss, preceded by one of the tied
  weights' gradients when the model ties weights across stages (:mod:`bamboo.rc.ties`); then every
  hosted stage steps with the global clip coefficient, or skips the step after an fp16 overflow
  (:mod:`bamboo.rc.precision`)). `RY` receives the owner's reduced gradients; the replica steps with
  them, and the same tied sums, right before its next use.

All per-microbatch state is keyed by (stage, microbatch), so a node can host two stages after a
failover. The gradient w.r.t. each stage input (what `SG` sends) is kept for the whole iteration
(:attr:`StageInterpreter.input_grads`), so it can be sent again to a new owner. What the
interpreter must know of failures (events to notice while it waits, the group barrier) it asks
the :class:`~bamboo.rc.coordinator.FailoverCoordinator`.
"""

from __future__ import annotations

import concurrent.futures
import time
from collections.abc import Callable, Collection, Sequence
from typing import Any, ClassVar

import torch
from bamboo.rc.comm import CHUNK_BYTES, MAX_CHUNKS, GroupTable, wait_works
from bamboo.rc.config import TrainingConfig
from bamboo.rc.coordinator import FailoverCoordinator
from bamboo.rc.device import RedundantStream, to_device
from bamboo.rc.failures import FailureNoticed, PeerFailure
from bamboo.rc.layout import Layout
from bamboo.rc.precision import StepOutcome, autocast, backward, step_outcome
from bamboo.rc.records import CommitResult
from bamboo.rc.rng import global_microbatch
from bamboo.rc.stash import FrcStash
from bamboo.rc.state import ReusedBuffers, SpareBuffers, TrainableSlice
from bamboo.rc.ties import TiedWeights, squared_norm
from bamboo.rc.transport import HostStaging
from bamboo.schedule import FailoverPlan, Instruction, Kind

__all__ = ["StageInterpreter"]

# Message tags: kind (3 bits) | stage (< 128) | microbatch or segment (< 4096).
_TAG_ACT, _TAG_GRAD, _TAG_HEADER, _TAG_SYNC = 1, 2, 3, 4


def _tag(kind: int, stage: int, microbatch: int) -> int:
    if not (stage < 128 and microbatch < 4096):
        raise ValueError(f"stage {stage} / microbatch {microbatch} do not fit the message tag (128 / 4096)")
    return (kind * 128 + stage) * 4096 + microbatch


def _never_posted() -> tuple[list[object], torch.Tensor | None]:
    raise RuntimeError("a posted transfer was lost before it completed")


def _segments(flat: torch.Tensor) -> list[torch.Tensor]:
    """Split a large 1-D payload into messages that each fit MAX_CHUNKS chunks."""
    per_message = max(1, MAX_CHUNKS * CHUNK_BYTES // flat.element_size())
    return list(flat.split(per_message))


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]

Key = tuple[int, int]
Posted = tuple[list[object] | None, torch.Tensor, torch.Tensor, Any, tuple[int, ...]]
"""A posted all-reduce: (works, gradients, loss, (step, gradients, loss) as contributed, members). Works of None:
to be posted again on the group of `members`, once its build in the background is done
(:meth:`StageInterpreter.repost_changed_allreduces`)."""


class StageInterpreter:
    """Executes one node's instructions: its slices, its tensors, its transfers and its commit."""

    def __init__(
        self,
        slices: dict[int, TrainableSlice],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        config: TrainingConfig,
        layout: Layout,
        node: int,
        pipeline: int,
        groups: GroupTable,
        coordinator: FailoverCoordinator,
        keeps_contributions: bool = True,
        device: torch.device | None = None,
        ties: TiedWeights | None = None,
    ) -> None:
        self.slices = slices
        self.loss_fn = loss_fn
        self.config = config
        self.layout = layout
        self.node = node
        self.pipeline = pipeline
        self.rank = layout.rank(node, pipeline)
        self.groups = groups
        self.coordinator = coordinator
        self.ties = ties or TiedWeights()
        """The model's tied weights: their gradients are summed over the pipeline at the commit."""
        self.keeps_contributions = keeps_contributions
        """Whether each all-reduce keeps a copy of what it contributed, to be redone or posted again after a
        failure. Only with redundancy: without, a failure ends the run, and the copy would cost a fresh
        gradient-sized tensor every step."""
        self.device = device or torch.device("cpu")
        """Where the slices, the activations and the gradients live (:mod:`bamboo.rc.device`); messages and
        the all-reduced gradients are in host memory, staged by :attr:`staging`."""
        self.staging = HostStaging(self.device)
        self.redundant = RedundantStream(self.device)
        """The second stream FRC and BRC run on, on a GPU."""
        self.stash = FrcStash()
        self.step = 0
        self.losses: list[float] = []
        self.last_commit: CommitResult | None = None
        """The result of the last commit this node completed (published with its progress after a failure)."""
        self.sync_bytes = 0
        self.kind_seconds: dict[str, float] = {}
        self._waiter = concurrent.futures.ThreadPoolExecutor(max_workers=8) if coordinator.watching else None
        self._pending: dict[str, tuple[int, object, torch.Tensor | None]] = {}
        """Transfers a confirmed failure interrupted: instruction text -> (peer node, handle, buffer)."""
        self._segmented: dict[str, tuple[int, torch.Tensor, int]] = {}
        self._posted_syncs: dict[str, Instruction] = {}
        """Replica syncs posted and not yet waited for (their handles are in `_pending`): text -> instruction."""
        """Payloads sent in several messages that a failure interrupted: instruction text -> (peer node, the
        payload, the segment to resume at)."""
        self._act_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._act_meta_sent: set[int] = set()
        self._replica_updates: dict[int, tuple[torch.Tensor, StepOutcome, dict[str, torch.Tensor]]] = {}
        self._contributions: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._flat_buffers = ReusedBuffers(self.device)
        """Without redundancy: by stage, the buffer its flat gradients are gathered into, step after step."""
        self._spare_grads = SpareBuffers(self.device)
        """With redundancy: by stage, gradient-sized buffers free again (an all-reduce's that completed, a
        contribution no longer kept), for the next step's flat gradients and contribution."""
        self._sync_buffers = ReusedBuffers(self.device)
        """By ("out" or "in", stage): the payload of the stage's replica sync, sent or received, step after step."""
        self._microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._output_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._reduced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset_iteration()

    # ----------------------------------------------------------------------------- state
    def close(self) -> None:
        """End the idle threads that wait on transfers (one still waiting ends with its transfer)."""
        if self._waiter is not None:
            self._waiter.shutdown(wait=False)

    def reset_iteration(self) -> None:
        """Forget every tensor of the current iteration (the stash too)."""
        self.inputs: dict[Key, torch.Tensor] = {}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.out_grads: dict[Key, torch.Tensor] = {}
        self.input_grads: dict[Key, torch.Tensor] = {}
        self.red_inputs: dict[Key, torch.Tensor] = {}
        self.red_outputs: dict[Key, torch.Tensor] = {}
        self.local_outputs: dict[Key, torch.Tensor] = {}
        self.mb_losses: dict[int, float] = {}
        if self.keeps_contributions:  # each all-reduce in `_reduced` completed: nothing writes into its buffer
            for s, (flat, _) in self._reduced.items():
                self._spare_grads.give_back(s, flat)
        self._reduced = {}
        """Stage -> its reduced gradients and [the reduced loss as fp32, the stage's step number after this one]."""
        self._reducing: dict[int, Posted] = {}
        self._to_step: list[int] = []
        self._received_syncs: dict[int, torch.Tensor] = {}
        self._tie_sums: dict[str, torch.Tensor] | None = None
        """The tied weights' gradients summed over the pipeline, once the commit's first all-reduce completed."""
        self.stash.clear()

    def abandon_iteration(self) -> None:
        """Back to the start-of-iteration state: partial gradients and stashes discarded."""
        for piece in self.slices.values():
            piece.zero_grads()
        self._sync_buffers.drop()  # a transfer given up with the iteration may still be posted on one
        for key in self._posted_syncs:  # the iteration's groups are built again: nothing will take them
            self._pending.pop(key, None)
        self._posted_syncs.clear()
        self.reset_iteration()

    def set_microbatches(self, microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This iteration's (tokens, labels) by microbatch index within the pipeline (put on the device)."""
        self._microbatches = {k: (to_device(x, self.device), to_device(y, self.device))
                              for k, (x, y) in microbatches.items()}

    def _peer_rank(self, node: int) -> int:
        return self.layout.rank(node, self.pipeline)

    def _group_for(self, peer: int) -> str:
        a, b = sorted((self.rank, peer))
        return f"p2p-{a}-{b}"

    def _global_microbatches(self) -> int:
        return self.config.micro_batches * self.layout.pipelines

    # ----------------------------------------------------------------------------- transfers
    def _transfer(
        self, instruction: Instruction, peer: int, post: Callable[[], tuple[list[object], torch.Tensor | None]]
    ) -> torch.Tensor | None:
        """Post (or resume) a send or receive and wait for it.

        While it waits, the node checks for confirmed failure notices; if one arrives, the
        transfer stays posted (kept under the instruction's text, so the same instruction of the
        failover schedule resumes it instead of posting a duplicate) and FailureNoticed is raised.
        """
        key = str(instruction)
        if key in self._pending:
            _, handle, buffer = self._pending.pop(key)
        else:
            works, buffer = post()
            handle = works if self._waiter is None else self._waiter.submit(wait_works, works)
        if isinstance(handle, list):
            try:
                wait_works(handle)
            except RuntimeError as exc:
                raise PeerFailure(peer, self.layout.name(peer), key, exc) from exc
            return buffer
        assert isinstance(handle, concurrent.futures.Future)
        while True:
            try:
                handle.result(timeout=self.groups.timeouts.poll)
                return buffer
            except concurrent.futures.TimeoutError:
                self._post_built()
                event = self.coordinator.pending_event()
                if event is not None:
                    assert instruction.peer is not None
                    self._pending[key] = (instruction.peer, handle, buffer)
                    raise FailureNoticed(event) from None
            except RuntimeError as exc:
                raise PeerFailure(peer, self.layout.name(peer), key, exc) from exc

    def forget_transfers_with(self, victims: Collection[int]) -> list[str]:
        """Drop the interrupted transfers whose peer is one of `victims` (nodes of this pipeline that a
        failover removed); returns their instruction texts. The failover schedule never resumes them: they
        only fail, and they would keep their buffers to the end of this executor."""
        dropped = sorted({key for key, (peer, _, _) in [*self._pending.items(), *self._segmented.items()]
                          if peer in victims})
        for key in dropped:
            self._pending.pop(key, None)
            self._segmented.pop(key, None)
            self._posted_syncs.pop(key, None)
        if dropped:  # a dropped receive may still be posted on its buffer
            self._sync_buffers.drop()
        return dropped

    def _interrupter(self, group: str) -> Callable[[], None]:
        """While blocked in a collective on `group`: raise FailureNoticed if a confirmed failure
        removed a member of it. A collective whose members all live is left to complete (the
        event is noticed again at the next blocking point), so it is never posted twice."""

        def interrupt() -> None:
            self._post_built()
            event = self.coordinator.pending_event()
            if event is not None and set(event.victims) & set(self.groups.members[group]):
                raise FailureNoticed(event)

        return interrupt

    def _needs_barrier(self, group: str) -> bool:
        """Whether using `group` builds it first (its first use in an epoch) with others (callers check
        for a build in the background first)."""
        return self.coordinator.watching and group not in self.groups.groups and len(self.groups.members[group]) > 1

    def _announce_group(self, group: str, interrupt: Callable[[], None] | None = None) -> None:
        """Inside the failover itself, before `group`'s first use in the epoch: tell the other members
        that this node is about to build it, or wait for its build in the background (calling
        `interrupt`, which may raise)."""
        if group in self.groups.building:
            self.groups.wait_built(group, f"the build of {group}", interrupt)
        elif self._needs_barrier(group):
            self.coordinator.announce_group(group, self.groups.versions[group])

    def _await_group_members(self, group: str, instruction: str) -> None:
        """Before `group`'s first use in the epoch, raising FailureNoticed on any confirmed failure
        meanwhile: wait for its build in the background, or (none started) until every member is about
        to build it too (a member may die before it gets there, and a gloo build would only time out),
        then build it in the background and wait for that (a member may also die after it announced the
        build and before it joined it)."""
        if group in self.groups.building or self._needs_barrier(group):
            version, members = self.groups.versions[group], self.groups.members[group]
            self.groups.build_after_barrier(group, instruction,
                                            lambda: self.coordinator.await_group(group, version, members),
                                            self._poll)

    def _poll(self) -> None:
        """Called every `timeouts.poll` seconds while this node waits: post the all-reduces whose rebuilt
        group is now built (:meth:`repost_changed_allreduces`), and raise FailureNoticed on a confirmed
        failure."""
        self._post_built()
        self.coordinator.raise_if_noticed()

    def _send(self, instruction: Instruction, tensor: torch.Tensor, peer: int, tag: int) -> None:
        group = self._group_for(peer)
        self._await_group_members(group, str(instruction))
        self._transfer(instruction, peer, lambda: (
            self.groups.post_send(group, self.staging.outbound(tensor), peer, tag, str(instruction)), None))

    def _recv(self, instruction: Instruction, buffer: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        group = self._group_for(peer)
        self._await_group_members(group, str(instruction))
        out = self._transfer(
            instruction, peer, lambda: (self.groups.post_recv(group, buffer, peer, tag, str(instruction)), buffer)
        )
        assert out is not None
        return out

    # ----------------------------------------------------------------------------- instructions
    def execute(self, instruction: Instruction) -> None:
        """Execute one instruction (its wall time is added to :attr:`kind_seconds`)."""
        started = time.perf_counter()
        self._post_built()
        self._handlers[instruction.kind](self, instruction)
        code = instruction.kind.value
        self.kind_seconds[code] = self.kind_seconds.get(code, 0.0) + time.perf_counter() - started

    def _load(self, instruction: Instruction) -> None:
        k = instruction.microbatch
        if k not in self._microbatches:
            raise RuntimeError(f"{instruction}: microbatch {k} was not loaded (no data for this step)")

    def _recv_act(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None and instruction.peer is not None
        peer = self._peer_rank(instruction.peer)
        if peer not in self._act_meta:
            header = self._recv(instruction, torch.zeros(8, dtype=torch.int64), peer, _tag(_TAG_HEADER, s, 0))
            ndim = int(header[0])
            self._act_meta[peer] = (tuple(int(v) for v in header[2 : 2 + ndim]), _DTYPES[int(header[1])])
        shape, dtype = self._act_meta[peer]
        received = self._recv(instruction, self.staging.inbound_buffer(shape, dtype), peer, _tag(_TAG_ACT, s, k))
        buffer = self.staging.inbound(received)
        self.inputs[(s, k)] = buffer.requires_grad_(buffer.is_floating_point())

    def _stage_input(self, stage: int, k: int) -> torch.Tensor:
        if stage == 0:
            return self._microbatches[k][0]
        key = (stage, k)
        if key not in self.inputs:  # the previous stage runs here too: its local output
            self.inputs[key] = self.local_outputs[(stage - 1, k)].requires_grad_()
        return self.inputs[key]

    def _run_layers(self, stage: int, k: int, x: torch.Tensor) -> torch.Tensor:
        self._apply_replica_update(stage)
        microbatch = global_microbatch(self.pipeline, self.config.micro_batches, k)
        with autocast(self.config, self.device):
            y = self.slices[stage].forward(x, step=self.step, microbatch=microbatch)  # F, FR, BR's FR: same masks
        if stage == self.layout.stages - 1:
            return self.loss_fn(y, self._microbatches[k][1]) / self._global_microbatches()
        self._output_meta[stage] = (y.shape, y.dtype)
        if stage + 1 in self.slices:
            self.local_outputs[(stage, k)] = y.detach()  # input of the next stage's local copy
        return y

    def _forward(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        y = self._run_layers(s, k, self._stage_input(s, k))
        if s == self.layout.stages - 1:
            self.mb_losses[k] = float(y.detach()) * self._global_microbatches()
        self.outputs[(s, k)] = y

    def _send_act(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None and instruction.peer is not None
        peer = self._peer_rank(instruction.peer)
        y = (self.outputs[(s, k)] if (s, k) in self.outputs else self.red_outputs[(s, k)]).detach()
        if peer not in self._act_meta_sent:
            header = torch.zeros(8, dtype=torch.int64)
            header[0] = y.dim()
            header[1] = _DTYPES.index(y.dtype)
            header[2 : 2 + y.dim()] = torch.tensor(y.shape)
            self._send(instruction, header, peer, _tag(_TAG_HEADER, s + 1, 0))
            self._act_meta_sent.add(peer)
        self._send(instruction, y, peer, _tag(_TAG_ACT, s + 1, k))

    def _recv_grad(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None and instruction.peer is not None
        peer = self._peer_rank(instruction.peer)
        shape, dtype = self._output_meta[s]
        received = self._recv(instruction, self.staging.inbound_buffer(shape, dtype), peer, _tag(_TAG_GRAD, s, k))
        self.out_grads[(s, k)] = self.staging.inbound(received)

    def _output_grad(self, s: int, k: int) -> torch.Tensor | None:
        """The gradient w.r.t. stage s's output: received, or local when stage s+1 ran here."""
        if s == self.layout.stages - 1:
            return None
        if (s, k) in self.out_grads:
            return self.out_grads.pop((s, k))
        return self.input_grads[(s + 1, k)]

    def _backward_from(self, s: int, k: int, output: torch.Tensor, x: torch.Tensor | None) -> None:
        grad = self._output_grad(s, k)
        if grad is None:
            backward(output, self.slices[s].loss_scale)  # the loss, scaled with fp16
        else:
            torch.autograd.backward(output, grad)
        if s > 0 and x is not None:
            self.input_grads[(s, k)] = x.grad  # type: ignore[assignment]

    def _backward(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        self._backward_from(s, k, self.outputs.pop((s, k)), self.inputs.pop((s, k), None))

    def _send_grad(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None and instruction.peer is not None
        peer = self._peer_rank(instruction.peer)
        self._send(instruction, self.input_grads[(s, k)], peer, _tag(_TAG_GRAD, s - 1, k))

    def _replica_input(self, s: int, k: int) -> torch.Tensor:
        if s == 0:
            return self._microbatches[k][0]
        if (s, k) in self.stash.inputs:  # lflb: the stashed input (in host memory)
            return to_device(self.stash.inputs[(s, k)], self.device)
        return self.local_outputs[(s - 1, k)]

    def _frc(self, instruction: Instruction) -> None:
        """Forward of stage s with the replica layers; saved tensors are registered in the stash."""
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        x = self._replica_input(s, k)
        if s > 0:
            x = x.detach().requires_grad_()
        self._apply_replica_update(s)
        weights = {p.untyped_storage().data_ptr() for p in self.slices[s].parameters}
        with self.redundant.run(), self.stash.recording((s, k), skip=weights):
            y = self._run_layers(s, k, x)
        if s == self.layout.stages - 1:
            self.mb_losses.setdefault(k, float(y.detach()) * self._global_microbatches())
        self.red_inputs[(s, k)] = x
        self.red_outputs[(s, k)] = y

    def _swap_out(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        if (s, k) in self.red_outputs:
            self.stash.swap_out((s, k))
        else:  # lflb: no FRC ran; the stash is the replica's input
            self.stash.put_input((s, k), self._replica_input(s, k))

    def _swap_in(self, instruction: Instruction) -> None:
        self.stash.swap_in((instruction.stage, instruction.microbatch))  # type: ignore[arg-type]

    def _brc(self, instruction: Instruction) -> None:
        """Backward of stage s from the FRC stash (running the FRC first if it was lazy)."""
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        if (s, k) not in self.red_outputs:
            self._frc(instruction)
        output = self.red_outputs.pop((s, k))
        x = self.red_inputs.pop((s, k))
        with self.redundant.run():
            self._backward_from(s, k, output, x if s > 0 else None)
        self.stash.drop((s, k))

    def _allreduce(self, instruction: Instruction) -> None:
        """Start the data-parallel all-reduce of stage s (the result is awaited when needed:
        collectives on different groups must not wait on each other in the stream's order)."""
        s = instruction.stage
        piece = self.slices[s]
        last = s == self.layout.stages - 1
        loss = torch.tensor([sum(self.mb_losses.values()) if last else 0.0], dtype=torch.float64)
        # A fresh gradient-sized tensor costs its page faults again every step, so the flat gradients go into
        # a reused buffer: without redundancy nothing outlives the step's all-reduce (a failure ends the run),
        # so one per stage; with redundancy one whose all-reduce completed, or a contribution no longer kept.
        n = piece.numel()
        flat = piece.flat_grads(out=self._spare_grads.take(s, n) if self.keeps_contributions
                                else self._flat_buffers.get(s, n))
        if not self.keeps_contributions:
            contribution: tuple[int, torch.Tensor | None, torch.Tensor | None] = (self.step, None, None)
        elif self.layout.pipelines == 1:  # a group of one: the all-reduce leaves `flat` as it is, so it is its own copy
            contribution = (self.step, flat, loss)
        else:  # the all-reduce sums into `flat`: the contribution is kept apart, for a shadow's redo
            contribution = (self.step, self._spare_grads.take(s, n).copy_(flat), loss.clone())
        group = f"dp-s{s}"
        self._await_group_members(group, str(instruction))
        works = self.groups.post_allreduce(group, [flat, loss], str(instruction))
        self._reducing[s] = (works, flat, loss, contribution, self.groups.members[group])

    def _wait_reduction(self, s: int) -> None:
        """Finish stage s's all-reduce: load the reduced gradients, record the result.

        While it waits, any confirmed failure raises FailureNoticed (the all-reduce stays posted
        in `_reducing` and is resumed, never posted twice): a failed pipeline's survivors must
        never sit uninterruptibly in a collective with another pipeline, whose nodes may wait in
        the failover agreement for the survivors' progress.
        """
        if s not in self._reducing:
            return
        self._post_waiting(block=True, interrupt=self._poll)
        works, flat, loss, contribution, _members = self._reducing[s]
        assert works is not None
        group = f"dp-s{s}"
        self.groups.wait_collective(group, works, f"{s}AR", self._poll)
        del self._reducing[s]
        piece = self.slices[s]
        piece.load_flat_grads(flat)
        if self.layout.pipelines > 1 and self.keeps_contributions:  # in case a lost peer's shadow redoes it
            self._contributions[(s, contribution[0])] = (contribution[1], contribution[2])
            for key in [k for k in self._contributions if k[1] < contribution[0] - 1]:
                kept, _ = self._contributions.pop(key)
                self._spare_grads.give_back(key[0], kept)  # never posted: redos and reposts send copies
        self._reduced[s] = (flat, torch.cat([loss.float(), torch.tensor([float(piece.steps + 1)])]))

    def wait_posted_allreduces(self) -> None:
        """Wait until every posted data-parallel all-reduce completed (so the peers completed it too)."""
        self._post_waiting(block=True)
        for s in sorted(self._reducing):
            works, _, _, _, _ = self._reducing[s]
            assert works is not None
            self.groups.wait_collective(f"dp-s{s}", works, f"{s}AR")

    def _optimizer(self, instruction: Instruction) -> None:
        self._to_step.append(instruction.stage)  # applied at the commit, with the global clip

    def _sync_send(self, instruction: Instruction) -> None:
        """Post the send of stage s's reduced gradients (and its loss and step number) to its shadow, and go on.

        The replica sync is a buffered send (`bamboo.schedule.BUFFERED_SENDS`): the shadow receives it at the end
        of its own work, so waiting here would hold this node for nothing. It is completed before the commit
        (:meth:`complete_posted_syncs`), which keeps its payload buffer alive until then."""
        assert instruction.peer is not None
        s = instruction.stage
        self._wait_reduction(s)
        shadow = self._peer_rank(instruction.peer)
        payload = torch.cat(self._reduced[s], out=self._sync_buffers.get(("out", s), self._sync_size(s)))
        group = self._group_for(shadow)
        key = str(instruction)
        self._await_group_members(group, key)
        works: list[object] = []
        for segment, piece in enumerate(_segments(payload)):
            works += self.groups.post_send(group, piece, shadow, _tag(_TAG_SYNC, s, segment), key)
        handle = works if self._waiter is None else self._waiter.submit(wait_works, works)
        self._pending[key] = (instruction.peer, handle, payload)
        self._posted_syncs[key] = instruction
        self.sync_bytes += payload.numel() * payload.element_size()

    def complete_posted_syncs(self) -> None:
        """Wait until every replica sync this node posted was received, giving way to a confirmed failure
        (the sync stays posted, and is waited for again at the next commit)."""
        for key, instruction in list(self._posted_syncs.items()):
            if key in self._pending:
                assert instruction.peer is not None
                self._transfer(instruction, self._peer_rank(instruction.peer), _never_posted)
            del self._posted_syncs[key]

    def _sync_recv(self, instruction: Instruction) -> None:
        """Receive stage s's reduced gradients; the replica steps with them after the commit."""
        assert instruction.peer is not None
        s = instruction.stage
        self._apply_replica_update(s)  # lflb never runs the replica: apply the last update now
        owner = self._peer_rank(instruction.peer)
        # Reused: the last update, applied just now, was the only other user of the buffer.
        self._received_syncs[s] = self._receive_segments(
            instruction, lambda: self._sync_buffers.get(("in", s), self._sync_size(s)), owner, s
        )

    def _sync_size(self, s: int) -> int:
        """Elements of stage s's replica sync: its gradients, the reduced loss and the step number."""
        return self.slices[s].numel() + 2

    def _receive_segments(self, instruction: Instruction, make: Callable[[], torch.Tensor], peer: int,
                          stage: int) -> torch.Tensor:
        """Receive into the payload `make()` gives, one message per segment; returns the payload.

        A payload over MAX_CHUNKS chunks (256 MiB) comes in messages of that size, one after the other, so that
        no more than one message's chunks are posted at a time. A confirmed failure can interrupt it after some
        segments came: the payload and the first unfinished segment are kept under the instruction's text, so the
        failover schedule's same instruction resumes it there (the interrupted segment's receive is still posted),
        and never receives a segment twice."""
        key = str(instruction)
        assert instruction.peer is not None
        _, payload, start = self._segmented.pop(key, (instruction.peer, None, 0))
        if payload is None:
            payload = make()
        for segment, piece in enumerate(_segments(payload)):
            if segment < start:
                continue
            self._segmented[key] = (instruction.peer, payload, segment)
            self._recv(instruction, piece, peer, _tag(_TAG_SYNC, stage, segment))
        del self._segmented[key]
        return payload

    def _apply_replica_update(self, stage: int) -> None:
        """Apply the owner's step of the last iteration to the replica of `stage` (identical math)."""
        update = self._replica_updates.pop(stage, None)
        if update is None:
            return
        started = time.perf_counter()
        payload, outcome, tie_sums = update
        replica = self.slices[stage]
        step = int(payload[-1].item())
        if step != replica.steps + 1:
            raise RuntimeError(f"replica sync of stage {stage} out of order: got step {step}, replica at {replica.steps}")
        if not outcome.overflow:
            replica.load_flat_grads(payload[:-2])
        replica.finish_step(outcome, tie_sums)
        self.kind_seconds["replica_step"] = self.kind_seconds.get("replica_step", 0.0) + time.perf_counter() - started

    def apply_replica_updates(self) -> None:
        """Apply every received replica update now (they are otherwise applied at the replica's next use)."""
        for stage in list(self._replica_updates):
            self._apply_replica_update(stage)

    _handlers: ClassVar[dict[Kind, Callable[[StageInterpreter, Instruction], None]]] = {
        Kind.LOAD: _load,
        Kind.FORWARD: _forward,
        Kind.BACKWARD: _backward,
        Kind.FRC: _frc,
        Kind.BRC: _brc,
        Kind.SEND_ACT: _send_act,
        Kind.RECV_ACT: _recv_act,
        Kind.SEND_GRAD: _send_grad,
        Kind.RECV_GRAD: _recv_grad,
        Kind.SWAP_OUT: _swap_out,
        Kind.SWAP_IN: _swap_in,
        Kind.ALLREDUCE: _allreduce,
        Kind.OPTIMIZER: _optimizer,
        Kind.SYNC_SEND: _sync_send,
        Kind.SYNC_RECV: _sync_recv,
    }

    # ----------------------------------------------------------------------------- commit
    def commit(self, hosted: Sequence[int]) -> float:
        """End the iteration of the `hosted` stages: one all-reduce over the pipeline of the squared
        gradient norm and the loss, then their optimizer steps with the global clip coefficient.
        Returns the step's mean loss over the global batch.

        This is the commit point: until it, no parameter has changed in this iteration, so a
        failure before it leaves every survivor at the start-of-iteration state. The all-reduce is
        not atomic: when a victim dies during it, survivors that completed it have committed and
        the others finish the commit with their result (:meth:`finish_commit`).
        """
        started = time.perf_counter()
        try:
            return self._commit(hosted)
        finally:
            self.kind_seconds["commit"] = self.kind_seconds.get("commit", 0.0) + time.perf_counter() - started

    def _commit(self, hosted: Sequence[int]) -> float:
        pipe = f"pipe-d{self.pipeline}"
        self._await_group_members(pipe, "commit")  # before anything changes: it may raise
        for s in sorted(self._reducing):
            self._wait_reduction(s)
        self.complete_posted_syncs()  # every shadow holds its stage's step before anyone commits it
        squared, loss = self._commit_contribution(hosted)
        if self.ties:  # the tied copies' gradients summed over the pipeline (zeros from a node holding none)
            tied = self.ties.contribution([self.slices[s].tied for s in sorted(hosted)])
            self.groups.allreduce(pipe, [tied], "commit (tied weights' gradients)", self._interrupter(pipe))
            self._tie_sums = self.ties.split(tied)
        norm_and_loss = torch.tensor([squared, loss], dtype=torch.float64)
        self.groups.allreduce(pipe, [norm_and_loss], "commit (global gradient norm and loss)", self._interrupter(pipe))
        return self._apply_commit(hosted, CommitResult(self.step, float(norm_and_loss[0]), float(norm_and_loss[1])))

    def _commit_contribution(self, hosted: Sequence[int]) -> tuple[float, float]:
        """This node's part of the commit: the squared gradient norm of the `hosted` stages and the
        loss (the last stage's). A victim's finished stage takes its gradients from its replica
        sync. Changes nothing but those gradients, so it can run again."""
        last = self.layout.stages - 1
        squared = 0.0
        loss = 0.0
        for s in hosted:
            if s in self._reduced:
                squared += self.slices[s].squared_grad_norm()
                reduced_loss = float(self._reduced[s][1][0])
            elif s in self._received_syncs:  # a victim's finished stage: its sync is the result
                payload = self._received_syncs[s]
                self.slices[s].load_flat_grads(payload[:-2])
                squared += self.slices[s].squared_grad_norm()
                reduced_loss = float(payload[-2])
            else:
                raise RuntimeError(f"stage {s} ended the iteration without an all-reduce")
            if s == last:
                loss = float(self._reduced[s][1][0]) if s in self._reduced else reduced_loss
        if last in hosted and last in self._reduced:
            loss = sum(self.mb_losses.values()) if self.layout.pipelines == 1 else loss
        return squared, loss

    def finish_commit(self, hosted: Sequence[int], result: CommitResult) -> float:
        """Finish this step's commit with `result`, the outcome of the commit's all-reduce that the
        other survivors completed while this node's failed (a victim died during it). `hosted` are
        the stages this node ran in the step. Returns the step's mean loss, as :meth:`commit`."""
        if result.step != self.step:
            raise RuntimeError(f"the result of the commit of step {result.step} cannot end step {self.step}")
        return self._apply_commit(hosted, result)

    def _apply_commit(self, hosted: Sequence[int], result: CommitResult) -> float:
        """The optimizer steps of the `hosted` stages with the clip coefficient of `result`, the
        replica updates, the step's loss; then the next iteration."""
        if self._pending or self._segmented:
            # A transfer with a live peer that the step ended without: the failover schedule should have
            # resumed it. Left posted, it would pair with the next step's transfer of the same text (a stale
            # send would deliver this step's tensor), so stop rather than train on.
            raise RuntimeError(
                f"step {self.step} of node {self.node} (pipeline {self.pipeline}) ended with transfers still posted: "
                f"{sorted({*self._pending, *self._segmented})}; the failover schedule did not resume them"
            )
        if self.ties and self._tie_sums is None:
            raise RuntimeError(f"the commit of step {self.step} ends without the sums of the tied weights' gradients")
        tie_sums = self._tie_sums or {}
        squared = result.squared_norm + squared_norm(tie_sums)  # a tied weight counts once
        outcome = step_outcome(self.config.gradient_clipping, squared, next(iter(self.slices.values())).loss_scale,
                               self.config.fp16)
        finished = [s for s in hosted if s not in self._reduced and s in self._received_syncs]
        for s in finished:
            self.slices[s].load_flat_grads(self._received_syncs[s][:-2])
        for s in [*self._to_step, *finished]:
            self.slices[s].finish_step(outcome, tie_sums)
        for s, payload in self._received_syncs.items():
            if s not in finished:
                self._replica_updates[s] = (payload, outcome, tie_sums)
        for piece in self.slices.values():  # replicas too: the scale is the same everywhere
            piece.loss_scale = outcome.loss_scale
        mean_loss = result.loss / self._global_microbatches()
        self.losses.append(mean_loss)
        self.last_commit = result
        self.step += 1
        self.reset_iteration()
        return mean_loss

    # ----------------------------------------------------------------------------- after failures
    def repost_changed_allreduces(self) -> None:
        """Post again, on the rebuilt group, every pending all-reduce whose group's membership
        changed (a member left at an iteration boundary).

        This runs while the event is applied, where nothing may block: each is posted once its group's
        build in the background is done, at this node's next instruction or wait, and at the latest
        where its result is needed, which waits for the build and gives way to a confirmed failure
        meanwhile (a member that died before it joined the build)."""
        for stage, (_, _, _, contribution, members) in list(self._reducing.items()):
            group = f"dp-s{stage}"
            if members != self.groups.members[group]:
                self._post_again(stage, contribution)

    def _post_again(self, stage: int, contribution: Any) -> None:
        """Post stage `stage`'s all-reduce again, with the contribution it had, on the group of the current
        membership: now if the group is built, else once its build in the background is done (started
        here if no membership change started it)."""
        group = f"dp-s{stage}"
        _, flat, loss = contribution
        if flat is None or loss is None:
            raise RuntimeError(f"stage {stage}: an all-reduce must be posted again, but its contribution was not kept "
                               f"(keeps_contributions is off: redundancy none)")
        if group not in self.groups.groups and group not in self.groups.building and len(self.groups.members[group]) > 1:
            self._announce_group(group)  # the store barrier the other members wait at before they build it
            self.groups.start_build(group)
        self._reducing[stage] = (None, flat.clone(), loss.clone(), contribution, self.groups.members[group])
        self._post_built()

    def _post_built(self) -> None:
        """Post each all-reduce waiting to be posted again whose group is ready by now; never blocks."""
        self._post_waiting(block=False)

    def _post_waiting(self, block: bool, interrupt: Callable[[], None] | None = None) -> None:
        """Post, in stage order, the all-reduces waiting to be posted again on their rebuilt group: those
        whose group is ready, or (`block`) each after waiting for its build. One whose group changed again
        is left to the event that changed it, which posts it again; where the result is needed (`block`),
        such a one is an error. A blocking wait calls `interrupt`, which may raise: those not posted yet
        stay waiting."""
        for stage in sorted(self._reducing):
            works, flat, loss, contribution, members = self._reducing[stage]
            if works is not None:
                continue
            group = f"dp-s{stage}"
            if members != self.groups.members.get(group):
                if not block:
                    continue
                raise RuntimeError(
                    f"stage {stage}: an all-reduce waits to be posted again on {group} as {list(members)}, but the "
                    f"group is {list(self.groups.members.get(group, ()))} now and no failover posted it again"
                )
            if block:
                self.groups.wait_built(group, f"{stage}AR (again)", interrupt)
            elif len(members) > 1 and not self.groups.ready(group):  # a failed build is raised when blocking
                continue
            posted = self.groups.post_allreduce(group, [flat, loss], f"{stage}AR (again)")
            self._reducing[stage] = (posted, flat, loss, contribution, members)

    def join_redone_allreduces(self, plan: FailoverPlan, lost: set[int] | frozenset[int], step: int,
                               hosted: Sequence[int]) -> None:
        """Take part, exactly once per step, in the all-reduce of each lost stage hosted here (the
        failover of another pipeline).

        `step` is the step in which the other pipeline failed. If the lost stage's shadow redoes
        that step's all-reduce: an all-reduce of ours for that step that already completed is
        joined again with our stored contribution; one still pending on the old group is posted
        again on the rebuilt group. If the shadow does not redo it (the victim had finished), ours
        completes on the old group. A pending all-reduce of a later step (this node ran ahead:
        its pipeline committed `step` without the failed one) is posted again too, but only after
        the redo of `step`: gloo matches the collectives of a group in posting order, and the
        shadow posts the redo of `step` first, so the other order would sum different steps.
        """
        for v in sorted(lost):
            if v not in hosted:
                continue
            shadow = plan.remainder.placement[v]  # the node that took stage v over
            redone = any(i.kind is Kind.ALLREDUCE and i.stage == v for i in plan.remainder.streams[shadow])
            group = f"dp-s{v}"
            pending = self._reducing.get(v)
            pending_step = pending[3][0] if pending is not None else None
            if pending_step is not None and pending_step < step:
                raise RuntimeError(
                    f"stage {v}: an all-reduce of step {pending_step} is still pending while the other pipeline "
                    f"failed in step {step}"
                )
            if redone and pending_step != step:  # ours of `step` completed (or is not posted yet)
                contribution = self._contributions.get((v, step))
                if contribution is not None:
                    flat, loss = contribution
                    self._announce_group(group, self._interrupter(group))
                    self.groups.allreduce(
                        group, [flat.clone(), loss.clone()], f"redo of {v}AR", self._interrupter(group)
                    )
                elif pending_step is not None:  # ran ahead, yet nothing stored: cannot redo exactly
                    raise RuntimeError(
                        f"stage {v}: the shadow redoes the all-reduce of step {step}, but this node is in step "
                        f"{pending_step} and kept no contribution of step {step}"
                    )
            if pending is not None and pending[4] != self.groups.members[group]:
                assert pending_step is not None
                if pending_step > step or redone:
                    self._post_again(v, pending[3])
