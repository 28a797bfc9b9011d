"""``bamboo.rc.PipelineModule``: DeepSpeed's ``PipelineModule`` as a description, with no process group needed.

DeepSpeed's ``deepspeed.pipe.PipelineModule`` builds its stage when it is constructed, over a world that
``deepspeed.init_distributed`` must have formed first (otherwise: ``DeepSpeed backend not set``). bamboo builds
the stages itself (each node its own stage and its replica, again after every failover and reconfiguration), so
it needs only what the module describes: the layer specs, the number of stages and the loss. This class takes
DeepSpeed's constructor arguments that bamboo honours and keeps them, nothing more::

    from bamboo.rc import PipelineModule          # instead of: from deepspeed.pipe import PipelineModule
    module = PipelineModule(layers=[LayerSpec(...), ...], num_stages=2, loss_fn=my_loss)
    engine = bamboo.rc.initialize(model=module, config=ds_config)

No ``deepspeed.init_distributed`` call is needed, and none is made. DeepSpeed's own ``PipelineModule`` is
accepted by :func:`bamboo.rc.initialize` too (its layer specs, ``num_stages`` and ``loss_fn`` are read); it
needs ``deepspeed.init_distributed`` before it is built, as DeepSpeed requires.

Arguments bamboo cannot honour are refused by name: a ``partition_method`` other than ``"parameters"``
(bamboo cuts the stages by parameter count, bamboo-reconfig's split; pass ``initialize(stage_bounds=...)``
for a cut of your own), a ``topology`` (bamboo places stages and pipelines itself) and activation
checkpointing.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import attrs

__all__ = ["PipelineModule"]


def _as_layers(value: Sequence[Any]) -> tuple[Any, ...]:
    if isinstance(value, str | bytes) or not isinstance(value, Sequence):
        raise TypeError(f"layers must be a list of LayerSpec (or zero-argument module factories), got {value!r}")
    layers = tuple(value)
    if not layers:
        raise ValueError("layers must not be empty")
    for index, layer in enumerate(layers):
        if not callable(layer) and not hasattr(layer, "build"):
            raise TypeError(f"layer {index} must be a LayerSpec or a zero-argument module factory, got {layer!r}")
    return layers


def _stages(instance: object, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
        raise ValueError(f"num_stages must be a positive integer, got {value!r}")


def _partition(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if value.lower() != "parameters":
        raise ValueError(f"partition_method={value!r} is not supported: bamboo cuts the stages by parameter count "
                         f"(partition_method='parameters'); pass bamboo.rc.initialize(stage_bounds=[(start, end), "
                         f"...]) for a cut of your own")


def _no_activation_checkpoints(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value:
        raise ValueError(f"activation_checkpoint_interval={value!r} is not supported by bamboo (use 0)")


def _no_topology(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        raise ValueError("topology= is not supported: bamboo places the stages and pipelines itself; pass "
                         "num_stages (the pipelines are WORLD_SIZE / num_stages)")


@attrs.frozen
class PipelineModule:
    """A DeepSpeed pipeline model as bamboo needs it: its layers, its stages (None: ``BAMBOO_STAGES``) and
    its loss; constructed with DeepSpeed's argument names, without a process group (see the module docstring)."""

    layers: tuple[Any, ...] = attrs.field(converter=_as_layers)
    num_stages: int | None = attrs.field(default=None, validator=_stages)
    topology: None = attrs.field(default=None, validator=_no_topology)
    loss_fn: Callable[[Any, Any], Any] | None = attrs.field(default=None)
    partition_method: str = attrs.field(default="parameters", validator=_partition)
    activation_checkpoint_interval: int = attrs.field(default=0, validator=_no_activation_checkpoints)

    @loss_fn.validator
    def _check_loss(self, attribute: attrs.Attribute, value: object) -> None:
        if value is not None and not callable(value):
            raise TypeError(f"loss_fn must be callable, got {value!r}")

    @property
    def _layer_specs(self) -> list[Any]:
        """The layers under DeepSpeed's attribute name (what :func:`bamboo.rc.initialize` reads)."""
        return list(self.layers)
