"""The example GPT's size as plain values: each layer's parameter count from the size alone is the count of the
layer torch builds, and neither it nor reading a DeepSpeed config imports torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from bamboo.rc.gpt_size import GPTSize, layer_cost
from bamboo.rc.model import gpt_layer_specs, inspect_layer


@pytest.mark.parametrize(("layers", "width", "heads", "sequence"), [(1, 64, 4, 32), (3, 64, 4, 32), (2, 96, 6, 48),
                                                                     (4, 8, 1, 5)])
def test_each_layer_s_count_is_what_the_built_layer_holds(layers: int, width: int, heads: int, sequence: int) -> None:
    size = GPTSize(layers=layers, width=width, heads=heads, sequence=sequence)
    built = [sum(p.numel() for p in inspect_layer(spec, i).parameters())
             for i, spec in enumerate(gpt_layer_specs(size))]
    assert size.layer_parameters() == built


def test_a_layer_s_cost_is_its_fp32_parameters_adam_s_state_and_its_count() -> None:
    cost = layer_cost(1000)
    assert (cost.param_bytes, cost.optimizer_bytes, cost.compute_cost) == (4000, 8000, 1000.0)


def test_the_sizes_and_reading_a_config_import_no_torch() -> None:
    code = ("import sys\n"
            "from bamboo.rc.gpt_size import GPTSize\n"
            "from bamboo.rc.config import load_config\n"
            "GPTSize(layers=2).layer_parameters()\n"
            "load_config({'train_micro_batch_size_per_gpu': 2, 'gradient_accumulation_steps': 4,\n"
            "             'fp16': {'enabled': True}}, pipelines=2)\n"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')))\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.strip() == "[]", done.stdout
