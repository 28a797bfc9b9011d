"""Tied weights: one weight used by several layers, often in different stages (input and output embeddings).

A layer spec ties one of its parameters to the same parameter of other layers the way DeepSpeed's
``TiedLayerSpec`` does it: a ``key`` shared by every layer of the tie, and ``tied_weight_attr``, the
parameter's name in the layer (a dotted path, or a list of them). Every layer keeps a copy of the weight
(a stage holds only its own layers); the copies start equal (they are built from the same source) and
stay equal because every copy takes the same step with the *sum* of the copies' gradients, which is the
gradient of the one shared weight:

- in one process (the references, P = 1) the copies of a slice are summed in layer order
  (:func:`local_sums`);
- in a pipeline each node adds up the copies it holds in the stages it runs (:func:`contribution`), and
  the commit all-reduces those contributions over the pipeline before it steps (zeros from a node that
  holds none), so every node of the pipeline ends with the same sums; each copy, its replica on the
  shadow and a stage taken over after a failover then step with them. For a weight tied between two
  layers (the usual pair of embeddings) this is the reference's sum bit for bit: adding zeros changes
  nothing, and two numbers add the same in either order.

The global gradient norm counts a tied weight once, from its sum (:func:`squared_norm`), as
``torch.nn.utils.clip_grad_norm_`` does for the one shared parameter of an untied model.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs
import torch
from bamboo.rc.model import inspect_layer
from torch import nn

__all__ = ["TiedWeights", "local_sums", "model_ties", "slice_ties", "squared_norm", "tied_weights"]

Ties = dict[str, list[tuple[int, str]]]
"""Tie key -> the (layer index, parameter name) of every copy, in layer order."""


def model_ties(specs: Sequence[Any]) -> Ties:
    """The ties of a model from its layer specs' ``key`` and ``tied_weight_attr`` (DeepSpeed's names): the
    ``i``-th parameter named by every layer of a key are one tied weight, under the key (``"<key>.<i>"`` when
    the layers name several). The copies may have different names in different layers (an embedding's
    ``tokens.weight``, a head's ``out.weight``).

    A key that only one layer has ties nothing and is left out; layers of one key that name different
    numbers of parameters are a ValueError.
    """
    named: dict[str, list[tuple[int, list[str]]]] = {}
    for index, spec in enumerate(specs):
        key = getattr(spec, "key", None)
        if key is not None:
            names = getattr(spec, "tied_weight_attr", "weight")
            named.setdefault(str(key), []).append((index, [names] if isinstance(names, str) else list(names)))
    ties: Ties = {}
    for key, layers in named.items():
        counts = {len(names) for _, names in layers}
        if len(counts) != 1:
            raise ValueError(f"the layers tied under key {key!r} name different numbers of parameters: "
                             + ", ".join(f"layer {index} {names}" for index, names in layers))
        if len(layers) < 2:
            continue
        for i in range(counts.pop()):
            ties[key if len(layers[0][1]) == 1 else f"{key}.{i}"] = [(index, names[i]) for index, names in layers]
    return ties


@attrs.frozen
class TiedWeights:
    """A model's ties (key -> the copies' layer indices and parameter names) and each tied weight's shape."""

    members: Ties = attrs.field(factory=dict)
    shapes: dict[str, torch.Size] = attrs.field(factory=dict)

    def __bool__(self) -> bool:
        return bool(self.members)

    def spans_stages(self, bounds: Sequence[Sequence[int]]) -> bool:
        """Whether some tie has copies in two stages of ``bounds`` (then the commit all-reduces the sums)."""
        stage_of = {index: s for s, (start, end) in enumerate(bounds) for index in range(start, end)}
        return any(len({stage_of[index] for index, _ in copies}) > 1 for copies in self.members.values())

    def contribution(self, held: Sequence[Mapping[str, list[nn.Parameter]]]) -> torch.Tensor:
        """This node's part of the commit's all-reduce of the tied gradients: for every tie key in sorted
        order, the sum of the copies it holds in ``held`` (its stages' :func:`slice_ties`, in stage order), or
        zeros."""
        pieces = []
        for key in sorted(self.members):
            grads = [grad for stage in held for grad in _grads(stage.get(key, []))]
            pieces.append(_sum(grads).reshape(-1) if grads else torch.zeros(self.shapes[key].numel()))
        return torch.cat(pieces) if pieces else torch.zeros(0)

    def split(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """The all-reduced :meth:`contribution` as tie key -> summed gradient."""
        sums = {}
        offset = 0
        for key in sorted(self.members):
            n = self.shapes[key].numel()
            sums[key] = flat[offset : offset + n].view(self.shapes[key])
            offset += n
        return sums


def tied_weights(specs: Sequence[Any]) -> TiedWeights:
    """The ties of ``specs`` with their shapes (each tied layer built to look at it,
    :func:`bamboo.rc.model.inspect_layer`); ValueError when the copies of a tie differ in shape."""
    members = model_ties(specs)
    shapes: dict[str, torch.Size] = {}
    for key, copies in members.items():
        found = {}
        for index, name in copies:
            module = inspect_layer(specs[index], index)
            found[(index, name)] = _parameter(module, index, name, key).shape
        if len(set(found.values())) != 1:
            raise ValueError(f"the copies of tied weight {key!r} differ in shape: "
                             + ", ".join(f"layer {i} {n}: {tuple(shape)}" for (i, n), shape in found.items()))
        shapes[key] = next(iter(found.values()))
    return TiedWeights(members, shapes)


def _parameter(module: nn.Module, index: int, name: str, key: str) -> nn.Parameter:
    try:
        return module.get_parameter(name)
    except AttributeError:
        raise ValueError(f"layer {index} ({type(module).__name__}) has no parameter {name!r} to tie under key "
                         f"{key!r}") from None


def slice_ties(ties: Ties, layers: nn.Sequential, indices: range) -> dict[str, list[nn.Parameter]]:
    """Tie key -> the copies of the tied weight that the layers ``indices`` (built as ``layers``) hold."""
    held: dict[str, list[nn.Parameter]] = {}
    for key, members in ties.items():
        for index, name in members:
            if index in indices:
                held.setdefault(key, []).append(_parameter(layers[index - indices.start], index, name, key))
    return held


def _grads(parameters: Iterable[nn.Parameter]) -> list[torch.Tensor]:
    grads = []
    for parameter in parameters:
        if parameter.grad is None:
            raise RuntimeError("a tied weight has no gradient at the end of the step")
        grads.append(parameter.grad)
    return grads


def _sum(grads: list[torch.Tensor]) -> torch.Tensor:
    total = grads[0].clone()
    for grad in grads[1:]:
        total.add_(grad)
    return total


def local_sums(held: Mapping[str, list[nn.Parameter]]) -> dict[str, torch.Tensor]:
    """Tie key -> the sum of the gradients of the copies held, added in layer order."""
    return {key: _sum(_grads(parameters)) for key, parameters in sorted(held.items())}


def squared_norm(sums: Mapping[str, torch.Tensor]) -> float:
    """The squared norm of the tied gradients, each counted once, in float64 (keys in sorted order)."""
    total = torch.zeros((), dtype=torch.float64)
    for key in sorted(sums):
        total += sums[key].double().pow(2).sum()
    return float(total)
