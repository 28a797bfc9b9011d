"""A Hugging Face ``datasets`` dataset saved to disk, as ``microbatch(step, index)`` (needs ``bamboo-rc[hf]``).

:class:`TokenDataset` opens a folder written by ``Dataset.save_to_disk`` (or a ``DatasetDict``'s, taking
one split), takes its ``input_ids`` column if it has one, and otherwise tokenizes its text column with a
tokenizer that the caller gives or that is saved beside the dataset (``tokenizer.save_pretrained`` into
the dataset's folder or its ``tokenizer/`` subfolder). The documents are packed into one flat token
array, the end-of-text token between them, and read like a token file
(:class:`~bamboo.rc.data.tokens.PackedTokens`): the same samples, in the same seeded order, wherever
and whenever they are asked for.

The tokenizing happens when the dataset is opened, in every process that opens it: for a large corpus,
write the tokens once (``write_token_file(TokenDataset(...).tokens, "corpus.bin")``) and train from the
:class:`~bamboo.rc.data.TokenFile`.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
from bamboo.rc.data.order import DataError
from bamboo.rc.data.tokens import PackedTokens

__all__ = ["TOKENIZE_BATCH", "TokenDataset"]

TOKENIZE_BATCH = 1000
"""Documents given to the tokenizer at a time."""


def _datasets() -> Any:
    try:
        import datasets
    except ImportError:
        raise DataError("TokenDataset reads a Hugging Face `datasets` dataset: pip install 'bamboo-rc[hf]'") from None
    return datasets


def _load(path: Path, split: str) -> Any:
    datasets = _datasets()
    if not path.is_dir():
        raise DataError(f"dataset {path} does not exist (a folder written by Dataset.save_to_disk)")
    try:
        loaded = datasets.load_from_disk(str(path))
    except (FileNotFoundError, ValueError) as error:
        raise DataError(f"{path} is not a dataset saved with save_to_disk: {error}") from None
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise DataError(f"dataset {path} has the splits {', '.join(loaded)}, not {split!r} (pass split=)")
        loaded = loaded[split]
    return loaded


def _tokenizer(path: Path, tokenizer: Any) -> Any:
    """The tokenizer given (an object, or a folder ``save_pretrained`` wrote), or the one saved beside the
    dataset; DataError if there is none."""
    if tokenizer is not None and not isinstance(tokenizer, (str, os.PathLike)):
        return tokenizer
    candidates = [Path(tokenizer)] if tokenizer is not None else [path, path / "tokenizer"]
    for folder in candidates:
        if (folder / "tokenizer_config.json").is_file() or (folder / "tokenizer.json").is_file():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(folder))
    if tokenizer is not None:
        raise DataError(f"{tokenizer} holds no tokenizer (tokenizer.json or tokenizer_config.json)")
    raise DataError(f"dataset {path} has no input_ids column and no tokenizer beside it: pass tokenizer=, or save one "
                    f"with tokenizer.save_pretrained('{path / 'tokenizer'}')")


def _pack(dataset: Any, text_column: str, tokenizer: Any, path: Path) -> np.ndarray:
    """Every document's token ids, one after another, the end-of-text token after each (if the tokenizer has
    one)."""
    if text_column not in dataset.column_names:
        raise DataError(f"dataset {path} has no column {text_column!r} (its columns: "
                        f"{', '.join(dataset.column_names)}; pass text_column=)")
    eos = getattr(tokenizer, "eos_token_id", None)
    pieces: list[np.ndarray] = []
    for batch in dataset.iter(batch_size=TOKENIZE_BATCH):
        for ids in tokenizer(batch[text_column], add_special_tokens=False)["input_ids"]:
            pieces.append(np.asarray([*ids, eos] if eos is not None else ids, dtype=np.int64))
    return np.concatenate(pieces) if pieces else np.zeros(0, dtype=np.int64)


class TokenDataset(PackedTokens):
    """A dataset saved with ``save_to_disk`` as ``microbatch(step, index)`` (see the module docstring).

    ``tokenizer``: a tokenizer, or the folder of one; by default the one saved beside the dataset (only
    needed when the dataset has no ``input_ids`` column). ``vocab_size``: the model's vocabulary; a tokenizer
    with more tokens, or ids outside it, is an error that says so.
    """

    def __init__(self, path: str | os.PathLike[str], *, seq_len: int, micro_batch: int, seed: int = 0,
                 tokenizer: Any = None, text_column: str = "text", split: str = "train",
                 vocab_size: int | None = None, global_microbatches: int | None = None) -> None:
        path = Path(path)
        dataset = _load(path, split)
        if "input_ids" in dataset.column_names:
            flat = [np.asarray(ids, dtype=np.int64) for ids in dataset["input_ids"]]
            tokens = np.concatenate(flat) if flat else np.zeros(0, dtype=np.int64)
        else:
            found = _tokenizer(path, tokenizer)
            if vocab_size is not None and len(found) > vocab_size:
                raise DataError(f"the tokenizer of {path} has {len(found)} tokens, more than the model's vocabulary "
                                f"of {vocab_size}: train with the model's own tokenizer, or a model with a larger "
                                "vocab_size")
            tokens = _pack(dataset, text_column, found, path)
        super().__init__(tokens, seq_len=seq_len, micro_batch=micro_batch, seed=seed, vocab_size=vocab_size,
                         global_microbatches=global_microbatches, name=f"dataset {path}", path=path)
