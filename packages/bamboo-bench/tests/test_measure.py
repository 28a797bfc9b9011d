"""bamboo.bench.measured.measure on hand-built event logs: each constant of a measured profile, computed by hand.

The profile it writes is loaded by ``bamboo.bench.load_profile`` (the format's own validation) and keeps
the measured values.
"""

from __future__ import annotations

import json

import pytest
from bamboo.bench.measured.baseline import RestartCost
from bamboo.bench.measured.measure import measure_events, measured_profile, step_time_measured
from bamboo.bench.measured.options import MeasureError, MeasureOptions
from bamboo.bench.profile import load_profile
from bamboo.launch.events import Checkpoint, Failover, Join, Preemption, Reconfiguration, RunStart, Step

UNIX = 1_000_000.0


def _steps(times: list[float], nodes: int = 4, first: int = 1) -> list[Step]:
    return [Step(t=t, step=first + i, samples=8, loss=1.0, nodes_active=nodes, duration_s=0.1)
            for i, t in enumerate(times)]


def _bamboo_events() -> list:
    """Start at 0, first step ends at 2.0 (start-up 1.9); steps every 0.1 s; a kill at 2.55 whose failover
    stretches step 6's interval (2.5 -> 2.8: 0.2 s extra), one slower step after it (0.15 s), and the
    reconfiguration in the next interval (2.95 -> 3.45: 0.4 s extra); then 0.1 s steps. A node joins at 3.0."""
    times = [2.0, 2.1, 2.2, 2.3, 2.4, 2.5, 2.8, 2.95, 3.45, 3.55, 3.65, 3.75]
    events: list = [RunStart(t=0.0, job="j", unix_time=UNIX, target_nodes=4, stages=2, pipelines=2)]
    events += _steps(times)
    events += [
        Preemption(t=2.55, node="node3", zone="a"),
        Failover(t=2.8, victim="node3", shadow="node2", stage=1, pause_s=0.2, step_end_unix=UNIX + 2.8),
        Join(t=3.0, node="node9", zone="b"),
        Reconfiguration(t=3.2, reason="rebuild", pipelines=2, stages=2, standby=0, bytes_moved=1, duration_s=0.4),
    ]
    return events


def test_bamboo_constants_by_hand() -> None:
    measured = measure_events(_bamboo_events(), "bamboo", warm_unix={"node9": UNIX + 4.5}, checkpoint_every=20)
    assert measured.startup_s == pytest.approx(1.9)
    assert measured.market_start_s == pytest.approx(2.0)
    # Clean intervals: the 4 from 2.1 to 2.5 (the first, 2.0->2.1, is the warm-up) and the 3 from 3.45 to 3.75.
    assert measured.step_time_s == {2: pytest.approx(0.1)}
    assert measured.step_intervals == {2: 7}
    assert measured.failover_pause_s == pytest.approx(0.2)
    assert measured.fallback_slowdown == pytest.approx(1.5)
    assert measured.reconfiguration_s == pytest.approx(0.4)
    assert measured.rebuild_delay_s == pytest.approx(3.2 - 2.55)  # the kill to the reconfiguration's record
    assert measured.instance_creation_s == pytest.approx(1.5)
    assert measured.steps == 12 and measured.samples == 96
    assert measured.counts["failovers"] == 1 and measured.counts["joins"] == 1


def test_bamboo_profile_loads_with_the_measured_values(tmp_path) -> None:
    measured = measure_events(_bamboo_events(), "bamboo", warm_unix={"node9": UNIX + 4.5}, checkpoint_every=20)
    document = measured_profile(measured, name="measured-bamboo", spot_price=1.0, on_demand_price=3.0).to_dict()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    profile = load_profile(path)
    assert profile.step_time_s(2) == pytest.approx(0.1)
    assert profile.step_time_s(1) == pytest.approx(0.1)  # not trained: the nearest measured count
    assert profile.timing.failover_pause_s == pytest.approx(0.2)
    assert profile.timing.reconfiguration_s == pytest.approx(0.4)
    assert profile.timing.rebuild_delay_s == pytest.approx(0.65)
    assert profile.timing.startup_s == pytest.approx(1.9)
    assert profile.timing.checkpoint_interval_s == pytest.approx(20 * 0.1)
    assert profile.on_demand_samples_per_second == pytest.approx(80.0)
    assert any("fallback_slowdown: 1.500 measured" in note for note in profile.notes)


def _restart(cause: str, node: str, to_first_step_s: float) -> RestartCost:
    at = UNIX + 1.0
    return RestartCost(cause=cause, node=node, at_unix=at, process_start_unix=at + 1, imported_unix=at + 2,
                       group_unix=at + 3, engine_unix=at + 4, loaded_unix=at + 4, load_s=0.0, loaded_step=1,
                       redone_steps=1, first_step_start_unix=at + to_first_step_s,
                       first_step_end_unix=at + to_first_step_s + 0.1, world=4, pipelines=2)


def test_checkpoint_restarts_and_checkpoint_cost(tmp_path) -> None:
    """Checkpoint intervals cost 0.3 s more; a kill's restart 5 s, a join's 7 s (so instance creation 2 s)."""
    times = [1.0, 1.1, 1.2, 1.3, 1.7, 1.8, 1.9, 2.0]
    events: list = [RunStart(t=0.0, job="j", unix_time=UNIX, target_nodes=4, stages=2, pipelines=2)]
    events += _steps(times)
    events.append(Checkpoint(t=1.5, step=4, path="c", bytes=1, duration_s=0.3))
    restarts = [_restart("kill", "node1", 5.0), _restart("join", "node5", 7.0)]
    measured = measure_events(events, "checkpoint", restarts=restarts, checkpoint_every=3)
    assert measured.checkpoint_s == pytest.approx(0.3)
    document = measured_profile(measured, name="measured-checkpoint", spot_price=1.0, on_demand_price=3.0).to_dict()
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    profile = load_profile(path)
    assert profile.timing.restart_s == pytest.approx(5.0)
    assert profile.timing.instance_creation_s == pytest.approx(2.0)
    assert profile.timing.checkpoint_s == pytest.approx(0.3)
    assert profile.timing.checkpoint_interval_s == pytest.approx(3 * 0.1 + 0.3)
    assert document["checkpoint_restart_on_join"] == "every-join"


def test_on_demand_s_rate_pays_its_checkpoints_and_checkpoint_restart_s_reference_does_not() -> None:
    """0.1 s steps, 8 samples each, and a checkpoint every 3 steps that costs 0.3 s: bamboo-launch's on-demand run
    trains 24 samples per 0.6 s (40/s), not 80/s; the checkpoint/restart baseline's on-demand reference is
    its clean step (its checkpoints are DeepSpeed's, not what on-demand runs)."""
    times = [1.0, 1.1, 1.2, 1.3, 1.7, 1.8, 1.9, 2.0]
    events: list = [RunStart(t=0.0, job="j", unix_time=UNIX, target_nodes=4, stages=2, pipelines=2)]
    events += [*_steps(times), Checkpoint(t=1.5, step=4, path="c", bytes=1, duration_s=0.3)]
    rates = {}
    for system in ("on-demand", "bamboo", "checkpoint"):
        measured = measure_events(events, system, checkpoint_every=3)
        profile = measured_profile(measured, name=system, spot_price=1.0, on_demand_price=3.0)
        rates[system] = profile.on_demand_samples_per_second
    assert rates == {"on-demand": pytest.approx(40.0), "bamboo": pytest.approx(40.0), "checkpoint": pytest.approx(80.0)}
    unchecked = events[:1] + _steps([1.0 + 0.1 * i for i in range(8)])
    without = measured_profile(measure_events(unchecked, "on-demand", checkpoint_every=3), name="o", spot_price=1.0,
                               on_demand_price=3.0)
    assert without.on_demand_samples_per_second == pytest.approx(80.0)  # no checkpoint measured: nothing to pay


def test_a_restart_counts_from_the_last_interruption_before_its_workers_started(tmp_path) -> None:
    """Killed at 1.5, another kill at 3.0 and a join at 5.0 before the workers' process start (at 6.0, first
    step at 9.0): the restart took the join's; a kill at 7.0, after the start, did not restart it."""
    times = [1.0, 1.1, 1.2, 1.3, 9.1, 9.2, 9.3, 9.4]
    events: list = [RunStart(t=0.0, job="j", unix_time=UNIX, target_nodes=4, stages=2, pipelines=2)]
    events += _steps(times)
    events += [Preemption(t=1.5, node="node1", zone="a"), Preemption(t=3.0, node="node2", zone="a"),
               Join(t=5.0, node="node5", zone="b"), Preemption(t=7.0, node="node5", zone="b")]
    at = UNIX + 1.5
    restart = RestartCost(cause="kill", node="node1", at_unix=at, process_start_unix=UNIX + 6.0,
                          imported_unix=UNIX + 7.0, group_unix=UNIX + 7.5, engine_unix=UNIX + 8.5,
                          loaded_unix=UNIX + 8.9, load_s=0.1, loaded_step=1, redone_steps=3,
                          first_step_start_unix=UNIX + 9.0, first_step_end_unix=UNIX + 9.1, world=3, pipelines=1)
    measured = measure_events(events, "checkpoint", restarts=[restart], checkpoint_every=3)
    assert measured.restart_s is None
    assert measured.join_restart_s == pytest.approx(4.0)  # 9.0 - 5.0, not 7.5 from the first kill
    document = measured_profile(measured, name="measured-checkpoint", spot_price=1.0, on_demand_price=3.0).to_dict()
    assert document["timing"]["restart_s"] == pytest.approx(4.0)
    assert document["timing"]["instance_creation_s"] == 0.0
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(document))
    assert load_profile(path).timing.restart_s == pytest.approx(4.0)


def test_too_few_steps_is_a_clear_error() -> None:
    events = [RunStart(t=0.0, job="j", unix_time=UNIX, target_nodes=4, stages=2, pipelines=2), *_steps([1.0, 1.1])]
    with pytest.raises(MeasureError, match="trained 2 step"):
        measure_events(events, "bamboo")


def test_options_errors_name_the_values() -> None:
    with pytest.raises(ValueError, match="--nodes 1 is too few for one pipeline of 2 stages"):
        MeasureOptions(system="bamboo", nodes=1, stages=2, pipelines=1, run_dir="r", steps=5)
    with pytest.raises(ValueError, match="--steps S or --duration SECONDS"):
        MeasureOptions(system="bamboo", nodes=4, stages=2, pipelines=1, run_dir="r")
    with pytest.raises(ValueError, match="system"):
        MeasureOptions(system="spot", nodes=4, stages=2, pipelines=1, run_dir="r", steps=5)


def _skypilot_like_log() -> tuple[list, list[RestartCost], dict[str, float]]:
    """The shape of a checkpoint/restart run on the SkyPilot trace, by hand: 4 nodes train from 2.0 (0.1 s steps,
    one pipeline of 2 stages each); node2 and node3 are killed at 3.0 and the restart reaches its first step at
    13.0; node5, added at 5.0, dies at 9.0 and node6, added at 14.0, dies at 24.0, both before their agents
    entered the rendezvous; node7, added at 15.0, entered at 23.0 and restarted the job (first step at 29.0).
    The start's agents entered 7.0 and 9.0 s after the run's start."""
    events: list = [RunStart(t=0.0, job="j", unix_time=UNIX, target_nodes=4, stages=2, pipelines=2)]
    events += [Join(t=0.0, node=f"node{i}", zone="a") for i in range(4)]
    events += _steps([2.0 + 0.1 * i for i in range(10)], nodes=4)
    events += [Preemption(t=3.0, node="node2", zone="a"), Preemption(t=3.0, node="node3", zone="a"),
               Join(t=5.0, node="node5", zone="b"), Preemption(t=9.0, node="node5", zone="b"),
               Join(t=14.0, node="node6", zone="b"), Join(t=15.0, node="node7", zone="b"),
               Preemption(t=24.0, node="node6", zone="b")]
    events += _steps([13.0 + 0.1 * i for i in range(5)], nodes=2, first=10)
    events += _steps([29.0 + 0.1 * i for i in range(5)], nodes=4, first=12)

    def restart(process_start: float, first_step: float) -> RestartCost:
        return RestartCost(cause="kill", node="node2", at_unix=UNIX + 3.0, process_start_unix=UNIX + process_start,
                           imported_unix=UNIX + process_start + 1, group_unix=UNIX + process_start + 2,
                           engine_unix=UNIX + process_start + 3, loaded_unix=UNIX + process_start + 3, load_s=0.1,
                           loaded_step=10, redone_steps=0, first_step_start_unix=UNIX + first_step,
                           first_step_end_unix=UNIX + first_step + 0.1, world=2, pipelines=1)

    registered = {"node0": UNIX + 7.0, "node1": UNIX + 9.0, "node2": UNIX + 7.0, "node3": UNIX + 9.0,
                  "node7": UNIX + 23.0}
    return events, [restart(8.0, 13.0), restart(25.0, 29.0)], registered


def test_checkpoint_joins_interrupt_when_their_agent_enters_the_rendezvous() -> None:
    """A join interrupts the job when its agent enters the rendezvous (node7: 8 s after its join), not at the
    join: node5 joined during the restart and died before its agent entered, so that restart took 10 s from the
    kill (3.0 -> 13.0), not 8 s from node5's join; node7's took 6 s from its entry (23.0 -> 29.0)."""
    events, restarts, registered = _skypilot_like_log()
    measured = measure_events(events, "checkpoint", warm_unix=registered, restarts=restarts, checkpoint_every=3)
    assert measured.instance_creation_s == pytest.approx(8.0)
    assert measured.restart_s == pytest.approx(10.0)
    assert measured.join_restart_s == pytest.approx(6.0)
    assert measured.counts["joins_ready"] == 1 and measured.counts["joins"] == 3
    timing = measured_profile(measured, name="m", spot_price=1.0, on_demand_price=3.0).timing
    assert timing.instance_creation_s == pytest.approx(8.0)
    assert timing.restart_s == pytest.approx(8.0)  # the mean of both restarts, each from when it took effect


def test_checkpoint_without_a_later_entry_takes_the_start_agents_entries() -> None:
    """No node added later entered the rendezvous: the agents of the start (7 s and 9 s after it) give the
    delay, not 0 (which would make every join restart the job at once)."""
    events, restarts, registered = _skypilot_like_log()
    del registered["node7"]
    measured = measure_events(events, "checkpoint", warm_unix=registered, restarts=restarts[:1], checkpoint_every=3)
    assert measured.instance_creation_s == pytest.approx(8.0)
    assert measured.restart_s == pytest.approx(10.0)
    profile = measured_profile(measured, name="m", spot_price=1.0, on_demand_price=3.0)
    assert profile.timing.instance_creation_s == pytest.approx(8.0)
    assert any("the nodes of the start" in note for note in profile.notes)


def test_a_step_time_needs_three_steps_and_a_clean_interval_after_the_warm_up() -> None:
    """The log of a measured run whose window ended too soon on a loaded machine: two steps, a kill between the
    second and the third, and the reconfiguration after it: three steps, and still no step time."""
    start = RunStart(t=0.0, job="j", unix_time=UNIX, target_nodes=4, stages=2, pipelines=2)
    first_two = [start, *_steps([27.2, 29.3])]
    assert not step_time_measured(first_two, "bamboo")
    killed = [*first_two, Preemption(t=30.9, node="node3", zone="b"), *_steps([34.2], nodes=2, first=3),
              Reconfiguration(t=34.3, reason="failure", pipelines=1, stages=2, standby=1, bytes_moved=0, duration_s=1.8)]
    assert not step_time_measured(killed, "bamboo")
    with pytest.raises(MeasureError, match="no interval between two steps was free of failovers"):
        measure_events(killed, "bamboo")
    assert step_time_measured([*killed, *_steps([35.3, 36.4], nodes=2, first=4)], "bamboo")
    assert step_time_measured([start, *_steps([2.0, 2.1, 2.2])], "checkpoint")


def test_a_duration_that_ends_without_a_step_time_goes_on_until_the_run_has_one() -> None:
    """``--duration`` over before the log gives a step time (a busy machine): the run goes on, reading its log,
    and stops once it does; cancelled meanwhile (the run ended), it does not stop it."""
    from bamboo.bench import timeouts
    from bamboo.bench.measured.run import _Stopper

    said: list[str] = []
    slept: list[float] = []
    answers = iter([False, False, False, True])
    stopper = _Stopper(4.0, said.append, sleep=lambda seconds: slept.append(seconds) is not None)
    assert stopper.wait(lambda: next(answers))
    assert slept == [4.0, *[timeouts.MEASURE_STEP_POLL_S] * 3]
    assert said == ["4 s since the first step and no step time yet (it needs 3 steps at least, and an interval "
                    "between two of them after the first step's warm-up free of failovers, reconfigurations, "
                    "restarts and checkpoints): going on until the run has one"]
    assert stopper.stopping() == "4 s since the first step and a step time measured: stopping every node"

    said.clear()
    on_time = _Stopper(4.0, said.append, sleep=lambda seconds: False)
    assert on_time.wait(lambda: True)
    assert said == []  # a step time at the deadline: nothing to say
    assert on_time.stopping() == "4 s since the first step: stopping every node"
    cancels = iter([False, True])
    assert not _Stopper(4.0, said.append, sleep=lambda seconds: next(cancels)).wait(lambda: False)
    assert not _Stopper(None, said.append).wait(lambda: False)  # --steps: no deadline


def test_a_run_that_chose_its_restore_points_is_modelled_with_their_measured_spacing() -> None:
    from bamboo.bench.measured.run import restore_spacing

    def records(generation: int, every: int, steps: range) -> list[Step]:
        return [Step(t=float(n), step=n, samples=8, loss=1.0, nodes_active=4, duration_s=0.1, generation=generation,
                     restore_point=n % every == 0) for n in steps]

    # generation 0 took one every 30 steps, generation 1 every 12 (a rewritten record counts once)
    events = [*records(0, 30, range(1, 100)), *records(1, 12, range(100, 180)), *records(1, 12, range(108, 109))]
    gaps = [30, 30, 12, 12, 12, 12, 12]
    assert restore_spacing(events) == 12 == sorted(gaps)[len(gaps) // 2]
    assert restore_spacing(records(0, 50, range(1, 80))) is None  # one restore point: no spacing
    assert restore_spacing([]) is None
    assert MeasureOptions(system="bamboo", nodes=4, stages=2, pipelines=2, run_dir="r",
                          duration_s=1.0).checkpoint_every == "auto"
    with pytest.raises(ValueError, match="checkpoint_every"):
        MeasureOptions(system="bamboo", nodes=4, stages=2, pipelines=2, run_dir="r", duration_s=1.0,
                       checkpoint_every=0)
