"""The built-in example: bamboo-rc's tiny GPT on the Python standard library's source bytes.

``bamboo-launch run`` and ``bamboo-launch agent`` train it when no script is given. Its DeepSpeed config
is :data:`EXAMPLE_CONFIG`; its size comes from ``--layers`` (decoder blocks).

Its description (each layer's state bytes and compute cost for the planner, the config, and the microbatches
per pipeline: the JSON a user script writes in ``describe`` mode) follows from its size alone:
:func:`describe_example` gives it without torch, in the process of the agent that writes the job's spec.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import TYPE_CHECKING

from bamboo.launch.json_types import JSON, JSONObject
from bamboo.launch.spec import ModelDescription, Program

if TYPE_CHECKING:
    from torch import Tensor

__all__ = ["DEFAULT_LAYERS", "EXAMPLE_CONFIG", "describe_example", "describe_program", "example_program"]

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


def describe_example(layers: int, pipelines: int) -> ModelDescription:
    """The built-in example's description for ``layers`` decoder blocks and ``pipelines`` pipelines, the same as
    :func:`describe_program` of :func:`example_program` gives (``tests/test_example.py``), without torch: each
    layer's cost from its parameter count (:meth:`bamboo.rc.gpt_size.GPTSize.layer_parameters`), and the
    microbatches from the config (:func:`bamboo.rc.config.load_config`, which reads it without torch). Building
    the layers instead (on the meta device) imported torch in a child process of the agent: 2.2 to 2.7 s and as
    many CPU-s before every job's spec."""
    from bamboo.rc.config import load_config
    from bamboo.rc.gpt_size import GPTSize, layer_cost

    config = copy.deepcopy(EXAMPLE_CONFIG)  # the caller's own: the spec may keep it
    return {
        "layers": [layer_cost(count).to_dict() for count in GPTSize(layers=layers).layer_parameters()],
        "config": config,
        "micro_batches": load_config(config, pipelines=pipelines).micro_batches,
    }
