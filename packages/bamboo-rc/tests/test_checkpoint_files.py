"""Tests of the atomic asynchronous checkpoints, with real files and torch.save."""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from bamboo.rc.checkpoint_async import AsyncCheckpointer
from bamboo.rc.checkpoint_files import (
    CheckpointError,
    CheckpointInfo,
    NoGoodCheckpointError,
    list_checkpoints,
    load_checkpoint,
    load_latest_good,
    write_checkpoint,
)


def state_at(step: int) -> dict[str, Any]:
    generator = torch.Generator().manual_seed(step)
    return {
        "step": step,
        "model": {"w": torch.randn(4, 3, generator=generator), "b": torch.full((3,), float(step))},
        "optimizer": {"lr": 0.1, "moments": [torch.ones(2) * step]},
    }


def assert_state_equal(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    assert actual["step"] == expected["step"]
    assert torch.equal(actual["model"]["w"], expected["model"]["w"])
    assert torch.equal(actual["model"]["b"], expected["model"]["b"])
    assert torch.equal(actual["optimizer"]["moments"][0], expected["optimizer"]["moments"][0])


def test_write_then_load_round_trip(tmp_path: Path) -> None:
    info = write_checkpoint(tmp_path, 7, state_at(7))
    folder = tmp_path / "step-000000007"
    assert info.path == folder / "state.pt" and info.shard == "state"
    assert info.bytes == info.path.stat().st_size
    manifest = json.loads((folder / "state.manifest.json").read_text())
    assert manifest["step"] == 7 and manifest["sha256"] == hashlib.sha256(info.path.read_bytes()).hexdigest()
    loaded = load_checkpoint(folder)
    assert loaded.step == 7
    assert_state_equal(loaded.state, state_at(7))
    assert sorted(p.name for p in folder.iterdir()) == ["state.manifest.json", "state.pt"]


def corrupt_flip_byte(folder: Path) -> None:
    data = bytearray((folder / "state.pt").read_bytes())
    data[len(data) // 2] ^= 0xFF
    (folder / "state.pt").write_bytes(bytes(data))


def corrupt_truncate(folder: Path) -> None:
    data = (folder / "state.pt").read_bytes()
    (folder / "state.pt").write_bytes(data[: len(data) // 3])


def corrupt_uncommitted(folder: Path) -> None:
    (folder / "state.manifest.json").unlink()


def corrupt_bad_manifest(folder: Path) -> None:
    (folder / "state.manifest.json").write_text('{"format": 1, "step": ')


def corrupt_data_missing(folder: Path) -> None:
    (folder / "state.pt").unlink()


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (corrupt_flip_byte, "does not match the manifest"),
        (corrupt_truncate, "truncated"),
        (corrupt_uncommitted, "partial write"),
        (corrupt_bad_manifest, "unreadable"),
        (corrupt_data_missing, "missing although its manifest exists"),
    ],
)
def test_bad_newest_checkpoint_falls_back_to_previous_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt, reason: str
) -> None:
    write_checkpoint(tmp_path, 10, state_at(10))
    write_checkpoint(tmp_path, 20, state_at(20))
    newest = tmp_path / "step-000000020"
    corrupt(newest)
    with pytest.raises(CheckpointError, match=reason):
        load_checkpoint(newest)
    with caplog.at_level(logging.ERROR, logger="bamboo.rc.checkpoint_files"):
        loaded = load_latest_good(tmp_path)
    assert loaded.step == 10
    assert_state_equal(loaded.state, state_at(10))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "step-000000020" in errors[0] and reason in errors[0]


def test_partial_temporary_file_is_ignored_and_cleaned(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 5, state_at(5))
    folder = tmp_path / "step-000000009"
    folder.mkdir()
    partial = folder / "state.pt.tmp-deadbeef"
    partial.write_bytes(b"half a tensor")
    with pytest.raises(CheckpointError, match=r"step-000000009/state.pt: no manifest, it is missing"):
        load_checkpoint(folder)
    assert load_latest_good(tmp_path).step == 5
    AsyncCheckpointer(tmp_path).close()
    assert not partial.exists()


def test_unloadable_file_with_valid_checksum_is_rejected(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 1, state_at(1))
    write_checkpoint(tmp_path, 2, state_at(2))
    bad = tmp_path / "step-000000002"
    (bad / "state.pt").write_bytes(b"not a torch file")
    manifest = json.loads((bad / "state.manifest.json").read_text())
    manifest.update(bytes=16, sha256=hashlib.sha256(b"not a torch file").hexdigest())
    (bad / "state.manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not load"):
        load_checkpoint(bad)
    assert load_latest_good(tmp_path).step == 1


def test_no_good_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NoGoodCheckpointError, match="no checkpoints"):
        load_latest_good(tmp_path)
    write_checkpoint(tmp_path, 3, state_at(3))
    corrupt_truncate(tmp_path / "step-000000003")
    with pytest.raises(NoGoodCheckpointError, match="step-000000003"):
        load_latest_good(tmp_path)


def test_sharded_step_needs_every_shard(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    stages = ["stage-0", "stage-1", "stage-2"]
    for step in (10, 20):
        for index, stage in enumerate(stages):
            if step == 20 and stage == "stage-2":
                continue  # the node of stage 2 died before writing step 20
            write_checkpoint(
                tmp_path, step, {"stage": index, "w": torch.full((2,), float(step + index))}, stage
            )
    with caplog.at_level(logging.ERROR, logger="bamboo.rc.checkpoint_files"):
        loaded = load_latest_good(tmp_path, shards=stages)
    assert loaded.step == 10 and sorted(loaded.shards) == stages
    assert torch.equal(loaded.shards["stage-1"]["w"], torch.full((2,), 11.0))
    assert "stage-2.pt: no manifest" in caplog.records[0].getMessage()
    assert load_latest_good(tmp_path, shards=["stage-0"]).step == 20
    with pytest.raises(ValueError, match=r"pick one from .shards"):
        _ = loaded.state


class GatedWriter:
    """A writer that blocks until the test opens the gate, to show that save() does not wait."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.steps: list[int] = []

    def __call__(self, directory: Path, step: int, state: Mapping[str, Any], shard: str) -> CheckpointInfo:
        self.started.set()
        assert self.gate.wait(30), "test never opened the gate"
        self.steps.append(step)
        return write_checkpoint(directory, step, state, shard)


def test_save_does_not_block_and_snapshots_the_state(tmp_path: Path) -> None:
    writer = GatedWriter()
    committed: list[CheckpointInfo] = []
    checkpointer = AsyncCheckpointer(
        tmp_path, every_steps=2, keep=2, on_commit=committed.append, writer=writer
    )
    state = state_at(0)
    assert checkpointer.maybe_save(0, state)
    assert writer.started.wait(30)
    # The writer is stuck on the disk; training goes on and mutates its tensors in place.
    state["model"]["w"].add_(100.0)
    assert not checkpointer.maybe_save(1, state)
    assert checkpointer.maybe_save(2, lambda: state_at(2))
    assert checkpointer.maybe_save(4, lambda: state_at(4))  # replaces the still-pending step 2
    assert checkpointer.superseded == 1
    assert not checkpointer.wait(timeout=0.05)
    writer.gate.set()
    checkpointer.close(timeout=30)
    assert writer.steps == [0, 4]
    assert [c.step for c in committed] == [0, 4]
    assert_state_equal(load_checkpoint(tmp_path / "step-000000000").state, state_at(0))  # the snapshot
    assert load_latest_good(tmp_path).step == 4


def test_a_cloned_state_is_taken_as_it_is_and_prepared_in_the_writer_thread(tmp_path: Path) -> None:
    """``cloned=True`` takes the caller's private copy without cloning it again; ``prepare`` turns each snapshot
    into what is written (the launcher serialises a slice's state there), in the writer thread."""
    prepared_in: list[str] = []

    def prepare(snapshot: dict[str, Any]) -> dict[str, Any]:
        prepared_in.append(threading.current_thread().name)
        return {**snapshot, "scaled": snapshot["model"]["w"] * 2}

    state = state_at(1)
    with AsyncCheckpointer(tmp_path, prepare=prepare) as checkpointer:
        checkpointer.save(1, state, cloned=True)
        checkpointer.wait(30)
        assert checkpointer.errors == []
    assert len(prepared_in) == 1 and prepared_in[0].startswith("bamboo-checkpoint-"), prepared_in
    loaded = load_checkpoint(tmp_path / "step-000000001").state
    assert torch.equal(loaded["scaled"], state["model"]["w"] * 2)
    assert_state_equal({k: v for k, v in loaded.items() if k != "scaled"}, state_at(1))


def test_keeps_only_the_newest_of_its_own_shard(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 0, {"other": torch.zeros(1)}, "other")
    with AsyncCheckpointer(tmp_path, every_steps=1, keep=2) as checkpointer:
        for step in range(5):
            checkpointer.save(step, state_at(step))
            checkpointer.wait(30)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [4, 3, 0]
    assert sorted(p.name for p in (tmp_path / "step-000000000").iterdir()) == [
        "other.manifest.json",
        "other.pt",
    ]


def test_rewriting_a_step_replaces_it(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 3, state_at(3))
    write_checkpoint(tmp_path, 3, state_at(4))
    assert_state_equal(load_latest_good(tmp_path).state, state_at(4))


def test_write_failure_is_reported_on_close(tmp_path: Path) -> None:
    def failing(directory: Path, step: int, state: Mapping[str, Any], shard: str) -> CheckpointInfo:
        raise OSError(28, "No space left on device")

    checkpointer = AsyncCheckpointer(tmp_path, writer=failing)
    checkpointer.save(0, state_at(0))
    with pytest.raises(CheckpointError, match="No space left"):
        checkpointer.close(timeout=30)


def test_bad_arguments_name_the_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="every_steps must be an integer >= 1, got 0"):
        AsyncCheckpointer(tmp_path, every_steps=0)
    with pytest.raises(ValueError, match="keep must be an integer >= 1, got -1"):
        AsyncCheckpointer(tmp_path, keep=-1)
    with pytest.raises(ValueError, match=r"shard name must be .* got '../x'"):
        AsyncCheckpointer(tmp_path, shard="../x")
    with (
        AsyncCheckpointer(tmp_path) as checkpointer,
        pytest.raises(ValueError, match=r"step must be .* got -3"),
    ):
        checkpointer.save(-3, {})
