"""The launcher's JSON-lines event log: one typed, validated record per line (the records and their keys
are in :mod:`bamboo.launch.event_records`).

:func:`read_events` names the file and line of any malformed record; :class:`EventLog` appends whole lines
from any number of writers.

**Events in etcd.** On a cluster there is no shared file: every agent and worker writes its records
to etcd with :class:`EtcdEventLog`, one key per record under
``/bamboo/<job>/events/<writer>/<sequence>`` (``writer`` is ``<node>.<role>.<pid>``), from a background
thread so that training never waits for etcd (one thread per etcd client writes every log on it:
:mod:`bamboo.launch.event_writer`). Each writer keeps only its newest
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
import os
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from bamboo.launch import timeouts
from bamboo.launch.accounting import TimeAccount
from bamboo.launch.event_records import (
    EVENT_TYPES,
    Checkpoint,
    Event,
    EventField,
    Failover,
    Join,
    Preemption,
    Reconfiguration,
    RedundancyChoice,
    Restore,
    RunEnd,
    RunStart,
    Startup,
    Step,
    WorkerPhase,
    event_from_dict,
    event_to_dict,
)
from bamboo.launch.event_writer import RecordWriter, writer_for
from bamboo.launch.json_types import JSON
from bamboo.membership.kv import FencedError, StoreError, StoreUnavailableError

if TYPE_CHECKING:
    from bamboo.membership import Guard, KeyValue, KeyValueStore, WatchEvent
    from bamboo.membership.kv_base import WatchHandle

__all__ = [
    "EVENTS_PER_WRITER",
    "EVENT_TYPES",
    "Checkpoint",
    "EtcdEventFollower",
    "EtcdEventLog",
    "EtcdEventReader",
    "Event",
    "EventLog",
    "EventLogError",
    "EventWriter",
    "Failover",
    "Join",
    "Preemption",
    "Reconfiguration",
    "RedundancyChoice",
    "Restore",
    "RunEnd",
    "RunStart",
    "Startup",
    "Step",
    "TimeAccount",
    "WorkerPhase",
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


class EventWriter(Protocol):
    """What a writer of the event log offers (:class:`EventLog`, :class:`EtcdEventLog`): the job's clock and
    a write."""

    def now(self) -> float: ...

    def write(self, event: Event) -> None: ...


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

    def emit(self, cls: type[Event], **fields: EventField) -> Event:
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
        kv: KeyValueStore,
        job: str,
        writer: str,
        start_unix: float,
        *,
        local: str | os.PathLike[str] | None = None,
        keep: int = EVENTS_PER_WRITER,
        outage_s: float = timeouts.ETCD_OUTAGE_S,
        retry_s: float = timeouts.ETCD_RETRY_S,
        guard: Guard | None = None,
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
        self._pending = 0  # records written and not yet out (or dropped)
        self._idle = threading.Condition()
        self.fenced = threading.Event()
        self._closed = False
        shared = writer_for(kv)  # one thread per client writes every log's records (bamboo.launch.event_writer)
        self._writer, self._own_writer = (shared, False) if shared is not None else (RecordWriter(), True)

    def now(self) -> float:
        """Seconds since the job's time zero (never negative)."""
        return max(0.0, time.time() - self.start_unix)

    def write(self, event: Event) -> None:
        """Queue one record (already built, with its own ``t``); it reaches etcd shortly after."""
        if self._closed:
            raise ValueError(f"event log {self.prefix} is closed")
        with self._idle:
            self._pending += 1
        self._writer.submit(lambda: self._write_out(event))

    def emit(self, cls: type[Event], **fields: EventField) -> Event:
        event = cls(t=self.now(), **fields)
        self.write(event)
        return event

    def flush(self, timeout: float = 10.0) -> bool:
        """Wait until every queued record was written (or dropped); False on timeout."""
        with self._idle:
            return self._idle.wait_for(lambda: self._pending == 0, timeout)

    def close(self, timeout: float = 10.0) -> None:
        """Write what is queued (up to ``timeout`` seconds), then stop."""
        if self._closed:
            return
        self._closed = True
        self.flush(timeout)
        if self._own_writer:
            self._writer.stop()
        if self._local is not None:
            self._local.close()

    def _write_out(self, event: Event) -> None:
        try:
            self._put(event)
        finally:
            with self._idle:
                self._pending -= 1
                self._idle.notify_all()

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
    return _typed_etcd_record(key, _decoded_etcd_record(key, value))


def _decoded_etcd_record(key: str, value: bytes) -> JSON:
    try:
        return json.loads(value)
    except ValueError as error:
        raise EventLogError(f"etcd key {key}: {error}") from None


def _typed_etcd_record(key: str, record: JSON) -> Event:
    try:
        return event_from_dict(record)
    except (ValueError, TypeError) as error:
        raise EventLogError(f"etcd key {key}: {error}") from None


def read_etcd_events(kv: KeyValueStore, job: str,
                     select: Callable[[list[JSON]], Callable[[JSON], bool]] | None = None) -> list[Event]:
    """Every record of a job's event log in etcd, sorted by ``t`` (ties by key); a bad one raises
    :class:`EventLogError` naming its key.

    ``select``, when given, sees every record's JSON first and returns which of them to type and keep: a reader
    that needs few of them skips the validation of the rest (at the log's cap of 20,000 step records, about 40 us
    each of the 0.85 s a whole read took). A process that reads the log again and again keeps an
    :class:`EtcdEventReader` instead."""
    decoded = [(item.key, _decoded_etcd_record(item.key, item.value)) for item in kv.get_prefix(events_prefix(job))]
    return _typed_events(decoded, select)


def _typed_events(decoded: list[tuple[str, JSON]], select: Callable[[list[JSON]], Callable[[JSON], bool]] | None,
                  typed: dict[str, Event] | None = None) -> list[Event]:
    """``decoded`` (key, JSON) typed where ``select`` wants them, sorted by ``t`` then key; ``typed`` keeps each
    record typed once, by key, for the next call."""
    wanted = select([record for _, record in decoded]) if select is not None else None
    known = {} if typed is None else typed
    parsed = []
    for key, record in decoded:
        if wanted is None or wanted(record):
            event = known.get(key)
            if event is None:
                event = known[key] = _typed_etcd_record(key, record)
            parsed.append((event, key))
    parsed.sort(key=lambda pair: (pair[0].t, pair[1]))
    return [event for event, _ in parsed]


def _decoded_by_key(items: Iterable[KeyValue]) -> dict[str, JSON]:
    return {item.key: _decoded_etcd_record(item.key, item.value) for item in items}


class EtcdEventReader:
    """A job's event log in etcd for a process that reads it again and again (each layout decision with
    ``--redundancy auto``, the coordinator's checks of how far a layout trained): :meth:`read` is
    :func:`read_etcd_events`, but each read after the first takes only the records written since the one
    before (``range_at(..., changed_after=)``) and keeps them decoded, and typed once wanted. Replayed on a
    400-step run's etcd, a whole read with the mode choice's selection took about 20 ms, and it grows with the
    log; the reader took 4 to 6 ms. It holds the log decoded in memory as long as it lives.

    When etcd holds fewer records than were kept (the oldest step records deleted at the log's cap), the next
    read takes the whole log again. A store without ``range_at`` and ``count_prefix`` is read whole each time.
    Reads may come from several threads."""

    def __init__(self, kv: KeyValueStore, job: str) -> None:
        self._kv, self.job = kv, job
        self._records: dict[str, JSON] = {}
        self._typed: dict[str, Event] = {}  # the records typed so far, by key
        self._revision = 0  # the etcd revision of the last read (0: none yet)
        self._lock = threading.Lock()

    def read(self, select: Callable[[list[JSON]], Callable[[JSON], bool]] | None = None) -> list[Event]:
        with self._lock:
            self._update()
            return _typed_events(list(self._records.items()), select, self._typed)

    def _update(self) -> None:
        prefix = events_prefix(self.job)
        range_at = getattr(self._kv, "range_at", None)
        count = getattr(self._kv, "count_prefix", None)
        if range_at is None or count is None:
            self._records = _decoded_by_key(self._kv.get_prefix(prefix))
            self._typed.clear()
            return
        items, revision = range_at(prefix, changed_after=self._revision)
        fresh = _decoded_by_key(items)
        if self._revision and len(self._records.keys() | fresh.keys()) != count(prefix, revision):
            items, revision = range_at(prefix)  # records deleted since the last read: the whole log again
            self._records, self._typed = {}, {}
            fresh = _decoded_by_key(items)
        for key in fresh.keys() & self._typed.keys():  # rewritten: typed again when next wanted
            del self._typed[key]
        self._records.update(fresh)
        self._revision = revision


class EtcdEventFollower:
    """Follows a job's event log in etcd: each :meth:`poll` returns the records added since the last one.

    The first poll returns the whole log so far. Records come in the order etcd stored them, which is
    ``t`` order for each writer; across writers a record may arrive slightly out of ``t`` order.

    ``on_arrival``, if given, is called on the watch's thread after each record (or malformed record) it queued
    for the next poll: a reader that polls from there takes each record as it comes, without a thread of its own
    to wake for each one.

    What was delivered is kept as two etcd revisions, not as the keys seen, so a follower of a run of days holds
    no more than one of an hour: the watch delivers in revision order, and a read (the first, or a final one)
    takes the records written after the newest revision the watch delivered; the watch then skips what that read
    took.
    """

    def __init__(self, kv: KeyValueStore, job: str, on_arrival: Callable[[], None] | None = None) -> None:
        self._kv = kv
        self.job = job
        self._on_arrival = on_arrival
        self._pending: list[Event] = []
        self._watched_to = 0  # the newest revision the watch delivered
        self._read_to = 0  # the newest revision a read delivered
        self._lock = threading.Lock()
        self._watch: WatchHandle | None = None
        self._error: EventLogError | None = None

    def _on_event(self, event: WatchEvent) -> None:
        if getattr(event.kind, "value", event.kind) != "put":
            return
        try:
            record = _parse_etcd_record(event.key, event.value)
        except EventLogError as error:
            with self._lock:
                self._error = error
        else:
            with self._lock:
                self._watched_to = max(self._watched_to, event.revision)
                if event.revision <= self._read_to:  # a final read (poll(final=True)) delivered it already
                    return
                self._pending.append(record)
        if self._on_arrival is not None:
            self._on_arrival()

    def _read_unseen(self) -> None:
        """Queue, in ``t`` order, every record in etcd newer than what the watch and earlier reads delivered."""
        items = self._kv.get_prefix(events_prefix(self.job))
        with self._lock:
            floor = max(self._watched_to, self._read_to)
            fresh = [item for item in items if item.mod_revision > floor]
        records = sorted(((_parse_etcd_record(item.key, item.value), item.key, item.mod_revision) for item in fresh),
                         key=lambda row: (row[0].t, row[1]))
        with self._lock:  # the watch may have delivered some of them meanwhile, in revision order
            self._pending.extend(record for record, _, revision in records if revision > self._watched_to)
            self._read_to = max([self._read_to, *(revision for *_, revision in records)])

    def poll(self, *, final: bool = False) -> list[Event]:
        """The records added since the last call. ``final``: the last call, once every writer has closed its
        log: the records still on their way through the watch are read from etcd itself, so none is missed."""
        if self._watch is None:
            revision = self._kv.revision()
            self._read_unseen()
            # puts only: each writer deletes its oldest record as it writes past its keep; no use to a reader
            self._watch = self._kv.watch_prefix(events_prefix(self.job), self._on_event, start_revision=revision + 1,
                                                puts_only=True)
        elif final:
            self._read_unseen()
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
