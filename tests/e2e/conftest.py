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


def _events_so_far(handles: Any) -> list[Any]:
    from bamboo.launch.events import read_events

    try:
        return read_events(handles.events)
    except Exception:  # the mirror is being written (a partial last line): read again next time
        return []


def wait_for_step(handles: Any, step: int, deadline_s: float = 120.0) -> None:
    """Return once the job's reported step is at least ``step`` (the moment a scenario acts: a kill at step 5)."""
    deadline = time.monotonic() + deadline_s
    while handles.step() < step:
        assert time.monotonic() < deadline, f"the run never reached step {step}"
        time.sleep(0.02)


@pytest.fixture
def until_step() -> Callable[..., None]:
    """``until_step(handles, step, deadline_s=120)``: see `wait_for_step`."""
    return wait_for_step


def finish_once(handles: Any, played_out: Callable[[list[Any]], bool], *, steps_after: int = 5,
                deadline_s: float = 150.0) -> None:
    """Ask the job to finish (``bamboo-launch finish``) once ``played_out(events)`` holds for its event log and
    ``steps_after`` more steps have trained: a scenario ends when it has played out, not after filler steps
    sized for the slowest machine (the job still ends four steps after that, at a boundary all nodes reach)."""
    deadline = time.monotonic() + deadline_s
    while not played_out(_events_so_far(handles)):
        assert time.monotonic() < deadline, "the scenario never played out"
        time.sleep(0.05)
    target = handles.step() + steps_after
    while handles.step() < target:
        assert time.monotonic() < deadline, f"the job never reached step {target} after the scenario"
        time.sleep(0.05)
    handles.finish()


@pytest.fixture
def finish_when() -> Callable[..., None]:
    """``finish_when(handles, played_out, steps_after=5)``: see `finish_once`."""
    return finish_once


def check_preempted(events: list[Any], expected: set[str] | frozenset[str]) -> None:
    """Assert that the job confirmed the failure of exactly ``expected``; a mismatch names every confirmed node
    with the reason its detector gave (a node declared dead that the test never killed: which signal, whose
    report), since that is all a failed run on a loaded machine leaves to go on."""
    from bamboo.launch.events import Preemption

    confirmed = {e.node: e.reason or "(no reason recorded)" for e in events if isinstance(e, Preemption)}
    assert set(confirmed) == set(expected), (
        f"confirmed failures {sorted(confirmed)}, expected {sorted(expected)}:\n"
        + "\n".join(f"  {node}: {reason}" for node, reason in sorted(confirmed.items())))


@pytest.fixture
def assert_preempted() -> Callable[[list[Any], set[str] | frozenset[str]], None]:
    """``assert_preempted(events, {"node1", ...})``: see `check_preempted`."""
    return check_preempted
