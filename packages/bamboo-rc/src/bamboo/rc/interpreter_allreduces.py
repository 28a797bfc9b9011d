"""The interpreter's data-parallel all-reduces: posted, awaited where needed, posted again after a failure.

`AR` posts the all-reduce of a stage's gradients (and the loss); its result is awaited where it is needed
(collectives of different groups never wait on each other in stream order). With redundancy each keeps a copy
of what it contributed, so that a shadow's redo of a lost stage's all-reduce can be joined exactly once
(:meth:`InterpreterAllReduces.join_redone_allreduces`), and one pending on a group whose membership changed is
posted again on the rebuilt group once its build in the background is done.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch
from bamboo.rc.failures import FailureNoticed
from bamboo.rc.interpreter_transfers import InterpreterTransfers
from bamboo.schedule import FailoverPlan, Instruction, Kind

__all__ = ["InterpreterAllReduces"]


class InterpreterAllReduces(InterpreterTransfers):
    """The interpreter's all-reduces: posting, waiting, keeping contributions, posting again."""

    def _allreduce(self, instruction: Instruction) -> None:
        """Start the data-parallel all-reduce of stage s (the result is awaited when needed:
        collectives on different groups must not wait on each other in the stream's order)."""
        s = instruction.stage
        piece = self.slices[s]
        last = s == self.layout.stages - 1
        loss = torch.tensor([sum(self.mb_losses.values()) if last else 0.0], dtype=torch.float64)
        # A fresh gradient-sized tensor costs its page faults again every step, so the flat gradients go into
        # a reused buffer: without redundancy nothing outlives the step's all-reduce (a failure ends the run),
        # so one per stage; with redundancy one whose all-reduce completed, or a contribution no longer kept.
        n = piece.numel()
        flat = piece.flat_grads(out=self._spare_grads.take(s, n) if self.keeps_contributions
                                else self._flat_buffers.get(s, n))
        if not self.keeps_contributions:
            contribution: tuple[int, torch.Tensor | None, torch.Tensor | None] = (self.step, None, None)
        elif self.layout.pipelines == 1:  # a group of one: the all-reduce leaves `flat` as it is, so it is its own copy
            contribution = (self.step, flat, loss)
        else:  # the all-reduce sums into `flat`: the contribution is kept apart, for a shadow's redo
            contribution = (self.step, self._spare_grads.take(s, n).copy_(flat), loss.clone())
        group = f"dp-s{s}"
        self._await_group_members(group, str(instruction))
        works = self.groups.post_exact_sum(group, [flat, loss], str(instruction))
        self._reducing[s] = (works, flat, loss, contribution, self.groups.members[group])

    def _wait_reduction(self, s: int) -> None:
        """Finish stage s's all-reduce: load the reduced gradients, record the result.

        While it waits, any confirmed failure raises FailureNoticed (the all-reduce stays posted
        in `_reducing` and is resumed, never posted twice): a failed pipeline's survivors must
        never sit uninterruptibly in a collective with another pipeline, whose nodes may wait in
        the failover agreement for the survivors' progress.
        """
        if s not in self._reducing:
            return
        self._post_waiting(block=True, interrupt=self._poll)
        works, flat, loss, contribution, _members = self._reducing[s]
        assert works is not None
        group = f"dp-s{s}"
        self.groups.wait_collective(group, works, f"{s}AR", self._poll)
        del self._reducing[s]
        piece = self.slices[s]
        piece.load_flat_grads(flat)
        if self.layout.pipelines > 1 and self.keeps_contributions:  # in case a lost peer's shadow redoes it
            self._contributions[(s, contribution[0])] = (contribution[1], contribution[2])
            self.coordinator.note_allreduce_completed(s, contribution[0])  # a redo of ours: said for later agreements
            for key in [k for k in self._contributions if k[1] < contribution[0] - 1]:
                kept, _ = self._contributions.pop(key)
                self._spare_grads.give_back(key[0], kept)  # never posted: redos and reposts send copies
        self._reduced[s] = (flat, torch.cat([loss.float(), torch.tensor([float(piece.steps + 1)])]))

    def completed_allreduces(self) -> dict[int, tuple[int, ...]]:
        """Stage -> the steps whose all-reduce of that stage this node completed and still keeps a contribution
        of (the current step and the one before), or posted and finished without an error though no one
        waited for it yet (never blocks)."""
        completed: dict[int, set[int]] = {}
        for stage, step in self._contributions:
            completed.setdefault(stage, set()).add(step)
        for stage, (works, _, _, contribution, _) in self._reducing.items():
            if works is not None and _finished_well(works):
                completed.setdefault(stage, set()).add(contribution[0])
        return {stage: tuple(sorted(steps)) for stage, steps in sorted(completed.items())}

    def wait_posted_allreduces(self) -> None:
        """Wait until every posted data-parallel all-reduce completed (so the peers completed it too)."""
        self._post_waiting(block=True)
        for s in sorted(self._reducing):
            works, _, _, _, _ = self._reducing[s]
            assert works is not None
            self.groups.wait_collective(f"dp-s{s}", works, f"{s}AR")
    # ----------------------------------------------------------------------------- after failures
    def repost_changed_allreduces(self) -> None:
        """Post again, on the rebuilt group, every pending all-reduce whose group's membership
        changed (a member left at an iteration boundary).

        This runs while the event is applied, where nothing may block: each is posted once its group's
        build in the background is done, at this node's next instruction or wait, and at the latest
        where its result is needed, which waits for the build and gives way to a confirmed failure
        meanwhile (a member that died before it joined the build)."""
        for stage, (_, _, _, contribution, members) in list(self._reducing.items()):
            group = f"dp-s{stage}"
            if members != self.groups.members[group]:
                self._post_again(stage, contribution)

    def _post_again(self, stage: int, contribution: Any) -> None:
        """Post stage `stage`'s all-reduce again, with the contribution it had, on the group of the current
        membership: now if the group is built, else once its build in the background is done (started
        here if no membership change started it)."""
        group = f"dp-s{stage}"
        _, flat, loss = contribution
        if flat is None or loss is None:
            raise RuntimeError(f"stage {stage}: an all-reduce must be posted again, but its contribution was not kept "
                               f"(keeps_contributions is off: redundancy none)")
        if group not in self.groups.groups and group not in self.groups.building and len(self.groups.members[group]) > 1:
            self._announce_group(group)  # the store barrier the other members wait at before they build it
            self.groups.start_build(group)
        self._reducing[stage] = (None, flat.clone(), loss.clone(), contribution, self.groups.members[group])
        self._post_built()

    def _post_built(self) -> None:
        """Post each all-reduce waiting to be posted again whose group is ready by now; never blocks."""
        self._post_waiting(block=False)

    def _post_waiting(self, block: bool, interrupt: Callable[[], None] | None = None) -> None:
        """Post, in stage order, the all-reduces waiting to be posted again on their rebuilt group: those
        whose group is ready, or (`block`) each after waiting for its build. One whose group changed again
        is left to the event that changed it, which posts it again; where the result is needed (`block`),
        such a one is an error. A blocking wait calls `interrupt`, which may raise: those not posted yet
        stay waiting."""
        for stage in sorted(self._reducing):
            works, flat, loss, contribution, members = self._reducing[stage]
            if works is not None:
                continue
            group = f"dp-s{stage}"
            if members != self.groups.members.get(group):
                if not block:
                    continue
                raise RuntimeError(
                    f"stage {stage}: an all-reduce waits to be posted again on {group} as {list(members)}, but the "
                    f"group is {list(self.groups.members.get(group, ()))} now and no failover posted it again"
                )
            if block:
                self.groups.wait_built(group, f"{stage}AR (again)", interrupt)
            elif len(members) > 1 and not self.groups.ready(group):  # a failed build is raised when blocking
                continue
            posted = self.groups.post_exact_sum(group, [flat, loss], f"{stage}AR (again)")
            self._reducing[stage] = (posted, flat, loss, contribution, members)

    def join_redone_allreduces(self, plan: FailoverPlan, lost: set[int] | frozenset[int], step: int,
                               hosted: Sequence[int]) -> None:
        """Take part, exactly once per step, in the all-reduce of each lost stage hosted here (the
        failover of another pipeline): :meth:`owe_redone_allreduces`, then :meth:`join_owed_allreduces`."""
        self.owe_redone_allreduces(plan, lost, step, hosted)
        self.join_owed_allreduces()

    def owe_redone_allreduces(self, plan: FailoverPlan, lost: set[int] | frozenset[int], step: int,
                              hosted: Sequence[int]) -> None:
        """Note that this node owes its part in `plan`'s redo of each lost stage it hosts (joined, in the order
        noted, by :meth:`join_owed_allreduces`), with the membership version of the stage's group now."""
        for v in sorted(lost):
            if v in hosted:
                self._owed_joins.append((plan, v, step, self.groups.versions.get(f"dp-s{v}")))

    def join_owed_allreduces(self) -> None:
        """Join each redo this node owes (:meth:`_join_redone_allreduce`), in the order they were noted.

        Waiting for a redo's rebuilt group, a join gives way to any confirmed failure (FailureNoticed), of a
        member of the group or not: that failure may be of this node's own pipeline, whose survivors wait for its
        progress in their agreement, and the group's build may wait for a member that died after that failure
        (its death is the event after the next one, which a wait that heeds only the next event, and only if it
        touches the group, never reads). The join stays owed, and is resumed after the agreement on that failure
        if the group's membership is the same; a group rebuilt meanwhile (a member died or left) drops it, as the
        agreement that changed the group decided the redo's fate (the two redos meet on the new group, or
        :class:`~bamboo.rc.failures.LostContribution`). A join that fails otherwise is not owed any more."""
        while self._owed_joins:
            plan, v, step, version = self._owed_joins[0]
            try:
                if self.groups.versions.get(f"dp-s{v}") == version:
                    self._join_redone_allreduce(plan, v, step)
            except FailureNoticed:
                raise  # still owed
            except BaseException:
                self._owed_joins.pop(0)
                raise
            self._owed_joins.pop(0)

    def _join_redone_allreduce(self, plan: FailoverPlan, v: int, step: int) -> None:
        """Take part in the all-reduce of lost stage `v`, hosted here, in `plan` (another pipeline's failover).

        `step` is the step in which the other pipeline failed. If the lost stage's shadow redoes
        that step's all-reduce: an all-reduce of ours for that step that already completed is
        joined again with our stored contribution; one still pending on the old group is posted
        again on the rebuilt group. If the shadow does not redo it (the victim had finished), ours
        completes on the old group. A node already past `step` that kept no contribution of it (it took
        the stage over after that step) cannot join exactly, and raises: the agreement raises
        :class:`~bamboo.rc.failures.LostContribution` for that case before anyone gets here. A pending
        all-reduce of a later step (this node ran ahead: its pipeline committed `step` without the
        failed one) is posted again too, but only after
        the redo of `step`: gloo matches the collectives of a group in posting order, and the
        shadow posts the redo of `step` first, so the other order would sum different steps. The only wait is
        for the rebuilt group's build, before anything is posted: resumed, the join starts again from the top.
        """
        shadow = plan.remainder.placement[v]  # the node that took stage v over
        redone = any(i.kind is Kind.ALLREDUCE and i.stage == v for i in plan.remainder.streams[shadow])
        group = f"dp-s{v}"
        pending = self._reducing.get(v)
        pending_step = pending[3][0] if pending is not None else None
        if pending_step is not None and pending_step < step:
            raise RuntimeError(
                f"stage {v}: an all-reduce of step {pending_step} is still pending while the other pipeline "
                f"failed in step {step}"
            )
        if redone and pending_step != step:  # ours of `step` completed (or is not posted yet)
            contribution = self._contributions.get((v, step))
            if contribution is not None:
                # Posted, not waited for: nothing here needs the sum, and the shadow may post its redo only
                # after a later agreement that this node must take part in (its own pipeline failing
                # meanwhile). The work keeps its tensors until the shadow joins (the group table keeps the work).
                flat, loss = contribution
                self._announce_group(group, self._poll)
                self.groups.post_exact_sum(group, [flat.clone(), loss.clone()], f"redo of {v}AR")
            elif pending_step is not None or self.step > step:  # past that step, nothing stored: no exact redo
                raise RuntimeError(
                    f"stage {v}: the shadow redoes the all-reduce of step {step}, but this node is in step "
                    f"{self.step if pending_step is None else pending_step} and kept no contribution of step "
                    f"{step} (it did not hold the stage then)"
                )
        if pending is not None and pending[4] != self.groups.members[group]:
            assert pending_step is not None
            if pending_step > step or redone:
                self._post_again(v, pending[3])


def _finished_well(works: Sequence[object]) -> bool:
    """Whether every one of `works` (collectives) completed without an error: a completed work's wait returns at
    once, or raises its error."""
    if not all(work.is_completed() for work in works):  # type: ignore[attr-defined]
        return False
    try:
        for work in works:
            work.wait()  # type: ignore[attr-defined]
    except RuntimeError:
        return False
    return True
