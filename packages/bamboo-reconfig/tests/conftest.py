"""Shared builders and hypothesis strategies for the bamboo-reconfig tests (exposed as fixtures)."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import attrs
import pytest
from bamboo.reconfig import ClusterView, LayerSpec, Layout, Node, NodeState, plan_layout
from hypothesis import strategies as st


def uniform_layers(count: int, param_bytes: int = 100, optimizer_bytes: int = 200) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(param_bytes, optimizer_bytes, 1.0) for _ in range(count))


def zoned_nodes(count: int, zones: str = "abc", state: str = "active", prefix: str = "n") -> list[Node]:
    """``count`` nodes dealt round-robin over ``zones``."""
    return [Node(f"{prefix}{i:03d}", zones[i % len(zones)], state) for i in range(count)]


def with_states(nodes: Iterable[Node], states: dict[str, str]) -> list[Node]:
    """The nodes with some states changed."""
    return [attrs.evolve(node, state=NodeState(states[node.id])) if node.id in states else node for node in nodes]


def view_after(layout: Layout, nodes: Iterable[Node], **overrides: object) -> ClusterView:
    """A view of ``nodes`` whose current layout is ``layout`` (targets from the layout unless overridden)."""
    fields: dict[str, object] = {
        "nodes": list(nodes),
        "target_stages": layout.stages,
        "target_pipelines": max(1, layout.num_pipelines),
        "global_batch": max(1, layout.global_batch),
        "layers": layout.layers,
        "layout": layout,
    }
    fields.update(overrides)
    return ClusterView(**fields)  # type: ignore[arg-type]


@attrs.frozen
class Builders:
    uniform_layers: Callable[..., tuple[LayerSpec, ...]] = uniform_layers
    zoned_nodes: Callable[..., list[Node]] = zoned_nodes
    with_states: Callable[..., list[Node]] = with_states
    view_after: Callable[..., ClusterView] = view_after


@pytest.fixture(scope="session")
def build() -> Builders:
    return Builders()


@st.composite
def _layers(draw: st.DrawFn, min_size: int = 2, max_size: int = 10) -> tuple[LayerSpec, ...]:
    spec = st.builds(LayerSpec, st.integers(0, 50), st.integers(0, 100), st.integers(0, 20).map(float))
    return tuple(draw(st.lists(spec, min_size=min_size, max_size=max_size)))


@st.composite
def _scenario(draw: st.DrawFn) -> tuple[ClusterView, ClusterView]:
    """A first view (no layout), then a view after its layout lost, gained and churned some nodes."""
    layers = draw(_layers(min_size=2, max_size=8))
    stages = draw(st.integers(2, min(5, len(layers))))
    pipelines = draw(st.integers(1, 4))
    zones = draw(st.sampled_from(["a", "ab", "abc", "abcd"]))
    count = draw(st.integers(0, 18))
    nodes = [Node(f"n{i:02d}", draw(st.sampled_from(zones)), draw(st.sampled_from(["active", "standby", "joining"])))
             for i in range(count)]
    batch = draw(st.integers(1, 24))
    first = ClusterView(nodes=nodes, target_stages=stages, target_pipelines=pipelines, global_batch=batch,
                        layers=layers)
    layout = plan_layout(first)
    in_layout = {node for row in layout.owners for node in row}
    changed: list[Node] = []
    for node in nodes:
        state = "active" if node.id in in_layout else "standby"
        if draw(st.booleans()) and draw(st.booleans()):
            state = "preempted"
        changed.append(attrs.evolve(node, state=NodeState(state)))
    joiners = draw(st.integers(0, 6))
    changed += [Node(f"j{i:02d}", draw(st.sampled_from(zones)), "joining") for i in range(joiners)]
    second = ClusterView(nodes=changed, target_stages=stages, target_pipelines=draw(st.integers(1, 4)),
                         global_batch=batch, layers=layers, layout=layout)
    return first, second


@attrs.frozen
class Strategies:
    layers: Callable[..., st.SearchStrategy[tuple[LayerSpec, ...]]] = _layers
    scenario: Callable[[], st.SearchStrategy[tuple[ClusterView, ClusterView]]] = _scenario


@pytest.fixture(scope="session")
def strategies() -> Strategies:
    return Strategies()
