"""Layers and stages: the example model, the cost of each layer, and the split into stages.

The example model is a GPT-style byte-level decoder defined as DeepSpeed `LayerSpec`s: the layer
list is `[ByteEmbedding, DecoderBlock × n_layers, LMHead]`, with optional dropout
(:attr:`GPTSize.dropout`; its masks come from :mod:`bamboo.rc.rng`, so they are exact too).

Stages own contiguous layer ranges, the *stage bounds*. There is one split function for the
whole system, bamboo-reconfig's :func:`bamboo.reconfig.split_layers` (it balances compute and
honours node memory): :func:`stage_bounds` applies it to :func:`layer_costs`, and the runtime
builds exactly the bounds it is given (:func:`stage_slices`), so the plan in etcd is what runs.

Every layer is built under its own seed (:func:`build_layers`), so a stage, its replica on the
shadow and the single-process reference start from bit-identical weights whatever the split.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Sequence
from typing import Any, Protocol, cast

import torch
from bamboo.rc.gpt_size import VOCAB_SIZE, GPTSize, layer_cost
from bamboo.rc.rng import RNG_LOCK
from bamboo.reconfig import LayerSpec as LayerCost
from bamboo.reconfig import split_layers
from torch import nn
from torch.nn import functional
from torch.overrides import TorchFunctionMode

__all__ = [
    "ByteEmbedding",
    "DecoderBlock",
    "GPTSize",
    "LMHead",
    "LayerBuilder",
    "ModuleSpec",
    "build_layers",
    "check_stage_bounds",
    "gpt_layer_specs",
    "inspect_layer",
    "layer_costs",
    "lm_loss",
    "stage_bounds",
    "stage_slices",
]

StageBounds = tuple[tuple[int, int], ...]
"""Half-open layer ranges ``(start, end)``, one per stage, contiguous from layer 0 to the last."""

class ByteEmbedding(nn.Module):
    """Token (byte) plus learned position embedding: int64 [b, t] -> float [b, t, width]."""

    def __init__(self, width: int, sequence: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB_SIZE, width)
        self.positions = nn.Embedding(sequence, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.dropout(self.tokens(tokens) + self.positions(positions)[None])


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and MLP block: [b, t, width] -> [b, t, width]."""

    def __init__(self, width: int, heads: int, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.dropout = nn.Dropout(dropout)
        self.norm1 = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.norm2 = nn.LayerNorm(width)
        self.up = nn.Linear(width, 4 * width)
        self.down = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, w = x.shape
        q, k, v = self.qkv(self.norm1(x)).split(w, dim=2)
        q, k, v = (z.view(b, t, self.heads, w // self.heads).transpose(1, 2) for z in (q, k, v))
        scores = (q @ k.transpose(-2, -1)) / math.sqrt(w // self.heads)
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        attention = self.dropout(scores.masked_fill(mask, float("-inf")).softmax(dim=-1))
        y = (attention @ v).transpose(1, 2).reshape(b, t, w)
        x = x + self.dropout(self.proj(y))
        return x + self.dropout(self.down(functional.gelu(self.up(self.norm2(x)))))


class LMHead(nn.Module):
    """Final layer norm and projection to byte logits: [b, t, width] -> [b, t, 256]."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, VOCAB_SIZE)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def lm_loss(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross entropy (the `loss_fn` of the example PipelineModule)."""
    return functional.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


class ModuleSpec:
    """A layer to build: DeepSpeed's ``LayerSpec`` as bamboo's runtime uses it (a module class and its arguments,
    ``build()``), without importing DeepSpeed, which costs a process about a CPU-second; the layers, and so the
    weights, are the same. DeepSpeed's own ``PipelineModule`` wants its ``LayerSpec``: pass that to
    :func:`gpt_layer_specs` for it."""

    def __init__(self, typename: type[nn.Module], *module_args: object, **module_kwargs: object) -> None:
        self.typename = typename
        self.module_args = module_args
        self.module_kwargs = module_kwargs

    def build(self) -> nn.Module:
        return self.typename(*self.module_args, **self.module_kwargs)


class LayerBuilder(Protocol):
    """A layer spec as the runtime reads one: ``build()`` makes the layer's module (:class:`ModuleSpec`, DeepSpeed's
    ``LayerSpec``)."""

    def build(self) -> nn.Module: ...


def gpt_layer_specs(size: GPTSize, layer_spec: Callable[..., LayerBuilder] = ModuleSpec) -> list[LayerBuilder]:
    """The example decoder as a list of :class:`ModuleSpec` (or of ``layer_spec(module class, *args)``, any class
    with DeepSpeed's ``LayerSpec`` constructor and ``build()``, DeepSpeed's ``LayerSpec`` itself among them)."""
    return [
        layer_spec(ByteEmbedding, size.width, size.sequence, size.dropout),
        *(layer_spec(DecoderBlock, size.width, size.heads, size.dropout) for _ in range(size.layers)),
        layer_spec(LMHead, size.width),
    ]


def _layer_spec(spec: object, index: int) -> LayerBuilder:
    """Layer ``index``'s spec, checked: a DeepSpeed LayerSpec (anything with ``.build()``)."""
    if not callable(getattr(spec, "build", None)):
        raise TypeError(f"layer {index} is {type(spec).__name__}, not a LayerSpec with .build()")
    return cast(LayerBuilder, spec)


#: The in-place ops whose meta kernels import ``torch._dynamo`` (torch 2.13): the random fills, and ``erfinv_``,
#: which ``torch.nn.init.trunc_normal_`` applies. Each keeps its tensor's shape, dtype and strides.
_RANDOM_FILLS = frozenset({"normal_", "log_normal_", "exponential_", "cauchy_", "geometric_", "erfinv_"})


class _SkipRandomFillOnMeta(TorchFunctionMode):
    """Random fills of meta tensors (``normal_``, ``log_normal_``, ...) return the tensor untouched.

    A meta tensor has no values, so such a fill only returns it as it is; but torch's meta kernels for these
    ops are Python functions whose first call imports ``torch._dynamo``, a second of CPU for a process that
    only counts parameters (the agent's ``describe`` child, on the critical path of every job start).
    """

    def __torch_function__(self, func: Any, types: Any, args: Sequence[Any] = (),
                           kwargs: dict[str, Any] | None = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in _RANDOM_FILLS:  # Tensor.normal_(...) or torch.nn.init.normal_(tensor=...)
            target = args[0] if args else kwargs.get("tensor", kwargs.get("self"))
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def layer_costs(specs: Sequence[Any]) -> list[LayerCost]:
    """bamboo-reconfig's cost of each layer (:func:`bamboo.rc.gpt_size.layer_cost` of its parameter count).

    Each layer is built once to count its parameters, on the meta device where it can be (no
    memory, no random numbers drawn), else on the CPU with the random state restored afterwards.
    """
    return [layer_cost(sum(p.numel() for p in inspect_layer(spec, index).parameters()))
            for index, spec in enumerate(specs)]


def inspect_layer(spec: Any, index: int) -> nn.Module:
    """Layer ``index`` built to look at (its parameters' number and shapes), never to run: on the meta
    device where it can be (no memory, no random numbers drawn), else on the CPU with the random state
    restored afterwards."""
    spec = _layer_spec(spec, index)
    try:
        with torch.device("meta"), _SkipRandomFillOnMeta():
            return spec.build()
    except Exception:  # a layer whose constructor needs real tensors
        with torch.random.fork_rng(devices=[]):
            return spec.build()


def stage_bounds(specs: Sequence[Any], stages: int, node_memory_bytes: int | None = None) -> StageBounds:
    """The layer range of each of `stages` stages: ``split_layers(layer_costs(specs), stages, memory)``.

    Raises ValueError when there are fewer layers than stages, and
    :class:`bamboo.reconfig.InfeasibleSplit` when no split fits `node_memory_bytes`.
    """
    return split_layers(layer_costs(specs), stages, node_memory_bytes)


def check_stage_bounds(bounds: Sequence[Sequence[int]], layer_count: int, stages: int) -> StageBounds:
    """`bounds` as a tuple of pairs, after checking that they cut `layer_count` layers into `stages`
    contiguous, non-empty ranges; ValueError naming the bounds otherwise."""
    pairs = tuple((int(start), int(end)) for start, end in bounds)
    contiguous = all(start < end for start, end in pairs) and all(
        pairs[i][1] == pairs[i + 1][0] for i in range(len(pairs) - 1)
    )
    if len(pairs) != stages or not contiguous or pairs[0][0] != 0 or pairs[-1][1] != layer_count:
        raise ValueError(
            f"stage bounds {[list(p) for p in pairs]} do not cut {layer_count} layers into {stages} contiguous, "
            f"non-empty stages"
        )
    return pairs


def stage_slices(bounds: StageBounds, stage: int, redundancy: str) -> dict[int, range]:
    """The layers the node of `stage` builds, by stage: its own stage's range and, with redundancy,
    the range of its successor ``(stage + 1) % P``, whose replica it holds."""
    slices = {stage: range(*bounds[stage])}
    if redundancy != "none":
        successor = (stage + 1) % len(bounds)
        slices[successor] = range(*bounds[successor])
    return slices


def build_layers(specs: Sequence[Any], indices: range, seed: int) -> nn.Sequential:
    """Build layers `indices` of `specs`, each under its own seed (`seed`, layer index).

    Each spec must have a `.build()` method (a DeepSpeed LayerSpec): a ready module cannot be
    built twice, and the shadow needs its own copy of its successor's layers. The layers of a tie
    (DeepSpeed's ``TiedLayerSpec``: a ``key``) are built under the seed of the tie's first layer, so
    their copies of the tied weight start equal (:mod:`bamboo.rc.ties` keeps them equal); one with a
    ``forward_fn`` runs as ``forward_fn(layer, x)``, as in DeepSpeed.
    """
    first_of_tie: dict[str, int] = {}
    for position, spec in enumerate(specs):
        if getattr(spec, "key", None) is not None:
            first_of_tie.setdefault(str(spec.key), position)
    layers = []
    for index in indices:
        with RNG_LOCK, torch.random.fork_rng(devices=[]):
            # the copies of a tied layer are built under the seed of the tie's first layer: they start equal
            key = getattr(specs[index], "key", None)
            torch.manual_seed(seed * 100_003 + (first_of_tie[str(key)] if key is not None else index))
            spec = _layer_spec(specs[index], index)
            layer = spec.build()
        forward_fn = getattr(spec, "forward_fn", None)
        if forward_fn is not None:  # DeepSpeed's TiedLayerSpec: the layer runs as forward_fn(layer, x)
            layer.forward = functools.partial(forward_fn, layer)
        layers.append(layer)
    return nn.Sequential(*layers)
