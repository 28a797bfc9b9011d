"""Stub drift: the committed protobuf/gRPC stubs equal what `scripts/gen_proto.py` generates from `proto/`."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]
STUBS = Path("packages/bamboo-membership/src/bamboo/membership/v1")
PROTOS = sorted((ROOT / "proto/bamboo/membership/v1").glob("*.proto"))


def test_there_are_membership_protos() -> None:
    assert [p.name for p in PROTOS] == ["membership.proto"]


def test_committed_stubs_match_generated(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts/gen_proto.py"), "--out-root", str(tmp_path)],
        check=True,
        capture_output=True,
        text=True,
    )
    generated = sorted(p.name for p in (tmp_path / STUBS).iterdir())
    expected = sorted(f"{proto.stem}{suffix}" for proto in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py"))
    assert generated == expected
    for name in generated:
        committed = ROOT / STUBS / name
        assert committed.exists(), f"{committed} is missing: run `make proto` and commit it"
        assert committed.read_bytes() == (tmp_path / STUBS / name).read_bytes(), (
            f"{committed} differs from what `make proto` generates from proto/: regenerate and commit it"
        )
