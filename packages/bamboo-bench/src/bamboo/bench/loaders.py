"""Loaders that turn each real spot-trace format into one `Trace`, and the generic CSV writer.

Formats (see the `SOURCE.md` beside each trace folder):

- **EC2 event CSV** (the Bamboo paper's ``p3-trace.csv``, ``g4dn-trace.csv``): no header,
  ``delta_ms,add|remove,nodeN``. The file has no zone, so every node gets the `zone` argument.
- **GCP count log** (``a100x1-east1b.txt``): no header, ``YYYY-MM-DD, HH:MM:SS, N`` with N the
  number of running instances. Rows are sorted by time first (the V100 log goes backwards).
- **SkyPilot count JSON** (``{"metadata": {"gap_seconds": g}, "data": [n0, n1, ...]}``): one file
  per zone; the zone is the file name up to the first ``_``. Several files load into one
  multi-zone trace.
- **AWS count curve** (``doc/data`` files): no header, ``x,y`` with y the instance count and x in
  seconds, or in hours for ``*_scaled`` files (`time_unit_s` overrides).
- **Auto Scaling Group count CSV**: header ``timestamp,count`` or ``time,count``, ISO 8601 or
  ``YYYY-MM-DD HH:MM:SS`` times, instance totals (floats allowed when whole).
- **Generic CSV** (ours): a header line ``time_s,event,node,zone`` then one event per line, e.g.
  ``12.5,remove,node7,us-east-1a``. Lines starting with ``#`` are comments; a comment
  ``# duration_s=7200`` sets the observed window (default: the last event's time).

- **A folder of per-zone files** (as SkyPilot and GCP publish them): every trace file directly in it, one
  zone each, as one trace (`load_trace_folder`).

Count logs become events like this: a rise of k adds k new nodes named ``<zone>-<i>``, a drop of
k removes the k most recently added nodes of that zone (last in, first out). A count above
`MAX_INSTANCE_COUNT` is refused: every counted instance becomes a node with its own events.

Text files may start with a UTF-8 byte-order mark. Every malformed input raises `TraceFormatError`,
whose message names the file and the line (for JSON: the element, ``data[5]``).
"""

from __future__ import annotations

import csv
import datetime
import json
import re
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from bamboo.bench.trace import EventKind, Trace, TraceEvent

__all__ = [
    "GENERIC_CSV_HEADER",
    "MAX_INSTANCE_COUNT",
    "TRACE_SUFFIXES",
    "TraceFormatError",
    "load_count_csv",
    "load_count_curve",
    "load_ec2_events",
    "load_gcp_counts",
    "load_generic_csv",
    "load_skypilot_counts",
    "load_trace",
    "load_trace_folder",
    "write_generic_csv",
]

GENERIC_CSV_HEADER = "time_s,event,node,zone"
#: The largest instance count a count trace may hold. The real traces peak at 80; each counted instance
#: becomes a node with its own events (a count of a million took 580 MB), so a larger count is refused.
MAX_INSTANCE_COUNT = 10_000
_EC2_LINE = re.compile(r"^\s*\d+\s*,\s*(add|remove)\s*,")
_COUNT_CURVE_LINE = re.compile(r"^\s*\d+(\.\d*)?\s*,\s*\d+(\.0*)?\s*$")


class TraceFormatError(ValueError):
    """A trace file is malformed; the message says which file, which line, and what is wrong."""

    def __init__(self, path: Path | str, line: int | None, problem: str) -> None:
        self.path = str(path)
        self.line = line
        self.problem = problem
        where = f"{self.path}:{line}" if line is not None else self.path
        super().__init__(f"{where}: {problem}")


def _read_text(path: Path) -> str:
    """The file's text; a UTF-8 byte-order mark at the start is dropped."""
    try:
        return path.read_text(encoding="utf-8-sig")
    except OSError as error:
        raise TraceFormatError(path, None, f"cannot read: {error.strerror or error}") from error
    except UnicodeDecodeError as error:
        raise TraceFormatError(path, None, f"not UTF-8 text: {error.reason}") from error


def _read_lines(path: Path) -> list[str]:
    return _read_text(path).splitlines()


class _EventBuilder:
    """Checks add/remove consistency while events are collected (a node is added once, removed once)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.events: list[TraceEvent] = []
        self.alive: set[str] = set()
        self.seen: set[str] = set()

    def add(self, line: int, time_s: float, kind: EventKind, node: str, zone: str) -> None:
        if kind is EventKind.ADD:
            if node in self.seen:
                raise TraceFormatError(self.path, line, f"node {node!r} is added twice")
            self.seen.add(node)
            self.alive.add(node)
        else:
            if node not in self.alive:
                raise TraceFormatError(self.path, line, f"remove of {node!r}, which is not alive")
            self.alive.discard(node)
        self.events.append(TraceEvent(time_s, kind, node, zone))


def load_ec2_events(path: Path | str, zone: str = "ec2") -> Trace:
    """Load the paper's EC2 event CSV (``delta_ms,add|remove,nodeN``); every node is put in `zone`."""
    path = Path(path)
    builder = _EventBuilder(path)
    previous = 0.0
    for number, raw in enumerate(_read_lines(path), start=1):
        text = raw.strip()
        if not text:
            continue
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 3:
            raise TraceFormatError(path, number, f"expected 'ms,add|remove,node', got {raw!r}")
        ms, event, node = parts
        if not ms.isdigit():
            raise TraceFormatError(path, number, f"time {ms!r} is not a whole number of milliseconds")
        if event not in ("add", "remove"):
            raise TraceFormatError(path, number, f"event {event!r} is neither 'add' nor 'remove'")
        if not node:
            raise TraceFormatError(path, number, "empty node name")
        time_s = int(ms) / 1000.0
        if time_s < previous:
            raise TraceFormatError(path, number, f"time {ms} ms goes back before {previous * 1000:g} ms")
        previous = time_s
        builder.add(number, time_s, EventKind(event), node, zone)
    if not builder.events:
        raise TraceFormatError(path, None, "no events")
    return Trace.from_events(path.stem, builder.events)


def _count_events(
    path: Path, samples: Iterable[tuple[int, float, int]], zone: str, builder: _EventBuilder
) -> None:
    """Turn (line, time_s, count) samples of one zone into add/remove events (LIFO removal)."""
    stack: list[str] = []
    created = 0
    for line, time_s, count in samples:
        if count < 0:
            raise TraceFormatError(path, line, f"negative instance count {count}")
        if count > MAX_INSTANCE_COUNT:
            raise TraceFormatError(path, line, f"instance count {count} is above the limit of {MAX_INSTANCE_COUNT}")
        while len(stack) < count:
            created += 1
            node = f"{zone}-{created}"
            stack.append(node)
            builder.add(line, time_s, EventKind.ADD, node, zone)
        while len(stack) > count:
            builder.add(line, time_s, EventKind.REMOVE, stack.pop(), zone)


def _gcp_rows(path: Path) -> list[tuple[datetime.datetime, int, int]]:
    """A GCP count log's rows ``(time, line, count)``, sorted by time."""
    rows: list[tuple[datetime.datetime, int, int]] = []
    for number, raw in enumerate(_read_lines(path), start=1):
        if not raw.strip():
            continue
        parts = [p.strip() for p in raw.split(",")]
        if len(parts) != 3:
            raise TraceFormatError(path, number, f"expected 'YYYY-MM-DD, HH:MM:SS, N', got {raw!r}")
        try:
            when = datetime.datetime.strptime(f"{parts[0]} {parts[1]}", "%Y-%m-%d %H:%M:%S")
        except ValueError:
            raise TraceFormatError(path, number, f"bad date/time {parts[0]!r}, {parts[1]!r}") from None
        if not parts[2].isdigit():
            raise TraceFormatError(path, number, f"instance count {parts[2]!r} is not a whole number")
        rows.append((when, number, int(parts[2])))
    if not rows:
        raise TraceFormatError(path, None, "no rows")
    return sorted(rows, key=lambda r: (r[0], r[1]))


def _dated_counts(path: Path, rows: list[tuple[datetime.datetime, int, int]], zone: str,
                  start: datetime.datetime | None) -> Trace:
    """Count rows with dates as a trace whose time 0 is ``start`` (default: the earliest row)."""
    start = rows[0][0] if start is None else start
    samples = [(number, (when - start).total_seconds(), count) for when, number, count in rows]
    builder = _EventBuilder(path)
    _count_events(path, samples, zone, builder)
    return Trace.from_events(path.stem, builder.events, duration_s=samples[-1][1])


def load_gcp_counts(path: Path | str, zone: str | None = None) -> Trace:
    """Load a GCP count log (``YYYY-MM-DD, HH:MM:SS, N``); time 0 is the earliest row (in a folder of zones,
    :func:`load_trace_folder`, the earliest of all its dated rows). Zone defaults to the file stem."""
    path = Path(path)
    return _dated_counts(path, _gcp_rows(path), zone or path.stem, None)


def _whole_count(path: Path, line: int, text: str) -> int:
    try:
        value = float(text)
    except ValueError:
        raise TraceFormatError(path, line, f"instance count {text!r} is not a number") from None
    if not value.is_integer() or value < 0:
        raise TraceFormatError(path, line, f"instance count {text!r} is not a whole number >= 0")
    return int(value)


def load_count_curve(path: Path | str, time_unit_s: float | None = None, zone: str | None = None) -> Trace:
    """Load an AWS instance-count curve (``x,y`` rows, no header; the paper's early ``doc/data`` files).

    `x` is the time in units of `time_unit_s` seconds: by default hours (3600) for ``*_scaled``
    files and seconds (1) otherwise; pass 3600 for files already in hours. `y` is the count.
    """
    path = Path(path)
    unit = time_unit_s if time_unit_s is not None else (3600.0 if path.stem.endswith("_scaled") else 1.0)
    if not unit > 0:
        raise ValueError(f"time_unit_s must be > 0, got {time_unit_s!r}")
    zone = zone or path.stem
    samples: list[tuple[int, float, int]] = []
    previous = 0.0
    for number, raw in enumerate(_read_lines(path), start=1):
        if not raw.strip():
            continue
        parts = [p.strip() for p in raw.split(",")]
        if len(parts) != 2:
            raise TraceFormatError(path, number, f"expected 'time,count', got {raw!r}")
        try:
            when = float(parts[0]) * unit
        except ValueError:
            raise TraceFormatError(path, number, f"time {parts[0]!r} is not a number") from None
        if when < previous or when < 0:
            raise TraceFormatError(path, number, f"time {parts[0]} goes back before {previous / unit:g}")
        previous = when
        samples.append((number, when, _whole_count(path, number, parts[1])))
    if not samples:
        raise TraceFormatError(path, None, "no rows")
    builder = _EventBuilder(path)
    _count_events(path, samples, zone, builder)
    return Trace.from_events(path.stem, builder.events, duration_s=samples[-1][1])


_COUNT_HEADERS = ("timestamp,count", "time,count")


def _parse_timestamp(path: Path, line: int, text: str) -> datetime.datetime:
    for pattern in ("%Y-%m-%dT%H:%M:%SZ", "%Y-%m-%d %H:%M:%S", "%Y-%m-%dT%H:%M:%S"):
        try:
            return datetime.datetime.strptime(text, pattern)
        except ValueError:
            continue
    raise TraceFormatError(path, line, f"bad timestamp {text!r} (expected ISO 8601 or 'YYYY-MM-DD HH:MM:SS')")


def _count_csv_rows(path: Path) -> list[tuple[datetime.datetime, int, int]]:
    """A ``timestamp,count`` CSV's rows ``(time, line, count)``, sorted by time."""
    rows: list[tuple[datetime.datetime, int, int]] = []
    header_seen = False
    for number, raw in enumerate(_read_lines(path), start=1):
        text = raw.strip()
        if not text:
            continue
        if not header_seen:
            if text.replace(" ", "") not in _COUNT_HEADERS:
                raise TraceFormatError(path, number, f"expected a header {' or '.join(map(repr, _COUNT_HEADERS))}, got {raw!r}")
            header_seen = True
            continue
        parts = [p.strip() for p in text.split(",")]
        if len(parts) != 2:
            raise TraceFormatError(path, number, f"expected 'time,count', got {raw!r}")
        rows.append((_parse_timestamp(path, number, parts[0]), number, _whole_count(path, number, parts[1])))
    if not rows:
        raise TraceFormatError(path, None, "no rows")
    return sorted(rows, key=lambda r: (r[0], r[1]))


def load_count_csv(path: Path | str, zone: str | None = None) -> Trace:
    """Load an Auto Scaling Group count CSV (header ``timestamp,count`` or ``time,count``; ISO or ``YYYY-MM-DD HH:MM:SS`` times).

    The counts are instance totals (CloudWatch ``GroupInServiceInstances`` and the like); rows are
    sorted by time first. Time 0 is the earliest row; the zone defaults to the file stem.
    """
    path = Path(path)
    return _dated_counts(path, _count_csv_rows(path), zone or path.stem, None)


def load_skypilot_counts(paths: Sequence[Path | str] | Path | str) -> Trace:
    """Load one or more SkyPilot per-zone count JSON files into one trace (zone = file name up to ``_``)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ValueError("load_skypilot_counts needs at least one file")
    events: list[TraceEvent] = []
    duration = 0.0
    zones_seen: set[str] = set()
    for item in paths:
        path = Path(item)
        zone = path.stem.split("_", 1)[0]
        if zone in zones_seen:
            raise TraceFormatError(path, None, f"zone {zone!r} is loaded twice")
        zones_seen.add(zone)
        try:
            document = json.loads(_read_text(path))
        except json.JSONDecodeError as error:
            raise TraceFormatError(path, error.lineno, f"not JSON: {error.msg}") from None
        if not isinstance(document, dict) or "data" not in document:
            raise TraceFormatError(path, None, "expected an object with 'metadata.gap_seconds' and 'data'")
        metadata = document.get("metadata")
        if not isinstance(metadata, dict):
            raise TraceFormatError(path, None, f"'metadata' must be an object with 'gap_seconds', got {metadata!r}")
        gap = metadata.get("gap_seconds")
        if not isinstance(gap, (int, float)) or gap <= 0:
            raise TraceFormatError(path, None, f"metadata.gap_seconds must be a positive number, got {gap!r}")
        data = document["data"]
        if not isinstance(data, list) or not data:
            raise TraceFormatError(path, None, "'data' must be a non-empty list of counts")
        for index, count in enumerate(data):
            if not isinstance(count, int) or isinstance(count, bool):
                raise TraceFormatError(path, None, f"data[{index}] = {count!r} is not a whole number")
            if count < 0:
                raise TraceFormatError(path, None, f"data[{index}] = {count} is a negative instance count")
            if count > MAX_INSTANCE_COUNT:
                raise TraceFormatError(
                    path, None, f"data[{index}] = {count} is above the instance-count limit of {MAX_INSTANCE_COUNT}"
                )
        builder = _EventBuilder(path)
        # Every count was checked above, so the tick index never reaches an error message as a "line".
        _count_events(path, ((i, i * float(gap), c) for i, c in enumerate(data)), zone, builder)
        events.extend(builder.events)
        duration = max(duration, len(data) * float(gap))
    name = "+".join(Path(p).stem for p in paths)
    return Trace.from_events(name, events, duration_s=duration)


def load_generic_csv(path: Path | str) -> Trace:
    """Load our generic CSV (header ``time_s,event,node,zone``; ``# duration_s=...`` optional)."""
    path = Path(path)
    builder = _EventBuilder(path)
    duration: float | None = None
    header_seen = False
    previous = 0.0
    for number, raw in enumerate(_read_lines(path), start=1):
        text = raw.strip()
        if not text:
            continue
        if text.startswith("#"):
            match = re.fullmatch(r"#\s*duration_s\s*=\s*(\S+)", text)
            if match:
                try:
                    duration = float(match.group(1))
                except ValueError:
                    raise TraceFormatError(path, number, f"duration_s {match.group(1)!r} is not a number") from None
            continue
        if not header_seen:
            if text.replace(" ", "") != GENERIC_CSV_HEADER:
                raise TraceFormatError(path, number, f"expected header {GENERIC_CSV_HEADER!r}, got {raw!r}")
            header_seen = True
            continue
        parts = next(csv.reader([text]))
        if len(parts) != 4:
            raise TraceFormatError(path, number, f"expected 4 fields time_s,event,node,zone, got {len(parts)}: {raw!r}")
        time_text, event, node, zone = (p.strip() for p in parts)
        try:
            time_s = float(time_text)
        except ValueError:
            raise TraceFormatError(path, number, f"time {time_text!r} is not a number") from None
        if not time_s >= 0.0 or time_s == float("inf"):
            raise TraceFormatError(path, number, f"time {time_text!r} must be finite and >= 0")
        if time_s < previous:
            raise TraceFormatError(path, number, f"time {time_s:g} goes back before {previous:g}")
        previous = time_s
        if event not in ("add", "remove"):
            raise TraceFormatError(path, number, f"event {event!r} is neither 'add' nor 'remove'")
        if not node or not zone:
            raise TraceFormatError(path, number, "empty node or zone")
        builder.add(number, time_s, EventKind(event), node, zone)
    if not header_seen:
        raise TraceFormatError(path, None, f"no header {GENERIC_CSV_HEADER!r}")
    if duration is not None and duration < previous:
        raise TraceFormatError(path, None, f"duration_s={duration:g} is before the last event at {previous:g}")
    return Trace.from_events(path.stem, builder.events, duration_s=duration)


def write_generic_csv(trace: Trace, path: Path | str) -> None:
    """Write `trace` in the generic CSV format (loadable with `load_generic_csv`)."""
    lines = [f"# bamboo-bench generic trace: {trace.name}", f"# duration_s={trace.duration_s!r}", GENERIC_CSV_HEADER]
    lines.extend(f"{e.time_s!r},{e.kind.value},{e.node},{e.zone}" for e in trace.events())
    Path(path).write_text("\n".join(lines) + "\n", encoding="utf-8")


TRACE_SUFFIXES = (".json", ".txt", ".csv")
"""The files a folder of per-zone traces is read from (:func:`load_trace_folder`); others (a README) are skipped."""


def load_trace_folder(folder: Path | str) -> Trace:
    """The trace files directly in ``folder`` (:data:`TRACE_SUFFIXES`, sorted by name) as one trace of several zones,
    as SkyPilot and GCP publish them: a file per zone, all from the same start.

    SkyPilot's JSON files are read together (:func:`load_skypilot_counts`: the zone is the file name up to
    ``_``); any other file is read by :func:`load_trace` with its name (without the suffix) as the zone of formats
    that name none; a generic CSV keeps its own zones. The files with dates (GCP count logs, ``timestamp,count``
    CSVs) share one time 0, the earliest of their rows, so that zones that start later start later in the trace.
    The trace lasts as long as its longest file. A node that
    two files name is refused (:class:`TraceFormatError` names it and both files), as is a folder without trace
    files.
    """
    folder = Path(folder)
    files = sorted(item for item in folder.iterdir() if item.is_file() and item.suffix in TRACE_SUFFIXES)
    if not files:
        raise TraceFormatError(folder, None, f"a folder with no trace file in it (looked for {', '.join(TRACE_SUFFIXES)})")
    formats = {item: _format_of(item) for item in files}
    skypilot = [item for item in files if formats[item] == "skypilot"]
    traces = [(skypilot[0], load_skypilot_counts(skypilot))] if skypilot else []
    dated_rows = {"gcp": _gcp_rows, "count-csv": _count_csv_rows}
    dated = {item: dated_rows[formats[item]](item) for item in files if formats[item] in dated_rows}
    start = min((rows[0][0] for rows in dated.values()), default=None)  # dated zones share one time 0
    traces += [(item, _dated_counts(item, rows, item.stem, start)) for item, rows in dated.items()]
    traces += [(item, load_trace(item, item.stem)) for item in files if formats[item] not in ("skypilot", *dated_rows)]
    events: list[TraceEvent] = []
    owner: dict[str, Path] = {}
    for item, trace in traces:
        for node in trace.node_names:
            if owner.setdefault(node, item) != item:
                raise TraceFormatError(folder, None, f"node {node!r} is in both {owner[node].name} and {item.name}")
        events.extend(trace.events())
    return Trace.from_events(folder.name, events, duration_s=max(trace.duration_s for _, trace in traces))


def _format_of(path: Path) -> str:
    """Which format ``path`` holds: ``skypilot``, ``gcp``, ``generic``, ``ec2``, ``count-csv`` or ``count-curve``
    (by its suffix, then its first line that is not blank or a comment)."""
    if path.suffix == ".json":
        return "skypilot"
    if path.suffix == ".txt":
        return "gcp"
    for raw in _read_lines(path):
        text = raw.strip()
        if not text or text.startswith("#"):
            continue
        if text.replace(" ", "").startswith("time_s,"):
            return "generic"
        if _EC2_LINE.match(text):
            return "ec2"
        if text.replace(" ", "") in _COUNT_HEADERS:
            return "count-csv"
        if _COUNT_CURVE_LINE.match(text):
            return "count-curve"
        break
    raise TraceFormatError(
        path,
        None,
        "unknown trace format (expected the EC2 event CSV, an x,y count curve, a 'timestamp,count' or "
        f"'time,count' CSV, or a generic CSV with header {GENERIC_CSV_HEADER!r})",
    )


def load_trace(path: Path | str, zone: str | None = None) -> Trace:
    """Load any supported format, chosen by extension and first line.

    ``.json``: SkyPilot counts; ``.txt``: GCP count log; otherwise the first line decides: the EC2
    event CSV, a ``timestamp,count`` / ``time,count`` CSV, an ``x,y`` count curve (seconds, or hours
    for ``*_scaled`` files) or our generic CSV. A folder is one trace of several zones
    (:func:`load_trace_folder`).
    """
    path = Path(path)
    if path.is_dir():
        return load_trace_folder(path)
    if not path.is_file():
        raise TraceFormatError(path, None, "no such file")
    loaders: dict[str, Callable[[], Trace]] = {
        "skypilot": lambda: load_skypilot_counts([path]),
        "gcp": lambda: load_gcp_counts(path, zone),
        "generic": lambda: load_generic_csv(path),
        "ec2": lambda: load_ec2_events(path, zone or "ec2"),
        "count-csv": lambda: load_count_csv(path, zone),
        "count-curve": lambda: load_count_curve(path, zone=zone),
    }
    return loaders[_format_of(path)]()
