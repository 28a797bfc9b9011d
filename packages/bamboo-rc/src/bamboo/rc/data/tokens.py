"""Packed token samples: a flat token array cut into samples, read in :class:`~bamboo.rc.data.order.SampleOrder`.

A corpus is one flat array of token ids, documents one after another (a tokenizer's end-of-text token
between them): *packed*, so every position of every sample is a real token. Sample ``i`` is the
``seq_len + 1`` tokens from ``i * seq_len``: its inputs are the first ``seq_len``, its labels the last
``seq_len`` (each token's label is the next token), so neighbouring samples share one token and the
array holds ``(tokens - 1) // seq_len`` samples.

:class:`TokenFile` memory-maps such an array from a file of raw little-endian ``uint16`` or ``uint32``
values, the ``.bin`` files nanoGPT-style preprocessing writes (:func:`write_token_file` writes one):
nothing is read until a microbatch needs it, so a file of billions of tokens opens at once.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
from bamboo.rc.data.order import DataError, SampleOrder

__all__ = ["PackedTokens", "TokenFile", "bind_global_batch", "write_token_file"]

TOKEN_DTYPES = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
"""The token file formats: little-endian 16-bit (vocabularies up to 65536) or 32-bit ids."""

VOCAB_CHECK_TOKENS = 1 << 20
"""Tokens from the start of a token file checked against ``vocab_size`` when it is opened (every microbatch
is checked as it is read, too): enough to catch a file of the wrong dtype at once."""


def bind_global_batch(microbatch: Callable[..., Any], global_microbatches: int, micro_batch_size: int) -> None:
    """Tell a data source the run's global batch (``global_microbatches`` microbatches of ``micro_batch_size``
    samples per step), if it asks for it (has ``bind_global_batch``, as :class:`TokenFile` and
    :class:`~bamboo.rc.data.TokenDataset` have); other callables are left alone."""
    bind = getattr(microbatch, "bind_global_batch", None)
    if callable(bind):
        bind(global_microbatches, micro_batch_size)


class PackedTokens:
    """``microbatch(step, index) -> (inputs, labels)`` over a flat token array (see the module docstring).

    ``global_microbatches`` (microbatches per step in the global batch) fixes the order of samples; bamboo
    sets it when a run starts (:func:`bind_global_batch`), or give it here for use outside bamboo.
    """

    def __init__(self, tokens: np.ndarray, *, seq_len: int, micro_batch: int, seed: int = 0,
                 vocab_size: int | None = None, global_microbatches: int | None = None, name: str = "tokens",
                 path: Path | None = None) -> None:
        if seq_len < 1 or micro_batch < 1:
            raise DataError(f"seq_len and micro_batch must be >= 1, got seq_len={seq_len} micro_batch={micro_batch}")
        if seed < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        self.tokens = tokens
        self.seq_len = seq_len
        self.micro_batch = micro_batch
        self.seed = seed
        self.vocab_size = vocab_size
        self.name = name
        self.path = path
        """The file or folder the tokens come from (None: an array given in memory)."""
        self.samples = (len(tokens) - 1) // seq_len if len(tokens) > 0 else 0
        if self.samples < 1:
            raise DataError(f"{name} holds {len(tokens)} tokens, fewer than one sample of seq_len + 1 = {seq_len + 1}")
        if vocab_size is not None:
            self._check_vocabulary(tokens[:VOCAB_CHECK_TOKENS], "its first tokens")
        self._offsets = np.arange(seq_len + 1, dtype=np.int64)
        self.order: SampleOrder | None = None
        if global_microbatches is not None:
            self.bind_global_batch(global_microbatches, micro_batch)

    def bind_global_batch(self, global_microbatches: int, micro_batch_size: int) -> None:
        """Fix the order of samples for a global batch of ``global_microbatches`` microbatches per step; the run's
        micro batch size must be this data's ``micro_batch``, and one global batch must fit in the data. Binding
        again to another global batch would change the order: an error."""
        if micro_batch_size != self.micro_batch:
            raise DataError(f"{self.name} gives microbatches of {self.micro_batch} samples, but the run's "
                            f"train_micro_batch_size_per_gpu is {micro_batch_size}")
        if self.order is not None:
            if self.order.global_microbatches != global_microbatches:
                raise DataError(f"{self.name} reads a global batch of {self.order.global_microbatches} microbatches; "
                                f"this run's is {global_microbatches}: the order of samples would change")
            return
        if global_microbatches * micro_batch_size > self.samples:
            raise DataError(f"{self.name} holds {self.samples} samples of {self.seq_len + 1} tokens, fewer than one "
                            f"global batch of {global_microbatches} x {micro_batch_size} samples")
        self.order = SampleOrder(self.samples, micro_batch_size, global_microbatches, self.seed)

    def sample_ids(self, step: int, index: int) -> np.ndarray:
        """The samples (their numbers) of global microbatch ``index`` of step ``step``, one per row."""
        if self.order is None:
            raise DataError(f"{self.name} does not know the run's global batch yet: bamboo tells it when a run "
                            "starts (bamboo.rc.initialize, train_worker), or pass global_microbatches=")
        return self.order.sample_ids(step, index)

    def __call__(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(inputs, labels)``, both int64 ``[micro_batch, seq_len]``: global microbatch ``index`` of ``step``."""
        starts = self.sample_ids(step, index) * self.seq_len
        window = torch.from_numpy(self.tokens[starts[:, None] + self._offsets].astype(np.int64))  # one gather
        if self.vocab_size is not None:
            self._check_vocabulary(window, f"microbatch ({step}, {index})")
        return window[:, :-1].contiguous(), window[:, 1:].contiguous()

    def __repr__(self) -> str:
        where = f"{str(self.path)!r}, " if self.path is not None else ""
        return (f"{type(self).__name__}({where}seq_len={self.seq_len}, micro_batch={self.micro_batch}, "
                f"seed={self.seed}: {len(self.tokens)} tokens, {self.samples} samples)")

    def _check_vocabulary(self, tokens: Any, where: str) -> None:
        assert self.vocab_size is not None
        largest = int(tokens.max()) if len(tokens) else -1
        if largest >= self.vocab_size:
            raise DataError(f"{self.name}: {where} hold token id {largest}, outside the model's vocabulary of "
                            f"{self.vocab_size} (another tokenizer's tokens, or a file of another dtype?)")


class TokenFile(PackedTokens):
    """A memory-mapped token file as ``microbatch(step, index)`` (see the module docstring).

    ``dtype``: ``"uint16"`` (nanoGPT's) or ``"uint32"``. ``vocab_size``: the model's vocabulary, checked on
    the file's first tokens and on every microbatch read (a file of another tokenizer or dtype is an error
    that says so, instead of an index error inside the embedding).
    """

    def __init__(self, path: str | os.PathLike[str], *, seq_len: int, micro_batch: int, seed: int = 0,
                 dtype: str = "uint16", vocab_size: int | None = None,
                 global_microbatches: int | None = None) -> None:
        path = Path(path)
        if dtype not in TOKEN_DTYPES:
            raise DataError(f"token file dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
        if not path.is_file():
            raise DataError(f"token file {path} does not exist")
        size = path.stat().st_size
        width = TOKEN_DTYPES[dtype].itemsize
        if size % width:
            other = "uint16" if dtype == "uint32" else "uint32"
            raise DataError(f"token file {path} has {size} bytes, not a whole number of {dtype} tokens ({width} bytes "
                            f"each): is it {other}?")
        tokens = np.memmap(path, dtype=TOKEN_DTYPES[dtype], mode="r") if size else np.zeros(0, TOKEN_DTYPES[dtype])
        self.dtype = dtype
        super().__init__(tokens, seq_len=seq_len, micro_batch=micro_batch, seed=seed, vocab_size=vocab_size,
                         global_microbatches=global_microbatches, name=f"token file {path}", path=path)


def write_token_file(tokens: Any, path: str | os.PathLike[str], dtype: str | None = None) -> Path:
    """Write a flat array of token ids as a token file (atomically: a temporary file renamed into place);
    ``dtype`` defaults to ``uint16`` when every id fits, else ``uint32``. Returns the path."""
    array = np.asarray(tokens)
    if array.ndim != 1 or (array.size and (array.min() < 0 or not np.issubdtype(array.dtype, np.integer))):
        raise DataError(f"a token file holds a flat array of non-negative integer ids, got {array.dtype} of shape "
                        f"{array.shape}")
    if dtype is None:
        dtype = "uint16" if not array.size or int(array.max()) < 2**16 else "uint32"
    if dtype not in TOKEN_DTYPES:
        raise DataError(f"token file dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
    if array.size and int(array.max()) >= 2 ** (8 * TOKEN_DTYPES[dtype].itemsize):
        raise DataError(f"token id {int(array.max())} does not fit {dtype}")
    path = Path(path)
    partial = path.with_name(path.name + ".tmp")
    array.astype(TOKEN_DTYPES[dtype]).tofile(partial)
    os.replace(partial, path)
    return path
