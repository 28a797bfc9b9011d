"""TrainableSlice's gradient handling: flat gradients (a fresh copy, or written into a buffer the caller
reuses), loading them back, zeroing in place, and the squared norm in pieces."""

from __future__ import annotations

import pytest
import torch
from bamboo.rc import load_config, state
from bamboo.rc.model import GPTSize, gpt_layer_specs
from bamboo.rc.state import SpareBuffers, TrainableSlice
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


def _slice() -> TrainableSlice:
    return TrainableSlice(gpt_layer_specs(GPTSize(layers=1, width=16, heads=2, sequence=8)), range(3),
                          load_config(DEFAULT_CONFIG), 0)


def test_loading_flat_gradients_copies_them_into_the_gradients_the_slice_already_has() -> None:
    piece = _slice()
    piece.zero_grads()
    held = [p.grad for p in piece.parameters]
    flat = torch.randn(piece.numel(), generator=torch.Generator().manual_seed(5))
    piece.load_flat_grads(flat)
    assert all(p.grad is g for p, g in zip(piece.parameters, held, strict=True))
    assert torch.equal(piece.flat_grads(), flat)
    flat.zero_()  # the caller may reuse its buffer at once
    assert not torch.equal(piece.flat_grads(), flat)
    piece.zero_grads()  # in place, too
    assert all(p.grad is g and not g.any() for p, g in zip(piece.parameters, held, strict=True))


def test_loading_a_gradient_buffer_of_the_wrong_size_names_both_sizes() -> None:
    piece = _slice()
    with pytest.raises(ValueError, match=f"has {piece.numel() + 1} elements, the slice needs {piece.numel()}"):
        piece.load_flat_grads(torch.zeros(piece.numel() + 1))


@pytest.mark.parametrize("piece_entries", [7, 1 << 20])
def test_the_squared_norm_adds_each_piece_in_order_in_float64(monkeypatch: pytest.MonkeyPatch,
                                                               piece_entries: int) -> None:
    monkeypatch.setattr(state, "NORM_PIECE", piece_entries)
    piece = _slice()
    generator = torch.Generator().manual_seed(11)
    for p in piece.parameters:
        p.grad = torch.randn(p.shape, generator=generator) * 1e3
    expected = torch.zeros((), dtype=torch.float64)
    for p in piece.parameters:  # the definition, written out: pieces of piece_entries, in parameter order
        for chunk in p.grad.reshape(-1).double().split(piece_entries):
            expected += (chunk * chunk).sum()
    assert max(p.numel() for p in piece.parameters) > 7  # the small pieces do cut gradients
    assert piece.squared_grad_norm() == float(expected)
    assert piece.squared_grad_norm() == float(expected)  # the reused scratch changes nothing
    assert piece.squared_grad_norm() == pytest.approx(sum(float(p.grad.double().pow(2).sum()) for p in piece.parameters),
                                                      rel=1e-12)


def test_spare_buffers_hand_back_what_was_given_back_of_the_right_size_and_fresh_ones_otherwise() -> None:
    spares = SpareBuffers()
    first = spares.take(0, 6)
    assert first.numel() == 6 and spares.take(0, 6) is not first  # nothing given back yet: fresh
    spares.give_back(0, first)
    spares.give_back(0, first)  # twice: held once
    assert spares.held(0) == 1 and spares.held(1) == 0
    assert spares.take(1, 6) is not first  # another key
    assert spares.take(0, 6) is first and spares.held(0) == 0
    spares.give_back(0, first)
    other = spares.take(0, 7)  # the slice changed size: the spare of 6 is let go, a fresh one of 7
    assert other is not first and other.numel() == 7 and spares.held(0) == 0


def test_spare_buffers_hold_at_most_per_key_spares() -> None:
    spares = SpareBuffers()
    given = [torch.empty(3) for _ in range(SpareBuffers.PER_KEY + 2)]
    for buffer in given:
        spares.give_back("s", buffer)
    assert spares.held("s") == SpareBuffers.PER_KEY
    taken = {id(spares.take("s", 3)) for _ in range(SpareBuffers.PER_KEY)}
    assert taken == {id(buffer) for buffer in given[: SpareBuffers.PER_KEY]}


@pytest.mark.parametrize("device", [None, "cpu"])
def test_a_snapshot_is_a_private_copy_whose_bytes_restore_the_state(device: str | None) -> None:
    """``snapshot()`` (onto ``device`` when given) copies every tensor: training that goes on does not change it, and
    its bytes (``snapshot_bytes``) are those of ``state_bytes()`` at the snapshot's step."""
    piece = _slice()
    before = piece.state_bytes()
    taken = piece.snapshot(device=device)
    for parameter in piece.layers.parameters():
        with torch.no_grad():
            parameter.add_(1.0)  # training goes on
    other = _slice()
    other.load_state_bytes(state.snapshot_bytes(taken))
    reference = _slice()
    reference.load_state_bytes(before)
    for mine, theirs in zip(other.layers.parameters(), reference.layers.parameters(), strict=True):
        assert torch.equal(mine, theirs)
