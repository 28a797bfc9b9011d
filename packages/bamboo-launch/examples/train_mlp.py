"""Train your own model with bamboo-launch: a residual MLP classifier on a synthetic task.

Run it on an emulated spot cluster (4 nodes, 2 stages, 2 pipelines), check the result against a
fault-free single-process run, with optional script arguments after the script::

    bamboo-launch run --nodes 4 --stages 2 --pipelines 2 --steps 20 --verify -- \\
        packages/bamboo-launch/examples/train_mlp.py --width 64 --blocks 4

The script gives ``bamboo.launch.train_worker`` three things, as a DeepSpeed pipeline user would:

- the model as DeepSpeed ``LayerSpec`` s (bamboo-rc cuts it into the run's stages; every copy of a
  layer is built under the same seed, so replicas start bit-equal);
- the loss of one microbatch, ``loss_fn(outputs, labels)``;
- the data: ``microbatch(step, index)``, the ``(inputs, labels)`` at position ``index`` of the global
  batch of ``step``. It depends on ``(step, index)`` only, so a pipeline that takes over, or a run that
  reconfigures to a different number of pipelines, sees the very same samples.

The task: points in ``--features`` dimensions, labelled by which of ``--classes`` fixed random
directions they point to most (a "teacher" drawn from ``--data-seed``). Each residual block ends with
dropout (``--dropout``, 0.1 by default): bamboo runs every layer's forward under a generator seeded
from (seed, step, microbatch, layer), so the masks are the same on every copy of a layer, through
failovers and reconfigurations, and in the ``--verify`` reference; the run stays exact.
"""

from __future__ import annotations

import argparse

import bamboo.launch
import torch
from deepspeed.pipe import LayerSpec
from torch import nn
from torch.nn import functional


class InputProjection(nn.Module):
    """features -> width."""

    def __init__(self, features: int, width: int) -> None:
        super().__init__()
        self.linear = nn.Linear(features, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return functional.gelu(self.linear(x))


class ResidualBlock(nn.Module):
    """Pre-norm residual MLP block: width -> width."""

    def __init__(self, width: int, dropout: float) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, 2 * width)
        self.down = nn.Linear(2 * width, width)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.dropout(self.down(functional.gelu(self.up(self.norm(x)))))


class ClassifierHead(nn.Module):
    """width -> class logits."""

    def __init__(self, width: int, classes: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.out = nn.Linear(width, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(x))


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A residual MLP classifier trained under bamboo-launch run.")
    parser.add_argument("--features", type=int, default=16, help="input dimensions (default: %(default)s)")
    parser.add_argument("--classes", type=int, default=4, help="classes (default: %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="hidden width (default: %(default)s)")
    parser.add_argument("--blocks", type=int, default=4, help="residual blocks (default: %(default)s)")
    parser.add_argument("--dropout", type=float, default=0.1, help="dropout probability in each block "
                        "(default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=16, help="samples per microbatch (default: %(default)s)")
    parser.add_argument("--data-seed", type=int, default=1234, help="seed of the task and the samples "
                        "(default: %(default)s)")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    teacher = torch.randn(args.features, args.classes, generator=torch.Generator().manual_seed(args.data_seed))

    def microbatch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        generator = torch.Generator().manual_seed(args.data_seed * 1_000_003 + step * 10_007 + index)
        inputs = torch.randn(args.micro_batch, args.features, generator=generator)
        return inputs, (inputs @ teacher).argmax(dim=1)

    layers = [
        LayerSpec(InputProjection, args.features, args.width),
        *(LayerSpec(ResidualBlock, args.width, args.dropout) for _ in range(args.blocks)),
        LayerSpec(ClassifierHead, args.width, args.classes),
    ]
    config = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
        "gradient_clipping": 1.0,
    }
    bamboo.launch.train_worker(layers=layers, loss_fn=functional.cross_entropy, microbatch=microbatch,
                               config=config)


if __name__ == "__main__":
    main()
