"""Train a Hugging Face model (a small GPT-2 or Llama, built from a config) on a token file, under bamboo-launch.

Make a token file from text that ships with Python, then train on an emulated spot cluster with a kill and
a joiner (the trace kills node1 and the standby node takes its place), check the result against a
fault-free single-process run, and export a folder that ``transformers`` loads (``--preload`` imports the model's
code once, in the interpreter the nodes are forked from, instead of in every worker)::

    python packages/bamboo-launch/examples/stdlib_tokens.py /tmp/stdlib.bin
    bamboo-launch run --nodes 5 --stages 2 --pipelines 2 --steps 30 --zones a,b,c --time-scale 1 \\
        --preemptions packages/bamboo-launch/examples/kill_node1.csv --run-dir /tmp/hf-run --verify \\
        --preload transformers.models.gpt2.modeling_gpt2 -- \\
        packages/bamboo-launch/examples/train_hf.py --model gpt2 --tokens /tmp/stdlib.bin
    bamboo-launch export /tmp/hf-run --format hf -o /tmp/hf-model
    python -c "import transformers; print(transformers.AutoModelForCausalLM.from_pretrained('/tmp/hf-model'))"

The script gives ``bamboo.launch.train_worker`` what ``bamboo.rc.from_transformers`` makes of the model (its
layers, tied embeddings kept tied, and the model's own loss), and a ``TokenFile`` as the data: samples of
``--seq-len + 1`` tokens, in a seeded shuffle per epoch, the same for any number of pipelines, after a
failover, a joiner or ``--resume``. ``--precision bf16`` or ``fp16`` adds DeepSpeed's ``bf16`` or ``fp16``
section (fp16 with dynamic loss scaling); ``--verify``'s reference trains in the same precision.
"""

from __future__ import annotations

import argparse
from typing import Any

import bamboo.launch
from bamboo.rc import from_transformers
from bamboo.rc.data import TokenFile

VOCABULARY = 256
"""The token file of ``stdlib_tokens.py`` holds bytes."""


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description="A Hugging Face causal LM trained under bamboo-launch run.")
    parser.add_argument("--model", choices=["gpt2", "llama"], default="gpt2", help="the architecture (default: "
                        "%(default)s)")
    parser.add_argument("--tokens", required=True, help="the token file (uint16; stdlib_tokens.py writes one)")
    parser.add_argument("--layers", type=int, default=2, help="decoder blocks (default: %(default)s)")
    parser.add_argument("--width", type=int, default=64, help="hidden size (default: %(default)s)")
    parser.add_argument("--heads", type=int, default=4, help="attention heads (default: %(default)s)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sample (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per microbatch (default: %(default)s)")
    parser.add_argument("--precision", choices=["fp32", "bf16", "fp16"], default="fp32",
                        help="fp32, or bf16 / fp16 autocast over fp32 weights (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of the model's weights and of the data's "
                        "order (default: %(default)s)")
    return parser.parse_args()


def model_config(args: argparse.Namespace) -> Any:
    """A small GPT-2 (tied embeddings, learned positions, dropout) or Llama (RMSNorm, rotary positions, SwiGLU,
    grouped-query attention) of the given size."""
    import transformers

    if args.model == "gpt2":
        return transformers.GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads,
                                       vocab_size=VOCABULARY, n_positions=args.seq_len, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(num_hidden_layers=args.layers, hidden_size=args.width,
                                    num_attention_heads=args.heads, num_key_value_heads=max(1, args.heads // 2),
                                    intermediate_size=2 * args.width, vocab_size=VOCABULARY,
                                    max_position_embeddings=args.seq_len, bos_token_id=0, eos_token_id=0)


def main() -> None:
    args = parse_args()
    layers, loss_fn = from_transformers(model_config(args), seed=args.seed)
    data = TokenFile(args.tokens, seq_len=args.seq_len, micro_batch=args.micro_batch, seed=args.seed,
                     vocab_size=VOCABULARY)
    config: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": args.micro_batch,
        "gradient_accumulation_steps": 4,
        "optimizer": {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "weight_decay": 0.1}},
        "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3,
                                                     "warmup_num_steps": 10}},
        "gradient_clipping": 1.0,
    }
    if args.precision == "bf16":
        config["bf16"] = {"enabled": True}
    elif args.precision == "fp16":
        config["fp16"] = {"enabled": True, "initial_scale_power": 16, "loss_scale_window": 100, "hysteresis": 2}
    bamboo.launch.train_worker(layers=layers, loss_fn=loss_fn, microbatch=data, config=config)


if __name__ == "__main__":
    main()
