"""Two races of the failure model replayed end to end, with their timing forced (bamboo-rc verify, real workers).

Each was found by the soak about once in hundreds of runs and needs two timings at once, so a seeded kill point
almost never replays it. Here the test process patches the runtime before `run_verify` forks its workers (they
inherit the patches): chosen ranks are held at chosen points until another rank has reached its own, which
makes the race happen in every run. Flag files under the test's temporary folder carry "reached" between the
worker processes, and the test checks that every forced point was reached, so that a run which slipped past the
race cannot pass for one that went through it. Both runs are bit-equal to the fault-free reference since the
fixes (`docs/failure-model.md`, the two rows on a wait that gives way to any confirmed failure); before them,
every forced run ended with the survivors' group or confirm timeouts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.rc import comm, faults, interpreter
from bamboo.rc.faults import KillPoint
from bamboo.rc.timeouts import CommTimeouts
from bamboo.rc.verify import run_verify

pytestmark = pytest.mark.slow

FORCED_WAIT_S = 30.0
"""How long a held rank waits for the other rank's point; the forced run fails its check if that runs out."""


def _wait_for(ready: Callable[[], bool], limit_s: float = FORCED_WAIT_S) -> bool:
    end = time.monotonic() + limit_s
    while not ready():
        if time.monotonic() >= end:
            return False
        time.sleep(0.005)
    return True


def _step_tracking(monkeypatch: pytest.MonkeyPatch) -> dict[str, int]:
    """Patch the interpreter so that each worker process knows the step it is in (one dict a process)."""
    now = {"step": -1}
    execute = interpreter.StageInterpreter.execute

    def tracked(self: interpreter.StageInterpreter, instruction: object) -> None:
        now["step"] = self.step
        execute(self, instruction)  # type: ignore[arg-type]

    monkeypatch.setattr(interpreter.StageInterpreter, "execute", tracked)
    return now


def test_a_commit_takes_part_in_another_pipelines_failover(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The seed-242 soak case (P = 5, D = 3, 13 microbatches, efeb): rank 3 dies in step 0; in step 2 rank 4
    (pipeline 0's last stage) waits in its commit's sum over pipeline 0 when rank 14 (pipeline 2's last stage)
    dies, and rank 7 notices that failure just before it receives from rank 8 (`3RG1<4`). Rank 4 must take part in
    the rebuild of `dp-s4` from inside its commit, or the pipelines wait for each other until the group timeout."""
    in_commit, noticed = tmp_path / "rank4-in-commit", tmp_path / "rank7-noticed"
    at_receive = tmp_path / "rank7-at-its-receive"
    now = _step_tracking(monkeypatch)
    post_allreduce = comm.GroupTable.post_allreduce

    def post(self: comm.GroupTable, group: str, tensors: list[object], instruction: str) -> list[object]:
        if self.rank == 4 and group == "pipe-d0" and now["step"] == 2:
            in_commit.touch()
        return post_allreduce(self, group, tensors, instruction)  # type: ignore[arg-type]

    before = faults.FaultInjector.before_instruction

    def hold_victim(self: faults.FaultInjector, executor: object, instruction: object, index: int, length: int,
                    recovering: bool) -> None:
        if executor.rank == 14 and executor.step == 2 and index == 38 and not recovering:  # type: ignore[attr-defined]
            # Both points first: held only until rank 4's commit, one loaded make test slipped past the race (rank 7
            # noticed nothing at its receive); waiting for rank 7 there too makes the order certain.
            _wait_for(lambda: in_commit.exists() and at_receive.exists())
        before(self, executor, instruction, index, length, recovering)  # type: ignore[arg-type]

    execute = interpreter.StageInterpreter.execute  # the step-tracking one

    def hold_receiver(self: interpreter.StageInterpreter, instruction: object) -> None:
        if self.rank == 7 and self.step == 2 and str(instruction) == "3RG1<4" and self.coordinator.epoch < 2:
            at_receive.touch()
            if _wait_for(lambda: self.coordinator.pending_event() is not None):
                noticed.touch()
            time.sleep(0.2)
        execute(self, instruction)

    monkeypatch.setattr(comm.GroupTable, "post_allreduce", post)
    monkeypatch.setattr(faults.FaultInjector, "before_instruction", hold_victim)
    monkeypatch.setattr(interpreter.StageInterpreter, "execute", hold_receiver)
    timeouts = CommTimeouts(group=20.0, build=20.0, confirm=20.0)
    result = run_verify(5, 3, 3, "efeb", timeouts=timeouts, deadline_s=120.0, global_microbatches=13,
                        kills=(KillPoint(3, 0, "7", 0), KillPoint(4, 2, "38", 2)), kills_must_fire=False)
    assert in_commit.exists(), "rank 4 never reached its commit of step 2: the race was not forced"
    assert at_receive.exists(), "rank 7 never came to 3RG1<4 of step 2 before the failure: the race was not forced"
    assert noticed.exists(), "rank 7 never noticed the second failure before 3RG1<4: the race was not forced"
    assert len(result.killed) == 2, result.killed
    assert result.passed, result


def test_a_join_of_another_pipelines_redo_gives_way_to_an_unrelated_failure(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three failures (P = 3, D = 3, efeb): rank 2 dies after its settled all-reduce of step 1, its confirmation
    held until rank 5 has sent its replica sync, so rank 5 must join pipeline 0's redo of that all-reduce over
    `dp-s2`; once rank 5 waits in that group's build, rank 4 (rank 5's own pipeline, not in the group) dies, and
    then rank 8, a member of the group that never applied the first failure. Rank 5's join must give way to rank
    4's failure and then read rank 8's, or every survivor ends with an agreement error after the confirm
    timeout."""
    joining, after_second = tmp_path / "rank5-joining", tmp_path / "rank8-saw-event-2"
    wait_built = comm.GroupTable.wait_built

    def built(self: comm.GroupTable, name: str, instruction: str,
              interrupt: Callable[[], None] | None = None) -> None:
        if self.rank == 5 and name == "dp-s2" and instruction == "the build of dp-s2" and name in self.building:
            joining.touch()
        wait_built(self, name, instruction, interrupt)

    before = faults.FaultInjector.before_instruction

    def hold(self: faults.FaultInjector, executor: object, instruction: object, index: int, length: int,
             recovering: bool) -> None:
        rank = executor.rank  # type: ignore[attr-defined]
        if executor.step == 1 and index == 24 and not recovering and rank in (4, 8):  # type: ignore[attr-defined]
            _wait_for(joining.exists)
            if rank == 8:
                if _wait_for(lambda: executor.coordinator.notices.poll(2) is not None):  # type: ignore[attr-defined]
                    after_second.touch()
                time.sleep(0.1)
        before(self, executor, instruction, index, length, recovering)  # type: ignore[arg-type]

    monkeypatch.setattr(comm.GroupTable, "wait_built", built)
    monkeypatch.setattr(faults.FaultInjector, "before_instruction", hold)
    kills = (KillPoint(2, 0, "2OPT", 1, settle=True, hold_confirmation_until=(2, 1, "2SY>1", 1)),
             KillPoint(1, 1, "1B3", 1), KillPoint(2, 2, "2OPT", 1))
    timeouts = CommTimeouts(group=20.0, build=20.0, confirm=15.0)
    result = run_verify(3, 3, 3, "efeb", timeouts=timeouts, deadline_s=120.0, kills=kills, kills_must_fire=False)
    assert joining.exists(), "rank 5 never waited in the build of dp-s2: the race was not forced"
    assert after_second.exists(), "rank 8 never saw the second failure's event: the race was not forced"
    assert len(result.killed) == 3, result.killed
    assert result.passed, result
