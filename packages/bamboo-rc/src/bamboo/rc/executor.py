"""The stage executor: interprets one node's `bamboo.schedule` instruction stream with real tensors.

Node `n` of pipeline `d` owns stage `n` and, with redundancy, the replica of stage `(n+1) mod P`.
Each iteration it executes its stream (see `packages/bamboo-schedule/README.md`, "Executing a
schedule") one instruction at a time:

- `L`, `F`, `B`, `SA`/`RA`, `SG`/`RG`: the pipeline itself. Sends are posted without waiting
  (they complete in the background and are awaited at the end of the iteration); receives block.
- `FR`, `SO`, `SI`, `BR`: redundant work on the replica, with the FRC stash kept in
  :class:`~bamboo.rc.stash.FrcStash`.
- `AR`: the data-parallel all-reduce of the stage's gradients (and the loss).
- `OPT`, `SY`, `RY`: the step, and replica sync. The global gradient norm (for clipping) needs
  every stage of the pipeline, so when `gradient_clipping` is set these three run after the stream
  ends, behind one small all-reduce over the pipeline (in stream order). Without clipping they run
  in place. `RY` only posts its receive; the replica step runs right before the replica is next
  used (or at :meth:`StageExecutor.finish`), off the critical path.

All per-microbatch state is keyed by (stage, microbatch), so a node can host two stages after a
failover. The gradient w.r.t. each stage input (what `SG` sends) is kept for the whole iteration
(:attr:`StageExecutor.input_grads`), so it can be sent again to a new owner.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import signal
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any, ClassVar

import attrs
import torch
from bamboo.rc.comm import CHUNK_BYTES, MAX_CHUNKS, CommTimeouts, GroupTable, PeerFailure, wait_works
from bamboo.rc.config import TrainingConfig
from bamboo.rc.failures import ConsecutiveFailure, FailureEvent, FailureNoticed, FailureNotices, HandedOver
from bamboo.rc.model import partition_layers
from bamboo.rc.stash import FrcStash
from bamboo.rc.state import TrainableSlice, clip_coefficient
from bamboo.schedule import Instruction, Kind, RCMode, Schedule, one_f_one_b
from bamboo.schedule.engine import counterpart
from bamboo.schedule.failover import FailoverPlan, failover_schedule, merged_schedule
from torch.distributed import Store

__all__ = ["REDUNDANCY_MODES", "KillPoint", "Layout", "NoticePoint", "StageExecutor"]

REDUNDANCY_MODES = tuple(mode.value for mode in RCMode)


@attrs.frozen
class Layout:
    """D pipelines of P stages; global rank = pipeline × P + stage."""

    stages: int = attrs.field(validator=attrs.validators.ge(1))
    pipelines: int = attrs.field(validator=attrs.validators.ge(1))

    @property
    def world(self) -> int:
        return self.stages * self.pipelines

    def rank(self, stage: int, pipeline: int) -> int:
        return pipeline * self.stages + stage

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, pipeline) of a global rank."""
        return rank % self.stages, rank // self.stages

    def name(self, rank: int) -> str:
        stage, pipeline = self.position(rank)
        return f"stage {stage} pipeline {pipeline}"

    def group_members(self, placements: dict[int, tuple[int, ...]]) -> dict[str, list[int]]:
        """Every group for the given placements (pipeline -> the node that runs each stage):
        P2P pairs of nodes within a pipeline, per-stage data-parallel groups (the host of the stage
        in each pipeline), and per-pipeline groups (its live nodes)."""
        members: dict[str, list[int]] = {}
        for d, placement in placements.items():
            nodes = sorted({self.rank(n, d) for n in placement})
            members[f"pipe-d{d}"] = nodes
            for i, a in enumerate(nodes):
                for b in nodes[i + 1 :]:
                    members[f"p2p-{a}-{b}"] = [a, b]
        for s in range(self.stages):
            members[f"dp-s{s}"] = [self.rank(placements[d][s], d) for d in sorted(placements)]
        return members


@attrs.frozen
class NoticePoint:
    """Fault injection: the node of (stage, pipeline) is told at the start of step `step` that it
    will be preempted `lead_s` seconds later (as the launcher's agent would tell it)."""

    stage: int
    pipeline: int
    step: int
    lead_s: float = 60.0


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


# Message tags: kind (3 bits) | stage (< 128) | microbatch or segment (< 4096).
_TAG_ACT, _TAG_GRAD, _TAG_HEADER, _TAG_SYNC = 1, 2, 3, 4


def _tag(kind: int, stage: int, microbatch: int) -> int:
    if not (stage < 128 and microbatch < 4096):
        raise ValueError(f"stage {stage} / microbatch {microbatch} do not fit the message tag (128 / 4096)")
    return (kind * 128 + stage) * 4096 + microbatch


def _segments(flat: torch.Tensor) -> list[torch.Tensor]:
    """Split a large 1-D payload into messages that each fit MAX_CHUNKS chunks."""
    per_message = max(1, MAX_CHUNKS * CHUNK_BYTES // flat.element_size())
    return list(flat.split(per_message))


_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64]

Key = tuple[int, int]



class StageExecutor:
    """Runs one node of one pipeline: its stages, its replica, its groups, its steps and failovers."""

    def __init__(
        self,
        specs: Sequence[Any],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        config: TrainingConfig,
        layout: Layout,
        stage: int,
        pipeline: int,
        store: Store,
        redundancy: str = "eflb",
        seed: int = 0,
        job: str = "job",
        timeouts: CommTimeouts | None = None,
        notices: FailureNotices | None = None,
        kills: Sequence[KillPoint] = (),
        notice_points: Sequence[NoticePoint] = (),
    ) -> None:
        if redundancy not in REDUNDANCY_MODES:
            raise ValueError(f"redundancy must be one of {', '.join(REDUNDANCY_MODES)}, got {redundancy!r}")
        if not (0 <= stage < layout.stages and 0 <= pipeline < layout.pipelines):
            raise ValueError(f"stage {stage} pipeline {pipeline} is outside {layout}")
        if redundancy != "none" and layout.stages < 2:
            raise ValueError(f"redundancy {redundancy!r} needs at least 2 stages, got {layout.stages}")
        self.specs = specs
        self.loss_fn = loss_fn
        self.config = config
        self.layout = layout
        self.stage = stage
        self.pipeline = pipeline
        self.node = stage
        self.rank = layout.rank(stage, pipeline)
        self.redundancy = redundancy
        self.seed = seed
        self.job = job
        self.store = store
        self.timeouts = timeouts or CommTimeouts()
        self.notices = notices
        self.kills = [k for k in kills if (k.stage, k.pipeline) == (stage, pipeline)]
        self._holds = [
            KillPoint(stage, pipeline, k.hold_confirmation_until[2], k.hold_confirmation_until[3])
            for k in kills
            if k.hold_confirmation_until is not None and k.hold_confirmation_until[:2] == (stage, pipeline)
        ]
        self.notice_points = [n for n in notice_points if (n.stage, n.pipeline) == (stage, pipeline)]
        self._leaving = False
        self._die_at: float | None = None
        self.handovers: list[dict[str, Any]] = []
        self.parts = partition_layers(len(specs), layout.stages)
        self.slices: dict[int, TrainableSlice] = {stage: TrainableSlice(specs, self.parts[stage], config, seed)}
        self.replica_stage: int | None = None
        if redundancy != "none":
            self.replica_stage = (stage + 1) % layout.stages
            self.slices[self.replica_stage] = TrainableSlice(specs, self.parts[self.replica_stage], config, seed)
        self.schedule: Schedule = one_f_one_b(layout.stages, config.micro_batches, rc=redundancy)
        self.epoch = 0
        self.dead: set[int] = set()
        self.placements: dict[int, tuple[int, ...]] = {d: tuple(range(layout.stages)) for d in range(layout.pipelines)}
        self.layouts: dict[int, Schedule] = dict.fromkeys(range(layout.pipelines), self.schedule)
        """The schedule each pipeline runs in its next fault-free iteration (fault-free or merged):
        its ``placement`` and ``shadows`` say who runs and who shadows each stage."""
        self._recovering: dict[int, tuple[FailoverPlan, int]] = {}
        """pipeline -> (the failover plan whose remainder it runs or ran, the step of that plan)."""
        self.groups = GroupTable(store, job, self.rank, self.timeouts, {r: layout.name(r) for r in range(layout.world)})
        self.groups.set_members(0, layout.group_members(self.placements))
        for name in sorted(self.groups.members):  # eager: neighbours at distance 1 and 2, collectives
            ranks = self.groups.members[name]
            if self.rank in ranks and len(ranks) > 1 and (not name.startswith("p2p") or self._near(ranks)):
                self.groups.group(name)
        self.stash = FrcStash()
        self.step = 0
        self.losses: list[float] = []
        self.sync_bytes = 0
        self.kind_seconds: dict[str, float] = {}
        self.failovers: list[dict[str, Any]] = []
        self.iteration_times: list[tuple[float, float]] = []
        self._waiter = concurrent.futures.ThreadPoolExecutor(max_workers=8) if notices is not None else None
        self._pending: dict[str, tuple[object, torch.Tensor | None]] = {}
        self._act_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._act_meta_sent: set[int] = set()
        self._replica_updates: dict[int, tuple[torch.Tensor, float]] = {}
        self._contributions: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._output_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._reset_iteration()

    def _near(self, ranks: Sequence[int]) -> bool:
        a, b = (self.layout.position(r)[0] for r in ranks)
        return (a - b) % self.layout.stages in (1, 2, self.layout.stages - 1, self.layout.stages - 2)

    # ----------------------------------------------------------------------------- state
    def _reset_iteration(self) -> None:
        self.inputs: dict[Key, torch.Tensor] = {}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.out_grads: dict[Key, torch.Tensor] = {}
        self.input_grads: dict[Key, torch.Tensor] = {}
        self.red_inputs: dict[Key, torch.Tensor] = {}
        self.red_outputs: dict[Key, torch.Tensor] = {}
        self.local_outputs: dict[Key, torch.Tensor] = {}
        self.mb_losses: dict[int, float] = {}
        self._reduced: dict[int, torch.Tensor] = {}
        self._reducing: dict[int, tuple[list[object], torch.Tensor, torch.Tensor, Any, tuple[int, ...]]] = {}
        self._to_step: list[int] = []
        self._received_syncs: dict[int, torch.Tensor] = {}
        self.stash.clear()

    @property
    def hosted(self) -> tuple[int, ...]:
        """The stages this node runs as their primary copy."""
        return self.schedule.stages_on(self.node)

    def needs_data(self) -> bool:
        """Whether this node reads samples: it runs (or shadows) the first or the last stage."""
        last = self.layout.stages - 1
        return any(s in (0, last) for s in self.slices)

    def set_microbatches(self, microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This iteration's (tokens, labels) by microbatch index within the pipeline."""
        self._microbatches = microbatches

    def _peer_rank(self, node: int) -> int:
        return self.layout.rank(node, self.pipeline)

    def _group_for(self, peer: int) -> str:
        a, b = sorted((self.rank, peer))
        return f"p2p-{a}-{b}"

    def _global_microbatches(self) -> int:
        return self.config.micro_batches * self.layout.pipelines

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
            handle, buffer = self._pending.pop(key)
        else:
            works, buffer = post()
            handle = works if self._waiter is None else self._waiter.submit(wait_works, works)
        if isinstance(handle, list):
            try:
                wait_works(handle)
            except RuntimeError as exc:
                raise PeerFailure(peer, self.layout.name(peer), key, exc) from exc
            return buffer
        assert isinstance(handle, concurrent.futures.Future)
        while True:
            try:
                handle.result(timeout=self.timeouts.poll)
                return buffer
            except concurrent.futures.TimeoutError:
                event = self.notices.poll(self.epoch + 1) if self.notices is not None else None
                if event is not None:
                    self._pending[key] = (handle, buffer)
                    raise FailureNoticed(event) from None
            except RuntimeError as exc:
                raise PeerFailure(peer, self.layout.name(peer), key, exc) from exc

    def _interrupter(self, group: str) -> Callable[[], None]:
        """While blocked in a collective on `group`: raise FailureNoticed if a confirmed failure
        removed a member of it. A collective whose members all live is left to complete (the
        event is noticed again at the next blocking point), so it is never posted twice."""

        def interrupt() -> None:
            event = self.notices.poll(self.epoch + 1) if self.notices is not None else None
            if event is not None and set(event.victims) & set(self.groups.members[group]):
                raise FailureNoticed(event)

        return interrupt

    def _interrupt_on_any_failure(self) -> None:
        """While waiting for a posted data-parallel all-reduce (its works stay in `_reducing`, so
        it is resumed, never posted twice): raise FailureNoticed on any confirmed failure.

        A failed pipeline's survivors must never sit uninterruptibly in a collective with another
        pipeline: that pipeline's nodes wait in the failover agreement for the survivors'
        progress, so a survivor waiting for, say, stage 0's all-reduce with a node that is itself
        waiting for that progress would deadlock until the agreement timed out."""
        event = self.notices.poll(self.epoch + 1) if self.notices is not None else None
        if event is not None:
            raise FailureNoticed(event)

    def _announce_group(self, group: str) -> str | None:
        """Tell the other members that this node is about to build `group` (first use in a
        membership epoch); returns the key prefix, or None when nothing is to be built."""
        members = self.groups.members[group]
        if self.notices is None or group in self.groups.groups or len(members) < 2:
            return None
        prefix = f"bamboo/{self.job}/ready/e{self.groups.versions[group]}/{group}"
        self.store.set(f"{prefix}/{self.rank}", "1")
        return prefix

    def _await_group_members(self, group: str) -> None:
        """Before building `group` (first use in a membership epoch): wait until every member is
        about to build it too, raising FailureNoticed on any confirmed failure meanwhile.

        A gloo group build blocks until every member joins; after a failover, a member may die
        before it gets there (a second failure during the recovery), and the build would only
        time out. Waiting in the store instead keeps the failure noticeable. Paths that build a
        group inside the failover itself only announce it (`_announce_group`).
        """
        prefix = self._announce_group(group)
        if prefix is None or self.notices is None:
            return
        keys = [f"{prefix}/{rank}" for rank in self.groups.members[group]]
        deadline = time.monotonic() + self.timeouts.group
        while not self.store.check(keys) and time.monotonic() < deadline:
            event = self.notices.poll(self.epoch + 1)
            if event is not None:
                raise FailureNoticed(event)
            time.sleep(0.001)

    def _send(self, instruction: Instruction, tensor: torch.Tensor, peer: int, tag: int) -> None:
        group = self._group_for(peer)
        self._await_group_members(group)
        self._transfer(instruction, peer, lambda: (self.groups.post_send(group, tensor, peer, tag, str(instruction)), None))

    def _recv(self, instruction: Instruction, buffer: torch.Tensor, peer: int, tag: int) -> torch.Tensor:
        group = self._group_for(peer)
        self._await_group_members(group)
        out = self._transfer(
            instruction, peer, lambda: (self.groups.post_recv(group, buffer, peer, tag, str(instruction)), buffer)
        )
        assert out is not None
        return out

    # ----------------------------------------------------------------------------- interpreter
    def execute(self, instruction: Instruction) -> None:
        """Execute one instruction (its wall time is added to :attr:`kind_seconds`)."""
        started = time.perf_counter()
        self._handlers[instruction.kind](self, instruction)
        code = instruction.kind.value
        self.kind_seconds[code] = self.kind_seconds.get(code, 0.0) + time.perf_counter() - started

    def _maybe_die(self, instruction: Instruction, index: int, length: int, recovering: bool = False) -> None:
        preempted = self._die_at is not None and time.time() >= self._die_at
        for kill in self.kills if not preempted else [None]:
            if kill is None or kill.matches(self.step, instruction, index, length, recovering):
                if kill is not None and kill.settle:
                    for s in sorted(self._reducing):
                        works, _, _, _, _ = self._reducing[s]
                        self.groups.wait_collective(f"dp-s{s}", works, f"{s}AR (before the kill)")
                self.store.set(f"bamboo/{self.job}/killed_at/{self.rank}", repr(time.time()))
                sys.stdout.flush()
                sys.stderr.flush()
                os.kill(os.getpid(), signal.SIGKILL)

    def _mark_holds(self, instruction: Instruction, index: int, length: int) -> None:
        """Fault injection: tell the authority that this node executed an instruction that a kill
        point's `hold_confirmation_until` waits for."""
        for hold in self._holds:
            if hold.matches(self.step, instruction, index, length):
                self.store.set(f"bamboo/{self.job}/reached/{self.rank}/{hold.step}/{hold.instruction}", "1")

    def _check_notice(self) -> None:
        """At the start of an iteration: act on a preemption notice for this node.

        If the deadline leaves time for this iteration (1.5 × the median iteration so far), the
        node announces that it hands over after it, and leaves at the boundary (no BRC, no lost
        work). Otherwise it keeps going and is treated as an ordinary failure at the deadline.
        """
        for point in self.notice_points:
            if point.step == self.step:
                self.store.set(f"bamboo/{self.job}/notice/{self.rank}", repr(time.time() + point.lead_s))
        key = f"bamboo/{self.job}/notice/{self.rank}"
        if self._leaving or self._die_at is not None or not self.store.check([key]):
            return
        deadline = float(self.store.get(key))
        durations = [end - start for start, end in self.iteration_times]
        needed = 1.5 * (sorted(durations)[len(durations) // 2] if durations else float("inf"))
        if self.redundancy != "none" and self.schedule.placement == tuple(range(self.layout.stages)) and (
            time.time() + needed < deadline
        ):
            self._leaving = True
            self.store.set(f"bamboo/{self.job}/handover/d{self.pipeline}/{self.step}", str(self.node))
            self.store.set(f"bamboo/{self.job}/handover_request/{self.rank}", str(self.step))
        else:
            self._die_at = deadline

    def _after_boundary(self, step: int) -> None:
        """After the commit of `step`: leave if handing over; take over if a neighbour leaves."""
        if self._leaving:
            raise HandedOver(f"rank {self.rank} handed its role over after step {step}")
        key = f"bamboo/{self.job}/handover/d{self.pipeline}/{step}"
        if self.notices is None or not self.store.check([key]):
            return
        started = time.time()
        while True:
            event = self.notices.wait(self.epoch + 1, self.timeouts.confirm)
            if event is None:
                raise RuntimeError(f"the hand-over announced after step {step} was never confirmed")
            self._apply_membership(event)
            if event.handover:
                break
        self.handovers.append({"step": step, "epoch": self.epoch, "seconds": time.time() - started})

    def _apply_membership(self, event: FailureEvent) -> None:
        """Apply a hand-over event at an iteration boundary (no failover plan: nothing was lost)."""
        if not event.handover:
            raise RuntimeError(f"a failure at an iteration boundary during a hand-over: {event}")
        self.epoch = event.epoch
        new_dead = set(event.victims) - self.dead
        self.dead |= new_dead
        lost_here = {self.layout.position(r)[0] for r in new_dead if self.layout.position(r)[1] == self.pipeline}
        leavers: dict[int, set[int]] = {}
        for rank in new_dead:
            stage, pipeline = self.layout.position(rank)
            leavers.setdefault(pipeline, set()).add(stage)
        for pipeline, nodes in leavers.items():
            self.layouts[pipeline] = merged_schedule(self.layouts[pipeline], nodes)
            self.placements[pipeline] = self.layouts[pipeline].placement
        self.groups.set_members(self.epoch, self.layout.group_members(self.placements))
        for stage, (_, _, _, contribution, members) in list(self._reducing.items()):
            group = f"dp-s{stage}"
            if members != self.groups.members[group]:  # posted on a group the leaver was in: again
                _, flat, loss = contribution
                fresh_flat, fresh_loss = flat.clone(), loss.clone()
                self._announce_group(group)
                works = self.groups.post_allreduce(group, [fresh_flat, fresh_loss], f"{stage}AR (again)")
                self._reducing[stage] = (works, fresh_flat, fresh_loss, contribution, self.groups.members[group])
        if lost_here:
            self.schedule = self.layouts[self.pipeline]
            replica = [s for s, shadow in enumerate(self.schedule.shadows) if shadow == self.node]
            self.replica_stage = replica[0] if replica else None

    def run_iteration(self) -> float:
        """Run this iteration's stream, fail over as needed, commit. Returns the mean loss."""
        self._check_notice()
        stream = list(self.schedule.streams[self.node])
        fault_free_length = len(stream)
        iteration_started = time.time()
        index = 0
        failed_over = False
        while True:
            try:
                while index < len(stream):
                    self._maybe_die(stream[index], index, fault_free_length if not failed_over else len(stream),
                                    failed_over)
                    self.execute(stream[index])
                    if not failed_over:
                        self._mark_holds(stream[index], index, fault_free_length)
                    index += 1
                loss = self._commit()
                self.iteration_times.append((iteration_started, time.time()))
                self._after_boundary(self.step - 1)
                if failed_over:
                    self.failovers[-1]["iteration_end"] = time.time()
                    self.failovers[-1]["recovery_kinds"] = {
                        kind: seconds - self.failovers[-1]["kinds_before"].get(kind, 0.0)
                        for kind, seconds in self.kind_seconds.items()
                    }
                return loss
            except (PeerFailure, FailureNoticed) as failure:
                new_stream = self._fail_over(failure, stream, index)
                if new_stream is not stream:  # our pipeline failed over: run the remainder
                    stream, index, failed_over = new_stream, 0, True

    def _load(self, instruction: Instruction) -> None:
        k = instruction.microbatch
        if k not in self._microbatches:
            raise RuntimeError(f"{instruction}: microbatch {k} was not loaded (no data for this step)")

    def _recv_act(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None and instruction.peer is not None
        peer = self._peer_rank(instruction.peer)
        if peer not in self._act_meta:
            header = self._recv(instruction, torch.zeros(8, dtype=torch.int64), peer, _tag(_TAG_HEADER, s, 0))
            ndim = int(header[0])
            self._act_meta[peer] = (tuple(int(v) for v in header[2 : 2 + ndim]), _DTYPES[int(header[1])])
        shape, dtype = self._act_meta[peer]
        buffer = self._recv(instruction, torch.empty(shape, dtype=dtype), peer, _tag(_TAG_ACT, s, k))
        self.inputs[(s, k)] = buffer.requires_grad_(buffer.is_floating_point())

    def _stage_input(self, stage: int, k: int) -> torch.Tensor:
        if stage == 0:
            return self._microbatches[k][0]
        key = (stage, k)
        if key not in self.inputs:  # the previous stage runs here too: its local output
            self.inputs[key] = self.local_outputs[(stage - 1, k)].requires_grad_()
        return self.inputs[key]

    def _run_layers(self, stage: int, k: int, x: torch.Tensor) -> torch.Tensor:
        self._apply_replica_update(stage)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.config.bf16):
            y = self.slices[stage].layers(x)
        if stage == self.layout.stages - 1:
            return self.loss_fn(y, self._microbatches[k][1]) / self._global_microbatches()
        self._output_meta[stage] = (y.shape, y.dtype)
        if stage + 1 in self.slices:
            self.local_outputs[(stage, k)] = y.detach()  # input of the next stage's local copy
        return y

    def _forward(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        y = self._run_layers(s, k, self._stage_input(s, k))
        if s == self.layout.stages - 1:
            self.mb_losses[k] = float(y.detach()) * self._global_microbatches()
        self.outputs[(s, k)] = y

    def _send_act(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None and instruction.peer is not None
        peer = self._peer_rank(instruction.peer)
        y = (self.outputs[(s, k)] if (s, k) in self.outputs else self.red_outputs[(s, k)]).detach()
        if peer not in self._act_meta_sent:
            header = torch.zeros(8, dtype=torch.int64)
            header[0] = y.dim()
            header[1] = _DTYPES.index(y.dtype)
            header[2 : 2 + y.dim()] = torch.tensor(y.shape)
            self._send(instruction, header, peer, _tag(_TAG_HEADER, s + 1, 0))
            self._act_meta_sent.add(peer)
        self._send(instruction, y, peer, _tag(_TAG_ACT, s + 1, k))

    def _recv_grad(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None and instruction.peer is not None
        peer = self._peer_rank(instruction.peer)
        shape, dtype = self._output_meta[s]
        self.out_grads[(s, k)] = self._recv(instruction, torch.empty(shape, dtype=dtype), peer, _tag(_TAG_GRAD, s, k))

    def _output_grad(self, s: int, k: int) -> torch.Tensor | None:
        """The gradient w.r.t. stage s's output: received, or local when stage s+1 ran here."""
        if s == self.layout.stages - 1:
            return None
        if (s, k) in self.out_grads:
            return self.out_grads.pop((s, k))
        return self.input_grads[(s + 1, k)]

    def _backward_from(self, s: int, k: int, output: torch.Tensor, x: torch.Tensor | None) -> None:
        grad = self._output_grad(s, k)
        if grad is None:
            output.backward()
        else:
            torch.autograd.backward(output, grad)
        if s > 0 and x is not None:
            self.input_grads[(s, k)] = x.grad  # type: ignore[assignment]

    def _backward(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        self._backward_from(s, k, self.outputs.pop((s, k)), self.inputs.pop((s, k), None))

    def _send_grad(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None and instruction.peer is not None
        peer = self._peer_rank(instruction.peer)
        self._send(instruction, self.input_grads[(s, k)], peer, _tag(_TAG_GRAD, s - 1, k))

    def _replica_input(self, s: int, k: int) -> torch.Tensor:
        if s == 0:
            return self._microbatches[k][0]
        if (s, k) in self.stash.inputs:  # lflb: the stashed input
            return self.stash.inputs[(s, k)]
        return self.local_outputs[(s - 1, k)]

    def _frc(self, instruction: Instruction) -> None:
        """Forward of stage s with the replica layers; saved tensors are registered in the stash."""
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        x = self._replica_input(s, k)
        if s > 0:
            x = x.detach().requires_grad_()
        self._apply_replica_update(s)
        weights = {p.untyped_storage().data_ptr() for p in self.slices[s].parameters}
        with self.stash.recording((s, k), skip=weights):
            y = self._run_layers(s, k, x)
        if s == self.layout.stages - 1:
            self.mb_losses.setdefault(k, float(y.detach()) * self._global_microbatches())
        self.red_inputs[(s, k)] = x
        self.red_outputs[(s, k)] = y

    def _swap_out(self, instruction: Instruction) -> None:
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        if (s, k) in self.red_outputs:
            self.stash.swap_out((s, k))
        else:  # lflb: no FRC ran; the stash is the replica's input
            self.stash.put_input((s, k), self._replica_input(s, k))

    def _swap_in(self, instruction: Instruction) -> None:
        self.stash.swap_in((instruction.stage, instruction.microbatch))  # type: ignore[arg-type]

    def _brc(self, instruction: Instruction) -> None:
        """Backward of stage s from the FRC stash (running the FRC first if it was lazy)."""
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        if (s, k) not in self.red_outputs:
            self._frc(instruction)
        output = self.red_outputs.pop((s, k))
        x = self.red_inputs.pop((s, k))
        self._backward_from(s, k, output, x if s > 0 else None)
        self.stash.drop((s, k))

    def _allreduce(self, instruction: Instruction) -> None:
        """Start the data-parallel all-reduce of stage s (the result is awaited when needed:
        collectives on different groups must not wait on each other in the stream's order)."""
        s = instruction.stage
        piece = self.slices[s]
        last = s == self.layout.stages - 1
        loss = torch.tensor([sum(self.mb_losses.values()) if last else 0.0], dtype=torch.float64)
        flat = piece.flat_grads()
        contribution = (self.step, flat.clone(), loss.clone())
        group = f"dp-s{s}"
        self._await_group_members(group)
        works = self.groups.post_allreduce(group, [flat, loss], str(instruction))
        self._reducing[s] = (works, flat, loss, contribution, self.groups.members[group])

    def _wait_reduction(self, s: int) -> None:
        """Finish stage s's all-reduce: load the reduced gradients, record the result."""
        if s not in self._reducing:
            return
        works, flat, loss, contribution, _members = self._reducing[s]
        group = f"dp-s{s}"
        self.groups.wait_collective(group, works, f"{s}AR", self._interrupt_on_any_failure)
        del self._reducing[s]
        piece = self.slices[s]
        piece.load_flat_grads(flat)
        if self.layout.pipelines > 1:  # kept in case a lost peer's shadow redoes this all-reduce
            self._contributions[(s, contribution[0])] = (contribution[1], contribution[2])
            for key in [k for k in self._contributions if k[1] < contribution[0] - 1]:
                del self._contributions[key]
        self._reduced[s] = torch.cat([flat, loss.float(), torch.tensor([float(piece.steps + 1)])])

    def _optimizer(self, instruction: Instruction) -> None:
        self._to_step.append(instruction.stage)  # applied at the commit, with the global clip

    def _sync_send(self, instruction: Instruction) -> None:
        """Send stage s's reduced gradients (and its loss and step number) to its shadow."""
        assert instruction.peer is not None
        s = instruction.stage
        self._wait_reduction(s)
        payload = self._reduced[s]
        shadow = self._peer_rank(instruction.peer)
        for segment, piece in enumerate(_segments(payload)):
            self._send(instruction, piece, shadow, _tag(_TAG_SYNC, s, segment))
        self.sync_bytes += payload.numel() * payload.element_size()

    def _sync_recv(self, instruction: Instruction) -> None:
        """Receive stage s's reduced gradients; the replica steps with them after the commit."""
        assert instruction.peer is not None
        s = instruction.stage
        self._apply_replica_update(s)  # lflb never runs the replica: apply the last update now
        owner = self._peer_rank(instruction.peer)
        payload = torch.empty(self.slices[s].numel() + 2)
        for segment, piece in enumerate(_segments(payload)):
            received = self._recv(instruction, piece, owner, _tag(_TAG_SYNC, s, segment))
            if received is not piece:  # resumed after a failover: the data is in the first buffer
                piece.copy_(received)
        self._received_syncs[s] = payload

    def _apply_replica_update(self, stage: int) -> None:
        """Apply the owner's step of the last iteration to the replica of `stage` (identical math)."""
        update = self._replica_updates.pop(stage, None)
        if update is None:
            return
        started = time.perf_counter()
        payload, clip = update
        replica = self.slices[stage]
        step = int(payload[-1].item())
        if step != replica.steps + 1:
            raise RuntimeError(f"replica sync of stage {stage} out of order: got step {step}, replica at {replica.steps}")
        replica.load_flat_grads(payload[:-2])
        replica.apply_step(clip)
        self.kind_seconds["replica_step"] = self.kind_seconds.get("replica_step", 0.0) + time.perf_counter() - started

    def apply_replica_updates(self) -> None:
        for stage in list(self._replica_updates):
            self._apply_replica_update(stage)

    _handlers: ClassVar[dict[Kind, Callable[[StageExecutor, Instruction], None]]] = {
        Kind.LOAD: _load,
        Kind.FORWARD: _forward,
        Kind.BACKWARD: _backward,
        Kind.FRC: _frc,
        Kind.BRC: _brc,
        Kind.SEND_ACT: _send_act,
        Kind.RECV_ACT: _recv_act,
        Kind.SEND_GRAD: _send_grad,
        Kind.RECV_GRAD: _recv_grad,
        Kind.SWAP_OUT: _swap_out,
        Kind.SWAP_IN: _swap_in,
        Kind.ALLREDUCE: _allreduce,
        Kind.OPTIMIZER: _optimizer,
        Kind.SYNC_SEND: _sync_send,
        Kind.SYNC_RECV: _sync_recv,
    }

    # ----------------------------------------------------------------------------- commit
    def _commit(self) -> float:
        """End the iteration: one all-reduce over the pipeline of the squared gradient norm and the
        loss, then the optimizer steps of the hosted stages with the global clip coefficient.

        This is the commit point: until it, no parameter has changed in this iteration, so a
        failure before it leaves every survivor at the start-of-iteration state.
        """
        self._await_group_members(f"pipe-d{self.pipeline}")  # before anything changes: it may raise
        last = self.layout.stages - 1
        squared = 0.0
        loss = 0.0
        for s in sorted(self._reducing):
            self._wait_reduction(s)
        for s in self.hosted:
            if s in self._reduced:
                squared += self.slices[s].squared_grad_norm()
                reduced_loss = float(self._reduced[s][-2])
            elif s in self._received_syncs:  # a victim's finished stage: its sync is the result
                payload = self._received_syncs.pop(s)
                self.slices[s].load_flat_grads(payload[:-2])
                squared += self.slices[s].squared_grad_norm()
                reduced_loss = float(payload[-2])
                self._to_step.append(s)
            else:
                raise RuntimeError(f"stage {s} ended the iteration without an all-reduce")
            if s == last:
                loss = float(self._reduced[s][-2]) if s in self._reduced else reduced_loss
        if last in self.hosted and last in self._reduced:
            loss = sum(self.mb_losses.values()) if self.layout.pipelines == 1 else loss
        norm_and_loss = torch.tensor([squared, loss], dtype=torch.float64)
        self.groups.allreduce(
            f"pipe-d{self.pipeline}", [norm_and_loss], "commit (global gradient norm and loss)",
            self._interrupter(f"pipe-d{self.pipeline}"),
        )
        clip = clip_coefficient(self.config.gradient_clipping, float(norm_and_loss[0]))
        for s in self._to_step:
            self.slices[s].apply_step(clip)
        for s, payload in self._received_syncs.items():
            self._replica_updates[s] = (payload, clip)
        mean_loss = float(norm_and_loss[1]) / self._global_microbatches()
        self.losses.append(mean_loss)
        self.step += 1
        self._reset_iteration()
        return mean_loss

    def finish(self) -> None:
        """Apply the last replica updates and leave together (call after the last iteration).

        With several pipelines, every live node waits (in the store, watching for failure events)
        until every live node has finished, so a node is still there if a failover in another
        pipeline needs it to redo an all-reduce.
        """
        self.apply_replica_updates()
        if self.layout.pipelines == 1 or self.notices is None:
            return
        self.store.set(f"bamboo/{self.job}/finished/{self.rank}", "1")
        deadline = time.monotonic() + self.timeouts.build
        while True:
            event = self.notices.poll(self.epoch + 1)
            if event is not None:
                self._fail_over(FailureNoticed(event), [], 0)
                continue
            live = [r for r in range(self.layout.world) if r not in self.dead]
            if self.store.check([f"bamboo/{self.job}/finished/{r}" for r in live]):
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"not every live rank of {live} finished within {self.timeouts.build} s")
            time.sleep(0.005)

    # ----------------------------------------------------------------------------- failover
    def _confirmed_event(self, failure: PeerFailure | FailureNoticed) -> FailureEvent:
        if isinstance(failure, FailureNoticed):
            return failure.event
        if self.notices is None:
            raise failure
        self.notices.suspect(self.epoch, self.rank, failure.peer, failure.instruction)
        event = self.notices.wait(self.epoch + 1, self.timeouts.confirm)
        if event is None:
            raise failure  # not confirmed: a slow or partitioned peer is not treated as dead
        return event

    def _abandon_iteration(self) -> None:
        """Back to the start-of-iteration state: partial gradients and stashes discarded."""
        for piece in self.slices.values():
            piece.zero_grads()
        self._reset_iteration()

    def _surviving_copies(self, stage: int, layouts: dict[int, Schedule] | None = None) -> list[tuple[str, int]]:
        """Where copies of `stage` survive, judged on `layouts` (default: the current ones): the
        same stage in other pipelines, and the live replica of its shadow (if the stage has one)."""
        copies: list[tuple[str, int]] = []
        for d, schedule in (layouts if layouts is not None else self.layouts).items():
            host = self.layout.rank(schedule.placement[stage], d)
            if d != self.pipeline and host not in self.dead:
                copies.append(("data-parallel", host))
            shadow_node = schedule.shadows[stage]
            if shadow_node is not None and self.layout.rank(shadow_node, d) not in self.dead:
                copies.append(("shadow", self.layout.rank(shadow_node, d)))
        return copies

    def _progress_prefix(self, pipeline: int, lost: set[int]) -> str:
        """Where a pipeline's survivors publish their progress for the failover of `lost`: keyed by
        the victims (not the epoch), so nodes that learn of the failures in different epochs
        read the same agreement."""
        return f"bamboo/{self.job}/progress/d{pipeline}/v{'-'.join(map(str, sorted(lost)))}"

    def _read_progress(
        self, pipeline: int, lost: set[int], survivors: Sequence[int]
    ) -> tuple[dict[int, tuple[int, int, bool]], FailureEvent | None]:
        """Every survivor's (completed instructions, step, running a remainder) in `pipeline`, or
        a later failure event (which restarts the agreement) if one arrives first."""
        keys = [f"{self._progress_prefix(pipeline, lost)}/n{n}" for n in survivors]
        deadline = time.monotonic() + self.timeouts.confirm
        while not self.store.check(keys):
            later = self.notices.poll(self.epoch + 1) if self.notices is not None else None
            if later is not None:
                return {}, later
            if time.monotonic() > deadline:
                raise RuntimeError(
                    f"survivors {list(survivors)} of pipeline {pipeline} did not publish their progress "
                    f"in epoch {self.epoch}"
                )
            time.sleep(0.001)
        records = [json.loads(self.store.get(key)) for key in keys]
        return {
            n: (int(r["done"]), int(r["step"]), bool(r.get("remainder", False)))
            for n, r in zip(survivors, records, strict=True)
        }, None

    def _agreed_recovering(self, pipeline: int, progress: dict[int, tuple[int, int, bool]]) -> bool:
        """Whether `pipeline`'s survivors were running a failover remainder (all of them, in the
        step of the plan this node computed for it), or its steady schedule (all of them)."""
        flags = {flag for _, _, flag in progress.values()}
        if len(flags) != 1:
            raise RuntimeError(f"survivors of pipeline {pipeline} disagree on running a failover remainder: {progress}")
        if not flags.pop():
            return False
        known = self._recovering.get(pipeline)
        steps = {step for _, step, _ in progress.values()}
        if known is None or steps != {known[1]}:
            raise RuntimeError(
                f"pipeline {pipeline} runs a failover remainder in steps {sorted(steps)}, but the last plan known "
                f"here is for step {None if known is None else known[1]}"
            )
        return True

    def _plan(
        self, pipeline: int, victims: set[int], progress: dict[int, int], recovering: bool
    ) -> tuple[FailoverPlan, dict[int, int]]:
        """The failover plan of a pipeline from its survivors' progress (the same on every node).

        `progress` indexes the pipeline's steady schedule (`layouts`), or, when `recovering`, the
        remainder of the failover plan it was running (a second failure in the same iteration).
        A transfer that one side completed is completed by the other side too, so the cut pairs up.
        """
        base: Schedule | FailoverPlan
        if recovering:
            base = self._recovering[pipeline][0]
            streams = base.remainder.streams
        else:
            base = self.layouts[pipeline]
            streams = base.streams
        cut = dict(progress)
        for n, i in progress.items():
            if i < len(streams[n]):
                instruction = streams[n][i]
                partner = instruction.peer
                if partner is not None and partner in progress and counterpart(instruction, n) in streams[partner][
                    : progress[partner]
                ]:
                    cut[n] = i + 1
        return failover_schedule(base, victims, cut), cut

    def _fail_over(
        self, failure: PeerFailure | FailureNoticed, stream: list[Instruction], done: int
    ) -> list[Instruction]:
        """Switch to the failover schedule for the rest of this iteration; returns the new stream
        (the very same `stream` object when this node's pipeline lost nobody).

        All survivors of the victims' pipeline publish how many instructions they completed, agree
        on a consistent cut, and derive the same `failover_schedule` from the same facts. Groups
        whose membership changed are rebuilt for the new epoch; P2P groups between survivors stay,
        with anything in flight. Nodes of other pipelines only rebuild the data-parallel groups of
        the victims' stages; a node that already all-reduced a victim's stage this iteration joins
        the shadow's redo of that all-reduce with its stored contribution.
        """
        caught = time.time()
        event = self._confirmed_event(failure)
        confirmed = time.time()
        victims: dict[int, set[int]] = {}
        # The copies of lost stages are judged on the placements before this failover: when the
        # victims' deaths are confirmed in separate events, the loop below has already moved a
        # first victim's stage onto its shadow before it learns that a neighbour died too.
        layouts_before = dict(self.layouts)
        in_remainder = self._recovering.get(self.pipeline, (None, -1))[1] == self.step
        while True:  # a further failure during the agreement restarts it with every victim so far
            if event.handover:  # another pipeline's node left at a boundary: groups only
                self._apply_membership(event)
                later = self.notices.poll(self.epoch + 1) if self.notices is not None else None
                if later is None:
                    return stream
                event = later
                continue
            self.epoch = event.epoch
            new_dead = set(event.victims) - self.dead
            self.dead |= new_dead
            for rank in new_dead:
                stage, pipeline = self.layout.position(rank)
                victims.setdefault(pipeline, set()).add(stage)
            for pipeline, lost in victims.items():
                # Every stage a victim ran (its own, and one it took over earlier) needs a live shadow.
                before = layouts_before[pipeline]
                ran_there = [s for s in range(self.layout.stages) if before.placement[s] in lost]
                gone = lost | (set(range(self.layout.stages)) - set(before.nodes))
                if any(before.shadows[s] is None or before.shadows[s] in gone for s in ran_there):
                    self._abandon_iteration()
                    raise ConsecutiveFailure(
                        pipeline, ran_there, {s: self._surviving_copies(s, layouts_before) for s in ran_there}
                    )
                self.placements[pipeline] = tuple(
                    before.shadows[s] if before.placement[s] in lost else before.placement[s]  # type: ignore[misc]
                    for s in range(self.layout.stages)
                )
            self.groups.set_members(self.epoch, self.layout.group_members(self.placements))
            if self.redundancy == "none":
                raise failure
            mine = victims.get(self.pipeline, set())
            if mine:
                self.store.set(
                    f"{self._progress_prefix(self.pipeline, mine)}/n{self.node}",
                    json.dumps({"done": done, "step": self.step, "remainder": in_remainder}),
                )
            later = None
            plans: dict[int, tuple[FailoverPlan, dict[int, int], int]] = {}
            for pipeline, lost in sorted(victims.items()):
                survivors = [n for n in layouts_before[pipeline].nodes if n not in lost]
                progress, later = self._read_progress(pipeline, lost, survivors)
                if later is not None:
                    break
                recovering = self._agreed_recovering(pipeline, progress)
                plan, cut = self._plan(pipeline, lost, {n: done_ for n, (done_, _, _) in progress.items()}, recovering)
                plans[pipeline] = (plan, cut, max(step for _, step, _ in progress.values()))
            if later is None:
                break
            event = later
        for pipeline, (plan, _cut, step) in plans.items():
            self._recovering[pipeline] = (plan, step)
            self.layouts[pipeline] = plan.steady
            self.placements[pipeline] = plan.steady.placement
            if pipeline != self.pipeline:
                self._join_redone_allreduces(plan, victims[pipeline], step)
        self.failovers.append({
            "epoch": self.epoch, "victims": {d: sorted(v) for d, v in victims.items()}, "step": self.step,
            "cut": plans[self.pipeline][1] if self.pipeline in plans else None,
            "caught_at": caught, "confirmed_at": confirmed, "resumed_at": time.time(),
            "own_pipeline": self.pipeline in plans, "kinds_before": dict(self.kind_seconds),
        })
        if self.pipeline not in plans:
            return stream  # our pipeline lost nobody: resume where we were (same stream, same index)
        plan, cut, _ = plans[self.pipeline]
        if cut[self.node] > done:
            self.execute(stream[done])  # the interrupted transfer: its partner completed it
        self.apply_replica_updates()
        self.schedule = plan.steady
        replica = [s for s, shadow in enumerate(plan.steady.shadows) if shadow == self.node]
        self.replica_stage = replica[0] if replica else None
        return list(plan.remainder.streams[self.node])

    def _join_redone_allreduces(self, plan: FailoverPlan, lost: set[int], step: int) -> None:
        """Take part, exactly once per step, in the all-reduce of each lost stage hosted here.

        `step` is the step in which the other pipeline failed. If the lost stage's shadow redoes
        that step's all-reduce: an all-reduce of ours for that step that already completed is
        joined again with our stored contribution; one still pending on the old group is posted
        again on the rebuilt group. If the shadow does not redo it (the victim had finished), ours
        completes on the old group. A pending all-reduce of a later step (this node ran ahead:
        its pipeline committed `step` without the failed one) is posted again too, but only after
        the redo of `step`: gloo matches the collectives of a group in posting order, and the
        shadow posts the redo of `step` first, so the other order would sum different steps.
        """
        for v in sorted(lost):
            if v not in self.hosted:
                continue
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
                    flat, loss = contribution
                    self._announce_group(group)
                    self.groups.allreduce(
                        group, [flat.clone(), loss.clone()], f"redo of {v}AR", self._interrupter(group)
                    )
                elif pending_step is not None:  # ran ahead, yet nothing stored: cannot redo exactly
                    raise RuntimeError(
                        f"stage {v}: the shadow redoes the all-reduce of step {step}, but this node is in step "
                        f"{pending_step} and kept no contribution of step {step}"
                    )
            if pending is not None and pending[4] != self.groups.members[group]:
                assert pending_step is not None
                if pending_step > step or redone:
                    _, flat, loss = pending[3]
                    fresh_flat, fresh_loss = flat.clone(), loss.clone()
                    self._announce_group(group)
                    works = self.groups.post_allreduce(group, [fresh_flat, fresh_loss], f"{v}AR (again)")
                    self._reducing[v] = (works, fresh_flat, fresh_loss, pending[3], self.groups.members[group])
