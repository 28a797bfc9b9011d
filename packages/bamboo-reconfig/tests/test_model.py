"""Value classes: validation messages that name the offending values, and grids with the error marked."""

from __future__ import annotations

import pytest
from bamboo.reconfig import ClusterView, LayerSpec, Layout, LayoutError, Node, StageSlot, parse_nodes


def small_layout(**overrides) -> Layout:
    fields = {
        "stages": 2,
        "layers": [LayerSpec(1, 2, 1.0)] * 4,
        "stage_layers": [(0, 2), (2, 4)],
        "owners": [["a", "b"], ["c", "d"]],
        "microbatches": [2, 2],
        "standby": ["e"],
    }
    fields.update(overrides)
    return Layout(**fields)


def test_shadow_follows_the_convention() -> None:
    layout = small_layout(stages=3, stage_layers=[(0, 1), (1, 2), (2, 4)], owners=[["a", "b", "c"]],
                          microbatches=[4])
    assert [layout.shadow(0, s) for s in range(3)] == ["c", "a", "b"]
    assert layout.layers_held_at(2) == frozenset({2, 3, 0})


def test_a_node_with_two_roles_prints_the_grid_with_it_marked() -> None:
    with pytest.raises(LayoutError) as error:
        small_layout(owners=[["a", "b"], ["c", "a"]])
    message = str(error.value)
    assert message.startswith("node(s) a hold more than one role")
    assert "*a" in message and "pipeline 1" in message
    with pytest.raises(LayoutError, match="node\\(s\\) e hold more than one role"):
        small_layout(owners=[["a", "b"], ["c", "e"]])


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"stage_layers": [(0, 1), (2, 4)]}, "stage 1 has layers \\[2, 4\\)"),
        ({"stage_layers": [(0, 2), (2, 3)]}, "end at layer 3 but the model has 4"),
        ({"microbatches": [2, 0]}, "pipeline 1 has microbatch share 0"),
        ({"microbatches": [4]}, "1 microbatch shares for 2 pipelines"),
        ({"owners": [["a", "b"], ["c"]]}, "pipeline 1 has 1 owners for 2 stages"),
    ],
)
def test_layout_validation_names_the_bad_value(overrides, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        small_layout(**overrides)


def test_a_one_stage_layout_is_pure_data_parallelism() -> None:
    layout = small_layout(stages=1, stage_layers=[(0, 4)], owners=[["a"], ["c"]])
    assert (layout.num_pipelines, layout.global_batch) == (2, 4)
    assert Layout.from_dict(layout.to_dict()) == layout


def test_layout_json_lists_owners_and_reads_the_older_per_stage_form() -> None:
    layout = small_layout()
    data = layout.to_dict()
    assert data["pipelines"][1] == {"microbatches": 2, "owners": ["c", "d"]}  # the shadow of c is d: not written
    data["pipelines"][1] = {"microbatches": 2, "stages": [{"stage": 1, "owner": "d", "shadow": "c"},
                                                          {"stage": 0, "owner": "c", "shadow": "d"}]}
    assert Layout.from_dict(data) == layout
    data["pipelines"][1]["stages"][1]["shadow"] = "c"
    with pytest.raises(LayoutError, match="shadow 'c' breaks the convention"):
        Layout.from_dict(data)
    data["pipelines"][1] = {"microbatches": 2, "owners": "cd"}
    with pytest.raises(LayoutError, match="pipeline 1: owners must be a list of node ids, got 'cd'"):
        Layout.from_dict(data)


def test_nodes_and_views_reject_bad_input() -> None:
    with pytest.raises(ValueError, match="unknown node state 'sleeping'"):
        Node("a", "z", "sleeping")
    with pytest.raises(ValueError, match="duplicate node id\\(s\\): a"):
        parse_nodes([{"id": "a", "zone": "z", "state": "active"}, {"id": "a", "zone": "y", "state": "standby"}])
    with pytest.raises(ValueError, match="missing key\\(s\\) zone"):
        parse_nodes([{"id": "a", "state": "active"}])
    layers = [LayerSpec(1, 1, 1.0)] * 3
    with pytest.raises(ValueError, match="P=4 is larger than the layer count 3"):
        ClusterView(nodes=[], target_stages=4, target_pipelines=1, global_batch=1, layers=layers)
    with pytest.raises(ValueError, match=r"'compute_cost' must be >= 0: -1\.0"):
        LayerSpec(1, 1, -1.0)


def test_view_checks_the_layout_against_the_nodes() -> None:
    layout = small_layout()
    nodes = [Node(name, "z", "active") for name in "abcd"] + [Node("e", "z", "standby")]
    ClusterView(nodes=nodes, target_stages=2, target_pipelines=2, global_batch=4, layers=layout.layers, layout=layout)
    with pytest.raises(LayoutError, match="owner 'd' of p1s1 is not among the nodes"):
        ClusterView(nodes=nodes[:3], target_stages=2, target_pipelines=2, global_batch=4, layers=layout.layers,
                    layout=layout)
    joining = [*nodes[:3], Node("d", "z", "joining")]
    with pytest.raises(LayoutError, match="owner 'd' of p1s1 is joining"):
        ClusterView(nodes=joining, target_stages=2, target_pipelines=2, global_batch=4, layers=layout.layers,
                    layout=layout)
    wrong_role = [*nodes[:3], Node("d", "z", "active", StageSlot(0, 1))]
    with pytest.raises(LayoutError, match="says its role is p0s1 but the layout puts it at p1s1"):
        ClusterView(nodes=wrong_role, target_stages=2, target_pipelines=2, global_batch=4, layers=layout.layers,
                    layout=layout)
