"""fp16's dynamic loss scale as plain values: its settings (DeepSpeed's ``fp16`` section) and its state.

Kept apart from :mod:`bamboo.rc.precision` (which applies the scale to tensors) so that reading a DeepSpeed config
(:func:`bamboo.rc.config.load_config`) needs no torch: an agent describes the built-in example with it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import attrs

__all__ = ["LossScale", "LossScaleConfig", "LossScaleError"]


class LossScaleError(RuntimeError):
    """A gradient overflowed at the minimum loss scale: DeepSpeed stops the run there too."""


_FINITE_POSITIVE = attrs.validators.and_(attrs.validators.gt(0.0), attrs.validators.lt(math.inf))
"""A loss scale after ``converter=float``: finite and > 0."""


@attrs.frozen
class LossScaleConfig:
    """DeepSpeed's ``fp16`` section: ``loss_scale`` (0 = dynamic), ``initial_scale_power``,
    ``loss_scale_window``, ``hysteresis``, ``consecutive_hysteresis``, ``min_loss_scale`` (DeepSpeed's
    defaults)."""

    loss_scale: float = attrs.field(default=0.0, converter=float, validator=attrs.validators.ge(0.0))
    initial_scale_power: int = attrs.field(default=16, validator=attrs.validators.ge(0))
    loss_scale_window: int = attrs.field(default=1000, validator=attrs.validators.gt(0))
    hysteresis: int = attrs.field(default=2, validator=attrs.validators.gt(0))
    consecutive_hysteresis: bool = False
    min_loss_scale: float = attrs.field(default=1.0, converter=float, validator=_FINITE_POSITIVE)

    @property
    def dynamic(self) -> bool:
        return self.loss_scale == 0.0

    def initial(self) -> LossScale:
        """The scale of the first step."""
        if not self.dynamic:
            return LossScale(scale=self.loss_scale, hysteresis=self.hysteresis)
        return LossScale(scale=float(2**self.initial_scale_power), hysteresis=self.hysteresis)


@attrs.frozen
class LossScale:
    """The loss-scale state after ``iteration`` steps: DeepSpeed's ``cur_scale``, ``cur_iter``,
    ``last_overflow_iter`` and ``cur_hysteresis``."""

    scale: float = attrs.field(converter=float, validator=_FINITE_POSITIVE)
    iteration: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    last_overflow: int = attrs.field(default=-1, validator=attrs.validators.ge(-1))
    hysteresis: int = attrs.field(default=2, validator=attrs.validators.ge(0))

    def after(self, overflow: bool, config: LossScaleConfig) -> LossScale:
        """The state after a step that did (``overflow``) or did not overflow: DeepSpeed's
        ``DynamicLossScaler.update_scale`` (a static scale only counts the step). Raises
        :class:`LossScaleError` on an overflow at the minimum scale."""
        if not config.dynamic:
            return attrs.evolve(self, iteration=self.iteration + 1)
        scale, hysteresis, last = self.scale, self.hysteresis, self.last_overflow
        if overflow:
            if config.hysteresis == 1 or hysteresis == 1:
                if scale == config.min_loss_scale:
                    raise LossScaleError(
                        f"a gradient overflowed at the minimum loss scale {config.min_loss_scale:g} (step "
                        f"{self.iteration}): the fp16 run cannot go on (lower the learning rate, or train in bf16)"
                    )
                scale = max(scale / 2.0, config.min_loss_scale)
            else:
                hysteresis -= 1
            last = self.iteration
        else:
            if config.consecutive_hysteresis:
                hysteresis = config.hysteresis
            stable = self.iteration - last - 1
            if stable > 0 and stable % config.loss_scale_window == 0:
                if not config.consecutive_hysteresis:
                    hysteresis = config.hysteresis
                scale *= 2.0
        return LossScale(scale=scale, iteration=self.iteration + 1, last_overflow=last, hysteresis=hysteresis)

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "iteration": self.iteration, "last_overflow": self.last_overflow,
                "hysteresis": self.hysteresis}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LossScale:
        return cls(scale=data["scale"], iteration=int(data["iteration"]), last_overflow=int(data["last_overflow"]),
                   hysteresis=int(data["hysteresis"]))
