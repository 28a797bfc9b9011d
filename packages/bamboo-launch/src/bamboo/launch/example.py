"""The built-in example: bamboo-rc's tiny GPT on the Python standard library's source bytes.

``bamboo-launch run`` and ``bamboo-launch agent`` train it when no script is given. Its DeepSpeed config
is :data:`EXAMPLE_CONFIG`; its size comes from ``--layers`` (decoder blocks).

``python -m bamboo.launch.example --layers N --pipelines D --out FILE`` writes the model's description
(the same JSON a user script writes in ``describe`` mode: each layer's state bytes and compute cost for
the planner, the config, and the microbatches per pipeline): the agent that writes the job's spec runs
it in a child process, so that the agent itself never imports torch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from bamboo.launch.json_types import JSON, JSONObject
from bamboo.launch.spec import ModelDescription, Program

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["DEFAULT_LAYERS", "EXAMPLE_CONFIG", "describe_program", "example_program", "main"]

DEFAULT_LAYERS = 4
"""The built-in example's decoder blocks when no ``--layers`` is given."""

EXAMPLE_CONFIG: JSONObject = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3}},
    "gradient_clipping": 1.0,
}


def example_program(size: dict[str, int], config: Mapping[str, JSON], seed: int) -> Program:
    """The built-in example: the tiny GPT of bamboo-rc of ``size`` on the standard library's source bytes."""
    from bamboo.rc import load_config
    from bamboo.rc.data import GlobalBatchSampler
    from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss

    gpt = GPTSize(**size)
    sampler = GlobalBatchSampler(load_config(config).micro_batch_size, gpt.sequence, seed=seed)

    def microbatch(step: int, index: int) -> tuple[Tensor, Tensor]:
        batch = sampler.microbatch(step, index)
        return batch.tokens, batch.labels

    return Program(layers=gpt_layer_specs(gpt), loss_fn=lm_loss, microbatch=microbatch, config=config)


def describe_program(program: Program, pipelines: int) -> ModelDescription:
    """The description of a program as the job's spec holds it: layer costs, config, microbatches per pipeline."""
    from bamboo.rc import load_config
    from bamboo.rc.data import bind_global_batch
    from bamboo.rc.model import layer_costs

    config = program.config if program.config is not None else dict(EXAMPLE_CONFIG)
    training = load_config(config, pipelines=pipelines)
    # a data source that needs the global batch (a token file) says here, before any node starts, if it is too small
    bind_global_batch(program.microbatch, training.micro_batches * pipelines, training.micro_batch_size)
    return {
        "layers": [layer.to_dict() for layer in layer_costs(program.layers)],
        "config": config,
        "micro_batches": training.micro_batches,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bamboo.launch.example",
                                     description="Write the built-in example's description (layer costs, "
                                     "config, microbatches per pipeline) as JSON.")
    parser.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="decoder blocks (default: %(default)s)")
    parser.add_argument("--pipelines", type=int, required=True, help="data-parallel pipelines D")
    parser.add_argument("--out", required=True, help="where the JSON goes")
    args = parser.parse_args(argv)
    program = example_program({"layers": args.layers}, dict(EXAMPLE_CONFIG), 0)
    out = Path(args.out)
    partial = out.with_suffix(out.suffix + ".tmp")
    partial.write_text(json.dumps(describe_program(program, args.pipelines)))
    os.replace(partial, out)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
