"""The records a worker writes about how it got to train: each reconfiguration's pause and its parts, a restore's
source, and its own start-up (event records); and what it leaves at the end, its final report (:class:`WorkerReport`).

The lowest rank of a new layout writes the ``reconfiguration`` record (and a ``restore`` record when the
layout restarted from a copy of an earlier step) once the layout's first step is done, so that the pause
counts what that step took beyond a usual one (:mod:`bamboo.launch.pauses`). Every worker writes one
``startup`` record at its first step: the phases of its start, from its agent's spawn on.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import attrs
from bamboo.launch.event_records import Reconfiguration, Restore, Startup
from bamboo.launch.json_types import JSONObject
from bamboo.launch.pauses import PauseBreakdown, first_step_excess, pause_breakdown
from bamboo.launch.records import AttemptOutcome, NodeUp, read_record

if TYPE_CHECKING:
    from bamboo.launch.events import EventWriter
    from bamboo.membership import MembershipStore
    from bamboo.reconfig import JobLayout
    from torch import Tensor

__all__ = ["SPAWNED_ENV", "StartupClock", "WorkerReport", "reconfiguration_pause", "write_reconfiguration"]

SPAWNED_ENV = "BAMBOO_WORKER_SPAWNED_UNIX"
"""Set by the agent when it spawns its worker: the wall-clock time of the spawn (the ``process_s`` phase)."""


class WorkerReport(TypedDict):
    """A worker's final report (``RUN_DIR/out/rank<R>.pt``, written by :mod:`bamboo.launch.worker`): its place in
    the last layout, the final state of each layer it built (``slices`` and their global indices ``slice_layers``,
    per hosted stage), its losses and failovers."""

    rank: int
    node: str
    generation: int
    history: list[list[int]]
    stage_bounds: list[list[int]]
    stage: int
    pipeline: int
    hosted: list[int]
    slices: dict[int, list[dict[str, Tensor]]]
    slice_layers: dict[int, list[int]]
    replica_stage: int | None
    losses: list[float]
    steps_done: int
    failovers: list[JSONObject]
    consecutive: str | None
    seconds: float


def reconfiguration_pause(membership: MembershipStore, layout: JobLayout, first_step_s: float,
                          usual: Sequence[float]) -> PauseBreakdown:
    """The pause of the reconfiguration that started ``layout`` (a ``JobLayout`` that went ahead), from the
    ``up`` records of its nodes and its outcome in etcd, and its first step of ``first_step_s`` seconds against
    ``usual`` step times. A record that cannot be read counts as missing (its part goes to the barrier)."""
    from bamboo.launch.attempt import outcome_name, up_name

    ups: list[NodeUp] = []
    prefix = up_name(layout.generation, "")
    try:  # one read of every node's record (a read of each cost a thousand-node job a second at its lowest rank)
        written, _ = membership.read_decisions(prefix)
    except Exception:  # etcd restarting: the figure loses its parts
        written = {}
    for name, decision in sorted(written.items()):
        if name.removeprefix(prefix) in layout.ranks:
            with contextlib.suppress(Exception):  # a malformed record: the figure only loses a part
                ups.append(NodeUp.from_dict(decision.value))
    try:
        outcome = read_record(AttemptOutcome, membership.get_decision(outcome_name(layout.generation)))
    except Exception:
        outcome = None
    go = outcome.at if outcome is not None and outcome.at is not None else time.time()
    stopped = [up.stopped for up in ups if up.stopped is not None]
    t0 = min(stopped, default=None)
    if t0 is None:  # nobody held state (a restart of every stage): from the last step trained (barrier_unix)
        t0 = float(layout.barrier_unix) if layout.barrier_unix is not None else go
    return pause_breakdown(t0, go, ups, first_step_excess(first_step_s, usual), stages=layout.stages)


def write_reconfiguration(log: EventWriter, layout: JobLayout, pause: PauseBreakdown, *, stages: int,
                          prepared: bool, restore_source: str | None) -> None:
    """Append the ``reconfiguration`` record of ``layout`` (and its ``restore`` record, when it restarted from a
    copy of an earlier step, from ``restore_source``: ``memory``, ``disk`` or ``initial``)."""
    log.write(Reconfiguration(t=log.now(), reason=layout.reason, pipelines=layout.pipelines, stages=stages,
                              standby=len(layout.standby), bytes_moved=layout.transfers.bytes_moved,
                              duration_s=pause.total_s, attempts=layout.attempt + 1, nodes_s=pause.nodes_s,
                              decide_s=pause.decide_s,
                              barrier_s=pause.barrier_s, transfers_s=pause.transfers_s,
                              group_builds_s=pause.group_builds_s, first_step_s=pause.first_step_s,
                              prepared=prepared, generation=layout.generation))
    if layout.restore is None:
        return
    step = layout.start_step
    log.write(Restore(t=log.now(), step=step, path=layout.restore.path or layout.restore.source,
                      lost_stages=",".join(str(s) for s in layout.restore.lost_stages),
                      discarded_steps=max(0, layout.barrier_step - step), source=restore_source or "disk",
                      duration_s=pause.total_s))


@attrs.define
class StartupClock:
    """The phases of a worker's start, as they end (``time.time()`` marks); :meth:`record` is its ``startup``."""

    spawned: float | None = attrs.field(factory=lambda: _spawned_at())
    entered: float = attrs.field(factory=lambda: _process_start() or time.time())
    """When the worker's process started (before its imports)."""
    imported: float | None = None
    warm: float | None = None
    role: float | None = None
    model_build_s: float | None = None
    group_build_s: float | None = None

    def record(self, log: EventWriter, node: str, first_step_s: float) -> Startup:
        def span(start: float | None, end: float | None) -> float | None:
            return None if start is None or end is None else max(0.0, end - start)

        return Startup(t=log.now(), node=node, process_s=span(self.spawned, self.entered),
                       imports_s=span(self.entered, self.imported), model_s=span(self.imported, self.warm),
                       wait_s=span(self.warm, self.role), model_build_s=self.model_build_s,
                       group_build_s=self.group_build_s, first_step_s=first_step_s)


def _process_start() -> float | None:
    """When this process started (wall clock), from Linux's ``/proc`` (None elsewhere)."""
    try:
        fields = Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()
        since_boot = int(fields[19]) / os.sysconf("SC_CLK_TCK")  # field 22 of proc(5): start time, in clock ticks
        return time.time() - (time.clock_gettime(time.CLOCK_BOOTTIME) - since_boot)
    except (OSError, ValueError, IndexError, AttributeError):
        return None


def _spawned_at() -> float | None:
    value = os.environ.get(SPAWNED_ENV)
    try:
        return float(value) if value else None
    except ValueError:
        return None
