"""The stdlib corpus and the deterministic global-batch sampler."""

from __future__ import annotations

import itertools

import torch
from bamboo.rc.data import GlobalBatchSampler, pipeline_data_iter, stdlib_corpus
from hypothesis import given, settings
from hypothesis import strategies as st


def test_corpus_is_python_source_in_a_fixed_order() -> None:
    corpus = stdlib_corpus()
    assert len(corpus) == 4_000_000
    assert corpus == stdlib_corpus.__wrapped__()  # read again from disk: the same bytes
    assert b"def " in corpus and b"import " in corpus


@settings(deadline=None, max_examples=15)
@given(
    micro_batches=st.integers(1, 4),
    pipelines_a=st.sampled_from([1, 2, 3, 4]),
    pipelines_b=st.sampled_from([1, 2, 3, 4]),
    steps=st.integers(1, 3),
)
def test_global_batches_are_identical_for_any_number_of_pipelines(
    micro_batches: int, pipelines_a: int, pipelines_b: int, steps: int
) -> None:
    """Split the same global batch among D_a and D_b pipelines: the union per step is identical."""
    sampler = GlobalBatchSampler(micro_batch_size=2, sequence=16, seed=7)
    global_size = micro_batches * 12  # divisible by 1, 2, 3, 4

    def per_step(pipelines: int) -> list[list[torch.Tensor]]:
        share = global_size // pipelines
        iterators = [pipeline_data_iter(sampler, d, share) for d in range(pipelines)]
        steps_seen = []
        for _ in range(steps):
            batch = []
            for iterator in iterators:
                batch += [tokens for tokens, _ in itertools.islice(iterator, share)]
            steps_seen.append(batch)
        return steps_seen

    a, b = per_step(pipelines_a), per_step(pipelines_b)
    for step_a, step_b in zip(a, b, strict=True):
        assert len(step_a) == len(step_b) == global_size
        assert all(torch.equal(x, y) for x, y in zip(step_a, step_b, strict=True))


def test_labels_are_the_next_bytes_and_steps_differ() -> None:
    sampler = GlobalBatchSampler(micro_batch_size=3, sequence=8)
    batch = sampler.microbatch(0, 0)
    assert batch.tokens.shape == batch.labels.shape == (3, 8)
    assert torch.equal(batch.tokens[:, 1:], batch.labels[:, :-1])
    assert not torch.equal(sampler.microbatch(1, 0).tokens, batch.tokens)
    assert torch.equal(GlobalBatchSampler(3, 8).microbatch(0, 0).tokens, batch.tokens)
