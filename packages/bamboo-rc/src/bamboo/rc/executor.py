"""The stage executor: runs one node's instruction stream over torch.distributed.

A node `n` of pipeline `d` owns stage `n` and, with redundancy, a replica of stage `(n+1) mod P`.
It runs its stream for an iteration, op by op (:class:`Op`: forward, backward, send/receive of
activations and gradients, FRC and BRC), then ends the iteration (:meth:`StageExecutor.end_iteration`):
1. the data-parallel all-reduce of its stage's gradients (and of the loss);
2. the global gradient norm over the pipeline, and the clip coefficient;
3. the optimizer and scheduler step;
4. replica sync: it sends its final gradients to its shadow, and applies the gradients that its
   successor sent to the replica, with the identical step (done lazily, before the replica is
   next used, so it stays off the critical path).

All per-microbatch state is keyed by (stage, microbatch), and peers are looked up through a
route table (stage -> global rank), so after a failover a node can host two stages and the
victim's messages go to its shadow. The gradients sent to the predecessor are kept for the whole
iteration (:attr:`StageExecutor.sent_grads`), so they can be sent again to a new owner.
"""

from __future__ import annotations

import enum
import time
from collections.abc import Callable, Sequence
from typing import Any

import attrs
import torch
from bamboo.rc.comm import CHUNK_BYTES, MAX_CHUNKS, CommTimeouts, EpochGroups, PendingSends
from bamboo.rc.config import TrainingConfig
from bamboo.rc.model import partition_layers
from bamboo.rc.stash import FrcStash
from bamboo.rc.state import TrainableSlice, clip_coefficient
from torch.distributed import Store

__all__ = ["REDUNDANCY_MODES", "Layout", "Op", "OpKind", "StageExecutor"]

REDUNDANCY_MODES = ("none", "lflb", "eflb", "efeb")


class OpKind(enum.Enum):
    """What the executor can do for one (stage, microbatch)."""

    RECV_ACT = "ra"
    FORWARD = "F"
    SEND_ACT = "sa"
    RECV_GRAD = "rg"
    BACKWARD = "B"
    SEND_GRAD = "sg"
    FRC = "FR"
    BRC = "BR"


@attrs.frozen
class Op:
    """One executor operation: `kind` for `stage`'s microbatch `microbatch` (compact form `2F5`)."""

    kind: OpKind
    stage: int
    microbatch: int
    label: str = ""

    def __str__(self) -> str:
        return self.label or f"{self.stage}{self.kind.value}{self.microbatch}"


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
        """Every group of the fault-free layout: neighbour P2P, per-stage DP, per-pipeline."""
        members: dict[str, list[int]] = {}
        for d in range(self.pipelines):
            members[f"pipe-d{d}"] = [self.rank(s, d) for s in range(self.stages)]
            for s in range(self.stages):
                for hop in (1, 2):  # neighbours, and the skip pairs that eager BRC and failover use
                    a, b = sorted((self.rank(s, d), self.rank((s + hop) % self.stages, d)))
                    if a != b:
                        members[f"p2p-{a}-{b}"] = [a, b]
        for s in range(self.stages):
            members[f"dp-s{s}"] = [self.rank(s, d) for d in range(self.pipelines)]
        return members


# Tag spaces (the comm layer multiplies by MAX_CHUNKS and adds the chunk index).
_TAG_ACT, _TAG_GRAD, _TAG_HEADER, _TAG_SYNC, _TAG_SKIP_GRAD = 1, 2, 3, 4, 5


def _tag(kind: int, stage: int, microbatch: int) -> int:
    """A 23-bit message tag: kind (3 bits), stage (< 128), microbatch (< 4096)."""
    if not (stage < 128 and microbatch < 4096):
        raise ValueError(f"stage {stage} / microbatch {microbatch} do not fit the message tag (128 / 4096)")
    return (kind * 128 + stage) * 4096 + microbatch


def _segments(flat: torch.Tensor) -> list[torch.Tensor]:
    """Split a large 1-D payload into messages that each fit MAX_CHUNKS chunks."""
    per_message = max(1, MAX_CHUNKS * CHUNK_BYTES // flat.element_size())
    return list(flat.split(per_message))


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]


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
        self.specs = specs
        self.loss_fn = loss_fn
        self.config = config
        self.layout = layout
        self.stage = stage
        self.pipeline = pipeline
        self.rank = layout.rank(stage, pipeline)
        self.redundancy = redundancy
        self.seed = seed
        self.job = job
        self.store = store
        self.timeouts = timeouts or CommTimeouts()
        self.parts = partition_layers(len(specs), layout.stages)
        self.slices: dict[int, TrainableSlice] = {stage: TrainableSlice(specs, self.parts[stage], config, seed)}
        self.replica_stage: int | None = None
        if redundancy != "none" and layout.stages > 1:
            self.replica_stage = (stage + 1) % layout.stages
            self.slices[self.replica_stage] = TrainableSlice(specs, self.parts[self.replica_stage], config, seed)
        self.owned: list[int] = [stage]
        for piece in self.slices.values():
            piece.zero_grads()
        # Route table: which global rank owns each stage of this pipeline.
        self.route: dict[int, int] = {s: layout.rank(s, pipeline) for s in range(layout.stages)}
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
        self._microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._reset_iteration()
        self._act_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._act_meta_sent: set[int] = set()
        self._replica_sync: tuple[list[object], torch.Tensor] | None = None
        self.timings: dict[str, float] = {}
        self.sync_bytes = 0

    # ----------------------------------------------------------------------------- state
    def _reset_iteration(self) -> None:
        self.inputs: dict[tuple[int, int], torch.Tensor] = {}
        self.outputs: dict[tuple[int, int], torch.Tensor] = {}
        self.out_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.sent_grads: dict[tuple[int, int], torch.Tensor] = {}
        self.frc_inputs: dict[int, torch.Tensor] = {}
        self.loss_sum = 0.0
        self.stash.clear()

    @property
    def replica(self) -> TrainableSlice | None:
        return None if self.replica_stage is None else self.slices[self.replica_stage]

    def needs_data(self) -> bool:
        """Whether this node reads samples: it hosts (or shadows) the first or the last stage."""
        last = self.layout.stages - 1
        return any(s in (0, last) for s in self.slices)

    def set_microbatches(self, microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This iteration's (tokens, labels) by microbatch index within the pipeline."""
        self._microbatches = microbatches

    def _group_for(self, peer: int) -> str:
        a, b = sorted((self.rank, peer))
        return f"p2p-{a}-{b}"

    def _global_microbatches(self) -> int:
        return self.config.micro_batches * self.layout.pipelines

    # ----------------------------------------------------------------------------- ops
    def run(self, ops: Sequence[Op]) -> None:
        """Run this iteration's ops in order."""
        for op in ops:
            self.execute(op)

    def execute(self, op: Op) -> None:
        handler = {
            OpKind.RECV_ACT: self._recv_act,
            OpKind.FORWARD: self._forward,
            OpKind.SEND_ACT: self._send_act,
            OpKind.RECV_GRAD: self._recv_grad,
            OpKind.BACKWARD: self._backward,
            OpKind.SEND_GRAD: self._send_grad,
            OpKind.FRC: self._frc,
            OpKind.BRC: self._brc,
        }[op.kind]
        handler(op)

    def _recv_act(self, op: Op) -> None:
        peer = self.route[op.stage - 1]
        if peer == self.rank:  # after a failover the predecessor may be local
            self.inputs[(op.stage, op.microbatch)] = (
                self.outputs[(op.stage - 1, op.microbatch)].detach().requires_grad_()
            )
            return
        group = self._group_for(peer)
        if peer not in self._act_meta:
            header = torch.zeros(8, dtype=torch.int64)
            self.groups.recv(group, header, peer, _tag(_TAG_HEADER, op.stage, 0), str(op))
            ndim = int(header[0])
            self._act_meta[peer] = (tuple(int(v) for v in header[2 : 2 + ndim]), _DTYPES[int(header[1])])
        shape, dtype = self._act_meta[peer]
        buffer = torch.empty(shape, dtype=dtype)
        self.groups.recv(group, buffer, peer, _tag(_TAG_ACT, op.stage, op.microbatch), str(op))
        self.inputs[(op.stage, op.microbatch)] = buffer.requires_grad_(buffer.is_floating_point())

    def _stage_input(self, stage: int, microbatch: int) -> torch.Tensor:
        if stage == 0:
            return self._microbatches[microbatch][0]
        return self.inputs[(stage, microbatch)]

    def _run_layers(self, stage: int, microbatch: int, x: torch.Tensor) -> torch.Tensor:
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.bf16):
            y = self.slices[stage].layers(x)
        if stage == self.layout.stages - 1:
            loss = self.loss_fn(y, self._microbatches[microbatch][1])
            return loss / self._global_microbatches()
        return y

    def _forward(self, op: Op) -> None:
        y = self._run_layers(op.stage, op.microbatch, self._stage_input(op.stage, op.microbatch))
        if op.stage == self.layout.stages - 1:
            self.loss_sum += float(y.detach()) * self._global_microbatches()
        self.outputs[(op.stage, op.microbatch)] = y

    def _send_act(self, op: Op) -> None:
        peer = self.route[op.stage + 1]
        if peer == self.rank:
            return  # the successor is local: its RECV_ACT reads our output directly
        y = self.outputs[(op.stage, op.microbatch)].detach()
        group = self._group_for(peer)
        if peer not in self._act_meta_sent:
            header = torch.zeros(8, dtype=torch.int64)
            header[0] = y.dim()
            header[1] = _DTYPES.index(y.dtype)
            header[2 : 2 + y.dim()] = torch.tensor(y.shape)
            self.groups.send(group, header, peer, _tag(_TAG_HEADER, op.stage + 1, 0), str(op), self.pending)
            self._act_meta_sent.add(peer)
        self.groups.send(group, y, peer, _tag(_TAG_ACT, op.stage + 1, op.microbatch), str(op), self.pending)

    def _recv_grad(self, op: Op) -> None:
        peer = self.route[op.stage + 1]
        key = (op.stage, op.microbatch)
        if peer == self.rank:
            self.out_grads[key] = self.sent_grads[(op.stage + 1, op.microbatch)]
            return
        buffer = torch.empty_like(self.outputs[key])
        self.groups.recv(self._group_for(peer), buffer, peer, _tag(_TAG_GRAD, op.stage, op.microbatch), str(op))
        self.out_grads[key] = buffer

    def _backward(self, op: Op) -> None:
        key = (op.stage, op.microbatch)
        output = self.outputs.pop(key)
        if op.stage == self.layout.stages - 1:
            output.backward()
        else:
            torch.autograd.backward(output, self.out_grads.pop(key))
        if op.stage > 0:
            grad = self.inputs.pop(key).grad
            self.sent_grads[key] = grad
        if op.stage == self.replica_stage and op.stage not in self.owned:
            self.stash.drop(op.microbatch)

    def _send_grad(self, op: Op) -> None:
        grad = self.sent_grads[(op.stage, op.microbatch)]
        peer = self.route[op.stage - 1]
        if peer != self.rank:
            tag = _tag(_TAG_GRAD, op.stage - 1, op.microbatch)
            self.groups.send(self._group_for(peer), grad, peer, tag, str(op), self.pending)
        if self.redundancy == "efeb" and self.layout.stages > 2:
            # Eager BRC: the shadow of our predecessor needs this gradient too.
            shadow = self.route[(op.stage - 2) % self.layout.stages]
            if shadow != self.rank:
                tag = _tag(_TAG_SKIP_GRAD, op.stage - 1, op.microbatch)
                self.groups.send(self._group_for(shadow), grad, shadow, tag, str(op), self.pending)

    def _frc(self, op: Op) -> None:
        """Forward redundant computation of the replica stage for `op.microbatch`.

        The replica's input is this node's own output for that microbatch (or, for the shadow of
        stage 0, the microbatch's tokens). Eager modes run the forward now, with its saved tensors
        packed into the CPU stash; lazy FRC keeps a copy of the input and runs it on failover.
        """
        replica_stage = self.replica_stage
        if replica_stage is None:
            raise RuntimeError(f"{op}: FRC without a replica (redundancy {self.redundancy!r})")
        self._finish_replica_sync()
        microbatch = op.microbatch
        if replica_stage == 0:
            x = self._microbatches[microbatch][0]
        else:
            x = self.outputs[(self.stage, microbatch)].detach().clone()
        self.frc_inputs[microbatch] = x
        if self.redundancy in ("eflb", "efeb"):
            self._replica_forward(microbatch)

    def _replica_forward(self, microbatch: int) -> None:
        replica_stage = self.replica_stage
        assert replica_stage is not None
        x = self.frc_inputs[microbatch]
        if replica_stage > 0:
            x = x.detach().requires_grad_()
            self.inputs[(replica_stage, microbatch)] = x
        weights = {p.untyped_storage().data_ptr() for p in self.slices[replica_stage].parameters}
        with self.stash.saving(microbatch, skip=weights):
            y = self._run_layers(replica_stage, microbatch, x)
        self.outputs[(replica_stage, microbatch)] = y

    def _brc(self, op: Op) -> None:
        """Backward redundant computation: the replica's backward from the FRC stash.

        The gradient of the replica's output comes from the stage after it: received over the
        skip group (eager BRC), or already local (P=2, or after a failover).
        """
        key = (op.stage, op.microbatch)
        if key not in self.outputs:
            self._replica_forward(op.microbatch)  # lazy FRC
        if op.stage != self.layout.stages - 1 and key not in self.out_grads:
            source = self.route[op.stage + 1]
            if source == self.rank:
                self.out_grads[key] = self.sent_grads[(op.stage + 1, op.microbatch)]
            else:
                buffer = torch.empty_like(self.outputs[key])
                tag = _tag(_TAG_SKIP_GRAD, op.stage, op.microbatch)
                self.groups.recv(self._group_for(source), buffer, source, tag, str(op))
                self.out_grads[key] = buffer
        self._backward(op)

    # ----------------------------------------------------------------------------- iteration end
    def _finish_replica_sync(self) -> None:
        """Apply the successor's final gradients of the previous step to the replica."""
        if self._replica_sync is None:
            return
        works, buffer = self._replica_sync
        self._replica_sync = None
        started = time.perf_counter()
        successor = self.route[self.replica_stage] if self.replica_stage is not None else -1
        self.groups.wait_recv(works, successor, "replica sync")
        replica = self.replica
        assert replica is not None
        expected_steps = int(buffer[-1].item())
        if expected_steps != replica.steps + 1:
            raise RuntimeError(f"replica sync out of order: got step {expected_steps}, replica at {replica.steps}")
        replica.load_flat_grads(buffer[:-1])
        replica.apply_step(1.0)
        self.timings["replica_sync"] = self.timings.get("replica_sync", 0.0) + time.perf_counter() - started

    def end_iteration(self) -> float:
        """All-reduce, clip, step, and start replica sync. Returns the step's mean loss."""
        self.pending.wait_all()
        own = self.slices[self.stage]
        last = self.layout.stages - 1
        # 1. data-parallel all-reduce of the gradients, with the loss sum riding along.
        loss = torch.tensor([self.loss_sum if self.stage == last else 0.0], dtype=torch.float64)
        if self.layout.pipelines > 1:
            flat = own.flat_grads()
            self.groups.allreduce(f"dp-s{self.stage}", [flat, loss], f"all-reduce of stage {self.stage}")
            own.load_flat_grads(flat)
        loss_sum = float(loss[0])
        # 2. global gradient norm (float64) and loss over the pipeline.
        norm_and_loss = torch.tensor([own.squared_grad_norm(), loss_sum], dtype=torch.float64)
        if self.layout.stages > 1:
            self.groups.allreduce(f"pipe-d{self.pipeline}", [norm_and_loss], "global gradient norm")
        clip = clip_coefficient(self.config.gradient_clipping, float(norm_and_loss[0]))
        if clip != 1.0:
            for p in own.parameters:
                p.grad.mul_(clip)
        # 3. replica sync: send the final gradients (and the step number) to the shadow.
        if self.replica_stage is not None:
            final = torch.cat([own.flat_grads(), torch.tensor([float(own.steps + 1)])])
            shadow = self.route[(self.stage - 1) % self.layout.stages]
            for segment, piece in enumerate(_segments(final)):
                tag = _tag(_TAG_SYNC, self.stage, segment)
                self.groups.send(self._group_for(shadow), piece, shadow, tag, "replica sync", self.pending)
            self.sync_bytes += final.numel() * final.element_size()
        own.apply_step(1.0)
        # 4. post the receive of the successor's gradients; applied before the replica is next used.
        if self.replica_stage is not None:
            self._finish_replica_sync()
            replica = self.slices[self.replica_stage]
            successor = self.route[self.replica_stage]
            buffer = torch.empty(replica.numel() + 1)
            works = []
            for segment, piece in enumerate(_segments(buffer)):
                tag = _tag(_TAG_SYNC, self.replica_stage, segment)
                works += self.groups.post_recv(self._group_for(successor), piece, successor, tag, "replica sync")
            self._replica_sync = (works, buffer)
        mean_loss = float(norm_and_loss[1]) / self._global_microbatches()
        self.losses.append(mean_loss)
        self.step += 1
        self._reset_iteration()
        return mean_loss

    def finish(self) -> None:
        """Complete the last replica sync and every send (call after the last iteration)."""
        self._finish_replica_sync()
        self.pending.wait_all()
