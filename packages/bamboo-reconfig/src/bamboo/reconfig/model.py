"""The value classes that reconfiguration reads and writes: nodes, layers, layouts and the cluster view.

Every class here is frozen and validated on construction; a validation message names the offending
value. Every class has a stable JSON round trip (``to_dict``/``from_dict`` and ``to_json``/``from_json``),
because the launcher writes the first decision into etcd as JSON and every other node reads it back.

Layout convention (docs/architecture.md, "A step"): the node at stage ``s`` of a pipeline also holds the replica
of stage ``(s + 1) mod P``. So the *shadow* of stage ``s`` is the node at stage ``(s - 1) mod P`` of the
same pipeline, and a node holds the state (parameters and optimizer state) of two stages.

With one stage (P = 1, pure data parallelism) every node holds the whole model and the redundant copy
of a node's work is the next pipeline's node (the runtime's shadow ring, ``bamboo.rc.ring``), so
``Layout.shadow`` names the node itself and ``decide`` judges losses over the ring of pipelines.
"""

from __future__ import annotations

import enum
import json
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs


class NodeState(enum.Enum):
    """Where a node stands in the job, as membership reports it."""

    ACTIVE = "active"
    STANDBY = "standby"
    JOINING = "joining"
    PREEMPTED = "preempted"

    @property
    def alive(self) -> bool:
        """Whether the node can still send, receive and compute."""
        return self is not NodeState.PREEMPTED

    @classmethod
    def parse(cls, text: object) -> NodeState:
        """The state named ``text``; a clear error names the bad value and the accepted ones."""
        if isinstance(text, NodeState):
            return text
        try:
            return cls(text)
        except ValueError:
            accepted = ", ".join(state.value for state in cls)
            raise ValueError(f"unknown node state {text!r} (expected one of: {accepted})") from None


_V = attrs.validators
_NON_NEGATIVE_INT = _V.and_(_V.instance_of(int), _V.ge(0))
_POSITIVE_INT = _V.and_(_V.instance_of(int), _V.ge(1))


def _non_empty_str(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty string, got {value!r}")


def _require_keys(data: Mapping[str, Any], keys: Iterable[str], what: str) -> None:
    if not isinstance(data, Mapping):
        raise ValueError(f"{what} must be a JSON object, got {data!r}")
    missing = [key for key in keys if key not in data]
    if missing:
        raise ValueError(f"{what} is missing key(s) {', '.join(missing)}: {dict(data)!r}")


@attrs.frozen
class StageSlot:
    """One cell of the layout grid: stage ``stage`` of pipeline ``pipeline``."""

    pipeline: int = attrs.field(validator=_NON_NEGATIVE_INT)
    stage: int = attrs.field(validator=_NON_NEGATIVE_INT)

    def __str__(self) -> str:
        return f"p{self.pipeline}s{self.stage}"

    def to_dict(self) -> dict[str, int]:
        return {"pipeline": self.pipeline, "stage": self.stage}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> StageSlot:
        _require_keys(data, ("pipeline", "stage"), "a role")
        return cls(pipeline=data["pipeline"], stage=data["stage"])


@attrs.frozen
class Node:
    """A machine of the job: its id, its zone, its state and, where it has one, the stage it owns."""

    id: str = attrs.field(validator=_non_empty_str)
    zone: str = attrs.field(validator=_non_empty_str)
    state: NodeState = attrs.field(converter=NodeState.parse)
    role: StageSlot | None = attrs.field(default=None)

    @role.validator
    def _check_role(self, _attribute: attrs.Attribute, value: object) -> None:
        if value is not None and not isinstance(value, StageSlot):
            raise ValueError(f"node {self.id!r}: role must be a StageSlot or None, got {value!r}")

    def to_dict(self) -> dict[str, Any]:
        data: dict[str, Any] = {"id": self.id, "zone": self.zone, "state": self.state.value}
        if self.role is not None:
            data["role"] = self.role.to_dict()
        return data

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Node:
        _require_keys(data, ("id", "zone", "state"), "a node")
        role = data.get("role")
        return cls(
            id=data["id"],
            zone=data["zone"],
            state=data["state"],
            role=None if role is None else StageSlot.from_dict(role),
        )


_NON_NEGATIVE_NUMBER = _V.and_(_V.instance_of((int, float)), _V.ge(0), _V.lt(float("inf")))


@attrs.frozen
class LayerSpec:
    """One layer of the model: the bytes of its parameters and optimizer state, and its compute cost."""

    param_bytes: int = attrs.field(validator=_NON_NEGATIVE_INT)
    optimizer_bytes: int = attrs.field(validator=_NON_NEGATIVE_INT)
    compute_cost: float = attrs.field(validator=_NON_NEGATIVE_NUMBER)

    @property
    def state_bytes(self) -> int:
        """Bytes a node must hold (and a transfer must move) for this layer."""
        return self.param_bytes + self.optimizer_bytes

    def to_dict(self) -> dict[str, Any]:
        return {
            "param_bytes": self.param_bytes,
            "optimizer_bytes": self.optimizer_bytes,
            "compute_cost": self.compute_cost,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> LayerSpec:
        _require_keys(data, ("param_bytes", "optimizer_bytes", "compute_cost"), "a layer")
        return cls(
            param_bytes=data["param_bytes"],
            optimizer_bytes=data["optimizer_bytes"],
            compute_cost=data["compute_cost"],
        )


def _to_layers(value: Iterable[LayerSpec]) -> tuple[LayerSpec, ...]:
    return tuple(value)


def _to_rows(value: Iterable[Iterable[str]]) -> tuple[tuple[str, ...], ...]:
    return tuple(tuple(row) for row in value)


def _to_bounds(value: Iterable[Iterable[int]]) -> tuple[tuple[int, int], ...]:
    return tuple((int(start), int(end)) for start, end in value)


class LayoutError(ValueError):
    """A layout breaks an invariant; the message prints the whole grid with the bad cells marked."""


def _owners_of_cells(pipeline: int, cells: Iterable[Mapping[str, Any]], stages: int) -> list[str]:
    """A pipeline's owners from its per-stage cells (``{"stage", "owner", "shadow"}``), the layout's form before
    version 2 of the job layout; a shadow that is not the owner of the stage before it is refused."""
    ordered = sorted(cells, key=lambda cell: cell["stage"])
    if [cell["stage"] for cell in ordered] != list(range(len(ordered))):
        raise LayoutError(f"pipeline {pipeline} lists stages {[c['stage'] for c in ordered]}; "
                          f"expected 0..{len(ordered) - 1}")
    row = [cell["owner"] for cell in ordered]
    for s, cell in enumerate(ordered):
        if "shadow" in cell and len(row) == stages and cell["shadow"] != row[(s - 1) % stages]:
            raise LayoutError(
                f"pipeline {pipeline} stage {s}: shadow {cell['shadow']!r} breaks the convention that the shadow "
                f"is the owner of stage {(s - 1) % stages} ({row[(s - 1) % stages]!r})"
            )
    return row


@attrs.frozen
class Layout:
    """D pipelines of P stages: who owns each stage, the layer split, microbatches and the standby queue.

    ``owners[d][s]`` is the node that owns stage ``s`` of pipeline ``d``; its shadow is
    ``owners[d][(s - 1) % P]`` (see the module docstring). ``stage_layers[s]`` is the half-open range of
    layer indices of stage ``s``. ``microbatches[d]`` is pipeline ``d``'s share of the global batch.
    ``same_zone_neighbours`` counts the pairs of consecutive stages (last to first included) whose owners
    share a zone; with one stage (P = 1) it counts the consecutive pipelines (last to first included) whose
    nodes share a zone, the shadow ring of pure data parallelism. A layout may have no pipeline at all (too few usable nodes); everyone then waits in
    ``standby``.
    """

    stages: int = attrs.field(validator=_POSITIVE_INT)
    layers: tuple[LayerSpec, ...] = attrs.field(converter=_to_layers)
    stage_layers: tuple[tuple[int, int], ...] = attrs.field(converter=_to_bounds)
    owners: tuple[tuple[str, ...], ...] = attrs.field(converter=_to_rows)
    microbatches: tuple[int, ...] = attrs.field(converter=tuple)
    standby: tuple[str, ...] = attrs.field(converter=tuple, default=())
    same_zone_neighbours: int = attrs.field(validator=_NON_NEGATIVE_INT, default=0)

    def __attrs_post_init__(self) -> None:
        if len(self.layers) < self.stages:
            raise LayoutError(f"{self.stages} stages need at least {self.stages} layers, got {len(self.layers)}")
        if len(self.stage_layers) != self.stages:
            raise LayoutError(f"stage_layers has {len(self.stage_layers)} ranges for {self.stages} stages")
        expected_start = 0
        for stage, (start, end) in enumerate(self.stage_layers):
            if start != expected_start or end <= start:
                raise LayoutError(
                    f"stage {stage} has layers [{start}, {end}); stages must be non-empty and contiguous "
                    f"from layer 0 (expected it to start at {expected_start}): {list(self.stage_layers)}"
                )
            expected_start = end
        if expected_start != len(self.layers):
            raise LayoutError(f"stage_layers end at layer {expected_start} but the model has {len(self.layers)} layers")
        for pipeline, row in enumerate(self.owners):
            if len(row) != self.stages:
                raise LayoutError(f"pipeline {pipeline} has {len(row)} owners for {self.stages} stages: {list(row)}")
            for node in row:
                if not isinstance(node, str) or not node:
                    raise LayoutError(f"pipeline {pipeline} has an owner that is not a node id: {node!r}")
        if len(self.microbatches) != len(self.owners):
            raise LayoutError(
                f"{len(self.microbatches)} microbatch shares for {len(self.owners)} pipelines: {list(self.microbatches)}"
            )
        for pipeline, share in enumerate(self.microbatches):
            if not isinstance(share, int) or isinstance(share, bool) or share < 1:
                raise LayoutError(f"pipeline {pipeline} has microbatch share {share!r}; each must be a positive integer")
        counts = Counter(node for row in self.owners for node in row)
        counts.update(self.standby)
        duplicates = sorted(node for node, count in counts.items() if count > 1)
        if duplicates:
            marks = {
                StageSlot(pipeline, stage)
                for pipeline, row in enumerate(self.owners)
                for stage, node in enumerate(row)
                if node in duplicates
            }
            raise LayoutError(
                f"node(s) {', '.join(duplicates)} hold more than one role (marked *):\n" + self.format_grid(marks)
            )

    # ---- queries -------------------------------------------------------------------------------------

    @property
    def num_pipelines(self) -> int:
        return len(self.owners)

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def global_batch(self) -> int:
        return sum(self.microbatches)

    def owner(self, pipeline: int, stage: int) -> str:
        return self.owners[pipeline][stage]

    def shadow(self, pipeline: int, stage: int) -> str:
        """The node that holds the replica of ``stage``: the owner of the previous stage, last to first."""
        return self.owners[pipeline][(stage - 1) % self.stages]

    def slots(self) -> dict[str, StageSlot]:
        """Each owner's slot."""
        return {
            node: StageSlot(pipeline, stage)
            for pipeline, row in enumerate(self.owners)
            for stage, node in enumerate(row)
        }

    def stage_layer_range(self, stage: int) -> range:
        start, end = self.stage_layers[stage]
        return range(start, end)

    def layers_held_at(self, stage: int) -> frozenset[int]:
        """Layers whose state the owner of ``stage`` holds: its own stage and its successor's replica."""
        return frozenset(self.stage_layer_range(stage)) | frozenset(self.stage_layer_range((stage + 1) % self.stages))

    def stage_of_layer(self, layer: int) -> int:
        for stage, (start, end) in enumerate(self.stage_layers):
            if start <= layer < end:
                return stage
        raise ValueError(f"layer {layer} is outside the model's {self.num_layers} layers")

    def format_grid(self, marks: Iterable[StageSlot] = (), show_standby: bool = True) -> str:
        """The whole grid, one pipeline a row, with the cells in ``marks`` flagged by ``*``."""
        marked = set(marks)
        rows = [[("*" if StageSlot(d, s) in marked else " ") + node for s, node in enumerate(row)]
                for d, row in enumerate(self.owners)]
        header = [" stage " + str(s) for s in range(self.stages)]
        width = max([len(cell) for row in rows for cell in row] + [len(h) for h in header])
        lines = ["           " + "  ".join(h.ljust(width) for h in header)]
        for d, row in enumerate(rows):
            lines.append(f"pipeline {d:<2}" + "  ".join(cell.ljust(width) for cell in row))
        if not rows:
            lines.append("(no pipeline)")
        if show_standby:
            lines.append("standby: " + (", ".join(self.standby) if self.standby else "(none)"))
        return "\n".join(lines)

    # ---- JSON ----------------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        return {
            "stages": self.stages,
            "layers": [layer.to_dict() for layer in self.layers],
            "stage_layers": [list(bounds) for bounds in self.stage_layers],
            # each pipeline's owners in stage order: a shadow is the owner of the stage before it, so it is not
            # written (at 1,000 nodes an object per stage made 59 KB of the layout that every node reads; this, 15 KB)
            "pipelines": [{"microbatches": share, "owners": list(row)}
                          for share, row in zip(self.microbatches, self.owners, strict=True)],
            "standby": list(self.standby),
            "same_zone_neighbours": self.same_zone_neighbours,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        _require_keys(data, ("stages", "layers", "stage_layers", "pipelines"), "a layout")
        stages = data["stages"]
        owners: list[list[str]] = []
        microbatches: list[int] = []
        for d, pipeline in enumerate(data["pipelines"]):
            _require_keys(pipeline, ("microbatches",), f"pipeline {d}")
            if "owners" in pipeline:
                if not isinstance(pipeline["owners"], list):
                    raise LayoutError(f"pipeline {d}: owners must be a list of node ids, got {pipeline['owners']!r}")
                owners.append(list(pipeline["owners"]))
            else:  # the form written before version 2 of the job layout: one object per stage
                _require_keys(pipeline, ("stages",), f"pipeline {d}")
                owners.append(_owners_of_cells(d, pipeline["stages"], stages))
            microbatches.append(pipeline["microbatches"])
        return cls(
            stages=stages,
            layers=[LayerSpec.from_dict(layer) for layer in data["layers"]],
            stage_layers=data["stage_layers"],
            owners=owners,
            microbatches=microbatches,
            standby=data.get("standby", []),
            same_zone_neighbours=data.get("same_zone_neighbours", 0),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Layout:
        return cls.from_dict(json.loads(text))


def _to_sorted_nodes(value: Iterable[Node]) -> tuple[Node, ...]:
    return tuple(sorted(value, key=lambda node: node.id))


@attrs.frozen
class ClusterView:
    """Everything a node knows when it plans: the nodes, the current layout, the targets and the model.

    ``target_stages`` (P) and ``target_pipelines`` (D) are upper bounds. ``global_batch`` is in
    microbatches and stays the same across reconfigurations. ``node_memory_bytes``, when given, bounds the
    state one node holds (its stage plus its successor's replica). Nodes are kept sorted by id, so the
    order in which they were given never changes a result. An owner that was preempted stays in the view
    (state ``preempted``) until a new layout replaces the one that places it: that is how ``decide`` sees
    which stages are lost.
    """

    nodes: tuple[Node, ...] = attrs.field(converter=_to_sorted_nodes)
    target_stages: int = attrs.field(validator=_POSITIVE_INT)
    target_pipelines: int = attrs.field(validator=_POSITIVE_INT)
    global_batch: int = attrs.field(validator=_POSITIVE_INT)
    layers: tuple[LayerSpec, ...] = attrs.field(converter=_to_layers)
    layout: Layout | None = attrs.field(default=None)
    node_memory_bytes: int | None = attrs.field(default=None)
    even_shares: bool = attrs.field(default=False)
    """Whether every pipeline must run the same number of microbatches (for a trainer that cannot run uneven shares;
    bamboo's runtime can, and bamboo-launch leaves this off): then the number of pipelines divides the global batch
    (:func:`~bamboo.reconfig.layout_plan.pipeline_count`)."""

    def __attrs_post_init__(self) -> None:
        counts = Counter(node.id for node in self.nodes)
        duplicates = sorted(node for node, count in counts.items() if count > 1)
        if duplicates:
            raise ValueError(f"duplicate node id(s): {', '.join(duplicates)}")
        if not self.layers:
            raise ValueError("the model has no layers")
        if self.target_stages > len(self.layers):
            raise ValueError(f"P={self.target_stages} is larger than the layer count {len(self.layers)}")
        if self.node_memory_bytes is not None:
            _POSITIVE_INT(self, attrs.fields(ClusterView).node_memory_bytes, self.node_memory_bytes)
        if self.layout is not None:
            self._check_layout(self.layout)

    def _check_layout(self, layout: Layout) -> None:
        by_id = self.nodes_by_id
        if layout.layers != self.layers:
            raise ValueError(
                f"the current layout describes {layout.num_layers} layers that differ from the view's "
                f"{len(self.layers)} layers; plan with the same model"
            )
        slots = layout.slots()
        for node_id, slot in sorted(slots.items()):
            node = by_id.get(node_id)
            if node is None:
                raise LayoutError(f"owner {node_id!r} of {slot} is not among the nodes (marked *):\n"
                                  + layout.format_grid([slot]))
            if node.state not in (NodeState.ACTIVE, NodeState.PREEMPTED):
                raise LayoutError(
                    f"owner {node_id!r} of {slot} is {node.state.value}; an owner is active or preempted "
                    f"(marked *):\n" + layout.format_grid([slot])
                )
            if node.role is not None and node.role != slot:
                raise LayoutError(f"node {node_id!r} says its role is {node.role} but the layout puts it at {slot} "
                                  f"(marked *):\n" + layout.format_grid([slot]))
        for node in self.nodes:
            if node.role is not None and node.id not in slots:
                raise ValueError(f"node {node.id!r} says its role is {node.role} but the layout does not place it")

    @property
    def nodes_by_id(self) -> dict[str, Node]:
        return {node.id: node for node in self.nodes}

    @property
    def usable_nodes(self) -> tuple[Node, ...]:
        """Nodes that are alive (active, standby or joining), sorted by id."""
        return tuple(node for node in self.nodes if node.state.alive)

    def to_dict(self) -> dict[str, Any]:
        return {
            "nodes": [node.to_dict() for node in self.nodes],
            "target_stages": self.target_stages,
            "target_pipelines": self.target_pipelines,
            "global_batch": self.global_batch,
            "layers": [layer.to_dict() for layer in self.layers],
            "layout": None if self.layout is None else self.layout.to_dict(),
            "node_memory_bytes": self.node_memory_bytes,
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ClusterView:
        _require_keys(data, ("nodes", "target_stages", "target_pipelines", "global_batch", "layers"), "a cluster view")
        layout = data.get("layout")
        return cls(
            nodes=[Node.from_dict(node) for node in data["nodes"]],
            target_stages=data["target_stages"],
            target_pipelines=data["target_pipelines"],
            global_batch=data["global_batch"],
            layers=[LayerSpec.from_dict(layer) for layer in data["layers"]],
            layout=None if layout is None else Layout.from_dict(layout),
            node_memory_bytes=data.get("node_memory_bytes"),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> ClusterView:
        return cls.from_dict(json.loads(text))


def parse_nodes(entries: Sequence[Mapping[str, Any]]) -> tuple[Node, ...]:
    """Nodes from a NODES.json list of ``{"id", "zone", "state"}``; duplicate ids are an error."""
    if not isinstance(entries, Sequence) or isinstance(entries, (str, bytes)):
        raise ValueError(f"the node list must be a JSON list of objects, got {type(entries).__name__}")
    nodes = tuple(Node.from_dict(entry) for entry in entries)
    counts = Counter(node.id for node in nodes)
    duplicates = sorted(node for node, count in counts.items() if count > 1)
    if duplicates:
        raise ValueError(f"duplicate node id(s): {', '.join(duplicates)}")
    return nodes
