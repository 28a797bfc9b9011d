"""The launcher's JSON-lines event log: one typed, validated record per line.

Every record is a JSON object on its own line with two common keys:

- ``"kind"``: the record type (see the table below);
- ``"t"``: seconds since the run started (float, >= 0, from a monotonic clock).

and the kind's own keys:

- ``run_start``: ``job`` (str), ``unix_time`` (float, wall clock at t=0), ``target_nodes``,
  ``stages``, ``pipelines`` (int);
- ``join``: ``node``, ``zone`` (str): a node started (billing starts) and joined, as a worker
  or on standby;
- ``preemption``: ``node``, ``zone`` (str), ``notice_s`` (float, seconds of notice, 0 if
  none): the node was killed; billing stops;
- ``failover``: ``victim``, ``shadow`` (str), ``stage`` (int), ``pause_s`` (float, seconds
  the survivors could not make progress: from catching the failure to resuming on the merged
  schedule), and, optionally, the wall-clock times (Unix seconds) at the shadow ``caught_unix``
  (it caught the failure), ``resumed_unix`` (it ran the first instruction of the merged schedule)
  and ``step_end_unix`` (the failed step committed);
- ``reconfiguration``: ``reason`` (str), ``pipelines``, ``stages``, ``standby`` (int),
  ``bytes_moved`` (int, bytes of layers transferred), ``duration_s`` (float), ``attempts`` (int,
  optional, default 1: more when a node died while the new layout started and it was redone);
- ``checkpoint``: ``step`` (int), ``path`` (str), ``bytes`` (int), ``duration_s`` (float);
- ``restore``: ``step`` (int, the checkpoint step training restarts from), ``path`` (str, its
  folder), ``lost_stages`` (str, the stages no survivor held, comma separated), ``discarded_steps``
  (int, steps done since that checkpoint, trained again): every copy of some stage was gone, so
  every node restarted from the last good checkpoint;
- ``step``: ``step`` (int), ``samples`` (int, samples in this step), ``loss`` (float),
  ``nodes_active`` (int), ``duration_s`` (float, the step's own time), and, optionally, ``generation``
  (int, the layout generation that trained it; the DeepSpeed baseline writes none);
- ``run_end``: ``steps`` (int): the run finished; nodes still alive stop being billed here.

Unknown keys are rejected, so a typo in a writer fails at once instead of silently vanishing
from the report. :func:`read_events` names the file and line of any malformed record.

**Events in etcd.** On a cluster there is no shared file: every agent and worker writes its records
to etcd with :class:`EtcdEventLog`, one key per record under
``/bamboo/<job>/events/<writer>/<sequence>`` (``writer`` is ``<node>.<role>.<pid>``), from a background
thread so that training never waits for etcd. Each writer keeps only its newest
:data:`EVENTS_PER_WRITER` records (it deletes the older ones as it goes), so the log stays bounded.
There, ``t`` counts from the job's ``created_unix`` (wall clock: clocks of different machines may
differ by their skew). :func:`read_etcd_events` returns the whole log sorted by ``t`` and
:class:`EtcdEventFollower` the records added since its last poll (``bamboo-launch watch`` and
``report`` read them with ``--etcd URL --job J``; ``bamboo-launch run`` mirrors them into a local
JSON-lines file).
"""

from __future__ import annotations

import json
import logging
import math
import os
import queue
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
from bamboo.launch import timeouts
from bamboo.membership.kv import FencedError, StoreError, StoreUnavailableError

__all__ = [
    "EVENTS_PER_WRITER",
    "EVENT_TYPES",
    "Checkpoint",
    "EtcdEventFollower",
    "EtcdEventLog",
    "Event",
    "EventLog",
    "EventLogError",
    "Failover",
    "Join",
    "Preemption",
    "Reconfiguration",
    "Restore",
    "RunEnd",
    "RunStart",
    "Step",
    "TimeAccount",
    "event_from_dict",
    "event_to_dict",
    "iter_kind",
    "read_etcd_events",
    "read_events",
]

log = logging.getLogger(__name__)

EVENTS_PER_WRITER = 20_000
"""How many records each writer keeps in etcd (older ones are deleted as new ones are written)."""


class EventLogError(ValueError):
    """A record that does not follow the event-log schema; the message names file and line."""


_V = attrs.validators
_NON_NEGATIVE_TIME = _V.and_(_V.instance_of((int, float)), _V.ge(0), _V.lt(math.inf))
_NON_NEGATIVE_INT = _V.and_(_V.instance_of(int), _V.ge(0))
_POSITIVE_INT = _V.and_(_V.instance_of(int), _V.ge(1))


def _non_empty_str(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not value:
        raise ValueError(f"{attribute.name} must be a non-empty string, got {value!r}")


def _finite(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


@attrs.frozen
class RunStart:
    """The run began: the job's name, the wall-clock time of t=0 and the requested layout."""

    KIND: ClassVar[str] = "run_start"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    job: str = attrs.field(validator=_non_empty_str)
    unix_time: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    target_nodes: int = attrs.field(validator=_POSITIVE_INT)
    stages: int = attrs.field(validator=_POSITIVE_INT)
    pipelines: int = attrs.field(validator=_POSITIVE_INT)


@attrs.frozen
class Join:
    """A node started (billing starts) and joined the cluster, as a worker or on standby."""

    KIND: ClassVar[str] = "join"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    node: str = attrs.field(validator=_non_empty_str)
    zone: str = attrs.field(validator=_non_empty_str)


@attrs.frozen
class Preemption:
    """A node was killed by the (emulated or real) spot market; billing stops."""

    KIND: ClassVar[str] = "preemption"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    node: str = attrs.field(validator=_non_empty_str)
    zone: str = attrs.field(validator=_non_empty_str)
    notice_s: float = attrs.field(default=0.0, validator=_NON_NEGATIVE_TIME)


@attrs.frozen
class Failover:
    """The shadow took over a victim's stage; ``pause_s`` is how long progress stopped."""

    KIND: ClassVar[str] = "failover"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    victim: str = attrs.field(validator=_non_empty_str)
    shadow: str = attrs.field(validator=_non_empty_str)
    stage: int = attrs.field(validator=_NON_NEGATIVE_INT)
    pause_s: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    caught_unix: float | None = attrs.field(default=None)
    resumed_unix: float | None = attrs.field(default=None)
    step_end_unix: float | None = attrs.field(default=None)


@attrs.frozen
class Reconfiguration:
    """The pipelines were re-formed: the new layout, the bytes of layers moved, how long it took, in how many
    attempts."""

    KIND: ClassVar[str] = "reconfiguration"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    reason: str = attrs.field(validator=_non_empty_str)
    pipelines: int = attrs.field(validator=_NON_NEGATIVE_INT)
    stages: int = attrs.field(validator=_POSITIVE_INT)
    standby: int = attrs.field(validator=_NON_NEGATIVE_INT)
    bytes_moved: int = attrs.field(validator=_NON_NEGATIVE_INT)
    duration_s: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    attempts: int = attrs.field(default=1, validator=_POSITIVE_INT)
    """Starts it took: more than 1 when a node died while it started and the decision was redone."""


@attrs.frozen
class Checkpoint:
    """A checkpoint of ``step`` was committed at ``path`` (``bytes`` on disk, ``duration_s`` to write)."""

    KIND: ClassVar[str] = "checkpoint"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    path: str = attrs.field(validator=_non_empty_str)
    bytes: int = attrs.field(validator=_NON_NEGATIVE_INT)
    duration_s: float = attrs.field(validator=_NON_NEGATIVE_TIME)


def _stage_list(instance: object, attribute: attrs.Attribute, value: str) -> None:
    parts = value.split(",") if isinstance(value, str) else []
    if not parts or not all(part.isdigit() for part in parts):
        raise ValueError(f"{attribute.name} must be stage numbers separated by commas, like '1,2', got {value!r}")


@attrs.frozen
class Restore:
    """No survivor held some stage: every node restarted from the checkpoint of ``step`` at ``path``.

    ``lost_stages`` are the stages whose every copy was gone (``"1"``, ``"1,2"``);
    ``discarded_steps`` the steps done after that checkpoint, which are trained again.
    """

    KIND: ClassVar[str] = "restore"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    path: str = attrs.field(validator=_non_empty_str)
    lost_stages: str = attrs.field(validator=_stage_list)
    discarded_steps: int = attrs.field(validator=_NON_NEGATIVE_INT)


@attrs.frozen
class Step:
    """One optimizer step finished at ``t``: its global batch size and loss, and the nodes at work."""

    KIND: ClassVar[str] = "step"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    step: int = attrs.field(validator=_NON_NEGATIVE_INT)
    samples: int = attrs.field(validator=_POSITIVE_INT)
    loss: float = attrs.field(validator=_finite)
    nodes_active: int = attrs.field(validator=_NON_NEGATIVE_INT)
    duration_s: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    generation: int | None = attrs.field(default=None, validator=attrs.validators.optional(_NON_NEGATIVE_INT))


@attrs.frozen
class RunEnd:
    """The run finished after ``steps`` steps; nodes still alive stop being billed at ``t``."""

    KIND: ClassVar[str] = "run_end"
    t: float = attrs.field(validator=_NON_NEGATIVE_TIME)
    steps: int = attrs.field(validator=_NON_NEGATIVE_INT)


Event = RunStart | Join | Preemption | Failover | Reconfiguration | Checkpoint | Restore | Step | RunEnd

EVENT_TYPES: dict[str, type[Event]] = {
    cls.KIND: cls
    for cls in (RunStart, Join, Preemption, Failover, Reconfiguration, Checkpoint, Restore, Step, RunEnd)
}


def event_to_dict(event: Event) -> dict[str, Any]:
    """The JSON object of one record: ``kind`` first, then ``t``, then the kind's own keys."""
    return {"kind": type(event).KIND, **attrs.asdict(event)}


def event_from_dict(record: dict[str, Any]) -> Event:
    """Parse one JSON object into its typed record; raises ``ValueError`` saying what is wrong."""
    if not isinstance(record, dict):
        raise ValueError(f"a record must be a JSON object, got {type(record).__name__}")
    kind = record.get("kind")
    cls = EVENT_TYPES.get(kind) if isinstance(kind, str) else None
    if cls is None:
        raise ValueError(f"unknown kind {kind!r}; expected one of {sorted(EVENT_TYPES)}")
    names = {f.name for f in attrs.fields(cls)}
    fields = {k: v for k, v in record.items() if k != "kind"}
    unknown = sorted(set(fields) - names)
    if unknown:
        raise ValueError(f"{kind} record has unknown keys {unknown}; allowed: {sorted(names)}")
    required = {f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING}
    missing = sorted(required - set(fields))
    if missing:
        raise ValueError(f"{kind} record is missing keys {missing}")
    return cls(**fields)


def read_events(path: str | os.PathLike[str]) -> list[Event]:
    """Read a whole event log. Blank lines are skipped; a bad line raises :class:`EventLogError`.

    A final line without a newline that does not parse is the tail of a record that was being
    written when the writer died: it is reported too, because a report over a torn log would
    silently undercount.
    """
    events: list[Event] = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as error:
                raise EventLogError(
                    f"{path}:{number}: not valid JSON ({error.msg}): {line.strip()[:80]!r}"
                ) from None
            try:
                events.append(event_from_dict(record))
            except (ValueError, TypeError) as error:
                raise EventLogError(f"{path}:{number}: {error}") from None
    return events


class EventLog:
    """An append-only, thread- and process-safe JSON-lines writer with a run clock.

    ``clock`` returns seconds; ``t`` of each record is ``clock() - start``. ``start`` defaults to
    the clock's time when the log is opened; processes on one machine that share a run pass the
    same ``start`` of ``time.monotonic`` (a system-wide clock on Linux), so their ``t`` agree.

    The file is opened with ``O_APPEND`` and each record is one ``os.write`` of a whole line, so
    several writers (threads, or the launcher and its agents) interleave whole records, never
    parts of them. ``fsync=True`` also forces each record to disk (slower; use it when the host
    itself may die).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        *,
        clock: Callable[[], float] = time.monotonic,
        start: float | None = None,
        fsync: bool = False,
    ) -> None:
        self.path = Path(path)
        self._clock = clock
        self.start = clock() if start is None else start
        self._fsync = fsync
        self._lock = threading.Lock()
        self._fd: int | None = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def now(self) -> float:
        """Seconds since the run's start, on this log's clock (never negative)."""
        return max(0.0, self._clock() - self.start)

    def write(self, event: Event) -> None:
        """Append one record (already built, with its own ``t``)."""
        data = (json.dumps(event_to_dict(event), separators=(",", ":")) + "\n").encode("utf-8")
        with self._lock:
            if self._fd is None:
                raise ValueError(f"event log {self.path} is closed")
            written = os.write(self._fd, data)
            if written != len(data):  # a regular file takes the whole write, or raises (ENOSPC)
                raise OSError(f"event log {self.path}: short write of {written} of {len(data)} bytes")
            if self._fsync:
                os.fsync(self._fd)

    def emit(self, cls: type[Event], **fields: Any) -> Event:
        """Build a record of ``cls`` stamped with :meth:`now` and append it; returns the record."""
        event = cls(t=self.now(), **fields)
        self.write(event)
        return event

    def write_all(self, events: Iterable[Event]) -> None:
        """Append several records in order."""
        for event in events:
            self.write(event)

    def close(self) -> None:
        """Close the file; later writes raise."""
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __enter__(self) -> EventLog:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def iter_kind(events: Iterable[Event], cls: type[Event]) -> Iterator[Event]:
    """The records of one type, in log order."""
    return (event for event in events if isinstance(event, cls))


def events_prefix(job: str) -> str:
    """The etcd prefix of a job's event records."""
    return f"/bamboo/{job}/events/"


class EtcdEventLog:
    """Writes records to etcd under ``/bamboo/<job>/events/<writer>/`` (see the module docstring).

    ``kv`` is a key-value store (``bamboo.membership.EtcdKV``); ``guard``, when given (a
    ``bamboo.membership.Guard``: the writer's registration), fences every write. ``start_unix`` is the job's time zero; ``t`` of a record is
    ``time.time() - start_unix``. Records are written in order by one background thread; a write that
    etcd refuses because the node was fenced stops the log (nothing this node writes reaches the job
    any more); a write that fails because etcd is unreachable is retried for ``outage_s`` seconds, then
    dropped with an error line. ``local``, if given, also gets every record (a JSON-lines
    :class:`EventLog`).
    """

    def __init__(
        self,
        kv: Any,
        job: str,
        writer: str,
        start_unix: float,
        *,
        local: str | os.PathLike[str] | None = None,
        keep: int = EVENTS_PER_WRITER,
        outage_s: float = timeouts.ETCD_OUTAGE_S,
        retry_s: float = timeouts.ETCD_RETRY_S,
        guard: Any = None,
    ) -> None:
        if keep < 1:
            raise ValueError(f"keep must be >= 1, got {keep}")
        self._kv = kv
        self._guard = guard
        self.prefix = f"{events_prefix(job)}{writer}/"
        self.start_unix = start_unix
        self.keep = keep
        self.outage_s = outage_s
        self.retry_s = retry_s
        self._local = EventLog(local, clock=time.time, start=start_unix) if local is not None else None
        self._sequence = 0
        self._queue: queue.Queue[Event | None] = queue.Queue()
        self.fenced = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._drain, name=f"bamboo-events-{writer}", daemon=True)
        self._thread.start()

    def now(self) -> float:
        """Seconds since the job's time zero (never negative)."""
        return max(0.0, time.time() - self.start_unix)

    def write(self, event: Event) -> None:
        """Queue one record (already built, with its own ``t``); it reaches etcd shortly after."""
        if self._closed:
            raise ValueError(f"event log {self.prefix} is closed")
        self._queue.put(event)

    def emit(self, cls: type[Event], **fields: Any) -> Event:
        event = cls(t=self.now(), **fields)
        self.write(event)
        return event

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued record was written (or dropped); False on timeout."""
        deadline = time.monotonic() + timeout
        while self._queue.unfinished_tasks and time.monotonic() < deadline:
            time.sleep(0.005)
        return not self._queue.unfinished_tasks

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout`` seconds), then stop."""
        if self._closed:
            return
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout)
        if self._local is not None:
            self._local.close()

    def _drain(self) -> None:
        while True:
            event = self._queue.get()
            try:
                if event is None:
                    return
                self._put(event)
            finally:
                self._queue.task_done()

    def _put(self, event: Event) -> None:
        if self._local is not None:
            self._local.write(event)
        if self.fenced.is_set():
            return
        data = json.dumps(event_to_dict(event), separators=(",", ":")).encode()
        key = f"{self.prefix}{self._sequence:010d}"
        deadline = time.monotonic() + self.outage_s
        while True:
            try:
                self._kv.put(key, data, guard=self._guard)
                if self._sequence >= self.keep:
                    self._kv.delete(f"{self.prefix}{self._sequence - self.keep:010d}", guard=self._guard)
                self._sequence += 1
                return
            except FencedError as error:
                log.error("event log %s: this node was fenced; no more records: %s", self.prefix, error)
                self.fenced.set()
                return
            except StoreUnavailableError as error:
                if time.monotonic() > deadline:
                    log.error("event log %s: dropped a %s record: %s", self.prefix, type(event).KIND, error)
                    return
                time.sleep(self.retry_s)
            except StoreError as error:
                log.error("event log %s: dropped a %s record: %s", self.prefix, type(event).KIND, error)
                return


def _parse_etcd_record(key: str, value: bytes) -> Event:
    try:
        return event_from_dict(json.loads(value))
    except (ValueError, TypeError) as error:
        raise EventLogError(f"etcd key {key}: {error}") from None


def read_etcd_events(kv: Any, job: str) -> list[Event]:
    """Every record of a job's event log in etcd, sorted by ``t`` (ties by key); a bad one raises
    :class:`EventLogError` naming its key."""
    items = kv.get_prefix(events_prefix(job))
    parsed = [(_parse_etcd_record(item.key, item.value), item.key) for item in items]
    parsed.sort(key=lambda pair: (pair[0].t, pair[1]))
    return [event for event, _ in parsed]


class EtcdEventFollower:
    """Follows a job's event log in etcd: each :meth:`poll` returns the records added since the last one.

    The first poll returns the whole log so far. Records come in the order etcd stored them, which is
    ``t`` order for each writer; across writers a record may arrive slightly out of ``t`` order.
    """

    def __init__(self, kv: Any, job: str) -> None:
        self._kv = kv
        self.job = job
        self._pending: list[Event] = []
        self._seen: set[str] = set()
        self._lock = threading.Lock()
        self._watch: Any = None
        self._error: EventLogError | None = None

    def _on_event(self, event: Any) -> None:
        if getattr(event.kind, "value", event.kind) != "put" or event.key in self._seen:
            return
        try:
            record = _parse_etcd_record(event.key, event.value)
        except EventLogError as error:
            with self._lock:
                self._error = error
            return
        with self._lock:
            self._seen.add(event.key)
            self._pending.append(record)

    def poll(self) -> list[Event]:
        """The records added since the last call."""
        if self._watch is None:
            revision = self._kv.revision()
            items = self._kv.get_prefix(events_prefix(self.job))
            records = sorted(((_parse_etcd_record(i.key, i.value), i.key) for i in items),
                             key=lambda pair: (pair[0].t, pair[1]))
            with self._lock:
                self._seen.update(key for _, key in records)
                self._pending[:0] = [record for record, _ in records]
            self._watch = self._kv.watch_prefix(events_prefix(self.job), self._on_event, start_revision=revision + 1)
        with self._lock:
            if self._error is not None:
                error, self._error = self._error, None
                raise error
            out, self._pending = self._pending, []
        return out

    def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            self._watch = None


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
    - ``reconfiguration_s`` / ``restore_s``: the reconfigurations (from the first holder at the barrier to
      the new layout's first step), those that restarted from a checkpoint counted as restores;
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
    _last_reconfiguration: float = 0.0
    _pauses: list[tuple[float, float]] = attrs.field(factory=list)
    _steps_seen: set[int] = attrs.field(factory=set)

    def apply(self, event: Event) -> None:
        if isinstance(event, RunStart):
            self.start, self.start_unix = event.t, event.unix_time  # unix_time is the wall clock at t=0
        elif isinstance(event, Step):
            begin = event.t - event.duration_s
            if self.first_step_start is None:
                self.first_step_start = begin
            self.last_step_end = event.t if self.last_step_end is None else max(self.last_step_end, event.t)
            self.step_s += event.duration_s
            if event.step in self._steps_seen:
                self.redone_s += event.duration_s
            self._steps_seen.add(event.step)
        elif isinstance(event, Failover):
            if self.start_unix is not None and event.caught_unix is not None and event.resumed_unix is not None:
                span = (event.caught_unix - self.start_unix, event.resumed_unix - self.start_unix)
            else:  # an older record: the pause, ending about when it was written
                span = (event.t - event.pause_s, event.t)
            if not any(a <= span[1] and span[0] <= b for a, b in self._pauses):  # one event's pauses count once
                self.failover_s += event.pause_s
            self._pauses.append(span)
        elif isinstance(event, Reconfiguration):
            self.reconfiguration_s += event.duration_s
            self._last_reconfiguration = event.duration_s
        elif isinstance(event, Restore):  # written right after its reconfiguration: move it over
            self.reconfiguration_s -= self._last_reconfiguration
            self.restore_s += self._last_reconfiguration
            self._last_reconfiguration = 0.0

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

    def summary(self) -> dict[str, float | None]:
        return {"startup_s": self.startup_s, "window_s": self.window_s, "step_s": self.step_s,
                "step_share": self.step_share, "failover_s": self.failover_s,
                "reconfiguration_s": self.reconfiguration_s, "restore_s": self.restore_s, "lost_s": self.lost_s}
