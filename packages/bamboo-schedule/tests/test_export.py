"""Exports: the text grids and the Chrome trace (one track per node, an arrow per message)."""

from __future__ import annotations

import json

from bamboo.schedule import chrome_trace, one_f_one_b, simulate, text_grid, time_grid


def test_chrome_trace_has_every_instruction_and_a_flow_per_message() -> None:
    schedule = one_f_one_b(4, 3, "efeb")
    trace = chrome_trace(schedule, simulate(schedule).timeline)
    json.dumps(trace)  # serialisable
    events = trace["traceEvents"]
    spans = [e for e in events if e["ph"] == "X"]
    assert len(spans) == len(schedule)
    sends = [str(i) for s in schedule.streams.values() for i in s if i.is_send]
    starts = [e["name"] for e in events if e["ph"] == "s"]
    assert sorted(starts) == sorted(sends)
    assert {e["tid"] for e in spans} == {0, 1, 2, 3}
    assert all(e["dur"] >= 0 for e in spans)


def test_text_grid_marks_cells_and_splits() -> None:
    schedule = one_f_one_b(2, 1)
    grid = text_grid(schedule.streams, [(1, 0)], {0: 2})
    lines = grid.splitlines()
    assert lines[2].startswith("node 1 | >>1RA0<0<<")
    assert "|0SA0>1" in lines[1]


def test_time_grid_draws_bubbles_as_dots() -> None:
    schedule = one_f_one_b(3, 2)
    grid = time_grid(schedule, simulate(schedule).timeline)
    rows = grid.splitlines()
    assert len(rows) == 3
    assert rows[2].split("|")[1].strip().startswith(".")  # the last stage waits at the start
    assert "2F0" in rows[2] and "0B1" in rows[0]
