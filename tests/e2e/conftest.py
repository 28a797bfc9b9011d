"""Fixtures of the end-to-end tests: scripted preemption traces (the paper's EC2 format), waiting for a layout."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

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


def _wait_for_layout(handles: Any, generation: int, deadline_s: float) -> Any:
    """The run's layout in etcd (a ``bamboo.reconfig.JobLayout``) once its generation is at least
    ``generation`` (an etcd error is retried)."""
    from bamboo.reconfig import JobLayout

    deadline = time.monotonic() + deadline_s
    while time.monotonic() < deadline:
        try:
            current = handles.membership.get_layout()
        except Exception:
            current = None
        if current is not None and int(current.value["generation"]) >= generation:
            return JobLayout.from_dict(current.value)
        time.sleep(0.01)
    raise AssertionError(f"no layout of generation {generation} within {deadline_s} s")


@pytest.fixture
def wait_for_layout() -> Callable[[Any, int, float], Any]:
    """``wait_for_layout(handles, generation, deadline_s)``: see `_wait_for_layout`."""
    return _wait_for_layout
