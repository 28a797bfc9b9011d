"""End to end: every copy of a stage is lost, so the run restores the last good checkpoint and finishes.

The cluster is 5 nodes, P=3 stages, D=1 pipeline (2 nodes on standby), with eager redundancy: the
node of stage s also holds the replica of stage s+1. Killing the nodes of stages 0 and 1 together
(a consecutive pair) leaves stage 1 with no copy at all (its owner and its shadow, the owner of
stage 0, are gone), while the survivor (stage 2) still holds stages 2 and 0. At the barrier the
next layout takes the survivor and both standby nodes, finds stage 1 missing and names the newest
checkpoint whose shards of every stage verify; every node of the next generation, the survivor
included, loads that folder and training goes on from its step.

Exactness: the checkpoint of step c holds the exact state after c steps (parameters, optimizer,
scheduler and step counter of every stage), and steps c+1, c+2, ... are trained again on the same
global batches with the same pipeline grouping (D=1 throughout). So the final parameters equal a
fault-free single-process run of the same number of steps; the bound checked is the suite's 1e-6
relative, and the figure measured was 0.0 (bit-equal). The steps done between c and
the barrier are discarded and trained again (``restore.discarded_steps``; their ``step`` records
appear twice in the log, and the report counts them once).

The test also corrupts the newest checkpoint's shard of the lost stage right after the kills: the
restore logs a clear error naming the file and why, and falls back to the previous good step. (That the
restore takes the newest complete checkpoint when nothing is corrupt is
``packages/bamboo-launch/tests/test_restore_parts.py``'s, and the reconfigure-kill e2e restores one too.)
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.bench.emulated.run import RunHandles, RunOptions, compare_with_reference, run_cluster
from bamboo.bench.value import compute_report
from bamboo.launch.events import Checkpoint, Reconfiguration, Restore, Step, read_events

pytestmark = pytest.mark.timeout(240)

TOLERANCE = 1e-6
STAGES = 3
EVERY = 5


def _options(tmp_path: Path) -> RunOptions:
    return RunOptions(redundancy="eflb",
        nodes=5,
        stages=STAGES,
        pipelines=1,
        steps=300,  # an upper bound: the test asks the job to finish once the restore has trained on
        zones=("a", "b", "c"),
        time_scale=1.0,
        run_dir=str(tmp_path / "run"),
        checkpoint_dir=str(tmp_path / "checkpoints"),
        checkpoint_every=EVERY,
        memory_copy_every=0,  # no in-memory copies: this test is about the last resort, disk
        confirm_timeout_s=30.0,
        timeout_s=200.0,
        group_timeout_s=20.0,
        size={"layers": 2},
    )


def _committed(events: list[object], before: float | None = None) -> dict[int, set[int]]:
    """Step -> the stages whose checkpoint shard of that step was committed (before ``before``)."""
    shards: dict[int, set[int]] = {}
    for event in events:
        if isinstance(event, Checkpoint) and (before is None or event.t < before):
            stage = int(Path(event.path).name.split(".")[0].removeprefix("stage-"))
            shards.setdefault(event.step, set()).add(stage)
    return shards


def _kill_stages_0_and_1(
    handles: RunHandles, after_complete_step: int, corrupt: dict[str, object] | None
) -> None:
    """Once checkpoint ``after_complete_step`` has every stage and two more steps are done, kill the
    nodes of stages 0 and 1 together (so, most likely, a few steps after the checkpoint are lost).

    With ``corrupt``, then flip bytes in the newest committed shard of stage 1 (its writer is dead,
    so no newer one can appear) and record which step that was.
    """
    deadline = time.monotonic() + 120.0
    while True:
        events = read_events(handles.events)
        done = max((e.step for e in events if isinstance(e, Step)), default=0)
        if done >= after_complete_step + 2 and _committed(events).get(after_complete_step) == set(
            range(STAGES)
        ):
            break
        assert time.monotonic() < deadline, f"checkpoint {after_complete_step} never had every stage"
        time.sleep(0.02)
    for rank in (0, 1):
        handles.preempt(handles.node_of_rank[rank])
    if corrupt is None:
        return
    checkpoints = Path(corrupt["dir"])  # type: ignore[arg-type]
    newest = max(
        int(folder.name.removeprefix("step-"))
        for folder in checkpoints.glob("step-*")
        if (folder / "stage-1.manifest.json").exists()
    )
    shard = checkpoints / f"step-{newest:09d}" / "stage-1.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    corrupt["step"] = newest
    corrupt["file"] = str(shard)


def _check_restored_run(tmp_path: Path, corrupt: bool, finish_when: Callable[..., None],
                        assert_preempted: Callable[..., None]) -> tuple[Restore, dict[str, object]]:
    options = _options(tmp_path)
    corrupted: dict[str, object] | None = {"dir": options.checkpoint_dir} if corrupt else None
    killed: list[str] = []

    def chaos(handles: RunHandles) -> None:
        killed.extend(handles.node_of_rank[rank] for rank in (0, 1))
        _kill_stages_0_and_1(handles, 2 * EVERY, corrupted)
        finish_when(handles, lambda events: any(isinstance(e, Restore) for e in events))

    result = run_cluster(options, during=chaos)
    events = read_events(result.events)
    assert not result.timed_out
    assert_preempted(events, set(killed))
    restores = [e for e in events if isinstance(e, Restore)]
    assert len(restores) == 1, restores
    restore = restores[0]
    reconfigurations = [e for e in events if isinstance(e, Reconfiguration)]
    assert [(r.reason, r.pipelines, r.standby, r.bytes_moved) for r in reconfigurations] == [
        ("consecutive failure", 1, 0, 0)
    ]
    assert restore.lost_stages == "1"
    # The newest step whose every shard was committed (and, here, not corrupted) before the restore.
    complete = {
        step for step, stages in _committed(events, before=restore.t).items() if stages == set(range(STAGES))
    }
    if corrupted is not None:
        assert restore.step < int(corrupted["step"])  # type: ignore[call-overload]
        complete.discard(int(corrupted["step"]))  # type: ignore[call-overload]
    assert restore.step == max(complete) and restore.step >= EVERY
    assert Path(restore.path).name == f"step-{restore.step:09d}"
    # The steps done after the checkpoint were trained again: exactly their step records appear twice.
    numbers = [e.step for e in events if isinstance(e, Step)]
    twice = sorted(n for n in set(numbers) if numbers.count(n) == 2)
    assert twice == list(range(restore.step + 1, restore.step + restore.discarded_steps + 1))
    # Each step record names the generation that trained it: a step trained again, a later one.
    first_generation: dict[int, int] = {}
    for record in (e for e in events if isinstance(e, Step)):
        assert record.generation is not None
        if record.step in first_generation:
            assert record.generation > first_generation[record.step], record
        else:
            first_generation[record.step] = record.generation
    final = result.steps_done
    assert restore.step + restore.discarded_steps < final < options.steps  # finished where the test asked
    assert sorted(set(numbers)) == list(range(1, final + 1))
    assert len(numbers) == final + restore.discarded_steps
    report = compute_report(events)
    assert report.restores == 1 and report.consecutive_failures == 1 and report.steps == final
    assert report.redone_steps == len(numbers) - final
    assert sorted(result.reports) == [0, 1, 2]
    comparison = compare_with_reference(result, options)
    assert comparison["history"] == [[0, 1], [restore.step, 1]]
    assert comparison["steps"] == final
    assert comparison["max_relative_diff"] <= TOLERANCE
    return restore, {"run_dir": result.run_dir, "corrupted": corrupted}


def test_a_corrupt_newest_checkpoint_is_reported_and_the_previous_good_one_restored(
    tmp_path: Path, finish_when: Callable[..., None],
    assert_preempted: Callable[..., None],
) -> None:
    restore, found = _check_restored_run(tmp_path, corrupt=True, finish_when=finish_when,
                                         assert_preempted=assert_preempted)
    corrupted = found["corrupted"]
    assert isinstance(corrupted, dict)
    assert f"step-{restore.step:09d}" not in str(corrupted["file"])
    assert restore.discarded_steps >= EVERY  # at least the corrupt checkpoint's steps were trained again
    logs = "".join(
        path.read_text(errors="replace") for path in (Path(found["run_dir"]) / "logs").glob("*.log")
    )  # type: ignore[arg-type]
    assert f"skipping bad checkpoint: checkpoint shard {corrupted['file']}: sha256" in logs
    assert "(corrupt)" in logs
