"""The checkpoint/restart baseline removes C++-extension build locks that a killed build left behind (every
DeepSpeed worker would wait on one forever), and only those."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bamboo.bench.measured.baseline import extension_build_roots, remove_stale_build_locks


def _lock(root: Path, extension: str, age_s: float, now: float) -> Path:
    lock = root / "py311_cpu" / extension / "lock"
    lock.parent.mkdir(parents=True)
    lock.touch()
    os.utime(lock, (now - age_s, now - age_s))
    return lock


def test_only_locks_older_than_the_limit_are_removed(tmp_path: Path) -> None:
    now = 1_800_000_000.0
    stale = _lock(tmp_path, "deepspeed_shm_comm", age_s=3600.0, now=now)
    building = _lock(tmp_path, "other_op", age_s=5.0, now=now)
    assert remove_stale_build_locks([tmp_path, tmp_path / "missing"], older_than_s=600.0, now=now) == [stale]
    assert not stale.exists() and building.exists()
    assert remove_stale_build_locks([tmp_path], older_than_s=600.0, now=now) == []


def test_the_roots_are_the_extensions_dir_and_torch_s_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    assert extension_build_roots() == [tmp_path, Path.home() / ".cache" / "torch_extensions"]
    monkeypatch.delenv("TORCH_EXTENSIONS_DIR")
    assert extension_build_roots() == [Path.home() / ".cache" / "torch_extensions"]
