"""TrainableSlice's flat gradients: a fresh copy, or written into a buffer the caller reuses."""

from __future__ import annotations

import torch
from bamboo.rc import load_config
from bamboo.rc.model import GPTSize, gpt_layer_specs
from bamboo.rc.state import TrainableSlice
from bamboo.rc.verify import DEFAULT_CONFIG


def test_flat_gradients_into_a_reused_buffer_equal_a_fresh_copy_and_alias_nothing() -> None:
    piece = TrainableSlice(gpt_layer_specs(GPTSize(layers=1, width=16, heads=2, sequence=8)), range(3),
                           load_config(DEFAULT_CONFIG), 0)
    buffer = torch.full((piece.numel(),), float("nan"))
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):  # the second step overwrites the first one's values in place
        for p in piece.parameters:
            p.grad = torch.randn(p.shape, generator=generator)
        fresh = piece.flat_grads()
        into = piece.flat_grads(out=buffer)
        assert into.data_ptr() == buffer.data_ptr()
        assert torch.equal(into, fresh)
    buffer.zero_()  # the gradients are copied, not viewed
    assert torch.equal(piece.flat_grads(), fresh)
