"""Data as a function of its position: ``microbatch(step, index) -> (inputs, labels)``.

Every node that runs a microbatch (its pipeline's node, the shadow that redoes it after a failure, a
joiner, the ``--verify`` reference, a run resumed from a checkpoint) asks for it by ``(step, global
microbatch index)``, and gets the same samples. This package holds such functions:

- :class:`TokenFile`: a memory-mapped flat ``uint16``/``uint32`` token file (the ``.bin`` files that
  nanoGPT-style pipelines write), cut into packed samples of ``seq_len + 1`` tokens, in a seeded shuffle
  per epoch (:mod:`bamboo.rc.data.tokens`);
- :class:`TokenDataset`: a Hugging Face ``datasets`` dataset saved to disk (``save_to_disk``), tokenized
  with a tokenizer given or saved beside it and packed the same way (:mod:`bamboo.rc.data.hf_datasets`;
  needs ``bamboo-rc[hf]``);
- :class:`GlobalBatchSampler` and :func:`stdlib_corpus`: the built-in example's bytes of the Python standard
  library (:mod:`bamboo.rc.data.corpus`).

The order of samples is a function of the global batch (``global_microbatches`` microbatches of
``micro_batch`` samples per step), never of how many pipelines share it; bamboo tells a data source its
global batch (:func:`bind_global_batch`) when ``bamboo.rc.initialize`` or a reference starts with it.
"""

from bamboo.rc.data.corpus import GlobalBatchSampler, Microbatch, pipeline_data_iter, stdlib_corpus
from bamboo.rc.data.order import DataError, SampleOrder
from bamboo.rc.data.tokens import TokenFile, bind_global_batch, write_token_file

__all__ = [
    "DataError",
    "GlobalBatchSampler",
    "Microbatch",
    "SampleOrder",
    "TokenDataset",
    "TokenFile",
    "bind_global_batch",
    "pipeline_data_iter",
    "stdlib_corpus",
    "write_token_file",
]


def __getattr__(name: str) -> object:
    if name == "TokenDataset":  # needs the `datasets` package: imported on first use
        from bamboo.rc.data.hf_datasets import TokenDataset

        return TokenDataset
    raise AttributeError(f"module 'bamboo.rc.data' has no attribute {name!r}")
