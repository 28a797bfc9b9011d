"""Token data as a function of its position: packed samples of a token file or a saved ``datasets`` dataset, a
seeded shuffle per epoch, the same samples whatever the number of pipelines or a resume, and one-line errors."""

from __future__ import annotations

import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
from bamboo.rc import load_config
from bamboo.rc.data import DataError, SampleOrder, TokenFile, stdlib_corpus, write_token_file
from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss
from bamboo.rc.reference import reference_step
from bamboo.rc.state import TrainableSlice


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    """The first 20 000 bytes of the standard library's source as uint16 tokens (a byte-level vocabulary)."""
    return write_token_file(np.frombuffer(stdlib_corpus(20_000), dtype=np.uint8), tmp_path / "stdlib.bin")


def test_samples_are_packed_windows_of_the_file(token_file: Path) -> None:
    tokens = np.fromfile(token_file, dtype=np.uint16)
    data = TokenFile(token_file, seq_len=16, micro_batch=3, seed=5, global_microbatches=4, vocab_size=256)
    assert data.samples == (len(tokens) - 1) // 16
    inputs, labels = data(2, 1)
    assert inputs.shape == labels.shape == (3, 16) and inputs.dtype == torch.int64
    for row, sample in enumerate(data.sample_ids(2, 1)):
        window = torch.from_numpy(tokens[sample * 16 : sample * 16 + 17].astype(np.int64))
        assert torch.equal(inputs[row], window[:-1]) and torch.equal(labels[row], window[1:])  # the next token


def test_every_epoch_reads_every_sample_once_in_its_own_order() -> None:
    order = SampleOrder(samples=50, micro_batch=3, global_microbatches=2, seed=7)
    stream = [int(s) for step in range(40) for index in range(2) for s in order.sample_ids(step, index)]
    epochs = [stream[e * 50 : (e + 1) * 50] for e in range(4)]
    assert all(sorted(epoch) == list(range(50)) for epoch in epochs)  # microbatches straddle epochs: still once
    assert len({tuple(epoch) for epoch in epochs}) == 4 and epochs[0] != list(range(50))
    assert order.epoch(25) == 3.0
    other_seed = SampleOrder(samples=50, micro_batch=3, global_microbatches=2, seed=8)
    assert not np.array_equal(order.sample_ids(0, 0), other_seed.sample_ids(0, 0))


def test_the_samples_are_the_same_for_any_number_of_pipelines_and_after_a_restart(token_file: Path) -> None:
    def run(pipelines: int, steps: range, data: TokenFile) -> dict[tuple[int, int], torch.Tensor]:
        per_pipeline = 8 // pipelines  # the global batch is kept: fewer pipelines run more microbatches each
        seen = {}
        for step in steps:
            for pipeline in range(pipelines):
                for k in range(per_pipeline):
                    index = pipeline * per_pipeline + k
                    seen[(step, index)] = data(step, index)[0]
        return seen

    def fresh() -> TokenFile:
        return TokenFile(token_file, seq_len=8, micro_batch=2, seed=1, global_microbatches=8)

    one = run(1, range(6), fresh())
    for pipelines in (2, 4, 8):
        assert all(torch.equal(one[key], tensor) for key, tensor in run(pipelines, range(6), fresh()).items())
    resumed = run(2, range(3, 6), fresh())  # a new process after --resume at step 3: nothing carried but the step
    assert all(torch.equal(one[key], tensor) for key, tensor in resumed.items())


def test_a_resumed_run_trains_the_same_samples_and_ends_bit_equal(token_file: Path) -> None:
    """Steps 0..3 at once, against steps 0..1, the state saved and loaded into a fresh slice, then steps 2..3
    from a freshly opened file: the same samples, the same parameters, bit for bit."""
    config = load_config({"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                          "optimizer": {"type": "AdamW", "params": {"lr": 1e-2}}})
    specs = gpt_layer_specs(GPTSize(layers=1, width=16, heads=2, sequence=8))

    class Recorded(TokenFile):
        def __init__(self) -> None:
            super().__init__(token_file, seq_len=8, micro_batch=2, seed=3, global_microbatches=2)
            self.read: list[tuple[int, tuple[int, ...]]] = []

        def __call__(self, step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
            self.read.append((step, tuple(int(s) for s in self.sample_ids(step, index))))
            return super().__call__(step, index)

    straight, data = TrainableSlice(specs, range(3), config, 0), Recorded()
    for step in range(4):
        reference_step(straight, lm_loss, config, data, step, 1, 2)
    first, before = TrainableSlice(specs, range(3), config, 0), Recorded()
    for step in range(2):
        reference_step(first, lm_loss, config, before, step, 1, 2)
    resumed, after = TrainableSlice(specs, range(3), config, 0), Recorded()
    resumed.load_state_bytes(first.state_bytes())
    for step in range(2, 4):
        reference_step(resumed, lm_loss, config, after, step, 1, 2)
    assert before.read + after.read == data.read
    assert all(torch.equal(p, q) for p, q in zip(straight.parameters, resumed.parameters, strict=True))


@pytest.mark.parametrize(
    ("content", "options", "message"),
    [
        (b"\x01\x00\x02", {}, "has 3 bytes, not a whole number of uint16 tokens (2 bytes each): is it uint32?"),
        (np.arange(300, dtype=np.uint16).tobytes(), {"dtype": "uint32"},
         "hold token id 19595562, outside the model's vocabulary of 256"),
        (np.arange(40, dtype=np.uint16).tobytes(), {"global_microbatches": 4},
         "holds 4 samples of 9 tokens, fewer than one global batch of 4 x 2 samples"),
        (np.arange(4, dtype=np.uint16).tobytes(), {}, "holds 4 tokens, fewer than one sample of seq_len + 1 = 9"),
        (b"", {"dtype": "int8"}, "token file dtype must be one of uint16, uint32, got 'int8'"),
    ],
)
def test_a_bad_token_file_is_one_line_naming_it(tmp_path: Path, content: bytes, options: dict, message: str) -> None:
    path = tmp_path / "bad.bin"
    path.write_bytes(content)
    with pytest.raises(DataError) as error:
        TokenFile(path, seq_len=8, micro_batch=2, **{"vocab_size": 256, **options})
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_run_binds_the_global_batch_once(token_file: Path) -> None:
    data = TokenFile(token_file, seq_len=8, micro_batch=2)
    with pytest.raises(DataError, match="does not know the run's global batch yet"):
        data(0, 0)
    with pytest.raises(DataError, match="gives microbatches of 2 samples, but the run's train_micro_batch_size_per_gpu is 4"):
        data.bind_global_batch(8, 4)
    data.bind_global_batch(8, 2)
    data.bind_global_batch(8, 2)  # again, the same: fine
    with pytest.raises(DataError, match="reads a global batch of 8 microbatches; this run's is 4"):
        data.bind_global_batch(4, 2)
    with pytest.raises(DataError, match=r"the index in 0..7"):
        data(0, 8)


def _stdlib_lines(count: int) -> list[str]:
    """Non-empty lines of the standard library's ``this.py`` and ``antigravity.py``-like small modules."""
    text = (Path(sysconfig.get_paths()["stdlib"]) / "textwrap.py").read_text()
    return [line for line in text.splitlines() if line.strip()][:count]


@pytest.fixture(scope="module")
def saved_dataset(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, int]:
    """A ``datasets`` dataset of text lines saved to disk, with a small byte-level BPE tokenizer trained on them
    and saved beside it (``tokenizer/``): no download anywhere."""
    datasets = pytest.importorskip("datasets")
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    lines = _stdlib_lines(400)
    folder = tmp_path_factory.mktemp("dataset") / "lines"
    datasets.Dataset.from_dict({"text": lines}).save_to_disk(str(folder))
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.train_from_iterator(lines, trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"],
                                                       initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|endoftext|>")
    tokenizer.save_pretrained(str(folder / "tokenizer"))
    return folder, len(tokenizer)


def test_a_saved_dataset_is_tokenized_with_the_tokenizer_beside_it_and_packed(saved_dataset: tuple[Path, int]) -> None:
    from bamboo.rc.data import TokenDataset
    from transformers import AutoTokenizer

    folder, vocabulary = saved_dataset
    data = TokenDataset(folder, seq_len=32, micro_batch=2, seed=0, vocab_size=512, global_microbatches=4)
    tokenizer = AutoTokenizer.from_pretrained(str(folder / "tokenizer"))
    lines = _stdlib_lines(400)
    assert data.tokens[: len(tokenizer(lines[0])["input_ids"]) + 1].tolist() == [
        *tokenizer(lines[0], add_special_tokens=False)["input_ids"], tokenizer.eos_token_id]  # packed, EOS between
    inputs, labels = data(3, 2)
    assert inputs.shape == (2, 32) and int(inputs.max()) < vocabulary
    again = TokenDataset(folder, seq_len=32, micro_batch=2, seed=0, global_microbatches=4)
    assert torch.equal(again(3, 2)[1], labels)
    with pytest.raises(DataError, match=rf"has {vocabulary} tokens, more than the model's vocabulary of 256"):
        TokenDataset(folder, seq_len=32, micro_batch=2, vocab_size=256)


def test_a_dataset_without_tokenizer_or_input_ids_is_one_line(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    from bamboo.rc.data import TokenDataset

    folder = tmp_path / "plain"
    datasets.Dataset.from_dict({"text": ["a b c"] * 10}).save_to_disk(str(folder))
    with pytest.raises(DataError, match="has no input_ids column and no tokenizer beside it: pass tokenizer="):
        TokenDataset(folder, seq_len=4, micro_batch=1)
    tokenized = tmp_path / "ids"
    datasets.Dataset.from_dict({"input_ids": [[1, 2, 3]] * 10}).save_to_disk(str(tokenized))
    assert TokenDataset(tokenized, seq_len=4, micro_batch=1, global_microbatches=2)(0, 1)[0].shape == (1, 4)
    with pytest.raises(DataError, match="has the splits train, not 'test'"):
        datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["x"]})}).save_to_disk(str(tmp_path / "d"))
        TokenDataset(tmp_path / "d", seq_len=4, micro_batch=1, split="test")
