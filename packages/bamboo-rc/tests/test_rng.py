"""Randomness as a function of where it is used (`bamboo.rc.rng`): the same (seed, step, global microbatch,
layer) draws the same numbers from every call site; other tuples draw others; the caller's generator is left
as it was; randomness outside torch's generators is named in a warning."""

from __future__ import annotations

import random
import warnings

import numpy as np
import pytest
import torch
from bamboo.rc.data import GlobalBatchSampler, pipeline_data_iter
from bamboo.rc.model import GPTSize, build_layers, gpt_layer_specs, lm_loss
from bamboo.rc.rng import RandomnessWarning, global_microbatch, layer_rng, layer_seed, run_layers
from bamboo.rc.state import TrainableSlice
from torch import nn

SIZE = GPTSize(layers=2, width=16, heads=2, sequence=8, dropout=0.25)


def _dropout_mask(seed: int, step: int, microbatch: int, layer: int) -> torch.Tensor:
    with layer_rng(seed, step, microbatch, layer):
        return nn.functional.dropout(torch.ones(64), 0.5, training=True) != 0


def test_the_seed_is_a_63_bit_function_of_the_whole_tuple() -> None:
    seeds = {layer_seed(seed, step, mb, layer)
             for seed in (0, 1, -1) for step in range(4) for mb in range(4) for layer in range(4)}
    assert len(seeds) == 3 * 4 * 4 * 4  # no collision among neighbours, nor among permutations
    assert all(0 <= s < 2**63 for s in seeds)
    assert layer_seed(7, 1, 2, 3) == layer_seed(7, 1, 2, 3)
    assert layer_seed(7, 1, 2, 3) != layer_seed(7, 2, 1, 3) != layer_seed(7, 3, 2, 1)


@pytest.mark.parametrize(("args", "message"), [
    ((0, -1, 0, 0), "step must be >= 0, got -1"),
    ((0, 0, -2, 0), "microbatch must be >= 0, got -2"),
    ((0, 0, 0, -3), "layer must be >= 0, got -3"),
    ((2**64, 0, 0, 0), r"\(18446744073709551616, 0, 0, 0\) do not fit in signed 64-bit integers"),
])
def test_bad_seed_inputs_are_refused_by_name(args: tuple[int, int, int, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        layer_seed(*args)


def test_the_same_tuple_gives_the_same_mask_and_any_other_tuple_another() -> None:
    base = _dropout_mask(5, 3, 2, 1)
    assert torch.equal(base, _dropout_mask(5, 3, 2, 1))
    for other in [(6, 3, 2, 1), (5, 4, 2, 1), (5, 3, 3, 1), (5, 3, 2, 2)]:
        assert not torch.equal(base, _dropout_mask(*other)), other


def test_the_callers_generator_is_left_as_it_was_even_on_an_error() -> None:
    torch.manual_seed(123)
    before = torch.get_rng_state()
    expected = torch.rand(3)
    torch.set_rng_state(before)
    _dropout_mask(0, 0, 0, 0)
    with pytest.raises(RuntimeError, match="inside"), layer_rng(0, 0, 0, 0):
        torch.rand(5)
        raise RuntimeError("inside")
    layers = build_layers(gpt_layer_specs(SIZE), range(4), seed=0)
    run_layers(list(layers), range(4), torch.zeros(2, 8, dtype=torch.int64), seed=0, step=0, microbatch=0)
    assert torch.equal(torch.get_rng_state(), before)
    assert torch.equal(torch.rand(3), expected)


def test_the_global_microbatch_index_is_the_data_iterators_order() -> None:
    sampler = GlobalBatchSampler(micro_batch_size=1, sequence=8, seed=3)
    micro_batches = 3
    for pipeline in range(2):
        data = pipeline_data_iter(sampler, pipeline, micro_batches)
        for k in range(micro_batches):
            tokens, _ = next(data)
            index = global_microbatch(pipeline * micro_batches, micro_batches, k)
            assert torch.equal(tokens, sampler.microbatch(0, index).tokens)
    assert global_microbatch(3, 3, 2) == 5
    assert global_microbatch(6, 5, 4) == 10  # an uneven share: 16 over 3 pipelines is 6, 5, 5
    with pytest.raises(ValueError, match=r"microbatch 3 of the share from 0 is outside 0\.\.2"):
        global_microbatch(0, 3, 3)


def test_a_stage_its_replica_and_the_whole_model_draw_the_same_masks() -> None:
    """The call sites of one layer (the stage's forward, the shadow's FRC on its own copy, the reference's
    whole model) give bit-equal outputs and gradients, and dropout really is on."""
    specs = gpt_layer_specs(SIZE)
    from bamboo.rc.config import load_config

    config = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    whole = TrainableSlice(specs, range(len(specs)), config, seed=4)
    first = TrainableSlice(specs, range(0, 2), config, seed=4)
    second = TrainableSlice(specs, range(2, len(specs)), config, seed=4)
    replica = TrainableSlice(specs, range(2, len(specs)), config, seed=4)  # the shadow's copy of the stage
    batch = GlobalBatchSampler(2, SIZE.sequence, seed=4).microbatch(7, 5)

    reference = lm_loss(whole.forward(batch.tokens, step=7, microbatch=5), batch.labels)
    reference.backward()
    hidden = first.forward(batch.tokens, step=7, microbatch=5)
    staged = lm_loss(second.forward(hidden.detach(), step=7, microbatch=5), batch.labels)
    staged.backward()
    again = lm_loss(replica.forward(hidden.detach(), step=7, microbatch=5), batch.labels)
    again.backward()
    assert torch.equal(reference, staged) and torch.equal(staged, again)
    for a, b, c in zip(whole.parameters[-len(second.parameters):], second.parameters, replica.parameters,
                       strict=True):
        assert torch.equal(a.grad, b.grad) and torch.equal(b.grad, c.grad)

    other_step = lm_loss(whole.forward(batch.tokens, step=8, microbatch=5), batch.labels)
    other_microbatch = lm_loss(whole.forward(batch.tokens, step=7, microbatch=4), batch.labels)
    assert not torch.equal(reference, other_step) and not torch.equal(reference, other_microbatch)
    whole.layers.eval()
    assert torch.equal(lm_loss(whole.forward(batch.tokens, step=7, microbatch=5), batch.labels),
                       lm_loss(whole.forward(batch.tokens, step=8, microbatch=4), batch.labels))


class _NumpyNoise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.from_numpy(np.random.standard_normal(x.shape).astype(np.float32))


class _PythonNoise(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * random.random()


class _OwnGenerator(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.generator = torch.Generator().manual_seed(0)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.rand(x.shape, generator=self.generator)


@pytest.mark.parametrize("layer", [_NumpyNoise(), _PythonNoise(), _OwnGenerator()], ids=lambda m: type(m).__name__)
def test_a_layer_drawing_outside_torchs_generators_is_named_in_a_warning(layer: nn.Module) -> None:
    layers = [nn.Linear(4, 4), layer, nn.Dropout(0.5)]
    with pytest.warns(RandomnessWarning, match=rf"layer 8 \({type(layer).__name__}\) gave different outputs"):
        run_layers(layers, [7, 8, 9], torch.ones(2, 4), seed=0, step=0, microbatch=0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # probed once per layer object: no second warning, no second probe
        run_layers(layers, [7, 8, 9], torch.ones(2, 4), seed=0, step=1, microbatch=0)


def test_the_probe_changes_neither_buffers_nor_an_in_place_layers_input_and_warns_of_nothing_controlled() -> None:
    def model() -> list[nn.Module]:
        torch.manual_seed(0)
        return [nn.Dropout(0.5, inplace=True), nn.BatchNorm1d(4), nn.Dropout(0.3)]

    x = torch.randn(6, 4)
    probed = model()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out = run_layers(probed, [0, 1, 2], x.clone(), seed=1, step=2, microbatch=3)
    unprobed = model()
    for layer in unprobed:
        from bamboo.rc import rng

        rng._PROBED.add(layer)  # as if already probed: the plain run
    plain = run_layers(unprobed, [0, 1, 2], x.clone(), seed=1, step=2, microbatch=3)
    assert torch.equal(out, plain)
    assert torch.equal(probed[1].running_mean, unprobed[1].running_mean)  # one update, not three
    assert int(probed[1].num_batches_tracked) == 1
