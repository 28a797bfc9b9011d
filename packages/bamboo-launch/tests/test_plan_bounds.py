"""The plan is what runs: the stage bounds in the layout that etcd holds are the layers every executor builds.

One split for the whole system (bamboo-reconfig's ``split_layers``, which honours node memory): the
coordinator writes it into the first layout, every worker reads the layout back from etcd as JSON, and
bamboo-rc builds exactly those ranges for its stage and its replica. The end-to-end check (the layout
saved from etcd against each worker's final report) is in ``tests/e2e/test_run_e2e.py``.
"""

from __future__ import annotations

from typing import Any

from bamboo.launch.coordinator_layouts import first_layout
from bamboo.launch.spec import JobSpec
from bamboo.reconfig import JobLayout, LayerSpec, split_layers
from hypothesis import given, settings
from hypothesis import strategies as st


def _spec(layers: list[LayerSpec], stages: int, pipelines: int) -> JobSpec:
    return JobSpec(job="bounds", stages=stages, pipelines=pipelines, steps=1, micro_batches=2, created_unix=1.0,
                   layers=[layer.to_dict() for layer in layers], config={})


def _built(layout: JobLayout, specs: Any, stage: int) -> dict[int, range]:
    """The layer ranges the executor of ``stage`` builds for ``layout``, read back as a worker reads it."""
    from bamboo.rc import StageExecutor, load_config
    from bamboo.rc.layout import Layout

    config = load_config({"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 2,
                          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, pipelines=layout.pipelines)
    executor = StageExecutor(specs, lambda y, t: y.sum(), config, Layout(layout.stages, layout.pipelines), stage, 0,
                             store=None, stage_bounds=layout.stage_bounds)  # type: ignore[arg-type]
    return {s: piece.indices for s, piece in executor.slices.items()}


@settings(max_examples=80, deadline=None)
@given(
    costs=st.lists(st.tuples(st.integers(1, 10_000), st.floats(0.5, 1e4)), min_size=2, max_size=16),
    stages=st.integers(2, 6),
    pipelines=st.integers(1, 3),
)
def test_the_layout_holds_the_one_split_for_random_layer_costs(costs: list[tuple[int, float]], stages: int,
                                                               pipelines: int) -> None:
    if stages > len(costs):
        return
    from bamboo.rc.model import stage_slices

    layers = [LayerSpec(4 * params, 8 * params, compute) for params, compute in costs]
    zones = {f"n{i}": "abc"[i % 3] for i in range(stages * pipelines)}
    layout = JobLayout.from_json(first_layout(_spec(layers, stages, pipelines), zones).to_json())
    assert layout.stage_bounds == split_layers(layers, stages)
    for rank in layout.node_of_rank:
        stage = rank % stages
        slices = stage_slices(layout.stage_bounds, stage, "eflb")
        assert slices[stage] == range(*layout.stage_bounds[stage])
        assert slices[(stage + 1) % stages] == range(*layout.stage_bounds[(stage + 1) % stages])


def test_the_demo_model_builds_the_bounds_of_its_layout() -> None:
    from bamboo.launch.example import EXAMPLE_CONFIG, describe_program, example_program

    program = example_program({"layers": 4}, dict(EXAMPLE_CONFIG), 0)
    description = describe_program(program, pipelines=2)
    spec = JobSpec(job="demo", stages=4, pipelines=2, steps=1, micro_batches=description["micro_batches"],
                   created_unix=1.0, layers=description["layers"], config=description["config"])
    layout = JobLayout.from_json(first_layout(spec, {f"n{i}": "abc"[i % 3] for i in range(8)}).to_json())
    assert layout.stage_bounds == ((0, 2), (2, 3), (3, 4), (4, 6))  # the planner's split of the demo model
    for stage in range(4):
        built = _built(layout, list(program.layers), stage)
        assert built == {stage: range(*layout.stage_bounds[stage]),
                         (stage + 1) % 4: range(*layout.stage_bounds[(stage + 1) % 4])}
