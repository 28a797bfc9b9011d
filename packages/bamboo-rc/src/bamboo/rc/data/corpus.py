"""The example corpus and its deterministic sampler (``bamboo-rc verify``'s and the built-in example's data).

The corpus is the Python standard library's source text (`*.py` under
`sysconfig.get_paths()["stdlib"]`), read as bytes in a fixed order (a depth-first walk with
sorted names, leaving out installed packages): every machine with this
Python has the very same bytes. :class:`GlobalBatchSampler` draws the microbatch at global index
`i` of step `s` from a generator seeded with `(seed, s, i)`, so the global batch of a step is the
same whatever the number of pipelines D that split it.
"""

from __future__ import annotations

import functools
import os
import sysconfig
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import numpy as np
import torch

__all__ = ["GlobalBatchSampler", "Microbatch", "pipeline_data_iter", "stdlib_corpus"]


_SKIPPED_DIRECTORIES = frozenset({"site-packages", "dist-packages", "__pycache__"})


@functools.lru_cache(maxsize=2)
def stdlib_corpus(limit_bytes: int = 4_000_000) -> bytes:
    """The first `limit_bytes` of the standard library's `.py` sources, in a fixed file order."""
    root = Path(sysconfig.get_paths()["stdlib"])
    chunks: list[bytes] = []
    total = 0
    # A depth-first walk with sorted directory and file names: a fixed order that stops early.
    for directory, subdirectories, files in os.walk(root):
        subdirectories[:] = sorted(d for d in subdirectories if d not in _SKIPPED_DIRECTORIES)
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            try:
                data = (Path(directory) / name).read_bytes()
            except OSError:
                continue
            chunks.append(data)
            total += len(data)
        if total >= limit_bytes:
            break
    corpus = b"".join(chunks)[:limit_bytes]
    if len(corpus) < 1024:
        raise RuntimeError(f"the standard library under {root} holds too little source text")
    return corpus


@attrs.frozen
class Microbatch:
    """Input bytes and next-byte labels, both int64 [micro_batch_size, sequence]."""

    tokens: torch.Tensor
    labels: torch.Tensor


@attrs.frozen
class GlobalBatchSampler:
    """Deterministic microbatches keyed by (step, index of the microbatch in the global batch)."""

    micro_batch_size: int
    sequence: int
    seed: int = 0
    corpus: bytes = attrs.field(factory=stdlib_corpus, repr=False)

    def microbatch(self, step: int, index: int) -> Microbatch:
        """The microbatch at global position `index` of step `step`."""
        if step < 0 or index < 0:
            raise ValueError(f"step and index must be >= 0, got step={step} index={index}")
        rng = np.random.default_rng([self.seed, step, index])
        starts = rng.integers(0, len(self.corpus) - self.sequence - 1, size=self.micro_batch_size)
        view = np.frombuffer(self.corpus, dtype=np.uint8)
        rows = np.stack([view[s : s + self.sequence + 1] for s in starts]).astype(np.int64)
        window = torch.from_numpy(rows)
        return Microbatch(tokens=window[:, :-1].contiguous(), labels=window[:, 1:].contiguous())

    def global_batch(self, step: int, microbatches: int) -> list[Microbatch]:
        """All `microbatches` microbatches of step `step`, in global order."""
        return [self.microbatch(step, index) for index in range(microbatches)]


def pipeline_data_iter(
    data: GlobalBatchSampler | Callable[[int, int], tuple[torch.Tensor, torch.Tensor]], pipeline: int,
    micro_batches: int, first_step: int = 0,
) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """DeepSpeed-style `(inputs, labels)` iterator for pipeline `pipeline` of D, over the example's sampler or any
    ``microbatch(step, index)`` (a :class:`~bamboo.rc.data.TokenFile`, say).

    Pipeline d takes global microbatches `d*M .. d*M+M-1` of every step, so any D sees the same
    global batch of D*M microbatches.
    """
    step = first_step
    while True:
        for k in range(micro_batches):
            index = pipeline * micro_batches + k
            if isinstance(data, GlobalBatchSampler):
                batch = data.microbatch(step, index)
                yield batch.tokens, batch.labels
            else:
                yield data(step, index)
        step += 1
