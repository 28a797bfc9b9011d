"""End to end: a Hugging Face GPT-2 trained through a kill and a joiner, exact, and exported for ``transformers``.

The user script is ``examples/train_hf.py``: a small GPT-2 built from a config (tied embeddings, learned
positions, dropout 0.1), split by ``bamboo.rc.from_transformers``, on a token file of the Python standard
library's source (``bamboo.rc.data.TokenFile``). Five nodes start (P=2, D=2, one on standby). The trace
kills node1 (stage 1 of pipeline 0) once training runs: its shadow takes the stage over (the embedding and
the head, in different stages, stay tied through the failover), then the standby node joins. ``--verify``
compares with the script's own fault-free single-process reference: ``max relative diff 0.0``. Then
``bamboo-launch export --format hf`` writes a folder that ``AutoModelForCausalLM.from_pretrained`` loads,
whose logits the export checks against bamboo's.
"""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from bamboo.launch.cli import main
from bamboo.launch.events import Failover, Preemption, Reconfiguration, read_events
from bamboo.rc.data import stdlib_corpus, write_token_file

if importlib.util.find_spec("transformers") is None:  # looked up, not imported: collecting stays light
    pytest.skip("transformers is not installed", allow_module_level=True)

pytestmark = pytest.mark.timeout(420)

EXAMPLE = Path(__file__).resolve().parents[2] / "packages" / "bamboo-launch" / "examples" / "train_hf.py"


def test_a_transformers_gpt2_survives_a_kill_and_a_joiner_exactly_and_exports_for_from_pretrained(
    tmp_path: Path, write_trace: Callable[[int, list[tuple[int, str, str]]], str],
    capsys: pytest.CaptureFixture[str],
) -> None:
    import transformers

    tokens = write_token_file(np.frombuffer(stdlib_corpus(400_000), dtype=np.uint8), tmp_path / "stdlib.bin")
    trace = write_trace(5, [(1500, "remove", "node2")])  # trace node2 is the launcher's node1
    run_dir = tmp_path / "run"
    code = main(["run", "--nodes", "5", "--stages", "2", "--pipelines", "2", "--steps", "48", "--zones", "a,b,c",
                 "--preemptions", trace, "--time-scale", "1", "--run-dir", str(run_dir), "--timeout", "360",
                 "--verify", "--json", "--no-live", "--redundancy", "eflb",  # a failover is what this test is about
                 "--preload", "transformers.models.gpt2.modeling_gpt2",  # each worker's 3.8 CPU-s, imported once
                 "--", str(EXAMPLE), "--model", "gpt2", "--tokens", str(tokens), "--width", "32", "--seq-len", "32"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, report
    assert report["verify"] == "PASSED" and report["compared_steps"] == 48, report
    assert report["max_relative_diff"] == 0.0, report
    events = read_events(run_dir / "events.jsonl")
    losses = [e for e in events if isinstance(e, (Failover, Preemption))]  # with how each loss was confirmed
    assert [e.victim for e in events if isinstance(e, Failover)] == ["node1"], losses
    assert any(e.bytes_moved > 0 for e in events if isinstance(e, Reconfiguration))  # the joiner got its stage

    model_dir = tmp_path / "model"
    assert main(["export", str(run_dir), "--format", "hf", "-o", str(model_dir)]) == 0
    assert "gives bamboo's logits (max abs diff 0)" in capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    assert type(model).__name__ == "GPT2LMHeadModel" and model.lm_head.weight is model.transformer.wte.weight
    final = {}
    for path in (run_dir / "out").glob("rank*.pt"):
        worker = torch.load(path, weights_only=False)
        for stage, indices in worker["slice_layers"].items():
            final.update({index: state for index, state in zip(indices, worker["slices"][stage], strict=True)})
    assert torch.equal(model.transformer.wte.weight, final[0]["tokens.weight"])
    assert torch.equal(final[0]["tokens.weight"], final[max(final)]["out.weight"])  # tied to the end
