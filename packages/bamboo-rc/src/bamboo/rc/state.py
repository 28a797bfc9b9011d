"""A trainable slice of the model: its layers, optimizer and LR scheduler, and the step math.

Both a stage and its replica on the shadow are :class:`TrainableSlice` objects built from the
same layer specs, seeds and config, so they start bit-equal. The step (:meth:`apply_step`) takes
the gradients and the global clip coefficient as inputs, so the shadow that receives the
original's final gradients applies the identical optimizer and scheduler step and stays
bit-equal. The same code runs the single-process reference. A slice also holds the copies of tied
weights among its layers (:mod:`bamboo.rc.ties`) and, with fp16, the loss-scale state
(:mod:`bamboo.rc.precision`), which is part of its state like the optimizer's.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import torch
from bamboo.rc.config import TrainingConfig, build_optimizer, build_scheduler
from bamboo.rc.device import host_empty
from bamboo.rc.model import build_layers
from bamboo.rc.precision import LossScale, StepOutcome, clip_coefficient, step_outcome
from bamboo.rc.rng import run_layers
from bamboo.rc.ties import local_sums, model_ties, slice_ties, squared_norm
from torch import nn

Leaf = TypeVar("Leaf")

__all__ = ["NORM_PIECE", "ReusedBuffers", "SpareBuffers", "TrainableSlice", "clip_coefficient", "map_leaves",
           "snapshot_bytes"]

NORM_PIECE = 1 << 20
"""Entries per piece of :meth:`TrainableSlice.squared_grad_norm` (8 MiB of float64 scratch at most)."""


class ReusedBuffers:
    """fp32 buffers by key, the same tensor each time while its size stays.

    A fresh gradient-sized tensor costs its page faults again every time: the allocator hands blocks that
    large back to the system when they are freed (about 21 ms per 13 M parameters on a 2-core machine here).
    The caller asks for a buffer again only once every operation posted on it has finished, and calls
    :meth:`drop` when one it gave up may still write into them. They are host memory (what gloo sends and
    receives), pinned when they face a GPU (``device``)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self._held: dict[object, torch.Tensor] = {}
        self._device = device or torch.device("cpu")

    def get(self, key: object, numel: int) -> torch.Tensor:
        held = self._held.get(key)
        if held is None or held.numel() != numel:
            held = self._held[key] = host_empty((numel,), torch.float32, self._device)
        return held

    def drop(self) -> None:
        """Forget every buffer (those still referenced elsewhere live on); the next :meth:`get` allocates."""
        self._held = {}


class SpareBuffers:
    """fp32 buffers handed back by their user once nothing reads or writes them any more, by key; :meth:`take`
    hands one of the right size out again, or a fresh one.

    For buffers whose lifetime is not one step: a gradient buffer an all-reduce sums into is free only once
    that all-reduce completed (a failure may leave it pending on a retired group, still writing), and a
    contribution kept for a shadow's redo only once it is no longer kept. At most :attr:`PER_KEY` spares
    are held per key; more are let go. Host memory, pinned when they face a GPU (``device``)."""

    PER_KEY = 2

    def __init__(self, device: torch.device | None = None) -> None:
        self._spare: dict[object, list[torch.Tensor]] = {}
        self._device = device or torch.device("cpu")

    def take(self, key: object, numel: int) -> torch.Tensor:
        spares = self._spare.get(key, [])
        while spares:
            spare = spares.pop()
            if spare.numel() == numel:
                return spare
        return host_empty((numel,), torch.float32, self._device)

    def give_back(self, key: object, buffer: torch.Tensor) -> None:
        """`buffer` is free: nothing posted on it is pending, and its user holds no reference it will use."""
        spares = self._spare.setdefault(key, [])
        if len(spares) < self.PER_KEY and all(spare is not buffer for spare in spares):
            spares.append(buffer)

    def held(self, key: object) -> int:
        """How many spares are held for `key`."""
        return len(self._spare.get(key, []))


def _reusable_grad(p: nn.Parameter, dtype: torch.dtype) -> bool:
    """Whether `p` holds a gradient of its own shape in `dtype`, which can be written in place."""
    return p.grad is not None and p.grad.shape == p.shape and p.grad.dtype == dtype


class TrainableSlice:
    """Layers `indices` of `specs`, with their own optimizer and scheduler, on `device`.

    The layers are built on the CPU (under their seeds, so every copy starts bit-equal) and then moved to
    `device`; the optimizer's state is made beside the parameters. Gradients come out of :meth:`flat_grads`
    into host buffers and go back in through :meth:`load_flat_grads`, whatever the device."""

    def __init__(self, specs: Sequence[Any], indices: range, config: TrainingConfig, seed: int,
                 device: torch.device | None = None) -> None:
        self.indices = indices
        self.seed = seed
        self.device = device or torch.device("cpu")
        self.layers: nn.Sequential = build_layers(specs, indices, seed)
        if self.device.type != "cpu":
            self.layers.to(self.device)
        self.parameters: list[nn.Parameter] = [p for p in self.layers.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(config.optimizer, self.parameters)
        self.scheduler = build_scheduler(config.scheduler, self.optimizer)
        self.steps = 0
        """Steps this slice went through, the skipped ones (an fp16 overflow) included: the job's step count."""
        self.tied: dict[str, list[nn.Parameter]] = slice_ties(model_ties(specs), self.layers, indices)
        """Tie key -> the copies of that tied weight among this slice's layers (:mod:`bamboo.rc.ties`)."""
        self._untied = [p for p in self.parameters if not any(p is t for copies in self.tied.values() for t in copies)]
        self.loss_scale: LossScale | None = config.fp16.initial() if config.fp16 is not None else None
        """With fp16: the loss-scale state of the next step (the same on every node: :mod:`bamboo.rc.precision`)."""
        self._norm_buffer: torch.Tensor | None = None

    def forward(self, x: Any, *, step: int, microbatch: int) -> Any:
        """The slice's layers on `x`, each under its own generator seeded from (seed, `step`, global
        `microbatch` index, layer index): :func:`bamboo.rc.rng.run_layers`."""
        return run_layers(self.layers, self.indices, x, seed=self.seed, step=step, microbatch=microbatch)

    def numel(self) -> int:
        return sum(p.numel() for p in self.parameters)

    def zero_grads(self) -> None:
        """Every gradient to zero, in place where it exists: nothing outside the slice holds a parameter's
        gradient tensor (:meth:`flat_grads` copies, :meth:`load_flat_grads` copies in), so it is reused
        from step to step instead of costing a fresh allocation."""
        for p in self.parameters:
            if _reusable_grad(p, p.dtype):
                p.grad.zero_()
            else:
                p.grad = torch.zeros_like(p)

    def flat_grads(self, out: torch.Tensor | None = None) -> torch.Tensor:
        """All gradients concatenated (fp32), a copy: written into `out` (of :meth:`numel` elements, on the
        slice's device or in host memory) when given, so that a caller can reuse one buffer from step to step;
        else on the slice's device."""
        if not self.parameters:
            return torch.zeros(0, device=self.device)
        grads = [p.grad.reshape(-1) for p in self.parameters]
        if out is None:
            return torch.cat(grads)
        if out.device == self.device:
            return torch.cat(grads, out=out)
        return out.copy_(torch.cat(grads))  # one copy off the device (into pinned memory: a fast one)

    def load_flat_grads(self, flat: torch.Tensor) -> None:
        """Set the gradients to `flat` (as :meth:`flat_grads` lays them out), copied: `flat` may be reused."""
        needed = self.numel()
        if needed != flat.numel():
            raise ValueError(f"gradient buffer has {flat.numel()} elements, the slice needs {needed}")
        if flat.device != self.device:  # one copy onto the device, done when this returns (`flat` may be reused)
            flat = flat.to(self.device)
        offset = 0
        for p in self.parameters:
            n = p.numel()
            piece = flat[offset : offset + n].view_as(p)
            if _reusable_grad(p, piece.dtype):
                p.grad.copy_(piece)
            else:
                p.grad = piece.clone()
            offset += n

    def squared_grad_norm(self) -> float:
        """Sum of squared gradient entries of the untied parameters in float64 (a tied weight counts once, from
        the sum of its copies' gradients: :func:`bamboo.rc.ties.squared_norm`): each parameter's gradient in
        pieces of :data:`NORM_PIECE` entries, in order, each piece's sum of squares added to the total.

        A piece is converted into one reused float64 buffer and squared in place there. Converting a whole
        gradient (``p.grad.double().pow(2).sum()``) allocated two float64 copies of it, which cost 83 ms per
        21 M parameters on one thread here, against 11 ms this way. The association is fixed by the piece
        size, so every node and the single-process reference get the same bits."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for p in self._untied:
            for piece in p.grad.reshape(-1).split(NORM_PIECE):
                scratch = self._norm_scratch(piece.numel())
                scratch.copy_(piece)
                total += scratch.mul_(scratch).sum()
        return float(total)

    def _norm_scratch(self, numel: int) -> torch.Tensor:
        if self._norm_buffer is None:
            largest = max((p.numel() for p in self.parameters), default=0)
            self._norm_buffer = torch.empty(min(largest, NORM_PIECE), dtype=torch.float64, device=self.device)
        return self._norm_buffer[:numel]

    def apply_step(self, clip: float) -> None:
        """Scale gradients by `clip`, step the optimizer and the scheduler, zero the gradients."""
        if clip != 1.0:
            for p in self.parameters:
                p.grad.mul_(clip)
        self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.steps += 1
        self.zero_grads()

    def skip_step(self) -> None:
        """A step skipped after an fp16 overflow (DeepSpeed's): no optimizer or scheduler step, gradients zeroed."""
        self.steps += 1
        self.zero_grads()

    def finish_step(self, outcome: StepOutcome, tie_sums: dict[str, torch.Tensor]) -> None:
        """End the step as ``outcome`` says: skipped on an overflow, else every tied copy's gradient set to its
        tie's sum (``tie_sums``) and :meth:`apply_step` with the outcome's factor. The loss scale is the
        caller's to set (on every slice of the node, replicas included)."""
        if outcome.overflow:
            self.skip_step()
            return
        for key, copies in self.tied.items():
            for parameter in copies:
                parameter.grad.copy_(tie_sums[key])
        self.apply_step(outcome.factor)

    def step_whole(self, config: TrainingConfig) -> float:
        """The step of a slice that holds every copy of its tied weights (the single-process references; P = 1),
        its gradients those of the global batch: the tied copies' gradients summed, the global norm (a tied
        weight counted once), the step or, after an fp16 overflow, its skip, and the next loss scale. Returns
        the (scaled) global squared norm."""
        sums = local_sums(self.tied)
        squared = self.squared_grad_norm() + squared_norm(sums)
        outcome = step_outcome(config.gradient_clipping, squared, self.loss_scale, config.fp16)
        self.finish_step(outcome, sums)
        self.loss_scale = outcome.loss_scale
        return squared

    def flat_parameters(self) -> torch.Tensor:
        return torch.cat([p.detach().reshape(-1) for p in self.parameters])

    def _state(self) -> dict[str, Any]:
        return {
            "layers": self.layers.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "scheduler": self.scheduler.state_dict() if self.scheduler is not None else None,
            "steps": self.steps,
            "loss_scale": self.loss_scale.to_dict() if self.loss_scale is not None else None,
        }

    def state_bytes(self) -> bytes:
        """Parameters, optimizer, scheduler, step counter and loss scale, serialised (torch.save)."""
        return snapshot_bytes(self._state())

    def snapshot(self, device: str | None = None) -> dict[str, Any]:
        """What :meth:`state_bytes` serialises, with every tensor cloned (onto ``device``, e.g. ``"cpu"``, when given:
        a copy that takes no accelerator memory): a memory copy, cheap to take at a step boundary;
        :func:`snapshot_bytes` serialises it later, in any thread."""
        return _cloned(self._state(), device)

    def load_state_bytes(self, data: bytes) -> None:
        """Load what :meth:`state_bytes` serialised."""
        self.load_state(torch.load(io.BytesIO(data), weights_only=False, map_location=self.device))

    def load_state(self, state: dict[str, Any]) -> None:
        """Load a state as :meth:`snapshot` gives it (or as a transfer unpacks it): the parameters are copied in; the
        optimizer keeps the given tensors as its state (moved to the parameters' device), so they must be this
        slice's own, not another live slice's."""
        self.layers.load_state_dict(state["layers"])
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scheduler is not None and state["scheduler"] is not None:
            self.scheduler.load_state_dict(state["scheduler"])
        self.steps = int(state["steps"])
        if state.get("loss_scale") is not None and self.loss_scale is not None:
            self.loss_scale = LossScale.from_dict(state["loss_scale"])


def snapshot_bytes(state: dict[str, Any]) -> bytes:
    """The bytes of a :meth:`TrainableSlice.snapshot`: ``load_state_bytes`` of them restores the state it was taken of."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def map_leaves(value: Any, leaf: type[Leaf], replace: Callable[[Leaf], Any]) -> Any:
    """``value`` (a state: dicts, lists and tuples of tensors and plain values) with every instance of ``leaf``
    in it replaced by ``replace(instance)``; the containers are new, the other values the same."""
    if isinstance(value, leaf):
        return replace(value)
    if isinstance(value, dict):
        return {key: map_leaves(item, leaf, replace) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(map_leaves(item, leaf, replace) for item in value)
    return value


def _cloned(value: Any, device: str | None = None) -> Any:
    return map_leaves(value, torch.Tensor, lambda tensor: tensor.detach().clone() if device is None
                      else tensor.detach().to(device, copy=True))
