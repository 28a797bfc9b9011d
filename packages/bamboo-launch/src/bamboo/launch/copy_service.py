"""This worker's in-memory copies (:mod:`bamboo.launch.memcopy`): taken at step boundaries, kept, served, sent
to keepers, and published.

:meth:`CopyService.take` runs on the training thread at a copy step: it applies the pending replica updates
and clones the state of every stage the node holds at that step (a memory copy, about a millisecond per
stage of the built-in example). One background thread does the rest: it serialises each clone, keeps it,
sends the ones of the stages this node writes (pipeline 0's host of each stage) to their keepers, and
publishes the node's index in etcd. When the thread is behind, a newer clone of a stage replaces the one
waiting, so training never waits for it. A clone the checkpoint took at the same step is reused, and so are
its bytes (:class:`StageSnapshot`): each stage is serialised once per step, for both.
"""

from __future__ import annotations

import hashlib
import os
import sys
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
from bamboo.launch import timeouts
from bamboo.launch.memcopy import (
    Copy,
    CopyIndex,
    CopyServer,
    CopyStore,
    Holding,
    catch_up_step,
    copies_prefix,
    fetch_copy,
    kept_elsewhere_step,
    lineage,
    plan_keepers,
    read_indexes,
    send_copy,
    verified,
)

if TYPE_CHECKING:
    from bamboo.launch.spec import WorkerContext
    from bamboo.membership import MembershipStore
    from bamboo.rc import StageExecutor
    from bamboo.reconfig import JobLayout

__all__ = ["CopyService", "StageSnapshot", "holding_of"]


class StageSnapshot:
    """A stage's state cloned at a step (``TrainableSlice.snapshot()``: torch state dicts) and its bytes
    (``bamboo.rc.state.snapshot_bytes``), serialised once, in whichever background thread asks first: the
    checkpoint's writer and the copy service share them."""

    def __init__(self, state: dict[str, object]) -> None:
        self.state = state
        self._data: bytes | None = None
        self._lock = threading.Lock()

    def data(self) -> bytes:
        with self._lock:
            if self._data is None:
                from bamboo.rc.state import snapshot_bytes

                self._data = snapshot_bytes(self.state)
            return self._data


@attrs.frozen
class _Pending:
    step: int
    stage: int
    layers: tuple[int, int]
    state: StageSnapshot
    """The stage's snapshot, opaque here: its bytes are kept and sent."""
    lineage: str
    holding: Holding | None
    """Who holds each stage, when this copy goes to keepers too (see :func:`memcopy.plan_keepers`)."""


def holding_of(layout: JobLayout, dead: set[int]) -> Holding:
    """Who holds each stage of ``layout`` (a ``JobLayout``) alive: the live owners of each stage."""
    owners: list[list[str]] = [[] for _ in range(layout.stages)]
    for node, rank in sorted(layout.ranks.items()):
        if rank not in dead:
            owners[rank % layout.stages].append(node)
    return Holding(owners=tuple(map(tuple, owners)), placed=tuple(layout.ranks))


class CopyService:
    """The in-memory copies of one worker (see the module docstring): its ``context``, its fenced
    ``membership`` and its ``job`` (those of its :class:`bamboo.launch.session.WorkerSession`)."""

    def __init__(self, context: WorkerContext, membership: MembershipStore, job: str) -> None:
        self.context, self.membership, self.job = context, membership, job
        self.node = context.node
        self.zone = context.zone or "default"
        self.token = Path(context.agent_token_file).read_text().strip() if context.agent_token_file else ""
        self.store = CopyStore(on_change=self._changed)
        self.server = CopyServer(self.store, os.environ.get("BAMBOO_GLOO_HOST") or "127.0.0.1", self.token)
        self._pending: dict[int, _Pending] = {}
        self._wake = threading.Condition()
        self._dirty = True
        self._closed = False
        self._thread = threading.Thread(target=self._loop, name="bamboo-copies", daemon=True)
        self._thread.start()

    def take(self, executor: StageExecutor, layout: JobLayout, *, sends: bool,
             clones: dict[int, StageSnapshot] | None = None) -> None:
        """Clone every stage ``executor`` holds at its current step (on the training thread); with ``sends``,
        the ones it hosts go to keepers too. ``clones``: stages already cloned at this step (by the checkpoint),
        reused instead of cloned again."""
        executor.apply_replica_updates()
        step, dead = executor.step, set(executor.dead)
        line = lineage(layout.history, step)
        every = holding_of(layout, dead) if sends else None  # the same for each stage this node sends
        taken: dict[int, _Pending] = {}
        for stage, piece in executor.slices.items():
            if piece.steps != step:
                continue
            holding = every if stage in executor.hosted else None
            clone = (clones or {}).get(stage)
            taken[stage] = _Pending(step, stage, (piece.indices.start, piece.indices.stop),
                                    StageSnapshot(piece.snapshot()) if clone is None else clone, line, holding)
        with self._wake:  # woken once every clone is taken: its serialising would hold the GIL against them
            self._pending.update(taken)  # an older clone still waiting is replaced
            self._wake.notify()

    def load(self, stage: int, step: int, sources: tuple[str, ...], bounds: tuple[int, int], line: str) -> bytes | bytearray:
        """The bytes of ``stage`` at ``step`` of lineage ``line``: from this node's memory, or from the first of
        ``sources`` that answers with such a copy of the layer range ``bounds`` (RuntimeError when none does)."""
        own = self.store.get(stage, step)
        errors = []
        if own is not None and own.layers == bounds and own.lineage == line:
            try:
                return verified(own, self.node).data
            except RuntimeError as error:  # damaged in this node's memory: a keeper's copy may be whole
                self.store.discard(own)
                errors.append(str(error))
        indexes = read_indexes(self.membership.kv, self.job)
        for source in sources:
            if source == self.node or source not in indexes:
                continue
            try:
                copy = fetch_copy(indexes[source].address, stage, step, self.token)
            except (OSError, RuntimeError) as error:
                errors.append(f"{source}: {error}")
                continue
            if copy.layers == bounds and copy.lineage == line:
                return copy.data
            errors.append(f"{source}: its copy holds layers {copy.layers} of lineage {copy.lineage}, not {bounds} of "
                          f"{line}")
        raise RuntimeError(f"no node could give stage {stage} at step {step} from memory ({'; '.join(errors) or 'none alive'})")

    def close(self) -> None:
        with self._wake:
            self._closed = True
            self._wake.notify()
        self._thread.join(timeouts.THREAD_JOIN_S)
        self.server.close()

    def _changed(self) -> None:
        with self._wake:
            self._dirty = True
            self._wake.notify()

    def _loop(self) -> None:
        while True:
            with self._wake:
                while not self._pending and not self._dirty and not self._closed:
                    self._wake.wait()
                if self._closed:
                    return
                pending = list(self._pending.values())
                self._pending.clear()
            for item in pending:
                self._keep_and_send(item)
            self._publish()
            time.sleep(timeouts.COPY_INDEX_S)

    def _keep_and_send(self, item: _Pending) -> None:
        data = item.state.data()
        copy = Copy(item.stage, item.step, item.layers, data, hashlib.sha256(data).hexdigest(), item.lineage)
        self.store.put(copy)
        if item.holding is None:
            return
        try:
            indexes = read_indexes(self.membership.kv, self.job)
        except Exception as error:  # etcd restarting: this copy stays here only; the next one is sent
            print(f"node {self.node}: could not read the keepers of stage {item.stage}: {error}", file=sys.stderr)
            return
        pin = kept_elsewhere_step(indexes, item.holding)  # common to every stage's keepers: kept here and there
        self.store.pin(item.stage, pin)
        behind = catch_up_step(indexes, item.holding, item.stage, self.store.steps(item.stage))
        if behind is not None and behind != copy.step:  # the step the others' keepers share, which ours lack
            copy = self.store.get(item.stage, behind) or copy
        for keeper in plan_keepers(indexes, item.holding)[item.stage]:
            try:
                send_copy(indexes[keeper].address, copy, self.token, pin=pin)
            except (OSError, RuntimeError) as error:  # a keeper that died meanwhile: the next copy goes elsewhere
                print(f"node {self.node}: the copy of stage {item.stage} at step {copy.step} did not reach {keeper}: "
                      f"{error}", file=sys.stderr, flush=True)

    def _publish(self) -> None:
        with self._wake:
            if not self._dirty:
                return
            self._dirty = False
        copies, layers = self.store.index()
        index = CopyIndex(self.node, self.zone, self.server.address, copies, layers)
        context, membership = self.context, self.membership
        try:
            membership.kv.put(copies_prefix(self.job) + self.node, index.to_json(),
                              lease=context.fence_lease or 0, guard=membership.guard)
        except Exception as error:  # fenced (this node is dead to the others) or etcd gone: published later
            print(f"node {self.node}: could not publish its in-memory copies: {error}", file=sys.stderr)
            self._changed()
