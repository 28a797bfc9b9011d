"""The end of an interpreter's step: the optimizer steps, the replica sync and the commit.

`OPT` is recorded and applied at the commit (:meth:`InterpreterCommit.commit`: one small all-reduce over the
pipeline of the squared gradient norm and the loss, preceded by one of the tied weights' gradients when the
model ties weights across stages; then every hosted stage steps with the global clip coefficient, or skips the
step after an fp16 overflow). `SY` posts a stage's reduced gradients to its shadow as a buffered send,
completed before the commit; `RY` receives the owner's, and the replica steps with them, and the same tied
sums, right before its next use.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch
from bamboo.rc.failures import FailureNoticed, PeerFailure
from bamboo.rc.interpreter_allreduces import InterpreterAllReduces
from bamboo.rc.interpreter_transfers import _TAG_SYNC, _segments, _tag
from bamboo.rc.precision import step_outcome
from bamboo.rc.records import CommitResult
from bamboo.rc.ties import squared_norm
from bamboo.rc.timeouts import LEFT_POLL_S
from bamboo.schedule import Instruction

__all__ = ["InterpreterCommit"]


class InterpreterCommit(InterpreterAllReduces):
    """The interpreter's commit, its optimizer steps, and the replica sync that keeps each copy equal."""

    def _optimizer(self, instruction: Instruction) -> None:
        self._to_step.append(instruction.stage)  # applied at the commit, with the global clip

    def _sync_send(self, instruction: Instruction) -> None:
        """Post the send of stage s's reduced gradients (and its loss and step number) to its shadow, and go on.

        The replica sync is a buffered send (`bamboo.schedule.BUFFERED_SENDS`): the shadow receives it at the end
        of its own work, so waiting here would hold this node for nothing. It is completed before the commit
        (:meth:`complete_posted_syncs`), which keeps its payload buffer alive until then."""
        assert instruction.peer is not None
        s = instruction.stage
        self._wait_reduction(s)
        shadow = self._peer_rank(instruction.peer)
        payload = torch.cat(self._reduced[s], out=self._sync_buffers.get(("out", s), self._sync_size(s)))
        group = self._group_for(shadow)
        key = str(instruction)
        self._await_group_members(group, key)
        works: list[object] = []
        for segment, piece in enumerate(_segments(payload)):
            works += self.groups.post_send(group, piece, shadow, _tag(_TAG_SYNC, s, segment), key)
        handle = self._handle(works)
        self._pending[key] = (instruction.peer, handle, payload)
        self._posted_syncs[key] = instruction
        self.sync_bytes += payload.numel() * payload.element_size()
    def _sync_recv(self, instruction: Instruction) -> None:
        """Receive stage s's reduced gradients; the replica steps with them after the commit."""
        assert instruction.peer is not None
        s = instruction.stage
        self._apply_replica_update(s)  # lflb never runs the replica: apply the last update now
        owner = self._peer_rank(instruction.peer)
        # Reused: the last update, applied just now, was the only other user of the buffer.
        self._received_syncs[s] = self._receive_segments(
            instruction, lambda: self._sync_buffers.get(("in", s), self._sync_size(s)), owner, s
        )

    def post_sync_ahead(self, instruction: Instruction) -> None:
        """Post the receive of a replica sync (`RY`) before its turn, where its buffer is free (the replica took the
        last update) and one message carries it; `_sync_recv` then resumes it (:meth:`_receive_segments`).

        The owner's `SY` is a buffered send in the schedule: its data lands while the shadow computes. A gloo send
        moves its data only once the receive is posted, so a shadow that posted it at `RY` received the whole
        payload there, at the end of its stream: on the node that ends the iteration (P = 2, M = 8, 9.3 MB) that
        was 5 to 6 ms of each step."""
        s, key = instruction.stage, str(instruction)
        if s in self._replica_updates or s in self._received_syncs or key in self._pending or key in self._segmented:
            return
        assert instruction.peer is not None
        owner = self._peer_rank(instruction.peer)
        group = self._group_for(owner)
        if group not in self.groups.groups or self._needs_barrier(group):
            return
        payload = self._sync_buffers.get(("in", s), self._sync_size(s))
        pieces = _segments(payload)
        if len(pieces) != 1:
            return
        works = self.groups.post_recv(group, pieces[0], owner, _tag(_TAG_SYNC, s, 0), key)
        self._pending[key] = (instruction.peer, self._handle(works), pieces[0])
        self._segmented[key] = (instruction.peer, payload, 0)

    def _sync_size(self, s: int) -> int:
        """Elements of stage s's replica sync: its gradients, the reduced loss and the step number."""
        return self.slices[s].numel() + 2
    def _apply_replica_update(self, stage: int) -> None:
        """Apply the owner's step of the last iteration to the replica of `stage` (identical math)."""
        update = self._replica_updates.pop(stage, None)
        if update is None:
            return
        started = time.perf_counter()
        payload, outcome, tie_sums = update
        replica = self.slices[stage]
        step = int(payload[-1].item())
        if step != replica.steps + 1:
            raise RuntimeError(f"replica sync of stage {stage} out of order: got step {step}, replica at {replica.steps}")
        if not outcome.overflow:
            replica.load_flat_grads(payload[:-2])
        replica.finish_step(outcome, tie_sums)
        self.kind_seconds["replica_step"] = self.kind_seconds.get("replica_step", 0.0) + time.perf_counter() - started

    def apply_replica_updates(self) -> None:
        """Apply every received replica update now (they are otherwise applied at the replica's next use)."""
        for stage in list(self._replica_updates):
            self._apply_replica_update(stage)
    # ----------------------------------------------------------------------------- commit
    def commit(self, hosted: Sequence[int]) -> float:
        """End the iteration of the `hosted` stages: one all-reduce over the pipeline of the squared
        gradient norm and the loss, then their optimizer steps with the global clip coefficient.
        Returns the step's mean loss over the global batch.

        This is the commit point: until it, no parameter has changed in this iteration, so a
        failure before it leaves every survivor at the start-of-iteration state. The all-reduce is
        not atomic: when a victim dies during it, survivors that completed it have committed and
        the others finish the commit with their result (:meth:`finish_commit`).
        """
        started = time.perf_counter()
        try:
            return self._commit(hosted)
        finally:
            self.kind_seconds["commit"] = self.kind_seconds.get("commit", 0.0) + time.perf_counter() - started

    def finish_posted_commit(self, hosted: Sequence[int]) -> bool:
        """Finish this step's commit, whose sums this node posted on its pipeline's group, after it left the wait
        for another pipeline's failure and the agreement found a consecutive failure: its pipeline-mates that
        went on waiting complete the commit and leave at the next step, so this node does the same, as it did
        when its commit heeded only its own pipeline's failures. Returns True once committed; False, leaving
        the iteration to be abandoned, when nothing was posted in this step on the group as it is, when a member
        is dead, or as soon as a member left for the barrier or failed (the commit then never completes)."""
        pipe = f"pipe-d{self.pipeline}"
        group, members = self.groups.groups.get(pipe), self.groups.members.get(pipe, ())
        if not self._commit_sums or set(members) & self.coordinator.dead or any(
            posted_on is not group for posted_on, _, _ in self._commit_sums.values()
        ):
            return False
        next_left_check = 0.0

        def interrupt() -> None:
            nonlocal next_left_check
            event = self.coordinator.pending_event()
            if event is not None and set(event.victims) & set(members):
                raise _GaveUp
            now = self.coordinator.clock.monotonic()
            if now >= next_left_check:
                next_left_check = now + LEFT_POLL_S
                if self.coordinator.any_left(members):
                    raise _GaveUp

        try:
            self._commit(hosted, interrupt)
        except (_GaveUp, PeerFailure, FailureNoticed):
            return False
        return True

    def _commit(self, hosted: Sequence[int], interrupt: Callable[[], None] | None = None) -> float:
        pipe = f"pipe-d{self.pipeline}"
        self._await_group_members(pipe, "commit")  # before anything changes: it may raise
        for s in sorted(self._reducing):
            self._wait_reduction(s)
        self.complete_posted_syncs()  # every shadow holds its stage's step before anyone commits it
        squared, loss = self._commit_contribution(hosted)
        if self.ties:  # the tied copies' gradients summed over the pipeline (zeros from a node holding none)
            tied = self._commit_sum(pipe, "commit (tied weights' gradients)",
                                    lambda: self.ties.contribution([self.slices[s].tied for s in sorted(hosted)]),
                                    interrupt)
            self._tie_sums = self.ties.split(tied)
        norm_and_loss = self._commit_sum(pipe, "commit (global gradient norm and loss)",
                                         lambda: torch.tensor([squared, loss], dtype=torch.float64), interrupt)
        return self._apply_commit(hosted, CommitResult(self.step, float(norm_and_loss[0]), float(norm_and_loss[1])))

    def _commit_sum(self, pipe: str, what: str, contribution: Callable[[], torch.Tensor],
                    interrupt: Callable[[], None] | None = None) -> torch.Tensor:
        """Sum `contribution()` over the pipeline's group `pipe` (one of the commit's all-reduces) and return it.

        The wait gives way to any confirmed failure (FailureNoticed), of this pipeline or of another: a node in
        its commit may have to take part in another pipeline's failover before its own pipeline can finish the
        commit. There, its data-parallel peer may wait in the redo of a lost all-reduce (the rebuilt group's
        build, or its sum) that needs this node, and hold up, through a transfer of its own pipeline, a node
        whose all-reduce this node's pipeline-mates wait for before they commit: a commit that heeded only its
        own pipeline's failures never learned of the other's, and every worker timed out. The sum stays posted
        and is resumed when the commit runs again (it is never posted twice: gloo matches a group's collectives
        in posting order), unless the group was rebuilt meanwhile (a failure in this pipeline) or the sum
        failed; one that completed is not summed again in the same step. `interrupt` replaces that wait's
        failure poll (:meth:`finish_posted_commit`)."""
        group = self.groups.groups.get(pipe)
        posted = self._commit_sums.get(what)
        if posted is None or posted[0] is not group:
            tensor = contribution()
            works = self.groups.post_allreduce(pipe, [tensor], what)
            posted = self._commit_sums[what] = (self.groups.groups.get(pipe), works, tensor)
        try:
            self.groups.wait_collective(pipe, posted[1], what, interrupt or self._poll)
        except PeerFailure:
            del self._commit_sums[what]
            raise
        return posted[2]

    def _commit_contribution(self, hosted: Sequence[int]) -> tuple[float, float]:
        """This node's part of the commit: the squared gradient norm of the `hosted` stages and the
        loss (the last stage's). A victim's finished stage takes its gradients from its replica
        sync. Changes nothing but those gradients, so it can run again."""
        last = self.layout.stages - 1
        squared = 0.0
        loss = 0.0
        for s in hosted:
            if s in self._reduced:
                squared += self.slices[s].squared_grad_norm()
                reduced_loss = float(self._reduced[s][1][0])
            elif s in self._received_syncs:  # a victim's finished stage: its sync is the result
                payload = self._received_syncs[s]
                self.slices[s].load_flat_grads(payload[:-2])
                squared += self.slices[s].squared_grad_norm()
                reduced_loss = float(payload[-2])
            else:
                raise RuntimeError(f"stage {s} ended the iteration without an all-reduce")
            if s == last:
                loss = float(self._reduced[s][1][0]) if s in self._reduced else reduced_loss
        if last in hosted and last in self._reduced:
            loss = sum(self.mb_losses.values()) if self.layout.pipelines == 1 else loss
        return squared, loss

    def finish_commit(self, hosted: Sequence[int], result: CommitResult) -> float:
        """Finish this step's commit with `result`, the outcome of the commit's all-reduce that the
        other survivors completed while this node's failed (a victim died during it). `hosted` are
        the stages this node ran in the step. Returns the step's mean loss, as :meth:`commit`."""
        if result.step != self.step:
            raise RuntimeError(f"the result of the commit of step {result.step} cannot end step {self.step}")
        return self._apply_commit(hosted, result)

    def _apply_commit(self, hosted: Sequence[int], result: CommitResult) -> float:
        """The optimizer steps of the `hosted` stages with the clip coefficient of `result`, the
        replica updates, the step's loss; then the next iteration."""
        if self._pending or self._segmented:
            # A transfer with a live peer that the step ended without: the failover schedule should have
            # resumed it. Left posted, it would pair with the next step's transfer of the same text (a stale
            # send would deliver this step's tensor), so stop rather than train on.
            raise RuntimeError(
                f"step {self.step} of node {self.node} (pipeline {self.pipeline}) ended with transfers still posted: "
                f"{sorted({*self._pending, *self._segmented})}; the failover schedule did not resume them"
            )
        if self.ties and self._tie_sums is None:
            raise RuntimeError(f"the commit of step {self.step} ends without the sums of the tied weights' gradients")
        tie_sums = self._tie_sums or {}
        squared = result.squared_norm + squared_norm(tie_sums)  # a tied weight counts once
        outcome = step_outcome(self.config.gradient_clipping, squared, next(iter(self.slices.values())).loss_scale,
                               self.config.fp16)
        finished = [s for s in hosted if s not in self._reduced and s in self._received_syncs]
        for s in finished:
            self.slices[s].load_flat_grads(self._received_syncs[s][:-2])
        for s in [*self._to_step, *finished]:
            self.slices[s].finish_step(outcome, tie_sums)
        for s, payload in self._received_syncs.items():
            if s not in finished:
                self._replica_updates[s] = (payload, outcome, tie_sums)
        for piece in self.slices.values():  # replicas too: the scale is the same everywhere
            piece.loss_scale = outcome.loss_scale
        mean_loss = result.loss / self._global_microbatches()
        self.losses.append(mean_loss)
        self.last_commit = result
        self.step += 1
        self.reset_iteration()
        return mean_loss


class _GaveUp(Exception):
    """:meth:`InterpreterCommit.finish_posted_commit` gives up: a member of the pipeline's group left or died."""
