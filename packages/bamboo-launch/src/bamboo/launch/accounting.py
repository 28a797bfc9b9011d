"""Where a run's time went, folded from its event log: the report's and the live view's time figures.

:class:`TimeAccount` reads records in ``t`` order (:meth:`TimeAccount.apply`) and keeps the start-up, the
training window and the steps' share of it, the failover pauses, and every reconfiguration's pause with its
parts (waiting for nodes, decide, barrier, transfers, group builds, first step; :mod:`bamboo.launch.pauses`
measures them) and every restore's pause and source.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING

import attrs
from bamboo.launch.event_records import Event, Failover, Reconfiguration, Restore, RunStart, Startup, Step
from bamboo.launch.json_types import JSON

if TYPE_CHECKING:
    from bamboo.reconfig import JobLayout

__all__ = ["PAUSE_PARTS", "STARTUP_PARTS", "TimeAccount", "last_step_end_unix", "progress_records", "steps_reached"]

PAUSE_PARTS = ("nodes_s", "decide_s", "barrier_s", "transfers_s", "group_builds_s", "first_step_s")
"""The parts of a reconfiguration's pause, in the ``reconfiguration`` record and the report."""
STARTUP_PARTS = ("process_s", "imports_s", "model_s", "wait_s", "model_build_s", "group_build_s", "first_step_s")
"""The phases of a worker's start, in the ``startup`` record and the report."""


@attrs.define
class TimeAccount:
    """Where a run's time went, folded from its records in ``t`` order with :meth:`apply`.

    - ``startup_s``: from the run's start to the start of its first step (processes, imports, the
      first layout, group building);
    - ``window_s``: the training window, from the start of the first step to the end of the last;
    - ``step_s``: the time the steps themselves took (their ``duration_s``; a step trained again after a
      restore counts again, and a failover's pause counts inside the step it interrupted);
    - ``step_share``: ``step_s / window_s``, the share of the window spent in steps;
    - ``failover_s``: the failover pauses (from catching the failure to resuming on the merged schedule;
      overlapping pauses of one event count once);
    - ``reconfiguration_s`` / ``restore_s``: the reconfigurations' pauses (from the first node that stopped
      to the new layout's go, plus its first step's excess), those that restarted from a copy of an
      earlier step counted as restores; ``pauses`` lists each reconfiguration's pause (restores apart) and
      ``parts_s`` sums the parts of all of them (restores included);
    - ``restores``: ``(pause, source)`` of each restore (``memory``, ``disk`` or ``initial``);
    - ``lost_s``: everything up to the last step that was not a step's first, useful run: start-up, the
      gaps between steps, failover pauses and steps trained again.
    """

    start: float = 0.0
    start_unix: float | None = None
    first_step_start: float | None = None
    last_step_end: float | None = None
    step_s: float = 0.0
    redone_s: float = 0.0
    failover_s: float = 0.0
    reconfiguration_s: float = 0.0
    restore_s: float = 0.0
    pauses: list[float] = attrs.field(factory=list)
    prepared: int = 0
    """Reconfigurations prepared while the old layout trained (make before break)."""
    parts_s: dict[str, float] = attrs.field(factory=lambda: dict.fromkeys(PAUSE_PARTS, 0.0))
    restores: list[tuple[float, str]] = attrs.field(factory=list)
    startups: list[Startup] = attrs.field(factory=list)
    """The ``startup`` records of the workers that trained the first step (they set the job's start-up)."""
    _last_reconfiguration: float = 0.0
    _first_step_end: float | None = None
    _failover_spans: list[tuple[float, float]] = attrs.field(factory=list)
    _steps_seen: set[int] = attrs.field(factory=set)

    def apply(self, event: Event) -> None:
        if isinstance(event, RunStart):
            self.start, self.start_unix = event.t, event.unix_time  # unix_time is the wall clock at t=0
        elif isinstance(event, Step):
            begin = event.t - event.duration_s
            if self.first_step_start is None:
                self.first_step_start, self._first_step_end = begin, event.t
            self.last_step_end = event.t if self.last_step_end is None else max(self.last_step_end, event.t)
            self.step_s += event.duration_s
            if event.step in self._steps_seen:
                self.redone_s += event.duration_s
            self._steps_seen.add(event.step)
        elif isinstance(event, Failover):
            self._failover(event)
        elif isinstance(event, Startup) and self._of_first_step(event):
            self.startups.append(event)
        elif isinstance(event, Reconfiguration):
            self.reconfiguration_s += event.duration_s
            self._last_reconfiguration = event.duration_s
            self.pauses.append(event.duration_s)
            self.prepared += event.prepared
            for part in PAUSE_PARTS:
                self.parts_s[part] += getattr(event, part) or 0.0
        elif isinstance(event, Restore):  # written right after its reconfiguration: move it over
            pause = event.duration_s if event.duration_s is not None else self._last_reconfiguration
            self.reconfiguration_s -= self._last_reconfiguration
            self.restore_s += self._last_reconfiguration
            if self.pauses and self._last_reconfiguration:
                self.pauses.pop()
            self._last_reconfiguration = 0.0
            self.restores.append((pause, event.source or "disk"))

    def _of_first_step(self, event: Startup) -> bool:
        """Whether a worker's start ended with the job's first step (not a joiner's, later)."""
        if self._first_step_end is None:
            return True
        return event.t - (event.first_step_s or 0.0) <= self._first_step_end

    def _failover(self, event: Failover) -> None:
        if self.start_unix is not None and event.caught_unix is not None and event.resumed_unix is not None:
            span = (event.caught_unix - self.start_unix, event.resumed_unix - self.start_unix)
        else:  # an older record: the pause, ending about when it was written
            span = (event.t - event.pause_s, event.t)
        if not any(a <= span[1] and span[0] <= b for a, b in self._failover_spans):  # one event's pauses count once
            self.failover_s += event.pause_s
        self._failover_spans.append(span)

    @property
    def startup_s(self) -> float:
        return 0.0 if self.first_step_start is None else max(0.0, self.first_step_start - self.start)

    @property
    def window_s(self) -> float:
        if self.first_step_start is None or self.last_step_end is None:
            return 0.0
        return max(0.0, self.last_step_end - self.first_step_start)

    @property
    def step_share(self) -> float | None:
        return None if self.window_s <= 0 else min(1.0, self.step_s / self.window_s)

    @property
    def lost_s(self) -> float:
        if self.last_step_end is None:
            return 0.0
        useful = self.step_s - self.redone_s - self.failover_s
        return max(0.0, self.last_step_end - self.start - useful)

    @property
    def pause_p50_s(self) -> float | None:
        return statistics.median(self.pauses) if self.pauses else None

    @property
    def pause_max_s(self) -> float | None:
        return max(self.pauses) if self.pauses else None

    def startup_parts(self) -> dict[str, float | None]:
        """The median of each start-up phase over the workers of the first step (None: no record has it)."""
        parts = {}
        for part in STARTUP_PARTS:
            values = [getattr(record, part) for record in self.startups if getattr(record, part) is not None]
            parts[part] = statistics.median(values) if values else None
        return parts

    def summary(self) -> dict[str, float | None]:
        """The account as a flat dict of seconds and shares (None: not known yet), keys as the live view's."""
        return {"startup_s": self.startup_s, "window_s": self.window_s, "step_s": self.step_s,
                "step_share": self.step_share, "failover_s": self.failover_s,
                "reconfiguration_s": self.reconfiguration_s, "restore_s": self.restore_s, "lost_s": self.lost_s,
                "reconfiguration_pause_p50_s": self.pause_p50_s, "reconfiguration_pause_max_s": self.pause_max_s}


def steps_reached(events: Iterable[Event], lost: JobLayout, created_unix: float) -> int:
    """The last step generation ``lost`` (a ``JobLayout``) completed, from the job's event log: the highest
    ``step`` record of that generation (``lost.start_step`` when it recorded none).

    A record that names its ``generation`` is judged by it. One that names none (written before records
    carried it) counts if it was written after the generation's barrier (strictly: a restart's barrier is the
    end of the lost generation's last step): the log's ``t`` counts from
    ``created_unix``, so that test is only as good as the writers' clocks, whose skew can move a record
    across the barrier."""
    return max((e.step for e in _own_steps(events, lost, created_unix)), default=lost.start_step)


def last_step_end_unix(events: Iterable[Event], lost: JobLayout, created_unix: float) -> float | None:
    """When the last step of generation ``lost`` ended (wall clock), from the job's event log, judged as in
    :func:`steps_reached`; when it recorded none (an attempt lost before its first step), when the last step of
    an earlier generation ended; None when the log has neither. A restart after every holder was lost counts
    its pause from here: no holder lived to say when it stopped, and nothing trained since."""
    events = list(events)
    own = _own_steps(events, lost, created_unix)
    if own:
        return max(created_unix + e.t for e in own)
    since = _barrier_t(lost, created_unix)
    return max((created_unix + e.t for e in events
                if isinstance(e, Step) and _is_earlier(e.generation, e.t, lost, since)), default=None)


def _own_steps(events: Iterable[Event], lost: JobLayout, created_unix: float) -> list[Step]:
    since = _barrier_t(lost, created_unix)
    return [e for e in events if isinstance(e, Step) and _is_own(e.generation, e.t, lost, since)]


def _barrier_t(lost: JobLayout, created_unix: float) -> float:
    return 0.0 if lost.barrier_unix is None else lost.barrier_unix - created_unix


def _is_own(generation: int | None, t: float, lost: JobLayout, since: float) -> bool:
    """Whether a step record of ``generation`` written at ``t`` belongs to generation ``lost`` (judged as
    :func:`steps_reached` says); ``since`` is ``lost``'s barrier on the log's clock."""
    return generation == lost.generation if generation is not None else t > since


def _is_earlier(generation: int | None, t: float, lost: JobLayout, since: float) -> bool:
    """Whether a step record of ``generation`` written at ``t`` belongs to a generation before ``lost``."""
    return generation < lost.generation if generation is not None else t <= since


def progress_records(lost: JobLayout, created_unix: float) -> Callable[[list[JSON]], Callable[[JSON], bool]]:
    """A ``select`` for ``read_etcd_events`` that keeps what :func:`steps_reached` and :func:`last_step_end_unix`
    need of generation ``lost``: of its own step records (judged as there), the one of the highest step and the one
    that ended last, and of the earlier generations' the one that ended last. The other records are not typed: a
    restart's decision typed the whole log, up to 20,000 step records (about 0.4 s of its 0.8 s read at that
    size)."""
    since = _barrier_t(lost, created_unix)

    def select(records: list[JSON]) -> Callable[[JSON], bool]:
        own, earlier = [], []
        for record in records:
            if not isinstance(record, dict) or record.get("kind") != Step.KIND:
                continue
            generation, t, step = record.get("generation"), record.get("t"), record.get("step")
            if not isinstance(t, (int, float)) or not isinstance(step, int):
                continue
            if generation is None or isinstance(generation, int):
                if _is_own(generation, t, lost, since):
                    own.append(record)
                elif _is_earlier(generation, t, lost, since):
                    earlier.append(record)
        kept = {id(max(own, key=lambda r: r["step"])), id(max(own, key=lambda r: r["t"]))} if own else set()
        if earlier:
            kept.add(id(max(earlier, key=lambda r: r["t"])))
        return lambda record: id(record) in kept

    return select
