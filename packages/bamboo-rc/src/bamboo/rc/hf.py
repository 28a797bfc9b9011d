"""Hugging Face ``transformers`` causal language models as bamboo layers (needs ``bamboo-rc[hf]``).

``layers, loss_fn = bamboo.rc.from_transformers(model)`` cuts a GPT-2, Llama or Qwen2 causal LM into the
layer list that ``initialize`` and ``train_worker`` take: the token embedding (with GPT-2's learned
positions and dropout), each decoder block, the final norm and the LM head. Each layer spec copies its
part of ``model`` when the runtime builds it, so every copy of a stage (the original, the shadow's
replica, a joiner's, the ``--verify`` reference) starts from the very weights of ``model``.

- **What a block computes** is what the model's own forward computes for it: the decoder layer of
  ``transformers`` itself, called with the causal mask that ``transformers.masking_utils`` builds for the
  model's attention implementation, and (Llama, Qwen2) the rotary position embeddings of the model's own
  rotary module, for positions ``0 .. t-1`` of a packed sequence (no padding, so no attention mask beyond
  the causal one). In one process, a step through these layers gives the model's loss and gradients bit
  for bit (``tests/test_hf.py``; with dropout off: bamboo seeds each layer's dropout itself, so the
  masks differ from the model's own forward, and are the same on every copy).
- **Tied embeddings** (GPT-2, and any model whose output embedding is its input embedding) stay tied: the
  embedding and the head are tied layer specs in DeepSpeed's manner (``key``, ``tied_weight_attr``), and
  the commit sums their gradients so both copies take the same step (:mod:`bamboo.rc.ties`).
- **The loss** is the model's own (``model.loss_function``, ``ForCausalLMLoss``) on labels aligned with the
  inputs (``labels[i]`` is the token after ``inputs[i]``, ``-100`` ignored), as :class:`~bamboo.rc.data.TokenFile`
  gives them: transformers' own ``shift_labels``.
- **Precision**: the copies are fp32 (master weights); bf16 and fp16 come from the DeepSpeed config as
  autocast (:mod:`bamboo.rc.precision`).
- **The model's config travels with its weights**: the embedding layer keeps it (JSON) in a ``uint8``
  buffer, ``hf_config``, so a run's final state or a checkpoint is enough for :func:`save_pretrained`,
  which writes a folder that ``AutoModelForCausalLM.from_pretrained`` loads (``bamboo-launch export
  --format hf``).
"""

from __future__ import annotations

import copy
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

__all__ = [
    "SUPPORTED",
    "CausalLMLoss",
    "DecoderBlock",
    "FinalNorm",
    "HFLayerSpec",
    "LMHead",
    "SplitModel",
    "TokenEmbedding",
    "compare_logits",
    "from_transformers",
    "load_state",
    "save_pretrained",
]

SUPPORTED = {"gpt2": "GPT-2", "llama": "Llama", "qwen2": "Qwen2"}
"""The ``model_type`` values :func:`from_transformers` splits, with their names."""

CONFIG_BUFFER = "hf_config"
"""The embedding layer's buffer that holds the model's config as UTF-8 JSON."""

TIE_KEY = "embeddings"
"""The tie key of the input and output embeddings (:mod:`bamboo.rc.ties`)."""


def _transformers() -> Any:
    try:
        import transformers
    except ImportError:
        raise ImportError("bamboo.rc.from_transformers needs the transformers package: pip install "
                          "'bamboo-rc[hf]'") from None
    return transformers


class TokenEmbedding(nn.Module):
    """Token ids ``[b, t]`` -> hidden states ``[b, t, width]``: the token embedding, plus GPT-2's learned
    position embedding and dropout. Ids outside the vocabulary (or sequences longer than GPT-2's positions)
    are a one-line ValueError, not an index error inside the embedding."""

    def __init__(self, tokens: nn.Embedding, positions: nn.Embedding | None = None, dropout: nn.Module | None = None,
                 config_json: bytes = b"{}") -> None:
        super().__init__()
        self.tokens = tokens
        self.positions = positions
        self.dropout = dropout if dropout is not None else nn.Identity()
        self.register_buffer(CONFIG_BUFFER, torch.tensor(list(config_json), dtype=torch.uint8))

    def _load_from_state_dict(self, state_dict: dict[str, Any], prefix: str, *args: Any) -> None:
        saved = state_dict.get(prefix + CONFIG_BUFFER)
        if saved is not None:  # the saved config's JSON may be of another length (another transformers version)
            self.hf_config = saved.detach().clone()
        super()._load_from_state_dict(state_dict, prefix, *args)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.device.type == "cpu" and ids.numel():  # elsewhere the check would cost a device sync per microbatch
            low, high = int(ids.min()), int(ids.max())
            if low < 0 or high >= self.tokens.num_embeddings:
                raise ValueError(f"token id {high if high >= self.tokens.num_embeddings else low} is outside the "
                                 f"model's vocabulary of {self.tokens.num_embeddings} (data of another tokenizer?)")
        x = self.tokens(ids)
        if self.positions is not None:
            if ids.shape[1] > self.positions.num_embeddings:
                raise ValueError(f"sequences of {ids.shape[1]} tokens are longer than the model's "
                                 f"{self.positions.num_embeddings} positions (n_positions)")
            position_ids = torch.arange(ids.shape[1], device=ids.device).unsqueeze(0)
            x = x + self.positions(position_ids)
        return self.dropout(x)


class DecoderBlock(nn.Module):
    """One decoder layer of the model, called as the model's own forward calls it (see the module docstring)."""

    def __init__(self, layer: nn.Module, config: Any, rotary: nn.Module | None, sliding: bool) -> None:
        super().__init__()
        self.layer = layer
        self.rotary = rotary
        self.config = config
        self.sliding = sliding

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        from transformers import masking_utils

        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        make_mask = masking_utils.create_sliding_window_causal_mask if self.sliding else masking_utils.create_causal_mask
        mask = make_mask(config=self.config, inputs_embeds=hidden, attention_mask=None, cache=None,
                         position_ids=positions)
        if self.rotary is None:  # GPT-2: its positions were added by the embedding
            return self.layer(hidden, None, mask, None, encoder_attention_mask=None, use_cache=False,
                              position_ids=positions)
        return self.layer(hidden, attention_mask=mask, position_ids=positions, cache=None, use_cache=False,
                          position_embeddings=self.rotary(hidden, positions))


class FinalNorm(nn.Module):
    """The final norm (GPT-2's ``ln_f``, Llama's RMS ``norm``)."""

    def __init__(self, norm: nn.Module) -> None:
        super().__init__()
        self.norm = norm

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)


class LMHead(nn.Module):
    """Hidden states -> logits over the vocabulary (``lm_head``)."""

    def __init__(self, out: nn.Module) -> None:
        super().__init__()
        self.out = out

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.out(hidden)


class HFLayerSpec:
    """One layer of a split model: :meth:`build` makes a fresh fp32 copy of its part of the model, in training
    mode. ``key`` and ``tied_weight_attr`` are DeepSpeed ``TiedLayerSpec``'s names (:mod:`bamboo.rc.ties`);
    ``hf_names`` maps each child of the built layer to its name in the ``transformers`` model."""

    def __init__(self, factory: Callable[[], nn.Module], hf_names: Mapping[str, str], *, key: str | None = None,
                 tied_weight_attr: tuple[str, ...] = ()) -> None:
        self.factory = factory
        self.hf_names = dict(hf_names)
        self.key = key
        self.tied_weight_attr = list(tied_weight_attr)

    def build(self) -> nn.Module:
        return self.factory().float().train()

    def __repr__(self) -> str:
        return f"HFLayerSpec({', '.join(self.hf_names.values())})"


class CausalLMLoss:
    """The model's own causal-LM loss on labels aligned with the logits (transformers' ``shift_labels``):
    mean cross entropy over the positions whose label is not ``-100``."""

    def __init__(self, loss_function: Callable[..., torch.Tensor], vocab_size: int) -> None:
        self.loss_function = loss_function
        self.vocab_size = vocab_size

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return self.loss_function(logits=logits, labels=None, vocab_size=self.vocab_size, shift_labels=labels)


class SplitModel(NamedTuple):
    """What :func:`from_transformers` returns: ``layers, loss_fn = from_transformers(model)``."""

    layers: list[HFLayerSpec]
    loss_fn: CausalLMLoss


def _copy(*modules: nn.Module | None) -> list[nn.Module | None]:
    return [copy.deepcopy(module) if module is not None else None for module in modules]


def _parts(model: Any) -> tuple[list[tuple[Callable[[], nn.Module], dict[str, nn.Module]]], bool]:
    """The layers of ``model``: for each, how to build it and the model's submodules it copies (by the child's
    name in the built layer); and whether the output embedding is tied to the input embedding."""
    config = model.config
    family = config.model_type
    config_json = config.to_json_string().encode()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    if family == "gpt2":
        base = model.transformer
        if config.add_cross_attention:
            raise ValueError("from_transformers splits decoder-only GPT-2 models; this one has cross-attention "
                             "(add_cross_attention=True)")
        embedding = (lambda: TokenEmbedding(*_copy(base.wte, base.wpe, base.drop), config_json=config_json),  # type: ignore[arg-type]
                     {"tokens": base.wte, "positions": base.wpe})
        blocks = [(lambda layer=layer: DecoderBlock(copy.deepcopy(layer), config, None, False), {"layer": layer})
                  for layer in base.h]
        norm = base.ln_f
    else:
        base = model.model
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * len(base.layers)
        embedding = (lambda: TokenEmbedding(*_copy(base.embed_tokens), config_json=config_json),  # type: ignore[arg-type]
                     {"tokens": base.embed_tokens})
        blocks = [(lambda layer=layer, kind=kind: DecoderBlock(copy.deepcopy(layer), config,
                                                               copy.deepcopy(base.rotary_emb),
                                                               kind == "sliding_attention"),
                   {"layer": layer}) for layer, kind in zip(base.layers, layer_types, strict=True)]
        norm = base.norm
    head = model.lm_head
    parts = [embedding, *blocks, (lambda: FinalNorm(copy.deepcopy(norm)), {"norm": norm}),
             (lambda: LMHead(copy.deepcopy(head)), {"out": head})]
    return parts, tied


def _layer_specs(model: Any) -> list[HFLayerSpec]:
    names = {id(module): name for name, module in model.named_modules()}
    parts, tied = _parts(model)
    specs = []
    for index, (factory, children) in enumerate(parts):
        tie: dict[str, Any] = {}
        if tied and index in (0, len(parts) - 1):
            tie = {"key": TIE_KEY, "tied_weight_attr": ("tokens.weight",) if index == 0 else ("out.weight",)}
        specs.append(HFLayerSpec(factory, {child: names[id(module)] for child, module in children.items()}, **tie))
    return specs


def _check_supported(model: Any) -> None:
    config = getattr(model, "config", None)
    family = getattr(config, "model_type", None)
    names = ", ".join(SUPPORTED.values())
    if family not in SUPPORTED or model.get_output_embeddings() is None:
        raise ValueError(f"from_transformers splits causal language models of {names} (model_type "
                         f"{', '.join(SUPPORTED)}); got {type(model).__name__} (model_type {family!r})")


def _load(model: Any, seed: int) -> Any:
    """A model instance: ``model`` itself, one built from a config (random weights under ``seed``), or one loaded
    from a local ``save_pretrained`` folder (never downloaded)."""
    transformers = _transformers()
    if isinstance(model, (str, os.PathLike)):
        folder = Path(model)
        if not (folder / "config.json").is_file():
            raise ValueError(f"{folder} is not a local save_pretrained folder (no config.json); bamboo never "
                             "downloads models: build one from a config, or save_pretrained it first")
        return transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True)
    if isinstance(model, transformers.PretrainedConfig):
        if model.model_type not in SUPPORTED:
            raise ValueError(f"from_transformers splits causal language models of {', '.join(SUPPORTED.values())} "
                             f"(model_type {', '.join(SUPPORTED)}); got a config of model_type {model.model_type!r}")
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed)
            return transformers.AutoModelForCausalLM.from_config(model)
    return model


def from_transformers(model: Any, *, seed: int = 0) -> SplitModel:
    """``layers, loss_fn`` of a ``transformers`` causal LM (see the module docstring).

    ``model``: a ``GPT2LMHeadModel``, ``LlamaForCausalLM`` or ``Qwen2ForCausalLM``; or a config of one (its
    weights drawn under ``seed``, so every process builds the same); or the path of a local
    ``save_pretrained`` folder. A model you build yourself must come out the same in every process (build it
    under a fixed ``torch.manual_seed``). Any other architecture is a one-line ValueError naming the
    supported ones.
    """
    model = _load(model, seed)
    _check_supported(model)
    loss_fn = CausalLMLoss(model.loss_function, int(model.config.vocab_size))
    return SplitModel(_layer_specs(model), loss_fn)


def load_state(state: Mapping[str, torch.Tensor]) -> tuple[Any, dict[str, torch.Tensor]]:
    """``(transformers model, its state dict)`` from a bamboo state dict of a split model (keys
    ``<layer index>.<name>``, as ``bamboo-launch export`` gathers them): the model is built from the config
    the embedding layer carries; ValueError when ``state`` is not of a model :func:`from_transformers` split."""
    transformers = _transformers()
    buffer = state.get(f"0.{CONFIG_BUFFER}")
    if buffer is None:
        raise ValueError("this model was not split by bamboo.rc.from_transformers (layer 0 has no hf_config): "
                         "export it with --format bamboo")
    settings = json.loads(bytes(buffer.tolist()).decode())
    settings["dtype"] = "float32"  # bamboo's weights are fp32 master weights, whatever the model was loaded as
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), **settings)
    with torch.random.fork_rng(devices=[]):
        model = transformers.AutoModelForCausalLM.from_config(config)
    specs = _layer_specs(model)
    if specs[0].key is not None:
        first, last = f"0.{specs[0].tied_weight_attr[0]}", f"{len(specs) - 1}.{specs[-1].tied_weight_attr[0]}"
        if first in state and last in state and not torch.equal(state[first], state[last]):
            raise ValueError(f"the tied input and output embeddings differ ({first} and {last}): the run did not "
                             "keep them tied")
    mapped: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        index, _, name = key.partition(".")
        child, _, rest = name.partition(".")
        if name == CONFIG_BUFFER:
            continue
        if not index.isdigit() or int(index) >= len(specs) or child not in specs[int(index)].hf_names:
            raise ValueError(f"{key!r} is not a parameter of a {SUPPORTED[config.model_type]} model of "
                             f"{len(specs)} layers")
        mapped[f"{specs[int(index)].hf_names[child]}.{rest}"] = tensor
    model.load_state_dict(mapped, strict=True)
    return model, mapped


def save_pretrained(state: Mapping[str, torch.Tensor], out: str | os.PathLike[str]) -> Any:
    """Write a bamboo state dict of a split model as a ``save_pretrained`` folder (``config.json`` and
    ``model.safetensors``) that ``AutoModelForCausalLM.from_pretrained(out)`` loads; returns the model."""
    model, _ = load_state(state)
    model.save_pretrained(str(out), safe_serialization=True)
    return model


def compare_logits(state: Mapping[str, torch.Tensor], folder: str | os.PathLike[str], *, tokens: int = 16,
                   seed: int = 0) -> float:
    """The largest difference between the logits of ``AutoModelForCausalLM.from_pretrained(folder)`` and those
    of bamboo's layers holding ``state``, on a batch of 2 sequences of ``tokens`` random token ids (eval mode:
    no dropout). 0.0 when the folder holds exactly the model bamboo trained.

    Both passes run on one intra-op thread: with several, a loaded machine can change how the BLAS library splits
    a matrix product between them, and so the order of its sums (1.8e-6 apart in one ``make test``), which says
    nothing about the weights."""
    transformers = _transformers()
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(str(folder), local_files_only=True).eval()
    layers = nn.Sequential(*[spec.build() for spec in from_transformers(reloaded).layers]).eval()
    layers.load_state_dict(dict(state), strict=True)
    positions = getattr(reloaded.config, "n_positions", None) or reloaded.config.max_position_embeddings
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, int(reloaded.config.vocab_size), (2, min(tokens, int(positions))), generator=generator)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            ours = layers(ids)
            theirs = reloaded(input_ids=ids, use_cache=False).logits
    finally:
        torch.set_num_threads(threads)
    return float((ours - theirs).abs().max())
