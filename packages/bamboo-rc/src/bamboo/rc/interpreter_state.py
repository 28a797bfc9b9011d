"""The state a node's instruction interpreter holds: its slices, the iteration's tensors and the posted work.

`InterpreterState` is the base of :class:`~bamboo.rc.interpreter.StageInterpreter`: its constructor (the
slices, the groups, the coordinator, the buffers reused step after step) and what resets an iteration. The
other parts of the interpreter (transfers, all-reduces, the commit, the instruction handlers) are subclasses
that add their methods to it, one module each.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from bamboo.rc.comm import GroupTable
from bamboo.rc.config import TrainingConfig
from bamboo.rc.coordinator import FailoverCoordinator
from bamboo.rc.device import RedundantStream, to_device
from bamboo.rc.layout import Layout
from bamboo.rc.precision import StepOutcome
from bamboo.rc.records import CommitResult
from bamboo.rc.stash import FrcStash
from bamboo.rc.state import ReusedBuffers, SpareBuffers, TrainableSlice
from bamboo.rc.ties import TiedWeights
from bamboo.rc.transport import HostStaging
from bamboo.rc.waiter import TransferWaiter, WaitHandle
from bamboo.schedule import FailoverPlan, Instruction

__all__ = ["InterpreterState", "Key", "Posted"]

Key = tuple[int, int]
Posted = tuple[list[object] | None, torch.Tensor, torch.Tensor, Any, tuple[int, ...]]
"""A posted all-reduce: (works, gradients, loss, (step, gradients, loss) as contributed, members). Works of None:
to be posted again on the group of `members`, once its build in the background is done
(:meth:`StageInterpreter.repost_changed_allreduces`)."""


class InterpreterState:
    """One node's interpreter state: its slices, the current iteration's tensors, the transfers and
    all-reduces it posted, and the buffers it reuses step after step."""

    def __init__(
        self,
        slices: dict[int, TrainableSlice],
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        config: TrainingConfig,
        layout: Layout,
        node: int,
        pipeline: int,
        groups: GroupTable,
        coordinator: FailoverCoordinator,
        keeps_contributions: bool = True,
        device: torch.device | None = None,
        ties: TiedWeights | None = None,
        receives_ahead: bool = True,
    ) -> None:
        self.slices = slices
        self.loss_fn = loss_fn
        self.config = config
        self.layout = layout
        self.node = node
        self.pipeline = pipeline
        self.rank = layout.rank(node, pipeline)
        self.groups = groups
        self.coordinator = coordinator
        self.ties = ties or TiedWeights()
        """The model's tied weights: their gradients are summed over the pipeline at the commit."""
        self.keeps_contributions = keeps_contributions
        """Whether each all-reduce keeps a copy of what it contributed, to be redone or posted again after a
        failure. Only with redundancy: without, a failure ends the run, and the copy would cost a fresh
        gradient-sized tensor every step."""
        self.receives_ahead = receives_ahead
        """Whether each activation or gradient receive is posted ahead of its turn (:meth:`StageInterpreter.post_ahead`):
        the schedule's `RCMode.receives_ahead` (all modes but efeb)."""
        self.device = device or torch.device("cpu")
        """Where the slices, the activations and the gradients live (:mod:`bamboo.rc.device`); messages and
        the all-reduced gradients are in host memory, staged by :attr:`staging`."""
        self.staging = HostStaging(self.device)
        self.redundant = RedundantStream(self.device)
        """The second stream FRC and BRC run on, on a GPU."""
        self.stash = FrcStash()
        self.step = 0
        self.losses: list[float] = []
        self.last_commit: CommitResult | None = None
        """The result of the last commit this node completed (published with its progress after a failure)."""
        self.sync_bytes = 0
        self.kind_seconds: dict[str, float] = {}
        self._waiter = TransferWaiter() if coordinator.watching else None
        self._pending: dict[str, tuple[int, object, torch.Tensor | None]] = {}
        """Transfers a confirmed failure interrupted: instruction text -> (peer node, handle, buffer)."""
        self._segmented: dict[str, tuple[int, torch.Tensor, int]] = {}
        """Payloads sent in several messages that a failure interrupted: instruction text -> (peer node, the
        payload, the segment to resume at)."""
        self._posted_syncs: dict[str, Instruction] = {}
        """Replica syncs posted and not yet waited for (their handles are in `_pending`): text -> instruction."""
        self._act_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._act_meta_sent: set[int] = set()
        self._replica_updates: dict[int, tuple[torch.Tensor, StepOutcome, dict[str, torch.Tensor]]] = {}
        self._contributions: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._owed_joins: list[tuple[FailoverPlan, int, int, int | None]] = []
        """The redos of other pipelines' lost all-reduces this node still has to join, in order: (the plan, the
        stage, the step, the version of the stage's group when it was owed). A confirmed failure interrupts a
        join waiting for its group; it is resumed after that failure's agreement
        (:meth:`~bamboo.rc.interpreter_allreduces.InterpreterAllReduces.join_owed_allreduces`)."""
        self._flat_buffers = ReusedBuffers(self.device)
        """Without redundancy: by stage, the buffer its flat gradients are gathered into, step after step."""
        self._spare_grads = SpareBuffers(self.device)
        """With redundancy: by stage, gradient-sized buffers free again (an all-reduce's that completed, a
        contribution no longer kept), for the next step's flat gradients and contribution."""
        self._sync_buffers = ReusedBuffers(self.device)
        """By ("out" or "in", stage): the payload of the stage's replica sync, sent or received, step after step."""
        self._microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self._output_meta: dict[int, tuple[torch.Size, torch.dtype]] = {}
        self._reduced: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        self.reset_iteration()

    # ----------------------------------------------------------------------------- state
    def close(self) -> None:
        """End the idle threads that wait on transfers (one still waiting ends with its transfer)."""
        if self._waiter is not None:
            self._waiter.close()

    def _handle(self, works: list[object]) -> list[object] | WaitHandle:
        """What a posted transfer is waited on by: its works themselves without failure notices, else a helper's
        :class:`~bamboo.rc.waiter.WaitHandle` (the node polls for failures while it waits)."""
        return works if self._waiter is None else self._waiter.submit(works)

    def reset_iteration(self) -> None:
        """Forget every tensor of the current iteration (the stash too)."""
        self.inputs: dict[Key, torch.Tensor] = {}
        self.outputs: dict[Key, torch.Tensor] = {}
        self.out_grads: dict[Key, torch.Tensor] = {}
        self.input_grads: dict[Key, torch.Tensor] = {}
        self.red_inputs: dict[Key, torch.Tensor] = {}
        self.red_outputs: dict[Key, torch.Tensor] = {}
        self.local_outputs: dict[Key, torch.Tensor] = {}
        self.mb_losses: dict[int, float] = {}
        if self.keeps_contributions:  # each all-reduce in `_reduced` completed: nothing writes into its buffer
            for s, (flat, _) in self._reduced.items():
                self._spare_grads.give_back(s, flat)
        self._reduced = {}
        """Stage -> its reduced gradients and [the reduced loss as fp32, the stage's step number after this one]."""
        self._reducing: dict[int, Posted] = {}
        self._to_step: list[int] = []
        self._received_syncs: dict[int, torch.Tensor] = {}
        self._tie_sums: dict[str, torch.Tensor] | None = None
        """The tied weights' gradients summed over the pipeline, once the commit's first all-reduce completed."""
        self._commit_sums: dict[str, tuple[object, list[object], torch.Tensor]] = {}
        """The commit's all-reduces posted in this step (forgotten with the iteration), by what they sum: (the group
        posted on, the works, the tensor summed in place), resumed when a confirmed failure interrupted the wait
        (:meth:`~bamboo.rc.interpreter_commit.InterpreterCommit._commit_sum`)."""
        self.stash.clear()

    def abandon_iteration(self) -> None:
        """Back to the start-of-iteration state: partial gradients and stashes discarded."""
        for piece in self.slices.values():
            piece.zero_grads()
        self._sync_buffers.drop()  # a transfer given up with the iteration may still be posted on one
        for key in self._posted_syncs:  # the iteration's groups are built again: nothing will take them
            self._pending.pop(key, None)
        self._posted_syncs.clear()
        self._owed_joins.clear()  # the iteration's redos are given up with it
        self.reset_iteration()

    def set_microbatches(self, microbatches: dict[int, tuple[torch.Tensor, torch.Tensor]]) -> None:
        """This iteration's (tokens, labels) by microbatch index within the pipeline (put on the device)."""
        self._microbatches = {k: (to_device(x, self.device), to_device(y, self.device))
                              for k, (x, y) in microbatches.items()}

    def _peer_rank(self, node: int) -> int:
        return self.layout.rank(node, self.pipeline)

    def _group_for(self, peer: int) -> str:
        a, b = sorted((self.rank, peer))
        return f"p2p-{a}-{b}"

    def _global_microbatches(self) -> int:
        return self.config.global_count(self.layout.pipelines)
