"""The example decoder's size and its layers' costs as plain values, without torch.

:class:`GPTSize` sizes :mod:`bamboo.rc.model`'s decoder, and :meth:`GPTSize.layer_parameters` counts each of its
layers' parameters from the size alone, so that an agent describes the built-in example (the cost of each layer,
:func:`layer_cost`) without importing torch or starting a process.
"""

from __future__ import annotations

import attrs
from bamboo.reconfig import LayerSpec as LayerCost

__all__ = ["VOCAB_SIZE", "GPTSize", "layer_cost"]

VOCAB_SIZE = 256


_POSITIVE = attrs.validators.ge(1)
_DROPOUT = attrs.validators.and_(attrs.validators.ge(0), attrs.validators.lt(1))
"""A dropout probability: in [0, 1)."""


@attrs.frozen
class GPTSize:
    """The size of the example decoder, from tiny upwards."""

    layers: int = attrs.field(default=4, validator=_POSITIVE)
    width: int = attrs.field(default=64, validator=_POSITIVE)
    heads: int = attrs.field(default=4, validator=_POSITIVE)
    sequence: int = attrs.field(default=32, validator=_POSITIVE)
    dropout: float = attrs.field(default=0.0, converter=float, validator=_DROPOUT)
    """Dropout probability after the embedding, the attention and the MLP (GPT-2's places); 0 = none."""

    def __attrs_post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")

    def layer_parameters(self) -> list[int]:
        """The parameters of each layer of :func:`bamboo.rc.model.gpt_layer_specs` (embedding, decoder blocks,
        head), counted from the shapes its modules give them (``tests/test_gpt_size.py`` holds the count to the
        built modules): the token and position tables; per block two layer norms (weight and bias), the
        attention's query-key-value and output projections and the MLP's two linear maps, each with a bias;
        the head's layer norm and its projection to the vocabulary, with a bias."""
        width = self.width
        embedding = VOCAB_SIZE * width + self.sequence * width
        block = 2 * (2 * width) + (width * 3 * width + 3 * width) + (width * width + width) \
            + (width * 4 * width + 4 * width) + (4 * width * width + width)
        head = 2 * width + width * VOCAB_SIZE + VOCAB_SIZE
        return [embedding, *([block] * self.layers), head]


def layer_cost(parameters: int) -> LayerCost:
    """bamboo-reconfig's cost of a layer of ``parameters`` parameters: the parameters in fp32 (4 bytes each),
    Adam's state (8 bytes each), and a compute cost equal to the parameter count."""
    return LayerCost(param_bytes=4 * parameters, optimizer_bytes=8 * parameters, compute_cost=float(parameters))
