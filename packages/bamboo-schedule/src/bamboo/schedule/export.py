"""Drawing schedules: a text grid (for terminals and error messages) and Chrome trace JSON (Perfetto).

`text_grid(streams, marks)` prints one row per node, one column per stream position, and marks the
given cells as ``>>2F5<<``. `time_grid(schedule, timeline)` prints the compute instructions at
their simulated times, the classic pipeline picture. `chrome_trace(schedule, timeline)` gives the
`traceEvents` JSON that chrome://tracing and ui.perfetto.dev open: one track per node, with an
arrow from every send to its receive.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from typing import Any

from bamboo.schedule.engine import Timeline, counterpart
from bamboo.schedule.ir import COMPUTE_KINDS, Instruction, Kind, Schedule

__all__ = ["chrome_trace", "text_grid", "time_grid"]

_MARK_OPEN, _MARK_CLOSE = ">>", "<<"


def text_grid(
    streams: Mapping[int, Sequence[Instruction]],
    marks: Collection[tuple[int, int]] = (),
    split: Mapping[int, int] | None = None,
) -> str:
    """All streams, one row per node; cells in ``marks`` (node, index) are shown as ``>>cell<<``.

    ``split[node]`` draws a ``|`` before that index (used to show where a failure struck).
    """
    marked = set(marks)
    texts = {
        n: [
            (_MARK_OPEN + str(i) + _MARK_CLOSE) if (n, j) in marked else str(i)
            for j, i in enumerate(stream)
        ]
        for n, stream in streams.items()
    }
    width = max((len(t) for row in texts.values() for t in row), default=1)
    label = max((len(str(n)) for n in streams), default=1)
    lines = [" " * (label + 7) + " ".join(f"{j:<{width}}" for j in range(max(map(len, texts.values()), default=0)))]
    for n, row in texts.items():
        cells = []
        for j, text in enumerate(row):
            cells.append(("|" if split and split.get(n) == j else "") + f"{text:<{width}}")
        lines.append(f"node {n:>{label}} | " + " ".join(cells))
    return "\n".join(lines)


def time_grid(schedule: Schedule, timeline: Timeline, slot: float | None = None) -> str:
    """Compute instructions (F, B, FR, BR) at their simulated start times, one row per node.

    Each column is ``slot`` time units wide (default: the shortest compute duration); an empty slot
    is ``.``, which is the bubble.
    """
    durations = [
        timeline.end[n][i] - timeline.start[n][i]
        for n, stream in schedule.streams.items()
        for i, instr in enumerate(stream)
        if instr.kind in COMPUTE_KINDS and timeline.end[n][i] > timeline.start[n][i]
    ]
    if slot is None:
        slot = min(durations, default=1.0)
    columns = max(1, round(timeline.makespan / slot))
    if columns > 400:
        slot = timeline.makespan / 400
        columns = 400
    rows = []
    cell_width = max((len(str(i)) for s in schedule.streams.values() for i in s if i.kind in COMPUTE_KINDS), default=3)
    for n, stream in schedule.streams.items():
        row = ["." * cell_width] * columns
        for i, instr in enumerate(stream):
            if instr.kind not in COMPUTE_KINDS:
                continue
            first = min(columns - 1, int(timeline.start[n][i] / slot + 1e-9))
            last = max(first, min(columns - 1, int(timeline.end[n][i] / slot - 1e-9)))
            for c in range(first, last + 1):
                row[c] = f"{instr!s:<{cell_width}}"
        rows.append(f"node {n:>2} | " + " ".join(row))
    return "\n".join(rows)


def _category(instr: Instruction) -> str:
    if instr.kind in COMPUTE_KINDS:
        return "compute"
    if instr.kind in (Kind.SWAP_OUT, Kind.SWAP_IN):
        return "swap"
    if instr.is_comm:
        return "p2p"
    return "step"


def chrome_trace(schedule: Schedule, timeline: Timeline, time_unit_us: float = 1000.0) -> dict[str, Any]:
    """Chrome trace JSON: a complete event ("ph": "X") per instruction, one thread per node.

    Timeline units are multiplied by ``time_unit_us`` to give microseconds (default: units are ms).
    """
    events: list[dict[str, Any]] = []
    for n in schedule.streams:
        events.append({"name": "thread_name", "ph": "M", "pid": 0, "tid": n, "args": {"name": f"node {n}"}})
    for n, stream in schedule.streams.items():
        for i, instr in enumerate(stream):
            events.append(
                {
                    "name": str(instr),
                    "cat": _category(instr),
                    "ph": "X",
                    "pid": 0,
                    "tid": n,
                    "ts": timeline.start[n][i] * time_unit_us,
                    "dur": (timeline.end[n][i] - timeline.start[n][i]) * time_unit_us,
                    "args": {
                        "kind": instr.kind.name,
                        "stage": instr.stage,
                        "microbatch": instr.microbatch,
                        "peer": instr.peer,
                        "index": i,
                    },
                }
            )
    # flow arrows from each send to its receive (Perfetto draws them between the two tracks)
    received = {(n, instr): i for n, stream in schedule.streams.items() for i, instr in enumerate(stream)
                if instr.is_comm and not instr.is_send}
    flow = 0
    for n, stream in schedule.streams.items():
        for i, send in enumerate(stream):
            if not send.is_send:
                continue
            assert send.peer is not None
            j = received.get((send.peer, counterpart(send, n)))
            if j is None:
                continue
            flow += 1
            start_ts, end_ts = timeline.end[n][i] * time_unit_us, timeline.end[send.peer][j] * time_unit_us
            events.append({"name": str(send), "cat": "message", "ph": "s", "id": flow, "pid": 0, "tid": n,
                           "ts": start_ts})
            events.append({"name": str(send), "cat": "message", "ph": "f", "bp": "e", "id": flow, "pid": 0,
                           "tid": send.peer, "ts": end_ts})
    return {"traceEvents": events, "displayTimeUnit": "ms"}
