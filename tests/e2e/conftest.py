"""Fixtures of the end-to-end tests: scripted preemption traces written in the paper's EC2 format."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest


@pytest.fixture
def write_trace(tmp_path: Path) -> Callable[[int, list[tuple[int, str, str]]], str]:
    """``write_trace(initial, later)``: ``initial`` nodes at t=0, then ``(ms, add|remove, traceN)`` rows.

    Trace node ``nodeK`` (K from 1) becomes the launcher's ``node{K-1}`` for the initial nodes.
    """

    def write(initial: int, later: list[tuple[int, str, str]]) -> str:
        rows = [f"0,add,node{k}" for k in range(1, initial + 1)]
        rows += [f"{ms},{kind},{node}" for ms, kind, node in later]
        path = tmp_path / "trace.csv"
        path.write_text("\n".join(rows) + "\n")
        return str(path)

    return write
