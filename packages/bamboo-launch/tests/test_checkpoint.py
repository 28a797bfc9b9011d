"""Tests of the atomic asynchronous checkpoints, with real files and torch.save."""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest
import torch
from bamboo.launch.checkpoint import (
    MANIFEST_NAME,
    STATE_NAME,
    AsyncCheckpointer,
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
    assert info.path == tmp_path / "step-000000007"
    assert info.bytes == (info.path / STATE_NAME).stat().st_size
    manifest = json.loads((info.path / MANIFEST_NAME).read_text())
    assert manifest["step"] == 7 and len(manifest["files"][STATE_NAME]["sha256"]) == 64
    loaded = load_checkpoint(info.path)
    assert loaded.step == 7
    assert_state_equal(loaded.state, state_at(7))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp")]


def corrupt_flip_byte(path: Path) -> None:
    data = bytearray((path / STATE_NAME).read_bytes())
    data[len(data) // 2] ^= 0xFF
    (path / STATE_NAME).write_bytes(bytes(data))


def corrupt_truncate(path: Path) -> None:
    data = (path / STATE_NAME).read_bytes()
    (path / STATE_NAME).write_bytes(data[: len(data) // 3])


def corrupt_no_manifest(path: Path) -> None:
    (path / MANIFEST_NAME).unlink()


def corrupt_bad_manifest(path: Path) -> None:
    (path / MANIFEST_NAME).write_text('{"format": 1, "step": ')


@pytest.mark.parametrize(
    ("corrupt", "reason"),
    [
        (corrupt_flip_byte, "does not match the manifest"),
        (corrupt_truncate, "truncated"),
        (corrupt_no_manifest, "partial write"),
        (corrupt_bad_manifest, "unreadable"),
    ],
)
def test_bad_newest_checkpoint_falls_back_to_previous_good(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, corrupt, reason: str
) -> None:
    write_checkpoint(tmp_path, 10, state_at(10))
    newest = write_checkpoint(tmp_path, 20, state_at(20))
    corrupt(newest.path)
    with pytest.raises(CheckpointError, match=reason):
        load_checkpoint(newest.path)
    with caplog.at_level(logging.ERROR, logger="bamboo.launch.checkpoint"):
        loaded = load_latest_good(tmp_path)
    assert loaded.step == 10
    assert_state_equal(loaded.state, state_at(10))
    errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
    assert len(errors) == 1 and "step-000000020" in errors[0] and reason in errors[0]


def test_partial_temporary_folder_is_ignored_and_cleaned(tmp_path: Path) -> None:
    write_checkpoint(tmp_path, 5, state_at(5))
    partial = tmp_path / ".tmp-step-000000009-deadbeef"
    partial.mkdir()
    (partial / STATE_NAME).write_bytes(b"half a tensor")
    assert [step for step, _ in list_checkpoints(tmp_path)] == [5]
    assert load_latest_good(tmp_path).step == 5
    AsyncCheckpointer(tmp_path).close()
    assert not partial.exists()


def test_unloadable_pickle_with_valid_checksum_is_rejected(tmp_path: Path) -> None:
    good = write_checkpoint(tmp_path, 1, state_at(1))
    bad = write_checkpoint(tmp_path, 2, state_at(2))
    (bad.path / STATE_NAME).write_bytes(b"not a torch file")
    manifest = json.loads((bad.path / MANIFEST_NAME).read_text())
    import hashlib

    manifest["files"][STATE_NAME] = {"bytes": 16, "sha256": hashlib.sha256(b"not a torch file").hexdigest()}
    (bad.path / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="does not load"):
        load_checkpoint(bad.path)
    assert load_latest_good(tmp_path).path == good.path


def test_no_good_checkpoint_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(NoGoodCheckpointError, match="no checkpoints"):
        load_latest_good(tmp_path)
    only = write_checkpoint(tmp_path, 3, state_at(3))
    corrupt_truncate(only.path)
    with pytest.raises(NoGoodCheckpointError, match="step-000000003"):
        load_latest_good(tmp_path)


class GatedWriter:
    """A writer that blocks until the test opens the gate, to show that save() does not wait."""

    def __init__(self) -> None:
        self.gate = threading.Event()
        self.started = threading.Event()
        self.steps: list[int] = []

    def __call__(self, directory: Path, step: int, state: Mapping[str, Any]) -> CheckpointInfo:
        self.started.set()
        assert self.gate.wait(30), "test never opened the gate"
        self.steps.append(step)
        return write_checkpoint(directory, step, state)


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
    assert_state_equal(
        load_checkpoint(committed[0].path).state, state_at(0)
    )  # the snapshot, not the mutation
    assert load_latest_good(tmp_path).step == 4


def test_keeps_only_the_newest(tmp_path: Path) -> None:
    with AsyncCheckpointer(tmp_path, every_steps=1, keep=2) as checkpointer:
        for step in range(5):
            checkpointer.save(step, state_at(step))
            checkpointer.wait(30)
    assert [step for step, _ in list_checkpoints(tmp_path)] == [4, 3]


def test_write_failure_is_reported_on_close(tmp_path: Path) -> None:
    def failing(directory: Path, step: int, state: Mapping[str, Any]) -> CheckpointInfo:
        raise OSError(28, "No space left on device")

    checkpointer = AsyncCheckpointer(tmp_path, writer=failing)
    checkpointer.save(0, state_at(0))
    with pytest.raises(CheckpointError, match="No space left"):
        checkpointer.close(timeout=30)


def test_bad_arguments_name_the_value(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="every_steps must be >= 1, got 0"):
        AsyncCheckpointer(tmp_path, every_steps=0)
    with pytest.raises(ValueError, match="keep must be >= 1, got -1"):
        AsyncCheckpointer(tmp_path, keep=-1)
