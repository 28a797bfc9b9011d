"""``bamboo-launch export --format hf``: a run's final model as a folder ``from_pretrained`` loads, checked
against bamboo's logits; one-line errors for a model not split from transformers and a bad output path.

The run directory is written here as the workers write it (``out/rank<r>.pt``: each worker's stages, their
layer indices and states), from a tiny GPT-2 split into two stages: no cluster, no download."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch
from bamboo.launch.cli import main
from bamboo.rc.model import build_layers

if importlib.util.find_spec("transformers") is None:  # looked up, not imported: collecting stays light
    pytest.skip("transformers is not installed", allow_module_level=True)


def _write_run(run_dir: Path, layers: list, bounds: list[tuple[int, int]]) -> dict[str, torch.Tensor]:
    """Each stage's layers as a worker's final report holds them; returns the whole model's state dict."""
    built = build_layers(layers, range(len(layers)), seed=0)
    with torch.no_grad():
        for parameter in built.parameters():  # "trained": the tied copies moved alike
            parameter.add_(0.02)
    (run_dir / "out").mkdir(parents=True)
    for rank, (start, end) in enumerate(bounds):
        torch.save({"slice_layers": {rank: list(range(start, end))},
                    "slices": {rank: [built[i].state_dict() for i in range(start, end)]}}, run_dir / "out" / f"rank{rank}.pt")
    return built.state_dict()


def test_a_run_of_a_transformers_model_exports_a_folder_that_from_pretrained_loads(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import transformers
    from bamboo.rc import from_transformers

    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=256, n_positions=32)
    layers = from_transformers(config).layers
    state = _write_run(tmp_path / "run", layers, [(0, 2), (2, 5)])
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "-o", str(tmp_path / "model")]) == 0
    out = capsys.readouterr().out
    assert "config.json, model.safetensors" in out and "gives bamboo's logits (max abs diff 0)" in out, out
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "model"))
    assert torch.equal(reloaded.transformer.wte.weight, state["0.tokens.weight"])
    assert reloaded.lm_head.weight is reloaded.transformer.wte.weight  # still one tied weight


def test_exporting_another_model_as_hf_or_into_a_file_is_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from bamboo.rc.model import GPTSize, gpt_layer_specs

    _write_run(tmp_path / "run", gpt_layer_specs(GPTSize(layers=1, width=16, heads=2, sequence=8)), [(0, 3)])
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "-o", str(tmp_path / "model")]) == 2
    error = capsys.readouterr().err.strip()
    assert error == ("bamboo-launch: error: this model was not split by bamboo.rc.from_transformers (layer 0 has no "
                     "hf_config): export it with --format bamboo")
    (tmp_path / "file").write_text("x")
    assert main(["export", str(tmp_path / "run"), "--format", "hf", "-o", str(tmp_path / "file")]) == 2
    assert "is a file; --format hf writes a folder" in capsys.readouterr().err
