"""``plan_transfers(old, new, holders)``: how each node of the new layout gets the state it must hold.

A node at stage ``s`` must hold the parameters and optimizer state of every layer of stage ``s`` and
of stage ``(s + 1) mod P`` (its replica). Under the old layout a live node holds the same for its old
stage: it is an owner, the shadow of the next stage, and a data-parallel peer of every node at its old
stage (replica sync keeps all those copies exact: docs/architecture.md, "A step"). So:

- a node fetches only the layers it does not already hold, which minimises the bytes moved: a layer a
  node holds never moves, and a layer it lacks must arrive at least once;
- each missing layer comes from a surviving holder, never from a dead node; among holders the planner
  prefers one already sending to that node (fewer, larger messages), then the least loaded, then the
  smallest id;
- the transfers run in rounds; in a round a node sends at most one transfer and receives at most one,
  and the number of rounds is the minimum (the most transfers any one node sends or receives);
- when some layer has no surviving copy anywhere, the plan is "restore from checkpoint" (no transfers,
  since checkpointed and live state must not be mixed) and names the new stages that force it.

The naive plan it is compared with moves every layer every new owner needs, as if nothing were reused.
"""

from __future__ import annotations

import json
from collections import defaultdict
from collections.abc import Collection, Iterable, Mapping
from typing import Any

import attrs
from bamboo.reconfig.model import Layout, StageSlot


def _to_layers(value: Iterable[int]) -> tuple[int, ...]:
    return tuple(int(layer) for layer in value)


@attrs.frozen
class Transfer:
    """One message: ``source`` sends the state of ``layers`` to ``destination``."""

    source: str = attrs.field(validator=attrs.validators.instance_of(str))
    destination: str = attrs.field(validator=attrs.validators.instance_of(str))
    layers: tuple[int, ...] = attrs.field(converter=_to_layers)
    bytes: int = attrs.field(validator=attrs.validators.instance_of(int))

    def __attrs_post_init__(self) -> None:
        if self.source == self.destination:
            raise ValueError(f"a transfer from {self.source!r} to itself moves nothing: layers {list(self.layers)}")
        if not self.layers:
            raise ValueError(f"the transfer {self.source!r} -> {self.destination!r} carries no layer")

    def __str__(self) -> str:
        return f"{self.source} -> {self.destination}: layers {_ranges(self.layers)} ({self.bytes} B)"

    def to_dict(self) -> dict[str, Any]:
        return {"source": self.source, "destination": self.destination, "layers": list(self.layers),
                "bytes": self.bytes}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Transfer:
        return cls(source=data["source"], destination=data["destination"], layers=data["layers"],
                   bytes=data["bytes"])


def _to_rounds(value: Iterable[Iterable[Transfer]]) -> tuple[tuple[Transfer, ...], ...]:
    return tuple(tuple(round_) for round_ in value)


@attrs.frozen
class TransferPlan:
    """The rounds of transfers, the bytes moved against the naive plan, or "restore from checkpoint"."""

    rounds: tuple[tuple[Transfer, ...], ...] = attrs.field(converter=_to_rounds)
    bytes_moved: int = attrs.field()
    naive_bytes: int = attrs.field()
    restore_from_checkpoint: bool = attrs.field(default=False)
    stages_without_copy: tuple[int, ...] = attrs.field(converter=_to_layers, default=())
    layers_without_copy: tuple[int, ...] = attrs.field(converter=_to_layers, default=())

    def __attrs_post_init__(self) -> None:
        total = sum(transfer.bytes for transfer in self.transfers)
        if total != self.bytes_moved:
            raise ValueError(f"bytes_moved is {self.bytes_moved} but the transfers move {total}")
        if self.restore_from_checkpoint and (self.rounds or not self.stages_without_copy):
            raise ValueError(
                f"a restore-from-checkpoint plan has no transfers and names the stages that force it; got "
                f"{len(self.rounds)} round(s) and stages {list(self.stages_without_copy)}"
            )
        for index, round_ in enumerate(self.rounds):
            for role in ("source", "destination"):
                seen = [getattr(transfer, role) for transfer in round_]
                twice = sorted({node for node in seen if seen.count(node) > 1})
                if twice:
                    raise ValueError(f"round {index}: node(s) {', '.join(twice)} appear as {role} more than once")

    @property
    def transfers(self) -> tuple[Transfer, ...]:
        return tuple(transfer for round_ in self.rounds for transfer in round_)

    @property
    def bytes_saved(self) -> int:
        return self.naive_bytes - self.bytes_moved

    def to_dict(self) -> dict[str, Any]:
        return {
            "rounds": [[transfer.to_dict() for transfer in round_] for round_ in self.rounds],
            "bytes_moved": self.bytes_moved,
            "naive_bytes": self.naive_bytes,
            "restore_from_checkpoint": self.restore_from_checkpoint,
            "stages_without_copy": list(self.stages_without_copy),
            "layers_without_copy": list(self.layers_without_copy),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransferPlan:
        return cls(
            rounds=[[Transfer.from_dict(item) for item in round_] for round_ in data["rounds"]],
            bytes_moved=data["bytes_moved"],
            naive_bytes=data["naive_bytes"],
            restore_from_checkpoint=data.get("restore_from_checkpoint", False),
            stages_without_copy=data.get("stages_without_copy", ()),
            layers_without_copy=data.get("layers_without_copy", ()),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> TransferPlan:
        return cls.from_dict(json.loads(text))


def holdings_from_layout(layout: Layout, survivors: Iterable[str]) -> dict[str, frozenset[int]]:
    """Layers whose state each surviving node holds under ``layout`` (its stage and its replica)."""
    alive = set(survivors)
    return {node: layout.layers_held_at(slot.stage) for node, slot in layout.slots().items() if node in alive}


def plan_transfers(
    old: Layout, new: Layout, holders: Collection[str] | Mapping[str, Iterable[int]], replicas: bool = True
) -> TransferPlan:
    """The transfer plan from ``old`` to ``new``.

    ``holders`` is either the ids of the surviving nodes (what each holds follows from ``old``), or a
    mapping from each surviving node to the layers it holds. Every node of ``new`` must be a survivor.
    ``replicas``: whether each owner of ``new`` also holds its successor's replica (False: a generation
    without redundancy, whose owners hold their own stage only).
    """
    if old.layers != new.layers:
        raise ValueError(
            f"the old layout's {old.num_layers} layers differ from the new layout's {new.num_layers}; "
            "transfers are planned for one model"
        )
    if isinstance(holders, Mapping):
        held = {node: frozenset(int(layer) for layer in layers) for node, layers in holders.items()}
    else:
        held = holdings_from_layout(old, holders)
    survivors = set(holders)
    new_slots = new.slots()
    dead_in_new = sorted(node for node in new_slots if node not in survivors)
    if dead_in_new:
        marks = [new_slots[node] for node in dead_in_new]
        raise ValueError(f"the new layout places node(s) {', '.join(dead_in_new)} that are not survivors "
                         f"(marked *):\n" + new.format_grid(marks))

    layer_bytes = [layer.state_bytes for layer in new.layers]
    needs: list[tuple[StageSlot, str, list[int]]] = []
    naive = 0
    for node, slot in sorted(new_slots.items(), key=lambda item: (item[1].pipeline, item[1].stage)):
        needed = new.layers_held_at(slot.stage) if replicas else frozenset(new.stage_layer_range(slot.stage))
        naive += sum(layer_bytes[layer] for layer in needed)
        missing = sorted(needed - held.get(node, frozenset()))
        if missing:
            needs.append((slot, node, missing))

    sources_of: dict[int, list[str]] = defaultdict(list)
    for node in sorted(held):
        for layer in held[node]:
            sources_of[layer].append(node)
    orphaned = sorted({layer for _slot, _node, missing in needs for layer in missing if not sources_of[layer]})
    if orphaned:
        stages = sorted({new.stage_of_layer(layer) for layer in orphaned})
        return TransferPlan(rounds=(), bytes_moved=0, naive_bytes=naive, restore_from_checkpoint=True,
                            stages_without_copy=stages, layers_without_copy=orphaned)

    sent_bytes: dict[str, int] = defaultdict(int)
    messages: dict[tuple[str, str], list[int]] = {}
    for _slot, node, missing in needs:
        chosen: list[str] = []
        for layer in missing:
            candidates = sources_of[layer]
            reuse = [source for source in chosen if source in candidates]
            if reuse:
                source = reuse[0]
            else:
                source = min(candidates, key=lambda candidate: (sent_bytes[candidate], candidate))
                chosen.append(source)
            sent_bytes[source] += layer_bytes[layer]
            messages.setdefault((source, node), []).append(layer)
    transfers = [
        Transfer(source, destination, layers, sum(layer_bytes[layer] for layer in layers))
        for (source, destination), layers in messages.items()
    ]
    rounds = schedule_rounds(transfers)
    return TransferPlan(rounds=rounds, bytes_moved=sum(t.bytes for t in transfers), naive_bytes=naive)


def schedule_rounds(transfers: Iterable[Transfer]) -> list[list[Transfer]]:
    """The fewest rounds in which no node sends more than one transfer or receives more than one.

    Senders and receivers form a bipartite multigraph, so by König's theorem its edges can be coloured
    with as many colours as the largest degree (``minimum_rounds``): each colour is a round. Each edge
    takes a colour free at both ends, after swapping two colours along an alternating path when needed.
    Transfers are coloured largest first, so that the first rounds carry the big ones.
    """
    ordered = sorted(transfers, key=lambda t: (-t.bytes, t.source, t.destination))
    colours = minimum_rounds(ordered)
    ends = [(("send", t.source), ("receive", t.destination)) for t in ordered]
    colour_of: list[int] = [-1] * len(ordered)
    edge_at: dict[tuple[str, str], dict[int, int]] = defaultdict(dict)
    for edge, (sender, receiver) in enumerate(ends):
        free_at_sender = next(c for c in range(colours) if c not in edge_at[sender])
        free_at_receiver = next(c for c in range(colours) if c not in edge_at[receiver])
        a, b = free_at_sender, free_at_receiver
        if a in edge_at[receiver]:
            # Swap a and b along the path that leaves the receiver on colour a; in a bipartite graph it
            # never reaches the sender, and afterwards a is free at both ends.
            path: list[int] = []
            vertex, colour = receiver, a
            while colour in edge_at[vertex]:
                step = edge_at[vertex][colour]
                path.append(step)
                first, second = ends[step]
                vertex = second if vertex == first else first
                colour = b if colour == a else a
            for step in path:
                for end in ends[step]:
                    del edge_at[end][colour_of[step]]
            for step in path:
                colour_of[step] = b if colour_of[step] == a else a
                for end in ends[step]:
                    edge_at[end][colour_of[step]] = step
        colour_of[edge] = a
        edge_at[sender][a] = edge
        edge_at[receiver][a] = edge
    rounds: list[list[Transfer]] = [[] for _ in range(colours)]
    for edge, transfer in enumerate(ordered):
        rounds[colour_of[edge]].append(transfer)
    return [sorted(round_, key=lambda t: (t.source, t.destination)) for round_ in rounds if round_]


def minimum_rounds(transfers: Iterable[Transfer]) -> int:
    """A lower bound on the rounds: the most transfers any node sends, or receives."""
    sends: dict[str, int] = defaultdict(int)
    receives: dict[str, int] = defaultdict(int)
    for transfer in transfers:
        sends[transfer.source] += 1
        receives[transfer.destination] += 1
    return max([*sends.values(), *receives.values(), 0])


def _ranges(layers: Iterable[int]) -> str:
    """``0-3,7`` for layers 0, 1, 2, 3 and 7."""
    parts: list[str] = []
    run: list[int] = []
    for layer in sorted(layers):
        if run and layer == run[-1] + 1:
            run.append(layer)
            continue
        if run:
            parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
        run = [layer]
    if run:
        parts.append(f"{run[0]}-{run[-1]}" if len(run) > 1 else str(run[0]))
    return ",".join(parts)
