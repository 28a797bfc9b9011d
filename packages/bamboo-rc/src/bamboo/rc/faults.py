"""Fault injection for the self-check: kill points, preemption notices, and the hook that fires them.

Production code carries no kill path. :class:`~bamboo.rc.executor.StageExecutor` only calls an
optional hook (:class:`~bamboo.rc.executor.ExecutorHook`) at the start of each iteration and
around each instruction; `verify`, `soak` and the chaos tests give their workers a
:class:`FaultInjector`, which:

- SIGKILLs its own process at a :class:`KillPoint` (after writing a :class:`KillRecord` under
  ``bamboo/<job>/killed_at/<rank>``, which tells the parent which point fired and when), or when
  the preemption deadline of a notice the node did not hand over for has passed;
- tells the node of a :class:`NoticePoint` that it will be preempted (as a launcher's worker tells it
  of its agent's notice);
- marks, for ``KillPoint.hold_confirmation_until``, that a node executed an instruction
  (``bamboo/<job>/reached/<rank>/<step>/<instruction>``), so the parent can hold back a
  confirmation until then.
"""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import attrs
from bamboo.rc.ports import Clock, SystemClock
from bamboo.rc.records import RECORD_VERSION, JsonRecord, RecordReader
from bamboo.rc.timeouts import NOTICE_LEAD_S
from bamboo.schedule import Instruction

if TYPE_CHECKING:
    from bamboo.rc.executor import StageExecutor

__all__ = ["FaultInjector", "KillPoint", "KillRecord", "NoticePoint", "killed_key", "reached_key"]


@attrs.frozen
class NoticePoint:
    """Fault injection: the node of (stage, pipeline) is told at the start of step `step` that it
    will be preempted `lead_s` seconds later (as the launcher's agent would tell it)."""

    stage: int
    pipeline: int
    step: int
    lead_s: float = NOTICE_LEAD_S


@attrs.frozen
class KillPoint:
    """Fault injection: the process of (stage, pipeline) SIGKILLs itself when it reaches
    `instruction` (compact form, e.g. `2B3`, or an index into its stream, negative from the end)
    in step `step`."""

    stage: int
    pipeline: int
    instruction: str
    step: int = 1
    settle: bool = False
    """When True, the node first waits for its posted data-parallel all-reduces to complete (so its
    peers in other pipelines completed them too), then dies."""
    hold_confirmation_until: tuple[int, int, str, int] | None = None
    """(stage, pipeline, instruction, step): the authority confirms this death only once that
    node has executed that instruction in that step (it forces a peer to run ahead of the notice)."""
    in_recovery: bool = False
    """When True, the point fires only while the node runs a failover's remainder of the iteration
    (a second failure during the recovery; `instruction` then indexes the remainder stream), and
    when False only outside one."""

    def matches(self, step: int, instruction: Instruction, index: int, length: int, recovering: bool = False) -> bool:
        if step != self.step or recovering != self.in_recovery:
            return False
        text = self.instruction
        if text.lstrip("-").isdigit():
            wanted = int(text)
            return index == (wanted if wanted >= 0 else length + wanted)
        return str(instruction) == text

    def __str__(self) -> str:
        """The point as `bamboo-rc verify --kill` writes it: STAGE:PIPELINE@INSTRUCTION/STEP[/recovery]."""
        return f"{self.stage}:{self.pipeline}@{self.instruction}/{self.step}" + ("/recovery" if self.in_recovery else "")


PREEMPTION = "preemption deadline"
"""The ``point`` of a :class:`KillRecord` written when a notice's deadline passed."""


@attrs.frozen
class KillRecord(JsonRecord):
    """Rank `rank` SIGKILLed itself at wall-clock time `at`, at kill point `point` (its text)."""

    RECORD: ClassVar[str] = "kill record"

    rank: int
    at: float
    point: str

    def to_dict(self) -> dict[str, Any]:
        return {"v": RECORD_VERSION, "rank": self.rank, "at": self.at, "point": self.point}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> KillRecord:
        read = RecordReader(cls.RECORD, data)
        return cls(read.integer("rank"), read.number("at"), read.text("point"))



def killed_key(job: str, rank: int) -> str:
    """Where a rank that killed itself left its :class:`KillRecord`."""
    return f"bamboo/{job}/killed_at/{rank}"


def reached_key(job: str, rank: int, step: int, instruction: str) -> str:
    """The mark that `rank` executed `instruction` in step `step` (``hold_confirmation_until``)."""
    return f"bamboo/{job}/reached/{rank}/{step}/{instruction}"


class FaultInjector:
    """The executor hook that fires the kill points and notice points of one node.

    Give every worker the same `kills` and `notice_points`; each injector keeps those of its own
    (stage, pipeline) (:meth:`for_node`).
    """

    def __init__(
        self, kills: Sequence[KillPoint] = (), notice_points: Sequence[NoticePoint] = (),
        holds: Sequence[KillPoint] = (), clock: Clock | None = None,
    ) -> None:
        self.kills = list(kills)
        self.notice_points = list(notice_points)
        self.holds = list(holds)
        self.clock = clock or SystemClock()

    @classmethod
    def for_node(
        cls, stage: int, pipeline: int, kills: Sequence[KillPoint] = (), notice_points: Sequence[NoticePoint] = (),
        clock: Clock | None = None,
    ) -> FaultInjector:
        """The injector of node (stage, pipeline): its kill points and notices, and the instructions
        other nodes' ``hold_confirmation_until`` wait for on it."""
        return cls(
            [k for k in kills if (k.stage, k.pipeline) == (stage, pipeline)],
            [n for n in notice_points if (n.stage, n.pipeline) == (stage, pipeline)],
            [
                KillPoint(stage, pipeline, k.hold_confirmation_until[2], k.hold_confirmation_until[3])
                for k in kills
                if k.hold_confirmation_until is not None and k.hold_confirmation_until[:2] == (stage, pipeline)
            ],
            clock,
        )

    def iteration_starting(self, executor: StageExecutor) -> None:
        """Tell the node of a notice point at its step that it will be preempted."""
        for point in self.notice_points:
            if point.step == executor.step:
                executor.coordinator.tell_notice(self.clock.time() + point.lead_s)

    def before_instruction(
        self, executor: StageExecutor, instruction: Instruction, index: int, length: int, recovering: bool
    ) -> None:
        """Kill this process at a matching kill point, or once a notice's deadline has passed."""
        deadline = executor.preemption_deadline
        if deadline is not None and self.clock.time() >= deadline:
            self._die(executor, PREEMPTION)
        for kill in self.kills:
            if kill.matches(executor.step, instruction, index, length, recovering):
                if kill.settle:
                    executor.interpreter.wait_posted_allreduces()
                self._die(executor, str(kill))

    def after_instruction(
        self, executor: StageExecutor, instruction: Instruction, index: int, length: int, recovering: bool
    ) -> None:
        """Mark an instruction that a kill point's ``hold_confirmation_until`` waits for."""
        if recovering:
            return
        for hold in self.holds:
            if hold.matches(executor.step, instruction, index, length):
                executor.store.set(reached_key(executor.job, executor.rank, hold.step, hold.instruction), "1")

    def _die(self, executor: StageExecutor, point: str) -> None:
        record = KillRecord(executor.rank, self.clock.time(), point)
        executor.store.set(killed_key(executor.job, executor.rank), record.to_json())
        sys.stdout.flush()
        sys.stderr.flush()
        os.kill(os.getpid(), signal.SIGKILL)
