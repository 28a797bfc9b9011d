"""Transfers a confirmed failure interrupts: kept for the failover schedule to resume (a payload received in
several messages from the message it stopped at; a replica sync's send is posted whole and completed before the
commit), dropped when their peer was a victim, and never carried past the step's commit.

In-process, with a fake group table whose transfers complete only when the test says so and a fake
coordinator that reports a confirmed failure while a transfer waits.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
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
    """A posted transfer that completes when `done` is set; a receive's data arrives then."""

    def __init__(self, arrive: Callable[[], None] = lambda: None) -> None:
        self.done = threading.Event()
        self.arrive = arrive

    def wait(self) -> None:
        if not self.done.wait(5.0):  # a test that posts a transfer twice fails instead of hanging
            raise RuntimeError("a held transfer was never released")
        self.arrive()

    def release(self) -> None:
        self.done.set()


class FakeGroups:
    """The part of GroupTable that transfers use; every P2P group is already built. A transfer completes at
    once unless its tag is in `held`; a receive then gets `incoming[tag]`."""

    def __init__(self) -> None:
        self.timeouts = SimpleNamespace(poll=0.01)
        self.groups: dict[str, object] = {"p2p-0-1": object(), "p2p-1-2": object()}
        self.members = {"p2p-0-1": (0, 1), "p2p-1-2": (1, 2)}
        self.building: dict[str, object] = {}  # no build in the background
        self.posted: list[tuple[str, HeldWork]] = []
        self.sent: list[tuple[int, torch.Tensor]] = []
        """(tag, a copy of the tensor) of every send posted."""
        self.received_tags: list[int] = []
        self.held: set[int] = set()
        self.incoming: dict[int, torch.Tensor] = {}

    def _post(self, what: str, tag: int, arrive: Callable[[], None] = lambda: None) -> list[object]:
        work = HeldWork(arrive)
        if tag not in self.held:
            work.release()
        self.posted.append((what, work))
        return [work]

    def post_recv(self, group: str, buffer: torch.Tensor, peer: int, tag: int, what: str) -> list[object]:
        self.received_tags.append(tag)
        return self._post(what, tag, lambda: buffer.copy_(self.incoming[tag]) if tag in self.incoming else None)

    def post_send(self, group: str, tensor: torch.Tensor, peer: int, tag: int, what: str) -> list[object]:
        self.sent.append((tag, tensor.clone()))
        return self._post(what, tag)


class FakeCoordinator:
    """Watching for failures; `event` is what a waiting transfer notices."""

    watching = True

    def __init__(self) -> None:
        self.event: FailureEvent | None = None

    def pending_event(self) -> FailureEvent | None:
        return self.event


class FakeSlice:
    """A stage's parameters, as far as a replica sync needs them."""

    def __init__(self, numel: int) -> None:
        self._numel = numel
        self.loss_scale = None  # fp32: no dynamic loss scale

    def numel(self) -> int:
        return self._numel


@pytest.fixture
def interpreter() -> Iterator[StageInterpreter]:
    made = StageInterpreter(
        {2: FakeSlice(4)}, lambda *_: torch.zeros(()), load_config(DEFAULT_CONFIG), Layout(3, 1), 1, 0,  # type: ignore[dict-item]
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
    interpreter.groups.held.add(7)  # type: ignore[attr-defined]
    work = interrupt(interpreter, "2RA0<2")
    work.release()
    instruction = Instruction.parse("2RA0<2")
    interpreter._recv(instruction, torch.zeros(2), 2, 7)
    assert len(interpreter.groups.posted) == 1  # type: ignore[attr-defined]  # resumed, not posted again
    assert interpreter.forget_transfers_with({2}) == []


def test_a_victims_transfers_are_dropped_and_the_others_kept(interpreter: StageInterpreter) -> None:
    interpreter.groups.held.add(7)  # type: ignore[attr-defined]
    interrupt(interpreter, "2RA0<2")
    interrupt(interpreter, "1SA0>0")
    assert interpreter.forget_transfers_with({2}) == ["2RA0<2"]
    assert interpreter.forget_transfers_with({2}) == []
    assert interpreter.forget_transfers_with({0}) == ["1SA0>0"]


def test_the_commit_refuses_a_step_that_left_a_transfer_posted(interpreter: StageInterpreter) -> None:
    interpreter.groups.held.add(7)  # type: ignore[attr-defined]
    interrupt(interpreter, "1SA0>0")
    with pytest.raises(RuntimeError, match=r"step 0 of node 1 .* transfers still posted: \['1SA0>0'\]"):
        interpreter.finish_commit([], CommitResult(0, 0.0, 0.0))
    assert interpreter.step == 0
    interpreter.forget_transfers_with({0})
    interpreter.finish_commit([], CommitResult(0, 0.0, 0.0))
    assert interpreter.step == 1


SYNC_TAGS = [(4 * 128 + 2) * 4096 + segment for segment in range(3)]  # _TAG_SYNC of stage 2, segments 0-2


def interrupt_at(interpreter: StageInterpreter, text: str, tag: int) -> None:
    """Execute `text` with the message of `tag` held, and confirm a failure while it waits."""
    groups: FakeGroups = interpreter.groups  # type: ignore[assignment]
    groups.held.add(tag)

    def confirm_when_held() -> None:
        while not any(work for _, work in groups.posted if not work.done.is_set()):
            threading.Event().wait(0.001)
        interpreter.coordinator.event = FailureEvent(1, (0,))  # type: ignore[attr-defined]

    threading.Thread(target=confirm_when_held, daemon=True).start()
    with pytest.raises(FailureNoticed):
        interpreter.execute(Instruction.parse(text))
    interpreter.coordinator.event = None  # type: ignore[attr-defined]


@pytest.fixture
def two_float_messages(monkeypatch: pytest.MonkeyPatch) -> None:
    """A message holds two floats, so a stage of 4 parameters syncs in 3 messages (with its loss and step)."""
    monkeypatch.setattr("bamboo.rc.interpreter_transfers.MAX_CHUNKS", 1)
    monkeypatch.setattr("bamboo.rc.interpreter_transfers.CHUNK_BYTES", 8)


def complete_with_a_failure(interpreter: StageInterpreter) -> None:
    """Wait for the posted replica syncs while a failure is confirmed: FailureNoticed, the syncs kept."""
    interpreter.coordinator.event = FailureEvent(1, (0,))  # type: ignore[attr-defined]
    with pytest.raises(FailureNoticed):
        interpreter.complete_posted_syncs()
    interpreter.coordinator.event = None  # type: ignore[attr-defined]


@pytest.mark.usefixtures("two_float_messages")
def test_a_sync_send_is_posted_whole_and_completed_before_the_commit(interpreter: StageInterpreter) -> None:
    """The replica sync is a buffered send: the instruction posts every message and returns while they wait;
    the commit's wait for them gives way to a confirmed failure and keeps them, and each goes once."""
    groups: FakeGroups = interpreter.groups  # type: ignore[assignment]
    groups.held.add(SYNC_TAGS[1])
    interpreter._reduced[2] = (torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0]))
    interpreter.execute(Instruction.parse("2SY>0"))  # returns with the second message still held
    assert [tag for tag, _ in groups.sent] == SYNC_TAGS
    assert torch.equal(torch.cat([tensor for _, tensor in groups.sent]), torch.arange(1.0, 7.0))
    complete_with_a_failure(interpreter)
    for _, work in groups.posted:
        work.release()
    interpreter.complete_posted_syncs()
    assert [tag for tag, _ in groups.sent] == SYNC_TAGS  # nothing posted twice
    interpreter.finish_commit([], CommitResult(0, 0.0, 0.0))  # nothing left posted
    assert interpreter.step == 1


@pytest.mark.usefixtures("two_float_messages")
def test_a_segmented_sync_receive_resumes_into_the_same_payload(interpreter: StageInterpreter) -> None:
    groups: FakeGroups = interpreter.groups  # type: ignore[assignment]
    groups.incoming = {tag: torch.tensor([2.0 * i + 1, 2.0 * i + 2]) for i, tag in enumerate(SYNC_TAGS)}
    interrupt_at(interpreter, "2RY<0", SYNC_TAGS[1])
    for _, work in groups.posted:
        work.release()
    interpreter.execute(Instruction.parse("2RY<0"))
    assert groups.received_tags == SYNC_TAGS  # each message once: the first is not received again
    assert torch.equal(interpreter._received_syncs[2], torch.arange(1.0, 7.0))


@pytest.mark.usefixtures("two_float_messages")
def test_a_posted_sync_to_a_victim_is_dropped_whole(interpreter: StageInterpreter) -> None:
    interpreter.groups.held.add(SYNC_TAGS[2])  # type: ignore[attr-defined]
    interpreter._reduced[2] = (torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([5.0, 6.0]))
    interpreter.execute(Instruction.parse("2SY>0"))
    with pytest.raises(RuntimeError, match=r"transfers still posted: \['2SY>0'\]"):
        interpreter.finish_commit([], CommitResult(0, 0.0, 0.0))
    assert interpreter.forget_transfers_with({0}) == ["2SY>0"]
    interpreter.complete_posted_syncs()  # nothing to wait for
    interpreter.finish_commit([], CommitResult(0, 0.0, 0.0))
