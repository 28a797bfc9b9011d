"""Point-to-point transfers of the interpreter that notice failure events, and the group builds they wait for.

A send or receive is posted and waited for; while it waits, a confirmed failure event raises
:class:`~bamboo.rc.failures.FailureNoticed` and the transfer stays posted under its instruction's text,
so the same instruction of the failover schedule resumes it instead of posting it again
(:meth:`InterpreterTransfers.forget_transfers_with` drops those whose peer was a victim). A payload over
MAX_CHUNKS chunks goes in several messages, one after the other, and resumes at the message it stopped at.
Before a group's first use in an epoch, the node waits until every member is about to build it.
This module also holds the message tags every transfer of the interpreter uses.
"""

from __future__ import annotations

from collections.abc import Callable, Collection
from typing import TYPE_CHECKING

import torch
from bamboo.rc.comm import CHUNK_BYTES, MAX_CHUNKS, wait_works
from bamboo.rc.failures import FailureNoticed, PeerFailure
from bamboo.rc.interpreter_state import InterpreterState
from bamboo.rc.waiter import WaitHandle
from bamboo.schedule import Instruction

__all__ = ["InterpreterTransfers"]

# Message tags: kind (3 bits) | stage (< 128) | microbatch or segment (< 4096).
_TAG_ACT, _TAG_GRAD, _TAG_HEADER, _TAG_SYNC = 1, 2, 3, 4


def _tag(kind: int, stage: int, microbatch: int) -> int:
    if not (stage < 128 and microbatch < 4096):
        raise ValueError(f"stage {stage} / microbatch {microbatch} do not fit the message tag (128 / 4096)")
    return (kind * 128 + stage) * 4096 + microbatch


def _never_posted() -> tuple[list[object], torch.Tensor | None]:
    raise RuntimeError("a posted transfer was lost before it completed")


def _completed(handle: object) -> bool:
    """Whether a posted transfer is known to have completed, without waiting: only a helper's `WaitHandle` can say.
    gloo's point-to-point works report completion only once waited on, so the works themselves (no failure notices,
    no helper) always count as still waiting."""
    return isinstance(handle, WaitHandle) and handle.done()


def _segments(flat: torch.Tensor) -> list[torch.Tensor]:
    """Split a large 1-D payload into messages that each fit MAX_CHUNKS chunks."""
    per_message = max(1, MAX_CHUNKS * CHUNK_BYTES // flat.element_size())
    return list(flat.split(per_message))


class InterpreterTransfers(InterpreterState):
    """The interpreter's sends and receives: posted, resumed after a failure event, or dropped."""

    if TYPE_CHECKING:

        def _post_built(self) -> None:
            """Defined by `InterpreterAllReduces`: post the all-reduces whose rebuilt group is built."""

        def apply_replica_updates(self) -> None:
            """Defined by `InterpreterCommit`: the replicas' optimizer steps of the last iteration."""

    # ----------------------------------------------------------------------------- transfers
    def _transfer(
        self, instruction: Instruction, peer: int, post: Callable[[], tuple[list[object], torch.Tensor | None]]
    ) -> torch.Tensor | None:
        """Post (or resume) a send or receive and wait for it.

        While it waits, the node checks for confirmed failure notices; if one arrives, the
        transfer stays posted (kept under the instruction's text, so the same instruction of the
        failover schedule resumes it instead of posting a duplicate) and FailureNoticed is raised.
        """
        key = str(instruction)
        if key in self._pending:
            _, handle, buffer = self._pending.pop(key)
            waits = buffer is not None and not _completed(handle)  # a receive posted ahead may have its data already
        else:
            works, buffer = post()
            handle = self._handle(works)
            waits = buffer is not None
        if waits and self._replica_updates:
            # A receive waits for its peer's work: idle time, where the replicas take the optimizer step of the last
            # iteration (due before their next use) instead of at the end of this one.
            self.apply_replica_updates()
        if isinstance(handle, list):
            try:
                wait_works(handle)
            except RuntimeError as exc:
                raise PeerFailure(peer, self.layout.name(peer), key, exc) from exc
            return buffer
        assert isinstance(handle, WaitHandle)
        while True:
            try:
                if handle.wait(self.groups.timeouts.poll):
                    return buffer
            except RuntimeError as exc:
                raise PeerFailure(peer, self.layout.name(peer), key, exc) from exc
            self._post_built()
            event = self.coordinator.pending_event()
            if event is not None:
                assert instruction.peer is not None
                self._pending[key] = (instruction.peer, handle, buffer)
                raise FailureNoticed(event) from None

    def forget_transfers_with(self, victims: Collection[int]) -> list[str]:
        """Drop the interrupted transfers whose peer is one of `victims` (nodes of this pipeline that a
        failover removed); returns their instruction texts. The failover schedule never resumes them: they
        only fail, and they would keep their buffers to the end of this executor."""
        dropped = sorted({key for key, (peer, _, _) in [*self._pending.items(), *self._segmented.items()]
                          if peer in victims})
        for key in dropped:
            self._pending.pop(key, None)
            self._segmented.pop(key, None)
            self._posted_syncs.pop(key, None)
        if dropped:  # a dropped receive may still be posted on its buffer
            self._sync_buffers.drop()
        return dropped

    def _needs_barrier(self, group: str) -> bool:
        """Whether using `group` builds it first (its first use in an epoch) with others (callers check
        for a build in the background first)."""
        return self.coordinator.watching and group not in self.groups.groups and len(self.groups.members[group]) > 1

    def _announce_group(self, group: str, interrupt: Callable[[], None] | None = None) -> None:
        """Inside the failover itself, before `group`'s first use in the epoch: tell the other members
        that this node is about to build it, or wait for its build in the background (calling
        `interrupt`, which may raise)."""
        if group in self.groups.building:
            self.groups.wait_built(group, f"the build of {group}", interrupt)
        elif self._needs_barrier(group):
            self.coordinator.announce_group(group, self.groups.versions[group])

    def _await_group_members(self, group: str, instruction: str) -> None:
        """Before `group`'s first use in the epoch, raising FailureNoticed on any confirmed failure
        meanwhile: wait for its build in the background, or (none started) until every member is about
        to build it too (a member may die before it gets there, and a gloo build would only time out),
        then build it in the background and wait for that (a member may also die after it announced the
        build and before it joined it)."""
        if group in self.groups.building or self._needs_barrier(group):
            version, members = self.groups.versions[group], self.groups.members[group]
            self.groups.build_after_barrier(group, instruction,
                                            lambda: self.coordinator.await_group(group, version, members),
                                            self._poll)

    def _poll(self) -> None:
        """Called every `timeouts.poll` seconds while this node waits: post the all-reduces whose rebuilt
        group is now built (:meth:`repost_changed_allreduces`), and raise FailureNoticed on a confirmed
        failure."""
        self._post_built()
        self.coordinator.raise_if_noticed()

    def _send(self, instruction: Instruction, tensor: torch.Tensor, peer: int, tag: int) -> None:
        group = self._group_for(peer)
        self._await_group_members(group, str(instruction))
        self._transfer(instruction, peer, lambda: (
            self.groups.post_send(group, self.staging.outbound(tensor), peer, tag, str(instruction)), None))

    def _recv(self, instruction: Instruction, buffer: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        group = self._group_for(peer)
        self._await_group_members(group, str(instruction))
        out = self._transfer(
            instruction, peer, lambda: (self.groups.post_recv(group, buffer, peer, tag, str(instruction)), buffer)
        )
        assert out is not None
        return out

    def complete_posted_syncs(self) -> None:
        """Wait until every replica sync this node posted was received, giving way to a confirmed failure
        (the sync stays posted, and is waited for again at the next commit)."""
        for key, instruction in list(self._posted_syncs.items()):
            if key in self._pending:
                assert instruction.peer is not None
                self._transfer(instruction, self._peer_rank(instruction.peer), _never_posted)
            del self._posted_syncs[key]

    def _receive_segments(self, instruction: Instruction, make: Callable[[], torch.Tensor], peer: int,
                          stage: int) -> torch.Tensor:
        """Receive into the payload `make()` gives, one message per segment; returns the payload.

        A payload over MAX_CHUNKS chunks (256 MiB) comes in messages of that size, one after the other, so that
        no more than one message's chunks are posted at a time. A confirmed failure can interrupt it after some
        segments came: the payload and the first unfinished segment are kept under the instruction's text, so the
        failover schedule's same instruction resumes it there (the interrupted segment's receive is still posted),
        and never receives a segment twice."""
        key = str(instruction)
        assert instruction.peer is not None
        _, payload, start = self._segmented.pop(key, (instruction.peer, None, 0))
        if payload is None:
            payload = make()
        for segment, piece in enumerate(_segments(payload)):
            if segment < start:
                continue
            self._segmented[key] = (instruction.peer, payload, segment)
            self._recv(instruction, piece, peer, _tag(_TAG_SYNC, stage, segment))
        del self._segmented[key]
        return payload
