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

The interpreter is one class built in layers, one module each: :mod:`bamboo.rc.interpreter_state` (the
constructor and the iteration's state), :mod:`bamboo.rc.interpreter_transfers` (transfers that notice failure
events, the group builds, the message tags), :mod:`bamboo.rc.interpreter_allreduces` (the all-reduces and
their reposting after failures), :mod:`bamboo.rc.interpreter_commit` (the replica sync and the commit), and
this module: the instruction handlers and the dispatch table.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable, Sequence
from typing import ClassVar

import torch
from bamboo.rc.device import to_device
from bamboo.rc.interpreter_allreduces import InterpreterAllReduces
from bamboo.rc.interpreter_commit import InterpreterCommit
from bamboo.rc.interpreter_transfers import _TAG_ACT, _TAG_GRAD, _TAG_HEADER, _tag
from bamboo.rc.precision import autocast, backward, backward_through
from bamboo.rc.rng import global_microbatch
from bamboo.schedule import Instruction, Kind

__all__ = ["StageInterpreter"]

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]
_RECEIVES = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})


class StageInterpreter(InterpreterCommit):
    """Executes one node's instructions: its slices, its tensors, its transfers and its commit."""

    # ----------------------------------------------------------------------------- instructions
    def execute(self, instruction: Instruction) -> None:
        """Execute one instruction (its wall time is added to :attr:`kind_seconds`)."""
        started = time.perf_counter()
        self._post_built()
        self._handlers[instruction.kind](self, instruction)
        code = instruction.kind.value
        self.kind_seconds[code] = self.kind_seconds.get(code, 0.0) + time.perf_counter() - started

    def post_ahead(self, stream: Sequence[Instruction], index: int) -> None:
        """Before `stream[index]` runs, post the first receive of an activation or a gradient after it, so that its
        sender does not wait for this node to get there.

        A gloo send completes only once its receiver has posted the matching receive: in 1F1B a stage that sends
        while its neighbour computes would wait for that computation to end. The receive is posted only where
        nothing can block (its shape known, its group built) and is kept as posted under its instruction's text,
        which resumes it when it runs, as an interrupted transfer (:meth:`_transfer`).

        A failure can strike while such a message is in flight (sent, its receive not run): a failover's cut allows
        for it (`bamboo.schedule.engine.received_ahead`), and the failover schedule keeps the receive, which then
        takes the data already there. Not in efeb (:attr:`receives_ahead`, `RCMode.receives_ahead`).

        A replica sync's receive (`RY`) met on the way is posted too (:meth:`post_sync_ahead`)."""
        if not self.receives_ahead or stream[index].kind in _RECEIVES:
            return
        later = index + 1  # the scan stops at the first receive, a few instructions on: no slice of the stream
        while later < len(stream) and stream[later].kind not in _RECEIVES:
            if stream[later].kind is Kind.SYNC_RECV:
                self.post_sync_ahead(stream[later])
            later += 1
        if later == len(stream):
            return
        ahead = stream[later]
        key = str(ahead)
        if key in self._pending or key in self._segmented:
            return
        peer, meta, tag = self._receive_spec(ahead)
        group = self._group_for(peer)
        if meta is None or group not in self.groups.groups or self._needs_barrier(group):
            return
        buffer = self.staging.inbound_buffer(*meta)
        works = self.groups.post_recv(group, buffer, peer, tag, key)
        self._pending[key] = (ahead.peer, self._handle(works), buffer)

    def _receive_spec(self, instruction: Instruction) -> tuple[int, tuple[tuple[int, ...], torch.dtype] | None, int]:
        """An activation's or a gradient's receive: the peer's rank, the message's shape and dtype (None until they
        are known: an activation's from its first message from that peer, a gradient's from the stage's first
        forward here), and its tag."""
        s, k = instruction.stage, instruction.microbatch
        assert k is not None and instruction.peer is not None
        peer = self._peer_rank(instruction.peer)
        if instruction.kind is Kind.RECV_ACT:
            return peer, self._act_meta.get(peer), _tag(_TAG_ACT, s, k)
        output = self._output_meta.get(s)
        return peer, None if output is None else (tuple(output[0]), output[1]), _tag(_TAG_GRAD, s, k)

    def _load(self, instruction: Instruction) -> None:
        k = instruction.microbatch
        if k not in self._microbatches:
            raise RuntimeError(f"{instruction}: microbatch {k} was not loaded (no data for this step)")

    def _recv_act(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        peer, meta, tag = self._receive_spec(instruction)
        if meta is None:
            header = self._recv(instruction, torch.zeros(8, dtype=torch.int64), peer, _tag(_TAG_HEADER, s, 0))
            ndim = int(header[0])
            meta = self._act_meta[peer] = (tuple(int(v) for v in header[2 : 2 + ndim]), _DTYPES[int(header[1])])
        received = self._recv(instruction, self.staging.inbound_buffer(*meta), peer, tag)
        buffer = self.staging.inbound(received)
        self.inputs[(s, k)] = buffer.requires_grad_(buffer.is_floating_point())

    def _stage_input(self, stage: int, k: int) -> torch.Tensor:
        if stage == 0:
            return self._microbatches[k][0]
        key = (stage, k)
        if key not in self.inputs:  # the previous stage runs here too: its local output
            self.inputs[key] = self.local_outputs[(stage - 1, k)].requires_grad_()
        return self.inputs[key]

    @functools.cached_property
    def _share(self) -> tuple[int, int]:
        """This pipeline's share of the global batch, ``(first, count)``: fixed for the interpreter's layout."""
        return self.config.share(self.pipeline, self.layout.pipelines)

    def _run_layers(self, stage: int, k: int, x: torch.Tensor) -> torch.Tensor:
        self._apply_replica_update(stage)
        microbatch = global_microbatch(*self._share, k)
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
        peer, meta, tag = self._receive_spec(instruction)
        assert meta is not None, f"{instruction}: no forward of stage {s} ran here before its gradient came"
        received = self._recv(instruction, self.staging.inbound_buffer(*meta), peer, tag)
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
            backward_through(output, grad)
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
        Kind.ALLREDUCE: InterpreterAllReduces._allreduce,
        Kind.OPTIMIZER: InterpreterCommit._optimizer,
        Kind.SYNC_SEND: InterpreterCommit._sync_send,
        Kind.SYNC_RECV: InterpreterCommit._sync_recv,
    }
