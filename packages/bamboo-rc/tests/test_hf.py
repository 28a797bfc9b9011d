"""Hugging Face causal LMs split into bamboo layers: the model's own loss and gradients bit for bit, tied
embeddings summed, the export that ``from_pretrained`` loads, and pipelines with a kill that stay exact in
fp32, bf16 and fp16. Every model is a tiny one built from a config: nothing is downloaded."""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from bamboo.rc.data import TokenFile, stdlib_corpus, write_token_file
from bamboo.rc.faults import KillPoint
from bamboo.rc.model import build_layers
from bamboo.rc.worker import VerifyModel, exact_mode

if importlib.util.find_spec("transformers") is None:  # looked up, not imported: collecting stays light
    pytest.skip("transformers is not installed", allow_module_level=True)

from bamboo.rc.hf import compare_logits, from_transformers, save_pretrained

VOCAB = 256


def _gpt2(**extra: Any) -> Any:
    import transformers

    return transformers.GPT2Config(**{"n_layer": 2, "n_embd": 32, "n_head": 4, "vocab_size": VOCAB, "n_positions": 64,
                                      "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, **extra})


def _llama(**extra: Any) -> Any:
    import transformers

    return transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64, **extra)


def _qwen2(**extra: Any) -> Any:
    import transformers

    return transformers.Qwen2Config(num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
                                    intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=64,
                                    tie_word_embeddings=True, **extra)


@pytest.fixture(autouse=True)
def _exact() -> Any:
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    exact_mode()
    yield
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(deterministic)


@pytest.mark.parametrize(("make", "tied"), [(_gpt2, True), (_llama, False), (_qwen2, True)],
                         ids=["gpt2", "llama", "qwen2"])
def test_a_step_through_our_layers_is_the_models_own_loss_and_gradients(make: Any, tied: bool) -> None:
    import transformers

    model = transformers.AutoModelForCausalLM.from_config(make()).train()
    ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(1))
    theirs = model(input_ids=ids, labels=ids, use_cache=False).loss
    theirs.backward()

    layers, loss_fn = from_transformers(model)
    assert (layers[0].key is not None) == tied and (layers[-1].key is not None) == tied
    built = build_layers(layers, range(len(layers)), seed=0)
    labels = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)  # aligned: transformers' shift_labels
    ours = loss_fn(built(ids), labels)
    ours.backward()
    assert ours.item() == theirs.item()

    grads: dict[str, torch.Tensor] = {}
    for spec, layer in zip(layers, built, strict=True):
        for child, name in spec.hf_names.items():
            for parameter_name, parameter in layer.get_submodule(child).named_parameters():
                key = f"{name}.{parameter_name}"
                grads[key] = grads[key] + parameter.grad if key in grads else parameter.grad.clone()
    if tied:  # the head's copy of the embedding: its gradient adds to the one shared weight's
        embedding = f"{layers[0].hf_names['tokens']}.weight"
        grads[embedding] = grads[embedding] + grads.pop("lm_head.weight")
    expected = dict(model.named_parameters())
    assert grads.keys() == expected.keys()
    assert all(torch.equal(grads[name], parameter.grad) for name, parameter in expected.items())


@pytest.mark.parametrize("make", [_gpt2, _qwen2], ids=["gpt2", "qwen2"])
def test_tied_copies_trained_apart_stay_the_one_weight_the_model_trains(make: Any) -> None:
    """Three AdamW steps of the model itself (its one tied embedding) against bamboo's reference step of the
    split model (two copies, their gradients summed): every weight bit-equal, both copies alike."""
    import transformers
    from bamboo.rc import load_config
    from bamboo.rc.config import build_optimizer
    from bamboo.rc.reference import reference_step
    from bamboo.rc.state import TrainableSlice
    from bamboo.rc.ties import model_ties

    model = transformers.AutoModelForCausalLM.from_config(make()).train()
    layers, loss_fn = from_transformers(model)
    assert model_ties(layers) == {"embeddings": [(0, "tokens.weight"), (len(layers) - 1, "out.weight")]}
    config = load_config({"train_micro_batch_size_per_gpu": 2, "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    whole = TrainableSlice(layers, range(len(layers)), config, seed=0)
    optimizer = build_optimizer(config.optimizer, list(model.parameters()))

    def batch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(step))
        return ids, torch.cat([ids[:, 1:], torch.full((2, 1), -100)], dim=1)

    for step in range(3):
        ids, _ = batch(step, 0)
        model.zero_grad()
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        optimizer.step()
        reference_step(whole, loss_fn, config, batch, step, 1, 1)
    assert torch.equal(whole.layers[0].tokens.weight, whole.layers[-1].out.weight)
    for spec, layer in zip(layers, whole.layers, strict=True):
        for child, name in spec.hf_names.items():
            for parameter_name, parameter in layer.get_submodule(child).named_parameters():
                assert torch.equal(parameter, model.get_parameter(f"{name}.{parameter_name}")), (name, parameter_name)


def test_a_config_or_a_local_folder_gives_the_same_layers_everywhere(tmp_path: Path) -> None:
    import transformers

    first, again = (from_transformers(_llama(), seed=4).layers for _ in range(2))
    assert all(torch.equal(a, b) for a, b in zip(first[1].build().state_dict().values(),
                                                 again[1].build().state_dict().values(), strict=True))
    model = transformers.AutoModelForCausalLM.from_config(_gpt2())
    model.save_pretrained(str(tmp_path / "saved"))
    from_folder = from_transformers(tmp_path / "saved").layers
    assert torch.equal(from_folder[1].build().layer.attn.c_attn.weight, model.transformer.h[0].attn.c_attn.weight)


@pytest.mark.parametrize(
    ("model", "message"),
    [
        (lambda: importlib.import_module("transformers").BertConfig(),
         "splits causal language models of GPT-2, Llama, Qwen2 (model_type gpt2, llama, qwen2); got a config of "
         "model_type 'bert'"),
        (lambda: importlib.import_module("transformers").GPT2Model(_gpt2()), "got GPT2Model (model_type 'gpt2')"),
        (lambda: "no/such/folder", "no/such/folder is not a local save_pretrained folder (no config.json)"),
    ],
)
def test_a_model_we_cannot_split_is_one_line_naming_the_supported_ones(model: Any, message: str) -> None:
    with pytest.raises(ValueError) as error:
        from_transformers(model())
    assert message in str(error.value) and "\n" not in str(error.value)


def test_token_ids_outside_the_vocabulary_are_one_line() -> None:
    embedding = from_transformers(_gpt2()).layers[0].build()
    with pytest.raises(ValueError, match=f"token id 300 is outside the model's vocabulary of {VOCAB}"):
        embedding(torch.tensor([[1, 300]]))
    with pytest.raises(ValueError, match="sequences of 65 tokens are longer than the model's 64 positions"):
        embedding(torch.zeros(1, 65, dtype=torch.int64))


@pytest.mark.parametrize("make", [_gpt2, _llama], ids=["gpt2", "llama"])
def test_the_exported_folder_loads_with_from_pretrained_and_gives_our_logits(make: Any, tmp_path: Path) -> None:
    import transformers

    layers = from_transformers(make()).layers
    built = build_layers(layers, range(len(layers)), seed=0)
    with torch.no_grad():  # "trained": every weight moved, the tied copies alike
        for parameter in built.parameters():
            parameter.add_(0.01)
    state = built.state_dict()
    save_pretrained(state, tmp_path / "out")
    assert {"config.json", "model.safetensors"} <= {path.name for path in (tmp_path / "out").iterdir()}
    assert compare_logits(state, tmp_path / "out") == 0.0
    assert type(transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out"))).__name__ == \
        type(transformers.AutoModelForCausalLM.from_config(make())).__name__


def test_an_export_of_untied_copies_or_of_another_model_is_refused(tmp_path: Path) -> None:
    from bamboo.rc.hf import load_state

    layers = from_transformers(_gpt2()).layers
    state = build_layers(layers, range(len(layers)), seed=0).state_dict()
    state[f"{len(layers) - 1}.out.weight"] = state[f"{len(layers) - 1}.out.weight"] + 1
    with pytest.raises(ValueError, match="the tied input and output embeddings differ"):
        load_state(state)
    with pytest.raises(ValueError, match=r"was not split by bamboo\.rc\.from_transformers"):
        load_state({"0.weight": torch.zeros(1)})


@pytest.fixture(scope="module")
def token_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("tokens")
    return write_token_file(np.frombuffer(stdlib_corpus(100_000), dtype=np.uint8), folder / "stdlib.bin")


CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4,
          "optimizer": {"type": "AdamW", "params": {"lr": 3e-3}}, "gradient_clipping": 1.0}


@pytest.mark.parametrize(
    ("make", "precision", "stages", "pipelines", "kill"),
    [
        (_gpt2, {}, 3, 1, KillPoint(1, 0, "5", step=2)),  # tied, fp32: the head's stage dies
        (_gpt2, {"bf16": {"enabled": True}}, 2, 2, KillPoint(0, 1, "3", step=1)),  # the embedding's stage dies
        (_llama, {"fp16": {"enabled": True, "initial_scale_power": 20, "hysteresis": 1, "loss_scale_window": 2}},
         3, 1, KillPoint(2, 0, "4", step=2)),  # overflows first: skipped steps, the scale halves
    ],
    ids=["gpt2-fp32-P3", "gpt2-bf16-P2D2", "llama-fp16-P3"],
)
def test_a_pipeline_with_a_kill_ends_bit_equal_to_the_reference_in_its_precision(
    token_file: Path, make: Any, precision: dict, stages: int, pipelines: int, kill: KillPoint
) -> None:
    from bamboo.rc.verify import run_verify

    dropout = {"resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1} if make is _gpt2 else {}
    layers, loss_fn = from_transformers(make(**dropout), seed=2)  # GPT-2 with dropout: seeded per layer, exact
    data = TokenFile(token_file, seq_len=16, micro_batch=2, seed=1, vocab_size=VOCAB)
    result = run_verify(stages, pipelines, 4, "eflb", config={**CONFIG, **precision},
                        model=VerifyModel(layers, loss_fn, data), kills=(kill,))
    assert result.passed, result
    assert result.max_relative_diff == 0.0 and result.killed and result.replicas_compared > 0
    if "fp16" in precision:  # the overflows happened, and every copy followed the reference's scale
        assert result.loss_scale is not None and result.loss_scale["last_overflow"] >= 0
        assert result.loss_scale["scale"] < 2.0**20 and result.loss_scales_match
