"""Transfers a confirmed failure interrupts: kept for the failover schedule to resume, dropped when their
peer was a victim, and never carried past the step's commit.

In-process, with a fake group table whose transfers complete only when the test says so and a fake
coordinator that reports a confirmed failure while a transfer waits.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from types import SimpleNamespace

import pytest
import torch
from bamboo.rc.config import load_config
from bamboo.rc.failures import FailureNoticed
from bamboo.rc.interpreter import StageInterpreter
from bamboo.rc.layout import Layout
from bamboo.rc.records import CommitResult, FailureEvent
from bamboo.rc.verify import DEFAULT_CONFIG
from bamboo.schedule import Instruction


class HeldWork:
    """A posted transfer that completes when `done` is set (or fails with `error`)."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.error: RuntimeError | None = None

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


class FakeGroups:
    """The part of GroupTable that transfers use; every P2P group is already built."""

    def __init__(self) -> None:
        self.timeouts = SimpleNamespace(poll=0.01)
        self.groups: dict[str, object] = {"p2p-0-1": object(), "p2p-1-2": object()}
        self.members = {"p2p-0-1": (0, 1), "p2p-1-2": (1, 2)}
        self.posted: list[tuple[str, HeldWork]] = []

    def _post(self, what: str) -> list[object]:
        work = HeldWork()
        self.posted.append((what, work))
        return [work]

    def post_recv(self, group: str, buffer: torch.Tensor, peer: int, tag: int, what: str) -> list[object]:
        return self._post(what)

    def post_send(self, group: str, tensor: torch.Tensor, peer: int, tag: int, what: str) -> list[object]:
        return self._post(what)


class FakeCoordinator:
    """Watching for failures; `event` is what a waiting transfer notices."""

    watching = True

    def __init__(self) -> None:
        self.event: FailureEvent | None = None

    def pending_event(self) -> FailureEvent | None:
        return self.event


@pytest.fixture
def interpreter() -> Iterator[StageInterpreter]:
    made = StageInterpreter(
        {}, lambda *_: torch.zeros(()), load_config(DEFAULT_CONFIG), Layout(3, 1), 1, 0,
        FakeGroups(), FakeCoordinator(),  # type: ignore[arg-type]
    )
    yield made
    for _, work in made.groups.posted:  # type: ignore[attr-defined]
        work.done.set()
    made.close()


def interrupt(interpreter: StageInterpreter, text: str) -> HeldWork:
    """Post `text`'s transfer, then confirm a failure while it waits: FailureNoticed, the transfer kept."""
    interpreter.coordinator.event = FailureEvent(1, (2,))  # type: ignore[attr-defined]
    instruction = Instruction.parse(text)
    with pytest.raises(FailureNoticed):
        if instruction.is_send:
            interpreter._send(instruction, torch.ones(2), instruction.peer, 7)
        else:
            interpreter._recv(instruction, torch.zeros(2), instruction.peer, 7)
    interpreter.coordinator.event = None  # type: ignore[attr-defined]
    return interpreter.groups.posted[-1][1]  # type: ignore[attr-defined]


def test_the_same_instruction_resumes_the_kept_transfer(interpreter: StageInterpreter) -> None:
    work = interrupt(interpreter, "2RA0<2")
    work.done.set()
    instruction = Instruction.parse("2RA0<2")
    interpreter._recv(instruction, torch.zeros(2), 2, 7)
    assert len(interpreter.groups.posted) == 1  # type: ignore[attr-defined]  # resumed, not posted again
    assert interpreter.forget_transfers_with({2}) == []


def test_a_victims_transfers_are_dropped_and_the_others_kept(interpreter: StageInterpreter) -> None:
    interrupt(interpreter, "2RA0<2")
    interrupt(interpreter, "1SA0>0")
    assert interpreter.forget_transfers_with({2}) == ["2RA0<2"]
    assert interpreter.forget_transfers_with({2}) == []
    assert interpreter.forget_transfers_with({0}) == ["1SA0>0"]


def test_the_commit_refuses_a_step_that_left_a_transfer_posted(interpreter: StageInterpreter) -> None:
    interrupt(interpreter, "1SA0>0")
    with pytest.raises(RuntimeError, match=r"step 0 of node 1 .* transfers still posted: \['1SA0>0'\]"):
        interpreter.finish_commit([], CommitResult(0, 0.0, 0.0))
    assert interpreter.step == 0
    interpreter.forget_transfers_with({0})
    interpreter.finish_commit([], CommitResult(0, 0.0, 0.0))
    assert interpreter.step == 1
