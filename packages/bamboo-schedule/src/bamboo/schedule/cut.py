"""Consistent cuts: how far each node had got when a failure struck, and whether the prefixes pair up.

`progress_at` places the failure moment on a timeline of the schedule (by default the unit-cost
execution) and counts each node's completed instructions; `cut_problem` says why a set of completed
prefixes is not a consistent cut (a message received but never sent). A message sent and not yet received is
in flight: its receive was posted ahead (`bamboo.schedule.engine.received_ahead`). `failover_schedule` and
`validate_failover` both check the cut with it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bamboo.schedule._gc import gc_paused
from bamboo.schedule.engine import (
    ExecutionError,
    StageTable,
    Timeline,
    check_execution,
    counterpart,
    execute,
    received_ahead,
)
from bamboo.schedule.ir import COMM_KINDS, Instruction, Kind, Schedule

__all__ = ["cut_problem", "progress_at"]


@gc_paused
def progress_at(
    schedule: Schedule,
    failures: Mapping[int, int],
    timeline: Timeline | None = None,
) -> dict[int, int]:
    """A consistent cut: how many instructions each node had completed when ``failures`` struck.

    ``failures[v] = i`` means stage v fails just before its instruction ``i``. All victims fail at
    the same moment: the earliest of those start times on ``timeline`` (default: the unit-cost
    execution). A node has completed an instruction if it started before that moment and ended by
    it; a send and its receive share their times, so the cut never splits a message.
    """
    if timeline is None:
        unit = {kind: [0.0 if kind in COMM_KINDS else 1.0] * schedule.stages for kind in Kind}
        timeline = execute(schedule.streams, StageTable(unit, lambda _n, i: 0.0 if i.is_comm else 1.0))
    moments = []
    for v, index in failures.items():
        if v not in schedule.streams:
            raise ValueError(f"stage {v} has no stream in this schedule")
        length = len(schedule.streams[v])
        if not 0 <= index <= length:
            raise ValueError(f"failure index {index} for stage {v} out of range 0..{length}")
        if index < length:
            moments.append(timeline.start[v][index])
        else:  # after its last instruction (a victim with nothing left to do fails at once)
            moments.append(timeline.end[v][-1] + 1.0 if length else 0.0)
    moment = min(moments)
    progress = {}
    for n, stream in schedule.streams.items():
        done = 0
        while done < len(stream) and timeline.start[n][done] < moment and timeline.end[n][done] <= moment:
            done += 1
        progress[n] = done
    for v, index in failures.items():
        progress[v] = min(progress[v], index)
    return progress


def cut_problem(executed: Mapping[int, Sequence[Instruction]], receives_ahead: bool = True) -> str | None:
    """Why the completed prefixes are not a consistent cut (a message received but never sent), or None.

    Messages with nodes whose progress is unknown (victims without an entry) are left out. With
    ``receives_ahead`` (`RCMode.receives_ahead`), a send may complete into its receiver's next activation or
    gradient receive, posted ahead: the cut holds such messages in flight (`received_ahead`), and a message
    received within the prefixes may have been sent before its receiver got there.
    """
    # (sender, send) of each message in flight: left out of the prefixes, as a receive posted ahead took it
    in_flight = {(receive.peer, counterpart(receive, m)) for m, receive in received_ahead(executed)
                 } if receives_ahead else set()
    prefixes = {
        n: tuple(i for i in s if (i.peer is None or i.peer in executed) and not (in_flight and (n, i) in in_flight))
        for n, s in executed.items()
    }
    try:
        check_execution(prefixes, receives_ahead=receives_ahead)
    except ExecutionError as error:
        return str(error)
    return None
