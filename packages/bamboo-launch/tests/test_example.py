"""The built-in example's description: computed from its size in the agent, the same as the one its built layers
give, and without torch."""

from __future__ import annotations

import subprocess
import sys

import pytest
from bamboo.launch.example import EXAMPLE_CONFIG, describe_example, describe_program, example_program


@pytest.mark.parametrize("layers", [1, 2, 4, 7])
@pytest.mark.parametrize("pipelines", [1, 3])
def test_the_description_from_the_size_is_the_built_layers_one(layers: int, pipelines: int) -> None:
    built = describe_program(example_program({"layers": layers}, dict(EXAMPLE_CONFIG), 0), pipelines)
    assert describe_example(layers, pipelines) == built


def test_an_agent_describes_the_built_in_example_without_torch_or_a_child_process(tmp_path) -> None:
    code = ("import sys\n"
            "from pathlib import Path\n"
            "from bamboo.launch.agent_spec import describe_model\n"
            "from bamboo.launch.spec import SpecFields\n"
            f"found = describe_model(SpecFields(stages=2, pipelines=2, size={{'layers': 3}}), Path({str(tmp_path)!r}) / 'd.log')\n"
            "print(len(found['layers']), found['micro_batches'], 'torch' in sys.modules)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert done.stdout.split() == ["5", "4", "False"], done.stdout + done.stderr
    assert list(tmp_path.iterdir()) == []  # no child wrote a log
