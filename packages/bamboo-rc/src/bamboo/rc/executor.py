"""The stage executor: interprets one node's `bamboo.schedule` instruction stream with real tensors.

Node `n` of pipeline `d` owns stage `n` and, with redundancy, the replica of stage `(n+1) mod P`.
Each iteration it executes its stream (see `packages/bamboo-schedule/README.md`, "Executing a
schedule") one instruction at a time:

- `L`, `F`, `B`, `SA`/`RA`, `SG`/`RG`: the pipeline itself. Sends are posted without waiting
  (they complete in the background and are awaited at the end of the iteration); receives block.
- `FR`, `SO`, `SI`, `BR`: redundant work on the replica, with the FRC stash kept in
  :class:`~bamboo.rc.stash.FrcStash`.
- `AR`: the data-parallel all-reduce of the stage's gradients (and the loss).
- `OPT`, `SY`, `RY`: the step, and replica sync. The global gradient norm (for clipping) needs
  every stage of the pipeline, so when `gradient_clipping` is set these three run after the stream
  ends, behind one small all-reduce over the pipeline (in stream order). Without clipping they run
  in place. `RY` only posts its receive; the replica step runs right before the replica is next
  used (or at :meth:`StageExecutor.finish`), off the critical path.

All per-microbatch state is keyed by (stage, microbatch), so a node can host two stages after a
failover. The gradient w.r.t. each stage input (what `SG` sends) is kept for the whole iteration
(:attr:`StageExecutor.input_grads`), so it can be sent again to a new owner.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from typing import Any, ClassVar

import attrs
import torch
from bamboo.rc.comm import CHUNK_BYTES, MAX_CHUNKS, CommTimeouts, EpochGroups, PendingSends
from bamboo.rc.config import TrainingConfig
from bamboo.rc.model import partition_layers
from bamboo.rc.stash import FrcStash
from bamboo.rc.state import TrainableSlice, clip_coefficient
from bamboo.schedule import Instruction, Kind, RCMode, Schedule, one_f_one_b
from torch.distributed import Store

__all__ = ["REDUNDANCY_MODES", "Layout", "StageExecutor"]

REDUNDANCY_MODES = tuple(mode.value for mode in RCMode)


@attrs.frozen
class Layout:
    """D pipelines of P stages; global rank = pipeline × P + stage."""

    stages: int = attrs.field(validator=attrs.validators.ge(1))
    pipelines: int = attrs.field(validator=attrs.validators.ge(1))

    @property
    def world(self) -> int:
        return self.stages * self.pipelines

    def rank(self, stage: int, pipeline: int) -> int:
        return pipeline * self.stages + stage

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, pipeline) of a global rank."""
        return rank % self.stages, rank // self.stages

    def name(self, rank: int) -> str:
        stage, pipeline = self.position(rank)
        return f"stage {stage} pipeline {pipeline}"

    def group_members(self) -> dict[str, list[int]]:
        """Every group of the fault-free layout: P2P pairs at distance 1 and 2 (efeb's extra
        gradient, failover re-routing), the per-stage data-parallel groups, the per-pipeline groups."""
        members: dict[str, list[int]] = {}
        for d in range(self.pipelines):
            members[f"pipe-d{d}"] = [self.rank(s, d) for s in range(self.stages)]
            for s in range(self.stages):
                for hop in (1, 2):
                    a, b = sorted((self.rank(s, d), self.rank((s + hop) % self.stages, d)))
                    if a != b:
                        members[f"p2p-{a}-{b}"] = [a, b]
        for s in range(self.stages):
            members[f"dp-s{s}"] = [self.rank(s, d) for d in range(self.pipelines)]
        return members


# Message tags: kind (3 bits) | stage (< 128) | microbatch or segment (< 4096).
_TAG_ACT, _TAG_GRAD, _TAG_HEADER, _TAG_SYNC = 1, 2, 3, 4


def _tag(kind: int, stage: int, microbatch: int) -> int:
    if not (stage < 128 and microbatch < 4096):
        raise ValueError(f"stage {stage} / microbatch {microbatch} do not fit the message tag (128 / 4096)")
    return (kind * 128 + stage) * 4096 + microbatch


def _segments(flat: torch.Tensor) -> list[torch.Tensor]:
    """Split a large 1-D payload into messages that each fit MAX_CHUNKS chunks."""
    per_message = max(1, MAX_CHUNKS * CHUNK_BYTES // flat.element_size())
    return list(flat.split(per_message))


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]

Key = tuple[int, int]


class StageExecutor:
    """Runs one node of one pipeline: its stage, its replica, its groups and its steps."""

    def __init__(
        self,
        specs: Sequence[Any],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        config: TrainingConfig,
        layout: Layout,
        stage: int,
        pipeline: int,
        store: Store,
        redundancy: str = "eflb",
        seed: int = 0,
        job: str = "job",
        timeouts: CommTimeouts | None = None,
    ) -> None:
        if redundancy not in REDUNDANCY_MODES:
            raise ValueError(f"redundancy must be one of {', '.join(REDUNDANCY_MODES)}, got {redundancy!r}")
        if not (0 <= stage < layout.stages and 0 <= pipeline < layout.pipelines):
            raise ValueError(f"stage {stage} pipeline {pipeline} is outside {layout}")
        if redundancy != "none" and layout.stages < 2:
            raise ValueError(f"redundancy {redundancy!r} needs at least 2 stages, got {layout.stages}")
        self.specs = specs
        self.loss_fn = loss_fn
        self.config = config
        self.layout = layout
        self.stage = stage
        self.pipeline = pipeline
        self.node = stage
        self.rank = layout.rank(stage, pipeline)
        self.redundancy = redundancy
        self.seed = seed
        self.job = job
        self.store = store
        self.timeouts = timeouts or CommTimeouts()
        self.parts = partition_layers(len(specs), layout.stages)
        self.slices: dict[int, TrainableSlice] = {stage: TrainableSlice(specs, self.parts[stage], config, seed)}
        self.replica_stage: int | None = None
        if redundancy != "none":
            self.replica_stage = (stage + 1) % layout.stages
            self.slices[self.replica_stage] = TrainableSlice(specs, self.parts[self.replica_stage], config, seed)
        self.owned: list[int] = [stage]
        self.schedule: Schedule = one_f_one_b(layout.stages, config.micro_batches, rc=redundancy)
        self.epoch = 0
        self.groups = EpochGroups(
            store, job, self.epoch, self.rank, layout.group_members(), self.timeouts,
            names={r: layout.name(r) for r in range(layout.world)},
        )
        self.retired_groups: list[EpochGroups] = []
        self.stash = FrcStash()
        self.pending = PendingSends()
        self.step = 0
        self.losses: list[float] = []
        self.sync_bytes = 0
        self.kind_seconds: dict[str, float] = {}
        self._act_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._act_meta_sent: set[int] = set()
        self._replica_sync: tuple[int, list[object], torch.Tensor, int] | None = None
        self._final_grads: dict[int, torch.Tensor] = {}
        self._microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._output_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._reset_iteration()

    # ----------------------------------------------------------------------------- state
    def _reset_iteration(self) -> None:
        self.inputs: dict[Key, torch.Tensor] = {}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.out_grads: dict[Key, torch.Tensor] = {}
        self.input_grads: dict[Key, torch.Tensor] = {}
        self.red_inputs: dict[Key, torch.Tensor] = {}
        self.red_outputs: dict[Key, torch.Tensor] = {}
        self.replica_feed: dict[Key, torch.Tensor] = {}
        self.loss_sum = 0.0
        self.loaded: set[int] = set()
        self._deferred: list[Instruction] = []
        self._deferred_done: frozenset[Instruction] = frozenset()
        self._reduced: set[int] = set()
        self.stash.clear()

    @property
    def replica(self) -> TrainableSlice | None:
        return None if self.replica_stage is None else self.slices[self.replica_stage]

    @property
    def stream(self) -> tuple[Instruction, ...]:
        return self.schedule.streams[self.node]

    def needs_data(self) -> bool:
        """Whether this node reads samples: it runs (or shadows) the first or the last stage."""
        last = self.layout.stages - 1
        return any(s in (0, last) for s in self.slices)

    def set_microbatches(self, microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This iteration's (tokens, labels) by microbatch index within the pipeline."""
        self._microbatches = microbatches

    def _peer_rank(self, node: int) -> int:
        return self.layout.rank(node, self.pipeline)

    def _group_for(self, peer: int) -> str:
        a, b = sorted((self.rank, peer))
        return f"p2p-{a}-{b}"

    def _global_microbatches(self) -> int:
        return self.config.micro_batches * self.layout.pipelines

    def _deferring(self) -> bool:
        return self.config.gradient_clipping > 0.0

    # ----------------------------------------------------------------------------- interpreter
    def run(self, stream: Iterable[Instruction] | None = None) -> None:
        """Execute this iteration's stream (by default the node's stream of the schedule)."""
        for instruction in self.stream if stream is None else stream:
            self.execute(instruction)

    def execute(self, instruction: Instruction) -> None:
        """Execute one instruction (its wall time is added to :attr:`kind_seconds`)."""
        started = time.perf_counter()
        self._handlers[instruction.kind](self, instruction)
        code = instruction.kind.value
        self.kind_seconds[code] = self.kind_seconds.get(code, 0.0) + time.perf_counter() - started

    def _load(self, instruction: Instruction) -> None:
        k = instruction.microbatch
        assert k is not None
        if k not in self._microbatches:
            raise RuntimeError(f"{instruction}: microbatch {k} was not loaded (no data for this step)")
        self.loaded.add(k)

    def _recv_act(self, instruction: Instruction) -> None:
        key = (instruction.stage, instruction.microbatch)
        peer = self._peer_rank(instruction.peer)  # type: ignore[arg-type]
        group = self._group_for(peer)
        if peer not in self._act_meta:
            header = torch.zeros(8, dtype=torch.int64)
            self.groups.recv(group, header, peer, _tag(_TAG_HEADER, instruction.stage, 0), str(instruction))
            ndim = int(header[0])
            self._act_meta[peer] = (tuple(int(v) for v in header[2 : 2 + ndim]), _DTYPES[int(header[1])])
        shape, dtype = self._act_meta[peer]
        buffer = torch.empty(shape, dtype=dtype)
        tag = _tag(_TAG_ACT, instruction.stage, key[1])  # type: ignore[arg-type]
        self.groups.recv(group, buffer, peer, tag, str(instruction))
        self.inputs[key] = buffer.requires_grad_(buffer.is_floating_point())  # type: ignore[index]

    def _stage_input(self, stage: int, k: int) -> torch.Tensor:
        if stage == 0:
            return self._microbatches[k][0]
        key = (stage, k)
        if key not in self.inputs:  # the previous stage runs here too: its local output
            self.inputs[key] = self.outputs[(stage - 1, k)].detach().requires_grad_()
        return self.inputs[key]

    def _run_layers(self, stage: int, k: int, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.bf16):
            y = self.slices[stage].layers(x)
        if stage == self.layout.stages - 1:
            return self.loss_fn(y, self._microbatches[k][1]) / self._global_microbatches()
        return y

    def _forward(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        y = self._run_layers(s, k, self._stage_input(s, k))
        if s == self.layout.stages - 1:
            self.loss_sum += float(y.detach()) * self._global_microbatches()
        else:
            self._output_meta[s] = (y.shape, y.dtype)
            if self.replica_stage == s + 1:
                self.replica_feed[(s + 1, k)] = y.detach()  # the replica's input, for FR / SO
        self.outputs[(s, k)] = y

    def _send_act(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        peer = self._peer_rank(instruction.peer)  # type: ignore[arg-type]
        y = self.outputs[(s, k)].detach()
        group = self._group_for(peer)
        if peer not in self._act_meta_sent:
            header = torch.zeros(8, dtype=torch.int64)
            header[0] = y.dim()
            header[1] = _DTYPES.index(y.dtype)
            header[2 : 2 + y.dim()] = torch.tensor(y.shape)
            self.groups.send(group, header, peer, _tag(_TAG_HEADER, s + 1, 0), str(instruction), self.pending)
            self._act_meta_sent.add(peer)
        self.groups.send(group, y, peer, _tag(_TAG_ACT, s + 1, k), str(instruction), self.pending)

    def _recv_grad(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        peer = self._peer_rank(instruction.peer)  # type: ignore[arg-type]
        shape, dtype = self._output_meta[s]
        buffer = torch.empty(shape, dtype=dtype)
        self.groups.recv(self._group_for(peer), buffer, peer, _tag(_TAG_GRAD, s, k), str(instruction))
        self.out_grads[(s, k)] = buffer

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
            output.backward()
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
        assert k is not None
        peer = self._peer_rank(instruction.peer)  # type: ignore[arg-type]
        grad = self.input_grads[(s, k)]
        self.groups.send(self._group_for(peer), grad, peer, _tag(_TAG_GRAD, s - 1, k), str(instruction), self.pending)

    def _replica_input(self, s: int, k: int) -> torch.Tensor:
        if s == 0:
            return self._microbatches[k][0]
        if (s, k) in self.stash.inputs:  # lflb: the stashed input
            return self.stash.inputs[(s, k)]
        return self.replica_feed.pop((s, k))

    def _frc(self, instruction: Instruction) -> None:
        """Forward of stage s with the replica layers; saved tensors are registered in the stash."""
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        self._finish_replica_sync()
        x = self._replica_input(s, k)
        if s > 0:
            x = x.detach().requires_grad_()
        weights = {p.untyped_storage().data_ptr() for p in self.slices[s].parameters}
        with self.stash.recording((s, k), skip=weights):
            y = self._run_layers(s, k, x)
        self.red_inputs[(s, k)] = x
        self.red_outputs[(s, k)] = y
        if s < self.layout.stages - 1:
            self._output_meta[s] = (y.shape, y.dtype)

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
        self._finish_replica_sync()
        if (s, k) not in self.red_outputs:
            self._frc(instruction)
        output = self.red_outputs.pop((s, k))
        x = self.red_inputs.pop((s, k))
        self._backward_from(s, k, output, x if s > 0 else None)
        self.stash.drop((s, k))

    def _allreduce(self, instruction: Instruction) -> None:
        s = instruction.stage
        piece = self.slices[s]
        loss = torch.tensor([self.loss_sum if s == self.layout.stages - 1 else 0.0], dtype=torch.float64)
        if self.layout.pipelines > 1:
            flat = piece.flat_grads()
            self.groups.allreduce(f"dp-s{s}", [flat, loss], str(instruction))
            piece.load_flat_grads(flat)
        if s == self.layout.stages - 1:
            self.loss_sum = float(loss[0])
        self._reduced.add(s)

    def _optimizer(self, instruction: Instruction) -> None:
        if self._deferring():
            self._deferred.append(instruction)
        else:
            self._step_stage(instruction.stage, 1.0)

    def _step_stage(self, s: int, clip: float) -> None:
        piece = self.slices[s]
        if clip != 1.0:
            for p in piece.parameters:
                p.grad.mul_(clip)
        if self.replica_stage is not None:
            self._final_grads[s] = torch.cat([piece.flat_grads(), torch.tensor([float(piece.steps + 1)])])
        piece.apply_step(1.0)

    def _sync_send(self, instruction: Instruction) -> None:
        if self._deferring() and instruction not in self._deferred_done:
            self._deferred.append(instruction)
            return
        s = instruction.stage
        final = self._final_grads.pop(s)
        shadow = self._peer_rank(instruction.peer)  # type: ignore[arg-type]
        for segment, piece in enumerate(_segments(final)):
            tag = _tag(_TAG_SYNC, s, segment)
            self.groups.send(self._group_for(shadow), piece, shadow, tag, str(instruction), self.pending)
        self.sync_bytes += final.numel() * final.element_size()

    def _sync_recv(self, instruction: Instruction) -> None:
        """Post the receive of the owner's final gradients; the replica step runs before next use."""
        if self._deferring() and instruction not in self._deferred_done:
            self._deferred.append(instruction)
            return
        self._finish_replica_sync()
        s = instruction.stage
        owner = self._peer_rank(instruction.peer)  # type: ignore[arg-type]
        buffer = torch.empty(self.slices[s].numel() + 1)
        works: list[object] = []
        for segment, piece in enumerate(_segments(buffer)):
            tag = _tag(_TAG_SYNC, s, segment)
            works += self.groups.post_recv(self._group_for(owner), piece, owner, tag, str(instruction))
        self._replica_sync = (s, works, buffer, owner)

    def _finish_replica_sync(self) -> None:
        """Apply the owner's final gradients of the previous step to the replica (identical step)."""
        if self._replica_sync is None:
            return
        s, works, buffer, owner = self._replica_sync
        self._replica_sync = None
        started = time.perf_counter()
        self.groups.wait_recv(works, owner, f"{s}RY<{self.layout.position(owner)[0]}")
        replica = self.slices[s]
        step = int(buffer[-1].item())
        if step != replica.steps + 1:
            raise RuntimeError(f"replica sync of stage {s} out of order: got step {step}, replica at {replica.steps}")
        replica.load_flat_grads(buffer[:-1])
        replica.apply_step(1.0)
        self.kind_seconds["replica_step"] = self.kind_seconds.get("replica_step", 0.0) + time.perf_counter() - started

    _handlers: ClassVar[dict[Kind, Callable[[StageExecutor, Instruction], None]]] = {
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

    # ----------------------------------------------------------------------------- iteration end
    def end_iteration(self) -> float:
        """Finish the iteration: the global norm and loss over the pipeline, the deferred steps
        and syncs, the outstanding sends. Returns the step's mean loss over the global batch."""
        last = self.layout.stages - 1
        squared = sum(self.slices[s].squared_grad_norm() for s in self._reduced)
        norm_and_loss = torch.tensor([squared, self.loss_sum if last in self._reduced else 0.0], dtype=torch.float64)
        if self.layout.stages > 1:
            self.groups.allreduce(f"pipe-d{self.pipeline}", [norm_and_loss], "global gradient norm and loss")
        if self._deferred:
            clip = clip_coefficient(self.config.gradient_clipping, float(norm_and_loss[0]))
            deferred, self._deferred = self._deferred, []
            self._deferred_done = frozenset(deferred)
            for instruction in deferred:
                if instruction.kind is Kind.OPTIMIZER:
                    self._step_stage(instruction.stage, clip)
                else:
                    self.execute(instruction)
            self._deferred_done = frozenset()
        self.pending.wait_all()
        mean_loss = float(norm_and_loss[1]) / self._global_microbatches()
        self.losses.append(mean_loss)
        self.step += 1
        self._reset_iteration()
        return mean_loss

    def finish(self) -> None:
        """Complete the last replica sync and every send (call after the last iteration)."""
        self._finish_replica_sync()
        self.pending.wait_all()
