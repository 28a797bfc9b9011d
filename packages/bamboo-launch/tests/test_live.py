"""Tests of the live progress view: incremental reading, the folded state, rendering, the CLI."""

from __future__ import annotations

import io
import json
import sys
import threading
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from bamboo.launch.cli import main
from bamboo.launch.events import (
    Checkpoint,
    Event,
    EventLog,
    EventLogError,
    Failover,
    Join,
    Preemption,
    Reconfiguration,
    Restore,
    RunEnd,
    RunStart,
    Step,
)
from bamboo.launch.live import EventFollower, LiveState, LiveView, ProgressLines, describe_event, render_live
from rich.console import Console

if TYPE_CHECKING:
    from conftest import FakeClock


def run_events() -> list:
    return [
        RunStart(t=0.0, job="live", unix_time=0.0, target_nodes=4, stages=2, pipelines=2),
        *(Join(t=0.0, node=f"n{i}", zone="ab"[i % 2]) for i in range(4)),
        Step(t=2.0, step=0, samples=8, loss=2.5, nodes_active=4, duration_s=2.0),
        Step(t=4.0, step=1, samples=8, loss=2.0, nodes_active=4, duration_s=2.0),
        Preemption(t=4.5, node="n3", zone="b", notice_s=1.0),
        Failover(t=4.6, victim="n3", shadow="n2", stage=1, pause_s=0.4),
        Step(t=7.0, step=2, samples=8, loss=1.5, nodes_active=3, duration_s=3.0),
        Join(t=7.5, node="n4", zone="b"),
        Join(t=7.6, node="n5", zone="a"),
        Reconfiguration(
            t=8.0, reason="join", pipelines=2, stages=2, standby=1, bytes_moved=3 * 2**20, duration_s=0.5
        ),
        Checkpoint(t=9.0, step=2, path="/ck/step-2", bytes=2**20, duration_s=0.1),
    ]


def test_state_folds_the_run() -> None:
    state = LiveState(window=2, history=3)
    state.apply_all(run_events())
    summary = state.summary()
    assert summary["step"] == 2 and summary["loss"] == 1.5
    assert summary["samples_per_second"] == pytest.approx(16 / 5.0)  # steps 1 and 2: from t=2 to t=7
    assert summary["nodes_alive"] == 5 and summary["nodes_active"] == 3 and summary["standby"] == 1
    assert summary["joining"] == 1
    assert (summary["preemptions"], summary["failovers"], summary["reconfigurations"], summary["checkpoints"]) == (
        1, 1, 1, 1,
    )  # fmt: skip
    assert len(summary["recent"]) == 3
    assert "reconfigure   join: D=2 P=2, 1 standby, 3.0 MiB; pause 0.50s" in summary["recent"][1]
    assert describe_event(Preemption(t=4.5, node="n3", zone="b", reason="lease expired")).endswith(
        "preemption    n3 in b (lease expired)")  # how the loss was confirmed, where the detector confirmed it
    assert not summary["finished"]
    state.apply(RunEnd(t=10.0, steps=3))
    assert state.finished and state.now == 10.0


def test_before_any_reconfiguration_the_first_layout_s_spare_nodes_are_on_standby_and_later_ones_join() -> None:
    """Five nodes for two pipelines of two stages: the fifth is the first layout's standby node, not a joining
    one (the live view said "4 active, 0 standby, 1 joining" through a run without reconfigurations); a node
    that joins later waits for the next reconfiguration; a lost node of the layout leaves the standby one there."""
    state = LiveState()
    state.apply_all([RunStart(t=0.0, job="live", unix_time=0.0, target_nodes=5, stages=2, pipelines=2),
                     *(Join(t=0.0, node=f"n{i}", zone="ab"[i % 2]) for i in range(5))])
    assert (state.standby, state.joining) == (0, 5)  # no layout trains yet
    state.apply(Step(t=2.0, step=0, samples=8, loss=2.5, nodes_active=4, duration_s=2.0))
    assert (state.nodes_active, state.standby, state.joining) == (4, 1, 0)
    state.apply(Join(t=3.0, node="n5", zone="a"))
    assert (state.standby, state.joining) == (1, 1)
    state.apply_all([Preemption(t=4.0, node="n0", zone="a", notice_s=0.0),
                     Step(t=5.0, step=1, samples=8, loss=2.0, nodes_active=3, duration_s=2.0)])
    assert (state.nodes_active, state.standby, state.joining) == (3, 1, 1)


def test_a_restore_is_counted_and_described() -> None:
    state = LiveState(history=2)
    state.apply_all(run_events())
    assert state.summary()["restores"] == 0
    state.apply(Restore(t=9.5, step=2, path="/ck/step-2", lost_stages="0,1", discarded_steps=1))
    summary = state.summary()
    assert summary["restores"] == 1 and summary["checkpoints"] == 1
    assert "restore       step 2 from disk (every live copy of stage 0,1 lost), 1 steps trained again" in (
        summary["recent"][-1]
    )
    console = Console(record=True, width=120)
    console.print(render_live(state))
    assert "checkpoints 1 (1 restored)" in console.export_text()


def test_follower_reads_only_whole_records(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    follower = EventFollower(path)
    assert follower.poll() == []  # not written yet
    line = json.dumps({"kind": "join", "t": 1.0, "node": "n0", "zone": "a"}) + "\n"
    with open(path, "w") as handle:
        handle.write(line[:10])
        handle.flush()
        assert follower.poll() == []
        handle.write(line[10:] + line[:5])
        handle.flush()
        assert follower.poll() == [Join(t=1.0, node="n0", zone="a")]
        handle.write(line[5:])
        handle.flush()
        assert follower.poll() == [Join(t=1.0, node="n0", zone="a")]
        assert follower.poll() == []
        handle.write('{"kind":"join","t":2}\n')
        handle.flush()
    with pytest.raises(
        EventLogError, match=r"events.jsonl:3: join record is missing keys \['node', 'zone'\]"
    ):
        follower.poll()


def test_render_shows_the_numbers() -> None:
    state = LiveState()
    state.apply_all(run_events())
    console = Console(record=True, width=120)
    console.print(render_live(state))
    text = console.export_text()
    for expected in ("step 2", "loss 1.5000", "active 3", "standby 1", "joining 1", "alive 5/4",
                     "preemptions 1", "failover      n3 -> n2 (stage 1), pause 0.40s"):  # fmt: skip
        assert expected in text, (expected, text)


def test_the_header_s_columns_line_up_and_its_labels_are_bold() -> None:
    state = LiveState()
    state.apply_all(run_events())
    console = Console(record=True, width=120)
    console.print(render_live(state))
    lines = console.export_text().splitlines()
    header = lines[1:4]  # under the panel's top border
    columns = [[line.index(word) for word in words]
               for line, words in zip(header, (("loss", "samples/s"), ("standby", "joining"),
                                               ("failovers", "reconfigurations")), strict=True)]
    assert columns[0] == columns[1] == columns[2], "\n".join(header)
    console = Console(record=True, width=120, force_terminal=True)
    console.print(render_live(state))
    assert "\x1b[1mstep\x1b[0m" in console.export_text(styles=True)


def test_the_live_view_redraws_when_records_arrive_at_most_once_per_interval(fake_clock: FakeClock) -> None:
    arrived: list[list[Event]] = []
    console = Console(record=True, width=120)
    with LiveView(lambda: arrived.pop() if arrived else [], console, redraw_s=1.0, clock=fake_clock) as view:
        assert view.draws == 1  # the empty view, when it opens
        assert not view.update() and view.draws == 1  # nothing new: nothing drawn
        fake_clock.advance(1.0)
        for step in range(5):  # five records in half a second: one redraw, then the rest waits for the interval
            arrived.append([Step(t=float(step), step=step, samples=8, loss=1.0, nodes_active=2, duration_s=0.1)])
            assert view.update()
            fake_clock.advance(0.1)
        assert view.draws == 2 and view.state.step == 4
        fake_clock.advance(0.5)
        assert not view.update() and view.draws == 3  # the records of the interval, drawn once it is over
        assert not view.update() and view.draws == 3
        arrived.append([Step(t=5.0, step=5, samples=8, loss=0.5, nodes_active=2, duration_s=0.1)])
        view.update()
        assert view.draws == 3  # within the interval: drawn when the view closes
    assert view.draws == 4
    assert "step 5" in console.export_text()


def test_watch_once_json(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.write_all(run_events())
    assert main(["watch", str(path), "--once", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["job"] == "live" and summary["step"] == 2 and summary["joining"] == 1


def test_watch_follows_until_the_run_ends(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "events.jsonl"
    with EventLog(path) as log:
        log.write_all([*run_events(), RunEnd(t=12.0, steps=3)])
    assert main(["watch", str(path), "--interval", "0.05"]) == 0
    assert "finished" in capsys.readouterr().out


def test_watch_says_it_waits_for_a_log_that_does_not_exist_yet_and_follows_it_once_written(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "later.jsonl"
    said: list[str] = []
    waiting = threading.Event()

    class Err(io.StringIO):  # the watch's stderr: the log is written once the watch said that it waits
        def write(self, text: str) -> int:
            said.append(text)
            if "waiting for" in text:
                waiting.set()
            return len(text)

    def write() -> None:
        waiting.wait(30)
        with EventLog(path) as log:
            log.write_all([*run_events(), RunEnd(t=12.0, steps=3)])

    monkeypatch.setattr(sys, "stderr", Err())
    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert main(["watch", str(path), "--interval", "0.05"]) == 0
    finally:
        waiting.set()
        writer.join()
    assert f"waiting for {path} to appear" in "".join(said) and "finished" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["watch", "missing.jsonl", "--once"], "cannot read missing.jsonl"),
        (["watch", "x.jsonl", "--json"], "--json needs --once"),
        (["watch", "x.jsonl", "--window", "0"], "argument --window: '0' must be >= 1"),
    ],
)
def test_watch_errors(capsys: pytest.CaptureFixture[str], args: list[str], message: str) -> None:
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_progress_lines_every_n_steps() -> None:
    state, lines, printed = LiveState(), ProgressLines(every=2), []
    assert lines.line(state) is None  # no step yet
    for step in range(7):
        state.apply(Step(t=float(step + 1), step=step, samples=8, loss=1.0 / (step + 1), nodes_active=4,
                         duration_s=1.0))
        line = lines.line(state)
        if line is not None:
            printed.append(line)
    assert [line.split()[1] for line in printed] == ["0", "2", "4", "6"]
    assert printed[1].startswith("step 2  loss 0.3333  samples/s 8.0") and "nodes 4 active" in printed[1]
    with pytest.raises(ValueError, match="every"):
        ProgressLines(every=0)
