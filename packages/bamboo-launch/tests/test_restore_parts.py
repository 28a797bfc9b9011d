"""Tests of the checkpoint-restore parts of a reconfiguration: the restore point, the slices, the record, the report.

The whole path, with real kills, is in tests/e2e/test_restore_e2e.py.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bamboo.bench.value import compute_report, format_report
from bamboo.launch.events import (
    EventLog,
    Reconfiguration,
    Restore,
    RunStart,
    Step,
    event_from_dict,
    read_events,
)
from bamboo.launch.pauses import PauseBreakdown
from bamboo.launch.reconfigure import next_history, restore_point, restore_slices, stage_shards
from bamboo.launch.worker_records import write_reconfiguration
from bamboo.rc.checkpoint_files import CheckpointError, write_checkpoint
from bamboo.reconfig import JobLayout, LayerSpec, Layout, RestorePoint, StartMode


def _shard(payload: bytes) -> dict[str, torch.Tensor]:
    return {"state": torch.frombuffer(bytearray(payload), dtype=torch.uint8)}


def _write_steps(directory: Path, steps: list[int], stages: int = 3) -> None:
    for step in steps:
        for stage in range(stages):
            write_checkpoint(
                directory, step, _shard(f"stage {stage} at step {step}".encode()), f"stage-{stage}"
            )


class FakeSlice:
    """Stands for bamboo-rc's TrainableSlice: records the state it was given."""

    def __init__(self) -> None:
        self.loaded: bytes | None = None

    def load_state_bytes(self, data: bytes) -> None:
        self.loaded = data


def test_restore_point_is_the_newest_step_with_every_stage(tmp_path: Path) -> None:
    _write_steps(tmp_path, [5, 10])
    write_checkpoint(tmp_path, 15, _shard(b"only stage 0 got this far"), "stage-0")  # the others died first
    assert restore_point(str(tmp_path), 3, [1]) == (10, str(tmp_path / "step-000000010"))


def test_restore_point_skips_a_corrupt_shard_and_says_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    _write_steps(tmp_path, [5, 10])
    shard = tmp_path / "step-000000010" / "stage-1.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert restore_point(str(tmp_path), 3, [1]) == (5, str(tmp_path / "step-000000005"))
    err = capsys.readouterr().err
    assert f"bamboo-launch restore: error: skipping bad checkpoint: checkpoint shard {shard}: sha256" in err
    assert "(corrupt)" in err


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (None, "every copy of stage(s) 1,2 is gone and the run writes no checkpoints (--checkpoint-dir)"),
        (
            "empty",
            "every copy of stage(s) 1,2 is gone and no checkpoint can replace them: no usable checkpoint",
        ),
    ],
)
def test_restore_point_without_a_good_checkpoint_is_a_clear_error(
    tmp_path: Path, make: str | None, message: str
) -> None:
    directory = str(tmp_path) if make else None
    with pytest.raises(RuntimeError) as caught:
        restore_point(directory, 3, [2, 1])
    assert message in str(caught.value)


def _layout(start_step: int, checkpoint: str | None = None, lost: tuple[int, ...] = (1,),
            barrier_step: int | None = None) -> JobLayout:
    """A P=3 layout of one pipeline, restarting from ``checkpoint`` (or moving state from peers)."""
    plan = Layout(stages=3, layers=[LayerSpec(4, 8, 1.0)] * 3, stage_layers=((0, 1), (1, 2), (2, 3)),
                  owners=[["a", "b", "c"]], microbatches=(4,))
    restore = None if checkpoint is None else RestorePoint(start_step, checkpoint, lost)
    return JobLayout(generation=1, plan=plan, start_step=start_step,
                     mode=StartMode.PEERS if checkpoint is None else StartMode.CHECKPOINT, restore=restore,
                     barrier_step=start_step if barrier_step is None else barrier_step,
                     history=[(0, 1), (start_step, 1)])


def test_restore_slices_loads_the_named_step_for_every_slice(tmp_path: Path) -> None:
    _write_steps(tmp_path, [5, 10])
    slices = {2: FakeSlice(), 0: FakeSlice()}
    layout = _layout(5, str(tmp_path / "step-000000005"))
    assert restore_slices(layout, slices) == 5
    assert slices[0].loaded == b"stage 0 at step 5" and slices[2].loaded == b"stage 2 at step 5"
    assert stage_shards(slices) == ["stage-0", "stage-2"]


def test_restore_slices_refuses_a_shard_that_no_longer_verifies(tmp_path: Path) -> None:
    _write_steps(tmp_path, [5])
    (tmp_path / "step-000000005" / "stage-2.pt").write_bytes(b"truncated")
    with pytest.raises(CheckpointError, match=r"stage-2\.pt has 9 bytes"):
        restore_slices(_layout(5, str(tmp_path / "step-000000005")), {2: FakeSlice()})


def test_next_history_cuts_the_abandoned_generations() -> None:
    assert next_history([[0, 2]], 40, 1) == [(0, 2), (40, 1)]
    assert next_history([[0, 2], [15, 1], [30, 2]], 20, 1) == [(0, 2), (15, 1), (20, 1)]
    assert next_history([[0, 2], [15, 1]], 15, 2) == [(0, 2), (15, 2)]  # a generation that ran no step


def test_restore_record_round_trip_and_validation(tmp_path: Path) -> None:
    path = tmp_path / "events.jsonl"
    pause = PauseBreakdown(total_s=2.5, nodes_s=0.0, decide_s=0.5, barrier_s=1.0, transfers_s=0.75, group_builds_s=0.25,
                           first_step_s=0.0)
    with EventLog(path) as log:
        write_reconfiguration(log, _layout(7), pause, stages=3, prepared=False, restore_source=None)  # no restore
        write_reconfiguration(log, _layout(10, "/ck/step-000000010", (1, 2), barrier_step=13), pause, stages=3,
                              prepared=False, restore_source="disk")
    first, second, record = read_events(path)
    assert isinstance(first, Reconfiguration) and isinstance(second, Reconfiguration)
    assert (first.duration_s, first.decide_s, first.barrier_s, first.transfers_s, first.group_builds_s) == (
        2.5, 0.5, 1.0, 0.75, 0.25)
    assert isinstance(record, Restore)
    assert (record.step, record.path, record.lost_stages, record.discarded_steps, record.source, record.duration_s) == (
        10,
        "/ck/step-000000010",
        "1,2",
        3,
        "disk",
        2.5,
    )
    with pytest.raises(ValueError, match="lost_stages must be stage numbers separated by commas"):
        event_from_dict(
            {"kind": "restore", "t": 1.0, "step": 1, "path": "p", "lost_stages": "one", "discarded_steps": 0}
        )


def test_report_counts_a_step_trained_again_once() -> None:
    events = [RunStart(t=0.0, job="r", unix_time=1.7e9, target_nodes=5, stages=3, pipelines=1)]
    events += [
        Step(t=float(k), step=k, samples=8, loss=1.0, nodes_active=3, duration_s=1.0) for k in range(1, 14)
    ]
    events += [
        Reconfiguration(
            t=20.0,
            reason="consecutive failure",
            pipelines=1,
            stages=3,
            standby=0,
            bytes_moved=0,
            duration_s=5.0,
        ),
        Restore(t=20.0, step=10, path="/ck/step-000000010", lost_stages="1", discarded_steps=3),
    ]
    events += [
        Step(t=10.0 + k, step=k, samples=8, loss=0.5, nodes_active=3, duration_s=1.0) for k in range(11, 21)
    ]
    report = compute_report(events)
    assert report.steps == 20 and report.samples == 160 and report.redone_steps == 3
    assert report.throughput == pytest.approx(160 / 30.0)
    assert report.restores == 1 and report.consecutive_failures == 1
    text = format_report(report)
    assert (
        "1 after a consecutive failure" in text
        and "restores         1 (0 from a peer's memory, the rest from disk; max pause 5.000 s; 3 steps trained again)"
        in text
    )
    assert report.restore_max_s == 5.0 and report.reconfiguration_pause_p50_s is None  # the one pause was a restore
