"""The commit's all-reduce over the pipeline gives way to a confirmed failure of another pipeline, and is resumed.

A node waiting in its commit may have to take part in another pipeline's failover first: build the data-parallel
group the failure changed and join the redo of the lost all-reduce. Its data-parallel peer may wait in that redo,
and hold up, through a transfer of its own pipeline, a node whose all-reduce this node's pipeline-mates wait for
before they reach the commit. The commit used to heed only its own pipeline's failures, so it never learned of
the other's, and every worker timed out (``bamboo-rc soak --stages 5 --pipelines 3 --global-microbatches 13
--redundancy efeb --second-failures --seed 242``, 1 run of 60: pipeline 0's last stage in its commit of step 2,
pipeline 1's last stage in the redo's build, pipeline 1's stage 1 sending to it before its ``1AR``, pipeline 0's
stage 1 waiting for that all-reduce).

In-process: a real group table over a fake gloo group whose all-reduce completes when the test says so, and a
fake coordinator that reports a confirmed failure.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest
import torch
from bamboo.rc.comm import GroupTable
from bamboo.rc.config import load_config
from bamboo.rc.failures import FailureNoticed, PeerFailure
from bamboo.rc.interpreter import StageInterpreter
from bamboo.rc.layout import Layout
from bamboo.rc.records import FailureEvent
from bamboo.rc.timeouts import CommTimeouts
from bamboo.rc.verify import DEFAULT_CONFIG

GIVE_UP_S = 30.0
"""A held sum fails on its own after this long (as gloo's would at the group timeout): a commit that does not give
way to the failure fails the test (a PeerFailure, or the sum marked failed) instead of hanging. Long, so that a
loaded machine never reaches it when the commit does give way: no assertion depends on the time taken."""


class HeldSum:
    """A posted all-reduce that completes when released, writing `result` into its tensor (or fails)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.result: torch.Tensor | None = None
        self.failed = False
        self.done = threading.Event()
        self.posted_at = time.monotonic()

    def release(self, result: torch.Tensor | None = None, failed: bool = False) -> None:
        self.result, self.failed = result, failed
        self.done.set()

    def is_completed(self) -> bool:
        if not self.done.is_set() and time.monotonic() - self.posted_at > GIVE_UP_S:
            self.release(failed=True)
        return self.done.is_set()

    def wait(self) -> bool:
        self.done.wait()
        if self.failed:
            raise RuntimeError("the held sum failed")
        if self.result is not None:
            self.tensor.copy_(self.result)
        return True


class FakeGloo:
    """The pipeline's group: every all-reduce posted on it, held."""

    def __init__(self) -> None:
        self.posted: list[HeldSum] = []

    def allreduce(self, tensors: list[torch.Tensor]) -> HeldSum:
        work = HeldSum(tensors[0])
        self.posted.append(work)
        return work


class FakeSlice:
    loss_scale = None  # fp32: no dynamic loss scale


@pytest.fixture
def node(noticing_coordinator: object) -> Iterator[StageInterpreter]:
    """Stage 1 of pipeline 0 (P = 2, D = 2: ranks 0 and 1 in pipeline 0, ranks 2 and 3 in pipeline 1), at the
    commit of step 0 with nothing of its own to add."""
    table = GroupTable(store=None, job="commit", rank=1, timeouts=CommTimeouts(poll=0.01), names={})  # type: ignore[arg-type]
    table.set_members(0, {"pipe-d0": (0, 1), "pipe-d1": (2, 3), "dp-s1": (1, 3)})
    table.groups["pipe-d0"] = FakeGloo()  # type: ignore[assignment]
    made = StageInterpreter(
        {1: FakeSlice()}, lambda *_: torch.zeros(()), load_config(DEFAULT_CONFIG), Layout(2, 2), 1, 0,  # type: ignore[dict-item]
        table, noticing_coordinator,  # type: ignore[arg-type]
    )
    yield made
    for work in made.groups.groups["pipe-d0"].posted:  # type: ignore[attr-defined]
        work.done.set()
    made.close()


def _posted(node: StageInterpreter) -> list[HeldSum]:
    return node.groups.groups["pipe-d0"].posted  # type: ignore[attr-defined, no-any-return]


def test_a_failure_of_another_pipeline_interrupts_the_commit_which_resumes_its_posted_sum(node: StageInterpreter) -> None:
    node.coordinator.event = FailureEvent(1, (3,))  # type: ignore[attr-defined]  # stage 1 of pipeline 1 died
    with pytest.raises(FailureNoticed):  # it gave way: it did not wait for its pipeline-mate (PeerFailure)
        node.commit([])
    assert len(_posted(node)) == 1 and node.step == 0 and not _posted(node)[0].failed
    node.coordinator.event = None  # type: ignore[attr-defined]  # agreed on (the executor's failover)
    _posted(node)[0].release(torch.tensor([0.0, 26.0], dtype=torch.float64))
    loss = node.commit([])  # the same sum, resumed: posting it again would pair it with the mate's next one
    assert len(_posted(node)) == 1
    assert node.step == 1 and node.last_commit is not None and node.last_commit.loss == 26.0
    assert loss == node.losses[-1]


def test_a_failed_commit_sum_is_posted_again_and_a_completed_one_not_in_the_next_step(node: StageInterpreter) -> None:
    node.coordinator.event = FailureEvent(1, (3,))  # type: ignore[attr-defined]
    with pytest.raises(FailureNoticed):
        node.commit([])
    node.coordinator.event = None  # type: ignore[attr-defined]
    _posted(node)[0].release(failed=True)
    with pytest.raises(PeerFailure, match="a member of pipe-d0"):
        node.commit([])
    assert len(_posted(node)) == 1
    threading.Timer(0.05, lambda: _posted(node)[1].release(torch.tensor([0.0, 2.0], dtype=torch.float64))).start()
    node.commit([])  # the failed sum is not waited for again: a new one is posted
    assert len(_posted(node)) == 2 and node.step == 1
    threading.Timer(0.05, lambda: _posted(node)[2].release(torch.tensor([0.0, 4.0], dtype=torch.float64))).start()
    node.commit([])  # the next step's commit posts its own sum
    assert len(_posted(node)) == 3 and node.step == 2 and node.last_commit is not None and node.last_commit.loss == 4.0


@pytest.mark.parametrize("mate", ["commits", "left"])
def test_after_a_consecutive_failure_elsewhere_an_interrupted_commit_is_finished_if_the_pipeline_mates_finish_it(
    node: StageInterpreter, mate: str
) -> None:
    """The agreement on the other pipeline's failure found a consecutive failure: every node leaves for the barrier.
    A pipeline-mate that went on waiting in the commit completes it and leaves at the next step, so this node
    finishes the commit too (the pipeline leaves at one step), unless a mate left without committing."""
    node.coordinator.event = FailureEvent(1, (2, 3))  # type: ignore[attr-defined]  # all of pipeline 1
    with pytest.raises(FailureNoticed):
        node.commit([])
    node.coordinator.event = None  # type: ignore[attr-defined]  # agreed on: a consecutive failure
    node.coordinator.dead |= {2, 3}  # type: ignore[attr-defined]
    if mate == "commits":
        threading.Timer(0.05, lambda: _posted(node)[0].release(torch.tensor([0.0, 6.0], dtype=torch.float64))).start()
        assert node.finish_posted_commit([])
        assert node.step == 1 and node.last_commit is not None and node.last_commit.loss == 6.0
    else:
        node.coordinator.left.add(0)  # type: ignore[attr-defined]
        assert not node.finish_posted_commit([])
        assert node.step == 0 and not _posted(node)[0].failed  # it gave up at once, not at the sum's failure
    assert len(_posted(node)) == 1


def test_a_commit_whose_pipeline_lost_a_member_is_not_finished(node: StageInterpreter) -> None:
    node.coordinator.event = FailureEvent(1, (0,))  # type: ignore[attr-defined]  # this pipeline's stage 0
    with pytest.raises(FailureNoticed):
        node.commit([])
    node.coordinator.dead.add(0)  # type: ignore[attr-defined]
    assert not node.finish_posted_commit([]) and node.step == 0
