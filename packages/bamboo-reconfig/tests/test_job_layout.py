"""The job layout record: derived placement, the versioned JSON codec and its errors."""

from __future__ import annotations

import json

import pytest
from bamboo.reconfig import (
    ClusterView,
    JobLayout,
    LayerSpec,
    Layout,
    Node,
    RecordError,
    RestorePoint,
    StartMode,
    plan_layout,
    plan_transfers,
)
from hypothesis import given, settings
from hypothesis import strategies as st

LAYERS = [LayerSpec(40, 80, 1.0 + index) for index in range(6)]


def _plan() -> Layout:
    return Layout(stages=2, layers=LAYERS, stage_layers=((0, 3), (3, 6)), owners=[["a", "b"], ["c", "d"]],
                  microbatches=(2, 2), standby=("e",))


def test_placement_is_derived_from_the_plan() -> None:
    layout = JobLayout(generation=3, plan=_plan(), start_step=7, mode=StartMode.PEERS, reason="new-pipeline",
                       barrier_step=7, history=[(0, 1), (7, 2)])
    assert layout.ranks == {"a": 0, "b": 1, "c": 2, "d": 3}
    assert layout.node_of_rank[3] == "d"
    assert (layout.stages, layout.pipelines, layout.micro_batches, layout.global_batch) == (2, 2, 2, 4)
    assert layout.stage_bounds == ((0, 3), (3, 6))
    assert layout.shadow(1, 0) == "d"
    assert layout.standby == ("e",)
    assert layout.history_at(6) == 1 and layout.history_at(7) == 2


def test_first_layout_defaults() -> None:
    layout = JobLayout(generation=0, plan=_plan())
    assert layout.mode is StartMode.FIRST
    assert layout.history == ((0, 2),)
    assert layout.transfers.bytes_moved == 0


def test_round_trip_with_transfers_and_restore() -> None:
    old = _plan()
    view = ClusterView(nodes=[Node(n, z, "active") for n, z in zip("abcdef", "xyxyxy", strict=True)],
                       target_stages=2, target_pipelines=3, global_batch=6, layers=LAYERS)
    new = plan_layout(view)
    transfers = plan_transfers(old, new, {n: old.layers_held_at(old.slots()[n].stage) if n in old.slots() else ()
                                          for n in "abcdef"})
    moved = JobLayout(generation=1, plan=new, start_step=4, mode="peers", transfers=transfers, barrier_step=4,
                      barrier_unix=1.5e9, base_generation=0, survivors=("a", "b", "c", "d"),
                      history=[(0, 2), (4, 3)], zones={"a": "x"})
    assert JobLayout.from_json(moved.to_json()) == moved
    restored = JobLayout(generation=2, plan=old, start_step=10, mode=StartMode.CHECKPOINT,
                         restore=RestorePoint(10, "/ckpt/step-000000010", [1]), barrier_step=12,
                         history=[(0, 2), (10, 2)])
    assert JobLayout.from_dict(json.loads(restored.to_json())) == restored


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(v=3), "layout: unknown version 3 (this reader knows versions 1, 2)"),
        (lambda d: d.update(zones={"x": "a"}), "layout: key 'zones' is malformed: zone 'x' must list its nodes"),
        (lambda d: d.update(zones={"x": ["a"], "y": ["a"]}), "node 'a' is in zones 'x' and 'y'"),
        (lambda d: d.pop("v"), "layout: missing key 'v'"),
        (lambda d: d.update(generation="3"), "layout: key 'generation' must be an integer, got '3'"),
        (lambda d: d.update(generation=True), "layout: key 'generation' must be an integer, got True"),
        (lambda d: d.pop("plan"), "layout: missing key 'plan'"),
        (lambda d: d["plan"].pop("stage_layers"), "layout: key 'plan' is malformed"),
        (lambda d: d.update(mode="teleport"), "layout: key 'mode' is malformed"),
        (lambda d: d.update(transfers={"rounds": []}), "layout: key 'transfers' is malformed: missing key"),
        (lambda d: d.update(survivors="abc"), "layout: key 'survivors' must be a list"),
        (lambda d: d.update(history=[[0, 1]]), "layout: history [(0, 1)] must end with this generation's"),
        (lambda d: d.update(mode="checkpoint"), "layout: generation 0 restarts from a checkpoint but names no"),
    ],
)
def test_reader_names_the_key(change: object, message: str) -> None:
    data = json.loads(JobLayout(generation=0, plan=_plan()).to_json())
    change(data)  # type: ignore[operator]
    with pytest.raises(RecordError) as error:
        JobLayout.from_dict(data)
    assert message in str(error.value)


def test_the_record_is_compact_and_a_version_1_record_still_reads() -> None:
    layout = JobLayout(generation=0, plan=_plan(), zones={"a": "x", "b": "y", "c": "x", "d": "y", "e": "x"})
    data = json.loads(layout.to_json())
    assert data["v"] == 2
    assert data["plan"]["pipelines"] == [{"microbatches": 2, "owners": ["a", "b"]},
                                         {"microbatches": 2, "owners": ["c", "d"]}]
    assert data["zones"] == {"x": ["a", "c", "e"], "y": ["b", "d"]}
    # version 1 (written before): an object per stage, with its shadow, and node -> zone
    data["v"] = 1
    data["plan"]["pipelines"] = [{"microbatches": 2, "stages": [{"stage": 1, "owner": b, "shadow": a},
                                                                {"stage": 0, "owner": a, "shadow": b}]}
                                 for a, b in (("a", "b"), ("c", "d"))]
    data["zones"] = {"a": "x", "b": "y", "c": "x", "d": "y", "e": "x"}
    assert JobLayout.from_dict(data) == layout


def test_reader_rejects_what_is_not_an_object() -> None:
    with pytest.raises(RecordError, match="layout: must be a JSON object, got list"):
        JobLayout.from_dict([])  # type: ignore[arg-type]
    with pytest.raises(RecordError, match="layout: not JSON"):
        JobLayout.from_json("{")


def test_unequal_shares_are_refused_where_a_pipeline_needs_its_count() -> None:
    plan = Layout(stages=2, layers=LAYERS, stage_layers=((0, 3), (3, 6)), owners=[["a", "b"], ["c", "d"]],
                  microbatches=(3, 2))
    with pytest.raises(ValueError, match=r"unequal microbatch shares \[3, 2\]"):
        _ = JobLayout(generation=0, plan=plan).micro_batches


def test_stages_of_layers() -> None:
    layout = JobLayout(generation=0, plan=_plan())
    assert layout.stages_of_layers([3, 4, 5, 0, 1, 2]) == (0, 1)
    assert layout.stages_of_layers([3, 4, 5]) == (1,)
    with pytest.raises(ValueError, match=r"layers \[3, 4\] are not whole stages"):
        layout.stages_of_layers([3, 4])
    assert layout.holdings_of_stages({"a": [1], "e": []}) == {"a": frozenset({3, 4, 5}), "e": frozenset()}


@settings(max_examples=60, deadline=None)
@given(
    costs=st.lists(st.integers(1, 50), min_size=2, max_size=12),
    stages=st.integers(2, 4),
    zones=st.lists(st.sampled_from("xyz"), min_size=2, max_size=10),
    generation=st.integers(0, 50),
)
def test_round_trip_of_planned_layouts(costs: list[int], stages: int, zones: list[str], generation: int) -> None:
    if stages > len(costs) or len(zones) < stages:
        return
    layers = [LayerSpec(cost * 4, cost * 8, float(cost)) for cost in costs]
    nodes = [Node(f"n{i}", zone, "standby") for i, zone in enumerate(zones)]
    plan = plan_layout(ClusterView(nodes=nodes, target_stages=stages, target_pipelines=3, global_batch=6,
                                   layers=layers))
    layout = JobLayout(generation=generation, plan=plan, start_step=generation,
                       history=[(generation, plan.num_pipelines)], zones={n.id: n.zone for n in nodes})
    assert JobLayout.from_json(layout.to_json()) == layout
