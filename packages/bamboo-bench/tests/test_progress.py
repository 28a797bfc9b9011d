"""Where a measured run's training stands at the end of its window (bamboo.bench.measured.progress)."""

from __future__ import annotations

import pytest
from bamboo.bench.measured.compare import window_figures
from bamboo.bench.measured.progress import Progress, progress_at_end
from bamboo.launch.events import Checkpoint, Event, Join, Preemption, Restore, RunStart, Step

UNIX = 1_000_000.0
SAMPLES = 16


def _steps(first: int, last: int, begin: float, step_s: float = 0.5) -> list[Event]:
    """Steps ``first`` to ``last``, one every ``step_s`` from ``begin`` (each record at its end)."""
    return [Step(t=begin + (i + 1) * step_s, step=step, samples=SAMPLES, loss=1.0, nodes_active=8,
                 duration_s=step_s) for i, step in enumerate(range(first, last + 1))]


def _checkpoints(every: int, last: int, begin: float, step_s: float = 0.5) -> list[Event]:
    """A checkpoint committed right after every ``every``-th step up to ``last`` (steps timed as `_steps`)."""
    return [Checkpoint(t=begin + step * step_s + 0.01, step=step, path=f"ckpt/{step}", bytes=1, duration_s=0.01)
            for step in range(every, last + 1, every)]


def _checkpoint_run() -> list[Event]:
    """Checkpoint/restart: 29 steps from t=10 (t=10.5 to 24.5), a checkpoint every 6 steps (6 to 24)."""
    start = RunStart(t=0.0, job="j", unix_time=UNIX, target_nodes=8, stages=4, pipelines=2)
    joins = [Join(t=0.0, node=f"n{i}", zone="a") for i in range(8)]
    return [start, *joins, *_steps(1, 29, 10.0), *_checkpoints(6, 29, 10.0)]


def test_a_window_that_ends_while_checkpoint_restart_restarts_stands_at_its_last_checkpoint() -> None:
    """Killed after step 29, not restarted when the window ends: steps 25 to 29 are lost (as the simulator
    rolls back at the kill), so the run has 24 steps to show, not 29."""
    events = [*_checkpoint_run(), Preemption(t=25.0, node="n7", zone="a")]
    progress = progress_at_end(events, restarts_at_interruptions=True)
    assert progress == Progress(step=24, samples=24 * SAMPLES, discarded_steps=5, discarded_s=pytest.approx(2.5))


def test_a_restart_that_trains_the_lost_steps_again_stands_at_the_step_it_trains() -> None:
    """Restarted from step 24 and at step 27 when the window ends: 27 steps, not the 29 it once reached."""
    restore = Restore(t=40.0, step=24, path="ckpt/24", lost_stages="0,1,2,3", discarded_steps=5)
    events = [*_checkpoint_run(), Preemption(t=25.0, node="n7", zone="a"), restore, *_steps(25, 27, 40.0)]
    progress = progress_at_end(events, restarts_at_interruptions=True)
    assert (progress.step, progress.samples, progress.discarded_steps) == (27, 27 * SAMPLES, 2)


def test_a_restart_that_caught_up_keeps_every_step() -> None:
    events = [*_checkpoint_run(), Preemption(t=25.0, node="n7", zone="a"), *_steps(25, 40, 40.0)]
    assert progress_at_end(events, restarts_at_interruptions=True) == Progress(step=40, samples=40 * SAMPLES)


def test_only_interruptions_of_the_job_roll_checkpoint_restart_back() -> None:
    """A node killed before its agent entered the rendezvous was never part of the job; one that entered after
    the last step interrupted it (a join restarts every worker)."""
    entered = {f"n{i}": UNIX for i in range(8)}
    killed_outside = [*_checkpoint_run(), Join(t=20.0, node="n8", zone="b"), Preemption(t=25.0, node="n8", zone="b")]
    assert progress_at_end(killed_outside, restarts_at_interruptions=True, registered_unix=entered).step == 29
    joined = [*_checkpoint_run(), Join(t=20.0, node="n8", zone="b")]
    assert progress_at_end(joined, restarts_at_interruptions=True,
                           registered_unix={**entered, "n8": UNIX + 26.0}).step == 24


def test_a_kill_bamboo_fails_over_loses_nothing_and_a_restore_rolls_it_back() -> None:
    killed = [*_checkpoint_run(), Preemption(t=25.0, node="n7", zone="a")]
    assert progress_at_end(killed, restarts_at_interruptions=False).step == 29
    restored = [*killed, Restore(t=25.5, step=24, path="ckpt/24", lost_stages="2", discarded_steps=5)]
    assert progress_at_end(restored, restarts_at_interruptions=False).step == 24


def test_the_window_counts_the_samples_training_kept_and_the_lost_steps_as_lost_time() -> None:
    """The report's 29 steps (464 samples) until 25 s; the window is 10 + 30 s; 24 steps kept, 2.5 s lost more."""
    report = {"training_s": 25.0, "samples": 29 * SAMPLES, "lost_s": 10.5}
    progress = {"samples": 24 * SAMPLES, "discarded_s": 2.5}
    window, throughput, lost = window_figures(report, 10.0, 30.0, progress)
    assert (window, throughput, lost) == (40.0, pytest.approx(24 * SAMPLES / 40.0), pytest.approx(28.0))
    assert window_figures(report, 10.0, 30.0)[1] == pytest.approx(29 * SAMPLES / 40.0)  # without: the report's
