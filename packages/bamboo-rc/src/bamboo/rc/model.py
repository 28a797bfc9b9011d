"""The example model: a GPT-style byte-level decoder defined as DeepSpeed `LayerSpec`s.

The layer list is `[ByteEmbedding, DecoderBlock × n_layers, LMHead]`. Stages own contiguous
slices of it (:func:`partition_layers`). Every layer is built under its own seed
(:func:`build_layers`), so a stage, its replica on the shadow and the single-process reference
start from bit-identical weights whatever the partition.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import attrs
import torch
from torch import nn
from torch.nn import functional

__all__ = [
    "ByteEmbedding",
    "DecoderBlock",
    "GPTSize",
    "LMHead",
    "build_layers",
    "gpt_layer_specs",
    "lm_loss",
    "partition_layers",
]

VOCAB_SIZE = 256


def _positive(_instance: object, attribute: attrs.Attribute, value: int) -> None:
    if value < 1:
        raise ValueError(f"{attribute.name} must be >= 1, got {value!r}")


@attrs.frozen
class GPTSize:
    """The size of the example decoder, from tiny upwards."""

    layers: int = attrs.field(default=4, validator=_positive)
    width: int = attrs.field(default=64, validator=_positive)
    heads: int = attrs.field(default=4, validator=_positive)
    sequence: int = attrs.field(default=32, validator=_positive)

    def __attrs_post_init__(self) -> None:
        if self.width % self.heads:
            raise ValueError(f"width {self.width} is not divisible by heads {self.heads}")


class ByteEmbedding(nn.Module):
    """Token (byte) plus learned position embedding: int64 [b, t] -> float [b, t, width]."""

    def __init__(self, width: int, sequence: int) -> None:
        super().__init__()
        self.tokens = nn.Embedding(VOCAB_SIZE, width)
        self.positions = nn.Embedding(sequence, width)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(tokens.shape[1], device=tokens.device)
        return self.tokens(tokens) + self.positions(positions)[None]


class DecoderBlock(nn.Module):
    """Pre-norm causal self-attention and MLP block: [b, t, width] -> [b, t, width]."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
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
        attention = scores.masked_fill(mask, float("-inf")).softmax(dim=-1)
        y = (attention @ v).transpose(1, 2).reshape(b, t, w)
        x = x + self.proj(y)
        return x + self.down(functional.gelu(self.up(self.norm2(x))))


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


def gpt_layer_specs(size: GPTSize) -> list[Any]:
    """The example decoder as a list of DeepSpeed `LayerSpec`s."""
    from deepspeed.pipe import LayerSpec

    return [
        LayerSpec(ByteEmbedding, size.width, size.sequence),
        *(LayerSpec(DecoderBlock, size.width, size.heads) for _ in range(size.layers)),
        LayerSpec(LMHead, size.width),
    ]


def partition_layers(layer_count: int, stages: int) -> list[range]:
    """Split `layer_count` layers into `stages` contiguous, non-empty, near-equal slices.

    The earlier stages get the smaller slices, so later stages (which also do the loss) are the
    slower ones, as in the paper's 1F1B bubbles.
    """
    if not 1 <= stages <= layer_count:
        raise ValueError(f"cannot split {layer_count} layers into {stages} stages")
    base, extra = divmod(layer_count, stages)
    bounds = [0]
    for stage in range(stages):
        bounds.append(bounds[-1] + base + (1 if stage >= stages - extra else 0))
    return [range(bounds[s], bounds[s + 1]) for s in range(stages)]


def build_layers(specs: Sequence[Any], indices: range, seed: int) -> nn.Sequential:
    """Build layers `indices` of `specs`, each under its own seed (`seed`, layer index).

    Each spec must have a `.build()` method (a DeepSpeed LayerSpec): a ready module cannot be
    built twice, and the shadow needs its own copy of its successor's layers.
    """
    layers = []
    for index in indices:
        spec = specs[index]
        if not callable(getattr(spec, "build", None)):
            raise TypeError(f"layer {index} is {type(spec).__name__}, not a LayerSpec with .build()")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 100_003 + index)
            layers.append(spec.build())
    return nn.Sequential(*layers)
