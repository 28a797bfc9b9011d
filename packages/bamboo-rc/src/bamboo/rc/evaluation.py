"""Forward-only passes through the pipeline: what the engine's ``eval_batch`` runs.

An evaluation runs the current placement of every pipeline forward only (no backward, no
redundancy, no optimizer) over M microbatches per pipeline, and returns the mean loss over the
global batch of M × D microbatches on every node. (With P = 1, after a failover and until the rebuild,
a node that took over a failed node's share evaluates that share too when it is given the data as a
function of the global index; otherwise the mean is over the shares evaluated: the sum of the losses
and the count of microbatches are reduced together.) It changes nothing a training step reads:

- the layers run under ``torch.no_grad()`` in eval mode (dropout off, as DeepSpeed's ``eval_batch``),
  with the random number generators forked and restored, and are put back in their mode after;
- its tensors live in this module, never in the interpreter's per-iteration state;
- its messages travel on gloo groups of its own, built for each evaluation under the prefix
  ``bamboo/<job>/eval<n>/`` (so nothing it posts can ever match a training message).

:func:`forward_only_streams` builds each node's stream in `bamboo.schedule`'s instruction IR
(``L``, ``RA``, ``F``, ``SA``): microbatch by microbatch, each hosted stage in order, so the streams
of any placement (a shadow that runs two stages after a failover included) execute without
deadlock (``bamboo.schedule.check_execution`` holds them to it in the tests).

Failures. Every node first publishes ``(epoch, step)`` under ``bamboo/<job>/eval/<n>/<rank>`` and waits
for every live rank's (the evaluation's start barrier, at most ``CommTimeouts.build`` seconds). If a
confirmed failure is pending, or arrives at any point of the evaluation, or the ranks are not all in
the same epoch, every node gives the evaluation up (:meth:`ForwardOnlyPass.run` returns None) and
the next ``train_batch`` handles the failure as one that struck between two steps. A P2P or
collective failure is reported to the failure detector first (it is confirmed, or raised when it is
not, as in training). The groups of an interrupted evaluation are freed only once
the operations posted on them have finished (:func:`bamboo.rc.comm.keep_until_settled`: gloo blocks
when a group with a stuck operation is freed); those of a finished one are freed at the next
evaluation's barrier, once every member is known to be done with them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING

import torch
from bamboo.rc.comm import GroupTable, wait_works
from bamboo.rc.device import to_device
from bamboo.rc.failures import FailureNoticed, PeerFailure
from bamboo.rc.precision import autocast
from bamboo.rc.timeouts import STORE_POLL_S
from bamboo.rc.waiter import TransferWaiter
from bamboo.schedule import Instruction, Kind

if TYPE_CHECKING:
    from bamboo.rc.executor import StageExecutor

__all__ = ["ForwardOnlyPass", "ShareSource", "forward_only_streams"]

ShareSource = Callable[[int], tuple[torch.Tensor, torch.Tensor]]
"""The evaluation's data as a function of the global microbatch index: ``(inputs, labels)``."""

_DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int32, torch.bool]
_MAX_DIMS = 6
_TAG_ACT, _TAG_HEADER = 1, 2


def _tag(kind: int, stage: int, microbatch: int) -> int:
    if not (stage < 128 and microbatch < 4096):
        raise ValueError(f"stage {stage} / microbatch {microbatch} do not fit the message tag (128 / 4096)")
    return (kind * 128 + stage) * 4096 + microbatch


def forward_only_streams(placement: Sequence[int], microbatches: int) -> dict[int, tuple[Instruction, ...]]:
    """Each node's forward-only stream for one pipeline whose stage ``s`` runs on node ``placement[s]``.

    For each microbatch ``k`` in order, each stage the node hosts, in order: ``L`` (stage 0) or ``RA``
    from the previous stage's node (unless it runs here too), ``F``, and ``SA`` to the next stage's node
    (unless it runs here too, or this is the last stage).
    """
    if microbatches < 1:
        raise ValueError(f"a forward-only pass needs at least 1 microbatch, got {microbatches}")
    stages = len(placement)
    streams: dict[int, list[Instruction]] = {node: [] for node in sorted(set(placement))}
    for k in range(microbatches):
        for s, node in enumerate(placement):
            stream = streams[node]
            if s == 0:
                stream.append(Instruction(Kind.LOAD, 0, k))
            elif placement[s - 1] != node:
                stream.append(Instruction(Kind.RECV_ACT, s, k, placement[s - 1]))
            stream.append(Instruction(Kind.FORWARD, s, k))
            if s + 1 < stages and placement[s + 1] != node:
                stream.append(Instruction(Kind.SEND_ACT, s, k, placement[s + 1]))
    return {node: tuple(stream) for node, stream in streams.items()}


class ForwardOnlyPass:
    """The forward-only passes of one node (one per engine; see the module docstring)."""

    def __init__(self, executor: StageExecutor) -> None:
        self.executor = executor
        self.count = 0
        """Evaluations started (every node starts the same ones, so the count names them job-wide)."""
        self._finished: GroupTable | None = None
        self._waiter: TransferWaiter | None = None

    # ---------------------------------------------------------------------------------- views
    @property
    def placement(self) -> tuple[int, ...]:
        """The node of each stage in this node's pipeline now."""
        return tuple(self.executor.schedule.placement)

    def hosted(self) -> tuple[int, ...]:
        return tuple(s for s, node in enumerate(self.placement) if node == self.executor.node)

    def needs_data(self) -> bool:
        """Whether this node reads samples in an evaluation: it runs the first or the last stage."""
        hosted = self.hosted()
        return 0 in hosted or self.executor.layout.stages - 1 in hosted

    # ---------------------------------------------------------------------------------- run
    def run(self, batches: dict[int, tuple[torch.Tensor, torch.Tensor]], microbatches: int,
            share_source: ShareSource | None = None) -> float | None:
        """Evaluate ``microbatches`` microbatches per pipeline (``batches``: this node's, by index within the
        pipeline, when it runs the first or the last stage); the mean loss over the microbatches evaluated, or
        None when a failure interrupted it.

        A P = 1 node that has taken over failed nodes' shares (see :mod:`bamboo.rc.ring`) evaluates them too
        when ``share_source`` gives their data (global index ``share*microbatches + k``); without it those
        shares are left out, and the mean is over the others."""
        executor = self.executor
        self.count += 1
        if not self._agree_to_start():
            return None
        self._finished = None  # every member reached this barrier: done with the previous groups
        groups = GroupTable(executor.store, f"{executor.job}/eval{self.count}", executor.rank, executor.timeouts,
                            {r: executor.layout.name(r) for r in range(executor.layout.world)})
        groups.set_members(0, executor.layout.group_members(executor.placements))
        try:
            loss = self._run(groups, batches, microbatches, share_source)
        except FailureNoticed:
            groups.release()
            return None
        except PeerFailure as failure:
            groups.release()
            if not executor.coordinator.watching:
                raise
            executor.coordinator.confirm(failure)  # the suspects go to the detector; raises if not confirmed
            return None
        self._finished = groups
        return loss

    def _agree_to_start(self) -> bool:
        """The start barrier: True when every live rank is here in the same epoch and nothing is pending."""
        executor = self.executor
        coordinator = executor.coordinator
        mine = f"{executor.epoch}:{executor.step}"
        prefix = f"bamboo/{executor.job}/eval/{self.count}/"
        executor.store.set(prefix + str(executor.rank), mine)
        live = [r for r in range(executor.layout.world) if r not in executor.dead]
        keys = [prefix + str(r) for r in live]
        deadline = executor.clock.monotonic() + executor.timeouts.build
        while not executor.store.check(keys):
            if coordinator.pending_event() is not None:
                return False
            if executor.clock.monotonic() > deadline:
                missing = [r for r in live if not executor.store.check([prefix + str(r)])]
                raise RuntimeError(
                    f"eval_batch: ranks {missing} did not start evaluation {self.count} within "
                    f"{executor.timeouts.build:g} s (every node calls eval_batch, as it calls train_batch)"
                )
            executor.clock.sleep(STORE_POLL_S)
        if coordinator.pending_event() is not None:
            return False
        theirs = {r: executor.store.get(prefix + str(r)).decode() for r in live}
        steps = {value.split(":")[1] for value in theirs.values()}
        if len(steps) > 1:
            raise RuntimeError(f"eval_batch: the nodes are at different steps (rank: epoch:step {theirs})")
        return all(value == mine for value in theirs.values())

    def taken_over_shares(self) -> tuple[int, ...]:
        """P = 1: the shares of failed nodes this node computes now (none before a failover, or with P > 1)."""
        ring = self.executor.ring
        if ring is None:
            return ()
        return tuple(share for share in ring.owned() if share != self.executor.pipeline)

    def _run(self, groups: GroupTable, batches: dict[int, tuple[torch.Tensor, torch.Tensor]],
             microbatches: int, share_source: ShareSource | None) -> float:
        executor = self.executor
        stream = forward_only_streams(self.placement, microbatches)[executor.node]
        layers = {s: executor.slices[s].layers for s in self.hosted()}
        last = executor.layout.stages - 1
        total, count = 0.0, 0
        with self._evaluation_mode(list(layers.values())):
            outputs: dict[tuple[int, int], torch.Tensor] = {}
            for instruction in stream:
                total += self._execute(groups, instruction, layers, batches, outputs)
            if last in layers:
                count = microbatches
            if share_source is not None:
                for share in self.taken_over_shares():  # P = 1: the whole model is layers[0]
                    for k in range(microbatches):
                        inputs, labels = share_source(share * microbatches + k)
                        inputs, labels = to_device(inputs, executor.device), to_device(labels, executor.device)
                        with autocast(executor.config, executor.device):
                            total += float(executor.loss_fn(layers[0](inputs), labels))
                        count += 1
        # The loss sum and the microbatch count travel together, so the mean is over what was evaluated.
        result = torch.tensor([total, float(count)], dtype=torch.float64)
        if last in layers:
            self._allreduce(groups, f"dp-s{last}", result)
        self._allreduce(groups, f"pipe-d{executor.pipeline}", result)
        return float(result[0]) / float(result[1])

    @contextlib.contextmanager
    def _evaluation_mode(self, modules: Sequence[torch.nn.Module]) -> Iterator[None]:
        training = [module.training for module in modules]
        device = self.executor.device
        devices = [device.index if device.index is not None else torch.cuda.current_device()] \
            if device.type == "cuda" else []
        try:
            with torch.random.fork_rng(devices=devices), torch.no_grad():
                for module in modules:
                    module.eval()
                yield
        finally:
            for module, mode in zip(modules, training, strict=True):
                module.train(mode)

    def _execute(self, groups: GroupTable, instruction: Instruction, layers: dict[int, torch.nn.Module],
                 batches: dict[int, tuple[torch.Tensor, torch.Tensor]],
                 outputs: dict[tuple[int, int], torch.Tensor]) -> float:
        """Run one instruction; returns the loss it computed (the last stage's forward), else 0."""
        executor = self.executor
        s, k = instruction.stage, instruction.microbatch
        assert k is not None
        if instruction.kind is Kind.LOAD:
            if k not in batches:
                raise RuntimeError(f"eval {instruction}: microbatch {k} was not loaded")
            outputs[(-1, k)] = to_device(batches[k][0], executor.device)
        elif instruction.kind is Kind.RECV_ACT:
            assert instruction.peer is not None
            outputs[(s - 1, k)] = self._recv(groups, executor.layout.rank(instruction.peer, executor.pipeline), s, k)
        elif instruction.kind is Kind.FORWARD:
            x = outputs.pop((s - 1, k))
            with autocast(executor.config, executor.device):
                y = layers[s](x)
            if s == executor.layout.stages - 1:
                return float(executor.loss_fn(y, to_device(batches[k][1], executor.device)))
            outputs[(s, k)] = y
        elif instruction.kind is Kind.SEND_ACT:
            assert instruction.peer is not None
            peer = executor.layout.rank(instruction.peer, executor.pipeline)
            self._send(groups, outputs.pop((s, k)), peer, s + 1, k)
        else:  # pragma: no cover - forward_only_streams makes no other kind
            raise RuntimeError(f"a forward-only pass cannot run {instruction}")
        return 0.0

    # ---------------------------------------------------------------------------------- messages
    def _group(self, groups: GroupTable, peer: int) -> str:
        a, b = sorted((self.executor.rank, peer))
        name = f"p2p-{a}-{b}"
        self._await_members(groups, name)
        return name

    def _await_members(self, groups: GroupTable, name: str) -> None:
        """With failure notices: wait until every member is about to build ``name`` (a member that died
        before raises FailureNoticed instead of leaving the others in a gloo build until its timeout)."""
        coordinator = self.executor.coordinator
        if coordinator.watching and name not in groups.groups:
            coordinator.await_group(f"eval{self.count}/{name}", 0, groups.members[name])

    def _wait(self, groups: GroupTable, name: str, works: list[object], what: str) -> None:
        """Wait for a collective's works (polled), raising FailureNoticed on a confirmed failure meanwhile."""
        groups.wait_collective(name, works, what, self.executor.coordinator.raise_if_noticed)

    def _wait_transfer(self, name: str, works: list[object], peer: int, what: str) -> None:
        """Wait for a send's or a receive's works. gloo completes them only inside ``wait()``, so with failure
        notices a thread waits while this one polls for a confirmed failure (FailureNoticed), as the
        interpreter's transfers do; a transfer given up this way stays in its (retired) group."""
        coordinator = self.executor.coordinator
        try:
            if not coordinator.watching:
                wait_works(works)
                return
            if self._waiter is None:
                self._waiter = TransferWaiter(max_threads=2, name="bamboo-eval")
            done = self._waiter.submit(works)
            while not done.wait(self.executor.timeouts.poll):
                coordinator.raise_if_noticed()
        except RuntimeError as error:
            raise PeerFailure(peer, self.executor.layout.name(peer), what, error) from error

    def _send(self, groups: GroupTable, tensor: torch.Tensor, peer: int, stage: int, k: int) -> None:
        """Send the input of ``stage`` (a header with its shape and dtype first) to global rank ``peer``."""
        if tensor.dim() > _MAX_DIMS or tensor.dtype not in _DTYPES:
            raise RuntimeError(f"eval: cannot send an activation of shape {tuple(tensor.shape)} and {tensor.dtype}")
        name = self._group(groups, peer)
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        header[0], header[1] = tensor.dim(), _DTYPES.index(tensor.dtype)
        header[2 : 2 + tensor.dim()] = torch.tensor(tensor.shape, dtype=torch.int64)
        what = f"eval {stage - 1}SA{k}"
        self._wait_transfer(name, groups.post_send(name, header, peer, _tag(_TAG_HEADER, stage, k), what), peer, what)
        data = self.executor.interpreter.staging.outbound(tensor).contiguous()
        self._wait_transfer(name, groups.post_send(name, data, peer, _tag(_TAG_ACT, stage, k), what), peer, what)

    def _recv(self, groups: GroupTable, peer: int, stage: int, k: int) -> torch.Tensor:
        name = self._group(groups, peer)
        what = f"eval {stage}RA{k}"
        header = torch.zeros(2 + _MAX_DIMS, dtype=torch.int64)
        self._wait_transfer(name, groups.post_recv(name, header, peer, _tag(_TAG_HEADER, stage, k), what), peer, what)
        ndim = int(header[0])
        staging = self.executor.interpreter.staging
        buffer = staging.inbound_buffer(tuple(int(v) for v in header[2 : 2 + ndim]), _DTYPES[int(header[1])])
        self._wait_transfer(name, groups.post_recv(name, buffer, peer, _tag(_TAG_ACT, stage, k), what), peer, what)
        return staging.inbound(buffer)

    def _allreduce(self, groups: GroupTable, name: str, tensor: torch.Tensor) -> None:
        if len(groups.members[name]) < 2:
            return
        self._await_members(groups, name)
        what = f"eval all-reduce on {name}"
        self._wait(groups, name, groups.post_allreduce(name, [tensor], what), what)
