"""The plan is what runs: every node builds exactly the stage bounds it is given (bamboo-reconfig's split)."""

from __future__ import annotations

import typing

import pytest
import torch
from bamboo.rc.config import load_config
from bamboo.rc.executor import StageExecutor
from bamboo.rc.layout import Layout
from bamboo.rc.model import (
    GPTSize,
    check_stage_bounds,
    gpt_layer_specs,
    layer_costs,
    lm_loss,
    stage_bounds,
    stage_slices,
)
from bamboo.rc.verify import DEFAULT_CONFIG
from bamboo.reconfig import InfeasibleSplit, LayerSpec, node_state_bytes, split_layers
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed import HashStore
from torch.overrides import _get_current_function_mode_stack


@st.composite
def split_cases(draw: st.DrawFn) -> tuple[list[LayerSpec], int, int | None]:
    count = draw(st.integers(1, 14))
    params = draw(st.lists(st.integers(0, 5000), min_size=count, max_size=count))
    layers = [LayerSpec(4 * p, 8 * p, float(draw(st.integers(0, 100)) if draw(st.booleans()) else p)) for p in params]
    stages = draw(st.integers(1, count))
    memory = draw(st.none() | st.integers(0, 2 * sum(layer.state_bytes for layer in layers) + 1))
    return layers, stages, memory


@settings(max_examples=300, deadline=None)
@given(case=split_cases(), redundancy=st.sampled_from(["none", "lflb", "eflb", "efeb"]))
def test_each_node_builds_exactly_its_bounds_and_its_replicas(case, redundancy: str) -> None:  # type: ignore[no-untyped-def]
    layers, stages, memory = case
    try:
        bounds = split_layers(layers, stages, memory)
    except InfeasibleSplit:
        return
    assert check_stage_bounds(bounds, len(layers), stages) == bounds
    if memory is not None:
        assert max(node_state_bytes(layers, bounds)) <= memory or stages == 1
    built: dict[int, list[int]] = {}
    for stage in range(stages):
        if redundancy != "none" and stages < 2:
            continue
        slices = stage_slices(bounds, stage, redundancy)
        assert slices[stage] == range(*bounds[stage])
        expected = {stage} if redundancy == "none" else {stage, (stage + 1) % stages}
        assert set(slices) == expected
        for s, indices in slices.items():
            assert indices == range(*bounds[s])  # a replica is exactly its stage's range
            if s == stage:
                built.setdefault(s, []).extend(indices)
    if built:
        assert sorted(i for indices in built.values() for i in indices) == list(range(len(layers)))


@pytest.mark.parametrize(
    ("bounds", "count", "stages"),
    [([(0, 2), (3, 6)], 6, 2), ([(0, 2), (2, 6)], 6, 3), ([(0, 0), (0, 6)], 6, 2), ([(0, 2), (2, 5)], 6, 2)],
)
def test_bounds_that_do_not_cut_the_model_are_rejected(bounds: list[tuple[int, int]], count: int, stages: int) -> None:
    with pytest.raises(ValueError, match=r"stage bounds .* do not cut 6 layers into"):
        check_stage_bounds(bounds, count, stages)


def test_layer_costs_count_fp32_parameters_and_adam_state() -> None:
    specs = gpt_layer_specs(GPTSize())
    costs = layer_costs(specs)
    params = [sum(p.numel() for p in spec.build().parameters()) for spec in specs]
    assert [c.compute_cost for c in costs] == [float(p) for p in params]
    assert [(c.param_bytes, c.optimizer_bytes) for c in costs] == [(4 * p, 8 * p) for p in params]
    assert stage_bounds(specs, 4) == split_layers(costs, 4)
    memory = max(node_state_bytes(costs, stage_bounds(specs, 3)))
    assert stage_bounds(specs, 3, memory) == split_layers(costs, 3, memory)


class _RandomlyInitialised(torch.nn.Module):
    """A layer whose constructor draws from every kind of random fill the meta-device count skips; it records
    the device it was built on, and the torch function modes it was built under."""

    built_on: typing.ClassVar[list[str]] = []
    modes: typing.ClassVar[list[str]] = []

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.empty(5, 7))
        torch.nn.init.trunc_normal_(self.weight)
        torch.nn.init.kaiming_normal_(self.weight)
        self.weight.data.log_normal_().exponential_().cauchy_().geometric_(0.5)
        self.embedding = torch.nn.Embedding(11, 3)
        type(self).built_on.append(self.weight.device.type)
        type(self).modes.extend(type(mode).__name__ for mode in _get_current_function_mode_stack())


def test_layer_costs_count_layers_with_random_fills_on_the_meta_device() -> None:
    from deepspeed.pipe import LayerSpec as DeepSpeedLayerSpec

    _RandomlyInitialised.built_on.clear()
    _RandomlyInitialised.modes.clear()
    (cost,) = layer_costs([DeepSpeedLayerSpec(_RandomlyInitialised)])
    assert _RandomlyInitialised.built_on == ["meta"]  # counted on meta: no fall-back to a real build on the CPU
    assert "_SkipRandomFillOnMeta" in _RandomlyInitialised.modes
    assert cost.param_bytes == 4 * sum(p.numel() for p in _RandomlyInitialised().parameters()) == 4 * (35 + 33)


def test_random_fills_of_meta_tensors_are_skipped_and_others_run() -> None:
    from bamboo.rc.model import _SkipRandomFillOnMeta

    def normal_(*args: object, **kwargs: object) -> None:
        raise AssertionError("a random fill of a meta tensor ran")

    meta, real = torch.empty(3, device="meta"), torch.zeros(3)
    mode = _SkipRandomFillOnMeta()
    assert mode.__torch_function__(normal_, (), (meta,)) is meta
    assert mode.__torch_function__(normal_, (), (), {"tensor": meta}) is meta  # torch.nn.init's keyword form
    with pytest.raises(AssertionError, match="ran"):
        mode.__torch_function__(normal_, (), (real,))
    with _SkipRandomFillOnMeta():
        assert torch.equal(real.clone().fill_(2.0), torch.full((3,), 2.0))  # anything else runs as usual


def _executor(stage: int, bounds: tuple[tuple[int, int], ...] | None = None) -> StageExecutor:
    config = load_config(DEFAULT_CONFIG)
    specs = gpt_layer_specs(GPTSize())
    return StageExecutor(specs, lm_loss, config, Layout(4, 1), stage, 0, HashStore(), "eflb", stage_bounds=bounds)


def test_the_executors_of_the_demo_model_build_the_planners_split() -> None:
    """For the demo model at P=4 the planner's split is (0,2),(2,3),(3,4),(4,6) (not an even cut of
    the layer count): every executor's slices hold exactly those layers."""
    planned = split_layers(layer_costs(gpt_layer_specs(GPTSize())), 4)
    assert planned == ((0, 2), (2, 3), (3, 4), (4, 6))
    for stage in range(4):
        executor = _executor(stage)
        assert executor.stage_bounds == planned
        assert {s: piece.indices for s, piece in executor.slices.items()} == {
            stage: range(*planned[stage]), (stage + 1) % 4: range(*planned[(stage + 1) % 4])
        }
        assert len(executor.slices[stage].layers) == planned[stage][1] - planned[stage][0]


def test_an_executor_builds_the_bounds_it_is_given() -> None:
    given_bounds = ((0, 1), (1, 2), (2, 5), (5, 6))
    executor = _executor(2, given_bounds)
    assert executor.slices[2].indices == range(2, 5) and executor.slices[3].indices == range(5, 6)
    with pytest.raises(ValueError, match="do not cut 6 layers into 4"):
        _executor(0, ((0, 3), (3, 6)))
