"""Benchmark: the data path against the training step, same run.

Run: `.venv/bin/python tests/benchmarks/bench_data.py` (add `--help` for the flags). Not collected by pytest.

The data: `bamboo.rc.data.TokenFile` over a token file of the Python standard library's source (a memory
map; every microbatch gathers its samples in the epoch's seeded order) and `TokenDataset` over the same text
saved with `datasets` and tokenized byte by byte at open (then packed in memory). For each, the samples per
second of `microbatch(step, index)` alone, over `--calls` microbatches of consecutive steps, in one thread.

The step: small `transformers` models split by `bamboo.rc.from_transformers`, trained in one process
(`bamboo.rc.reference.reference_step`: M microbatches, forward, backward, AdamW step; one intra-op thread,
as a bamboo worker runs) on the same `TokenFile`: samples per second of training. Each row prints how many
times faster the data path is than that step (a node of a pipeline runs a fraction of the model per
sample, so a stage needs data faster in proportion: the ratio must stay well above the number of stages).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import numpy as np
import torch
from bamboo.rc import from_transformers, load_config
from bamboo.rc.data import TokenFile, stdlib_corpus, write_token_file
from bamboo.rc.reference import reference_step
from bamboo.rc.state import TrainableSlice
from bamboo.rc.worker import exact_mode

MODELS = {
    "gpt2-tiny": {"model_type": "gpt2", "n_layer": 2, "n_embd": 64, "n_head": 4},
    "gpt2-small": {"model_type": "gpt2", "n_layer": 4, "n_embd": 256, "n_head": 8},
    "llama-small": {"model_type": "llama", "num_hidden_layers": 4, "hidden_size": 256, "num_attention_heads": 8,
                    "num_key_value_heads": 4, "intermediate_size": 512},
}


def data_rate(data: Any, calls: int, global_microbatches: int, micro_batch: int) -> float:
    """Samples per second of ``data(step, index)`` over ``calls`` consecutive microbatches."""
    started = time.perf_counter()
    for n in range(calls):
        data(*divmod(n, global_microbatches))
    return calls * micro_batch / (time.perf_counter() - started)


def train_rate(name: str, tokens: Path, seq_len: int, micro_batch: int, micro_batches: int, steps: int) -> float:
    """Samples per second of single-process training steps of model ``name`` (the first step is warm-up)."""
    import transformers

    settings = dict(MODELS[name])
    positions = {"n_positions": seq_len} if settings["model_type"] == "gpt2" else {"max_position_embeddings": seq_len}
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), vocab_size=256, **positions, **settings)
    layers, loss_fn = from_transformers(config)
    data = TokenFile(tokens, seq_len=seq_len, micro_batch=micro_batch, global_microbatches=micro_batches)
    training = load_config({"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": micro_batches,
                            "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}, "gradient_clipping": 1.0})
    whole = TrainableSlice(layers, range(len(layers)), training, seed=0)
    times = []
    for step in range(steps):
        started = time.perf_counter()
        reference_step(whole, loss_fn, training, data, step, 1, micro_batches)
        times.append(time.perf_counter() - started)
    return micro_batch * micro_batches / statistics.median(times[1:])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq-len", type=int, default=128, help="tokens per sample (default: %(default)s)")
    parser.add_argument("--micro-batch", type=int, default=4, help="samples per microbatch (default: %(default)s)")
    parser.add_argument("--micro-batches", type=int, default=4, help="microbatches per step (default: %(default)s)")
    parser.add_argument("--calls", type=int, default=4000, help="microbatches read per data source (default: "
                        "%(default)s)")
    parser.add_argument("--steps", type=int, default=6, help="training steps per model; the first is warm-up "
                        "(default: %(default)s)")
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS),
                        help="models to train (default: all)")
    parser.add_argument("--json", type=Path, default=None, help="also write the results to this JSON file")
    args = parser.parse_args(argv)
    exact_mode()
    text = stdlib_corpus()
    results: dict[str, Any] = {"seq_len": args.seq_len, "micro_batch": args.micro_batch,
                               "micro_batches": args.micro_batches, "torch_threads": torch.get_num_threads()}
    with tempfile.TemporaryDirectory(prefix="bamboo-bench-data-") as folder:
        tokens = write_token_file(np.frombuffer(text, dtype=np.uint8), Path(folder) / "stdlib.bin")
        token_file = TokenFile(tokens, seq_len=args.seq_len, micro_batch=args.micro_batch,
                               global_microbatches=args.micro_batches, vocab_size=256)
        rates = {"TokenFile": data_rate(token_file, args.calls, args.micro_batches, args.micro_batch)}
        import datasets
        from bamboo.rc.data import TokenDataset

        datasets.disable_progress_bars()
        lines = text.decode(errors="replace").splitlines()
        datasets.Dataset.from_dict({"input_ids": [[*line.encode(), 10] for line in lines]}).save_to_disk(
            str(Path(folder) / "dataset"))
        dataset = TokenDataset(Path(folder) / "dataset", seq_len=args.seq_len, micro_batch=args.micro_batch,
                               global_microbatches=args.micro_batches, vocab_size=256)
        rates["TokenDataset"] = data_rate(dataset, args.calls, args.micro_batches, args.micro_batch)
        results["data_samples_per_second"] = rates
        print(f"{len(token_file.tokens)} tokens, samples of {args.seq_len + 1}, micro batch {args.micro_batch}")
        for source, rate in rates.items():
            print(f"  {source:<13} microbatch() alone: {rate:12.0f} samples/s")
        print(f"\n{'model':<12} {'params':>10} {'train samples/s':>16} {'TokenFile / train':>18} "
              f"{'TokenDataset / train':>21}")
        results["models"] = {}
        for name in args.models:
            rate = train_rate(name, tokens, args.seq_len, args.micro_batch, args.micro_batches, args.steps)
            layers = from_transformers_params(name, args.seq_len)
            results["models"][name] = {"parameters": layers, "train_samples_per_second": rate,
                                       "token_file_over_train": rates["TokenFile"] / rate,
                                       "token_dataset_over_train": rates["TokenDataset"] / rate}
            print(f"{name:<12} {layers:>10} {rate:16.1f} {rates['TokenFile'] / rate:17.0f}x "
                  f"{rates['TokenDataset'] / rate:20.0f}x", flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(results, indent=2) + "\n")
    return 0


def from_transformers_params(name: str, seq_len: int) -> int:
    """The parameter count of model ``name`` (its tied embedding counted once)."""
    import transformers

    settings = dict(MODELS[name])
    positions = {"n_positions": seq_len} if settings["model_type"] == "gpt2" else {"max_position_embeddings": seq_len}
    config = transformers.AutoConfig.for_model(settings.pop("model_type"), vocab_size=256, **positions, **settings)
    return sum(p.numel() for p in transformers.AutoModelForCausalLM.from_config(config).parameters())


if __name__ == "__main__":
    raise SystemExit(main())
