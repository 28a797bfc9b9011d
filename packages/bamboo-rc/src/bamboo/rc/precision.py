"""Mixed precision: bf16 or fp16 autocast over fp32 master weights, and fp16's dynamic loss scaling.

A DeepSpeed config's ``bf16`` or ``fp16`` section turns on autocast (:func:`autocast`) for every layer's
forward: the parameters, their gradients and the optimizer state stay fp32, and the activations that
stages send each other are bf16 or fp16. With fp16 the loss of every microbatch is multiplied by the
*loss scale* before the backward pass (:func:`backward`), so that small gradients survive fp16's range;
the step then divides it out again, and skips the update when a gradient overflowed. The scale follows
DeepSpeed's ``DynamicLossScaler`` exactly (:class:`LossScale`, held to it by ``tests/test_precision.py``):

- on an overflow (an infinite or NaN gradient anywhere in the model) the step is skipped (no optimizer
  or scheduler step; the gradients are zeroed) and, once ``hysteresis`` overflows have used up the
  delay, the scale is halved, never below ``min_loss_scale``; an overflow at the minimum is an error, as
  in DeepSpeed;
- after ``loss_scale_window`` steps in a row without one, the scale doubles;
- ``loss_scale`` > 0 is a static scale: steps with an overflow are still skipped.

**Why it stays exact through failures.** The overflow is read from the commit's all-reduced squared
gradient norm (infinite or NaN exactly when some gradient is), which every node of every pipeline
computes alike, so every node derives the same next scale from the same facts at every commit: the
originals, their replicas on the shadows and the single-process reference. The scale is part of a
stage's state (:meth:`bamboo.rc.state.TrainableSlice.state_bytes`), so checkpoints, the transfers of a
reconfiguration and a joiner carry it; a shadow that takes a stage over already holds it.

The scale is a power of two, so scaling and unscaling are exact: the fp16 step is the fp32 step's math
on gradients multiplied and divided by the same power of two.
"""

from __future__ import annotations

import contextlib
import math
from typing import Any, Protocol

import attrs
import torch
from bamboo.rc.loss_scale import LossScale, LossScaleConfig, LossScaleError

__all__ = [
    "LossScale",
    "LossScaleConfig",
    "LossScaleError",
    "Precision",
    "StepOutcome",
    "autocast",
    "backward",
    "backward_through",
    "clip_coefficient",
    "step_outcome",
]


@attrs.frozen
class StepOutcome:
    """How a step ends: skipped on an overflow, else the factor every gradient is multiplied by (the
    clip coefficient divided by the loss scale); and the loss-scale state of the next step."""

    overflow: bool
    factor: float
    loss_scale: LossScale | None


class Precision(Protocol):
    """What a training config says about precision (:class:`bamboo.rc.config.TrainingConfig` is one)."""

    @property
    def bf16(self) -> bool: ...

    @property
    def fp16(self) -> LossScaleConfig | None: ...


def clip_coefficient(max_norm: float, squared_norm: float) -> float:
    """The factor that scales gradients with global squared norm `squared_norm` to `max_norm`.

    The same formula as `torch.nn.utils.clip_grad_norm_`: `max_norm / (norm + 1e-6)`, at most 1.
    A `max_norm` of 0 means no clipping.
    """
    if max_norm <= 0.0:
        return 1.0
    return min(1.0, max_norm / (math.sqrt(squared_norm) + 1e-6))


def step_outcome(max_norm: float, squared_norm: float, loss_scale: LossScale | None,
                 config: LossScaleConfig | None) -> StepOutcome:
    """The end of a step whose (scaled) gradients have global squared norm ``squared_norm``.

    Without loss scaling it is :func:`clip_coefficient`'s clip. With it, a non-finite norm is an
    overflow; otherwise the norm is unscaled (exactly: the scale is a power of two, or the user's
    static scale) before clipping, and the factor also divides the scale out, as DeepSpeed's
    ``unscale_and_clip_grads`` does in one multiplication.
    """
    if loss_scale is None or config is None:
        return StepOutcome(overflow=False, factor=clip_coefficient(max_norm, squared_norm), loss_scale=None)
    overflow = not math.isfinite(squared_norm)
    following = loss_scale.after(overflow, config)
    if overflow:
        return StepOutcome(overflow=True, factor=0.0, loss_scale=following)
    unscaled = squared_norm / (loss_scale.scale * loss_scale.scale)
    return StepOutcome(overflow=False, factor=clip_coefficient(max_norm, unscaled) / loss_scale.scale,
                       loss_scale=following)


def autocast(precision: Precision, device: torch.device | str = "cpu") -> contextlib.AbstractContextManager[Any]:
    """The autocast of a layer's forward on ``device``'s type: bf16, fp16, or none (fp32). The one place the
    forward's precision is decided."""
    device_type = device if isinstance(device, str) else device.type
    if precision.bf16 and precision.fp16 is not None:
        raise ValueError("bf16 and fp16 cannot both be enabled")
    if precision.bf16:
        return torch.autocast(device_type, dtype=torch.bfloat16)
    if precision.fp16 is not None:
        return torch.autocast(device_type, dtype=torch.float16)
    return contextlib.nullcontext()


def backward(loss: torch.Tensor, loss_scale: LossScale | None) -> None:
    """``loss.backward()``, with the loss multiplied by the loss scale first when there is one."""
    (loss if loss_scale is None else loss * loss_scale.scale).backward()


def backward_through(output: torch.Tensor, grad: torch.Tensor) -> None:
    """``torch.autograd.backward(output, grad)``: the backward pass of a stage that is not the last, from the
    gradient of its output (already scaled, with fp16, by the last stage's :func:`backward`).

    It calls autograd's engine as ``torch.autograd.backward`` does, with the same arguments, so the gradients are
    the same bits; it leaves out the Python checks in front of it, which import torch's symbolic shapes (and sympy
    through them) on their first call with a gradient: 0.4 to 0.6 CPU-s in every worker process, beside the
    2 CPU-s of importing torch and bamboo. A gradient whose shape or dtype class differs from the output's (a
    bug) goes through ``torch.autograd.backward``, which raises torch's own error, as does a torch without the
    engine call.
    """
    run = getattr(torch.autograd.graph, "_engine_run_backward", None)
    if (run is None or type(output) is not torch.Tensor or type(grad) is not torch.Tensor
            or output.shape != grad.shape or output.dtype.is_complex != grad.dtype.is_complex):
        torch.autograd.backward(output, grad)
        return
    run((output,), (grad,), False, False, (), allow_unreachable=True, accumulate_grad=True)
