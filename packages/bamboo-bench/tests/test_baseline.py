"""The checkpoint/restart baseline: its pure parts (Young's rule, the trace's interruptions, the pipelines a
world trains, the torchrun command, pairing restarts with their interruptions) and one end-to-end run on
the emulated market (torchrun agents, DeepSpeed's PipelineEngine, a real SIGKILL, a restart from a checkpoint).
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest
from bamboo.bench.emulated.market import ActionKind, MarketAction
from bamboo.bench.measured.baseline import (
    BaselineSpec,
    CheckpointInterval,
    checkpoint_interval,
    peak_nodes,
    restart_costs,
    trace_interruptions,
    usable_pipelines,
)
from bamboo.bench.measured.torchrun import CheckpointRestartOptions, torchrun_command


def test_young_rule_gives_k_from_cost_mtbf_and_step_time() -> None:
    interval = checkpoint_interval(0.5, 900.0, 0.3, 10_000)
    assert interval.rule == "young"
    assert interval.period_s == pytest.approx(math.sqrt(2 * 0.5 * 900.0))  # 30 s
    assert interval.steps == 100  # 30 s / 0.3 s per step
    assert "K = 100 steps by Young's rule" in interval.describe()
    assert CheckpointInterval.from_dict(interval.to_dict()) == interval


def test_young_rule_rounds_and_clamps_to_the_run() -> None:
    assert checkpoint_interval(0.02, 6.0, 0.05, 300).steps == 10  # sqrt(0.24) = 0.49 s -> 9.8 steps
    assert checkpoint_interval(0.001, 0.1, 1.0, 300).steps == 1  # a period shorter than a step
    assert checkpoint_interval(1.0, 10_000.0, 0.01, 50).steps == 50  # longer than the run


def test_no_interruptions_means_one_checkpoint_per_run() -> None:
    interval = checkpoint_interval(0.2, None, 0.1, 40)
    assert (interval.steps, interval.rule, interval.period_s) == (40, "no interruptions", None)
    assert "no interruption" in interval.describe()


@pytest.mark.parametrize(
    ("cost", "mtbf", "step", "steps", "message"),
    [
        (0.0, 10.0, 0.1, 5, "checkpoint_cost_s must be a finite number > 0, got 0.0"),
        (0.1, -1.0, 0.1, 5, "mtbf_s must be a finite number > 0 or None, got -1.0"),
        (0.1, 10.0, math.inf, 5, "step_time_s must be a finite number > 0, got inf"),
        (0.1, 10.0, 0.1, 0, "max_steps must be an integer >= 1, got 0"),
    ],
)
def test_young_rule_refuses_bad_inputs(cost: float, mtbf: float, step: float, steps: int, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        checkpoint_interval(cost, mtbf, step, steps)


def test_interruptions_are_kills_and_later_additions_over_the_plan() -> None:
    plan = [MarketAction(0.0, ActionKind.ADD, f"n{i}", "a") for i in range(4)]
    plan += [MarketAction(10.0, ActionKind.KILL, "n1", "a"), MarketAction(12.0, ActionKind.ADD, "n5", "a"),
             MarketAction(30.0, ActionKind.KILL, "n2", "a")]
    interruptions = trace_interruptions(plan)
    assert (interruptions.kills, interruptions.joins, interruptions.span_s) == (2, 1, 30.0)
    assert interruptions.mtbf_s == 10.0
    assert trace_interruptions(plan[:4]).mtbf_s is None
    assert peak_nodes(plan) == 4  # n5 starts after n1 left
    assert peak_nodes([*plan, MarketAction(31.0, ActionKind.ADD, "n6", "a"), MarketAction(32.0, ActionKind.ADD, "n7", "a")]) == 5


@pytest.mark.parametrize(
    ("world", "pipelines", "micro_batches", "minimum", "expected"),
    [
        (4, 2, 4, 1, 2),  # all there
        (3, 2, 4, 1, 1),  # one node short: one pipeline of 8 microbatches, one node idle
        (7, 4, 5, 1, 2),  # 3 pipelines fit, but 20 microbatches split evenly only in 2 (or 4, 1)
        (9, 4, 4, 1, 4),  # more nodes than P x D: still D pipelines
    ],
)
def test_usable_pipelines_keep_the_global_batch(world: int, pipelines: int, micro_batches: int, minimum: int,
                                                expected: int) -> None:
    assert usable_pipelines(world, 2, pipelines, micro_batches, minimum) == expected


def test_usable_pipelines_refuse_a_world_below_the_minimum() -> None:
    with pytest.raises(ValueError, match="3 nodes cannot train 2 or more pipelines of 2 stages"):
        usable_pipelines(3, 2, 2, 4, 2)


def test_torchrun_command_is_an_elastic_agent_on_the_launchers_store() -> None:
    options = CheckpointRestartOptions(nodes=5, stages=2, pipelines=2, min_pipelines=1)
    command = torchrun_command(options, "job-1", 4321, 5)
    assert command[:3] == [sys.executable, "-m", "torch.distributed.run"]
    flags = {command[i]: command[i + 1] for i in range(3, len(command) - 2) if command[i].startswith("--")}
    assert flags["--nnodes"] == "2:5" and flags["--nproc-per-node"] == "1"
    assert flags["--rdzv-backend"] == "c10d" and flags["--rdzv-endpoint"] == "127.0.0.1:4321"
    conf = dict(item.split("=") for item in flags["--rdzv-conf"].split(","))
    assert conf["is_host"] == "0" and conf["last_call_timeout"] == "1"
    assert conf["keep_alive_interval"] == "1" and conf["keep_alive_max_attempt"] == "5"
    assert flags["--max-restarts"] == "1000" and flags["--monitor-interval"] == "0.1"
    assert command[-2:] == ["-m", "bamboo.bench.measured.baseline_worker"]
    waits = torchrun_command(CheckpointRestartOptions(nodes=4, stages=2, pipelines=2, min_pipelines=2), "j", 1, 4)
    assert waits[waits.index("--nnodes") + 1] == "4:4"
    with pytest.raises(ValueError, match="max_nodes 3 is fewer than the 4 nodes of 2 pipelines of 2 stages"):
        torchrun_command(options, "j", 1, 3)


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"nodes": 3}, "nodes 3 cannot hold 2 pipelines of 2 stages"),
        ({"min_pipelines": 3}, "min_pipelines 3 is more than pipelines 2"),
        ({"measure_steps": 1}, "measure_steps must be >= 2"),
        ({"checkpoint_every": 0}, "'checkpoint_every' must be > 0: 0"),
        ({"stages": 7, "nodes": 14}, "stages 7 is more than the example's 6 layers"),
    ],
)
def test_options_refuse_bad_values(changes: dict[str, int], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        CheckpointRestartOptions(**{"nodes": 4, "stages": 2, "pipelines": 2, **changes})


def test_spec_round_trips_through_json() -> None:
    spec = BaselineSpec(stages=2, pipelines=2, steps=9, size={"layers": 2}, seed=3, config={"a": 1},
                        run_dir="/r", events="/r/e", checkpoint_dir="/c", start_unix=5.0, mtbf_s=2.5)
    assert BaselineSpec.from_json(spec.to_json()) == spec


def _start(at: float, redone: int = 0) -> dict[str, float | int | str]:
    return {"process_start_unix": at, "imported_unix": at + 1, "group_unix": at + 1.1, "engine_unix": at + 2,
            "loaded_unix": at + 2.5, "load_s": 0.4, "loaded_step": 10, "redone_steps": redone,
            "first_step_start_unix": at + 2.6, "first_step_end_unix": at + 2.7, "world": 3, "pipelines": 1,
            "world_id": f"127.0.0.1:{int(at)}"}


def test_each_restart_is_counted_from_its_first_kill() -> None:
    starts = [_start(100.0), _start(120.0, redone=4), _start(150.0)]
    changes = [("join", "n5", 110.0), ("kill", "n1", 112.0), ("kill", "n2", 113.0), ("join", "n6", 140.0)]
    first, second = restart_costs(changes, starts)
    assert (first.cause, first.node, first.at_unix, first.redone_steps) == ("kill", "n1", 112.0, 4)
    assert first.absorbed == ("join n5", "kill n2")
    assert first.to_step_end_s == pytest.approx(10.7) and first.to_first_step_s == pytest.approx(10.6)
    assert first.phases()["rendezvous"] == pytest.approx(8.0) and first.phases()["load"] == pytest.approx(0.5)
    assert (second.cause, second.node, second.absorbed) == ("join", "n6", ())
    assert restart_costs([("kill", "n1", 200.0)], starts) == []  # no start after it: no restart to count


@pytest.mark.slow
def test_a_kill_restarts_every_worker_from_the_last_checkpoint(tmp_path: Path) -> None:
    """4 nodes, P=2, D=2; node1 is killed 0.3 s into training; the job drops to one pipeline of 8 microbatches
    (3 nodes, one idle), restarts from its newest checkpoint and finishes every step."""
    from bamboo.bench.measured.torchrun import run_checkpoint_restart
    from bamboo.bench.value import compute_report
    from bamboo.launch.events import Checkpoint, Preemption, Restore, Step, read_events

    trace = tmp_path / "trace.csv"
    trace.write_text("0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\n300,remove,node2\n")
    options = CheckpointRestartOptions(nodes=4, stages=2, pipelines=2, steps=40, zones=("a", "b", "c"),
                                       preemptions=str(trace), time_scale=1.0, run_dir=str(tmp_path / "run"),
                                       size={"layers": 2}, timeout_s=240.0)
    result = run_checkpoint_restart(options)
    assert not result.timed_out and result.steps_done == 40
    assert result.dropped_unix == {}  # torchrun kept every live agent in its rendezvous (its usual restarts)
    assert result.interval is not None and result.interval.rule == "young" and result.interval.mtbf_s == 0.3
    events = read_events(result.events)
    kill = next(e for e in events if isinstance(e, Preemption))
    assert kill.node == "node1"
    (restore,) = [e for e in events if isinstance(e, Restore)]
    # The newest checkpoint written before the restart: on a loaded machine the one that was being written when
    # the kill landed can still complete, and its record come after the kill's.
    written = [e.step for e in events if isinstance(e, Checkpoint) and e.t < restore.t]
    assert restore.step == max(written, default=0) and restore.t > kill.t
    assert restore.lost_stages == "0,1"
    steps = [e for e in events if isinstance(e, Step)]
    trained_before = max(e.step for e in steps if e.t < restore.t)  # nothing trains between kill and restore
    assert restore.discarded_steps == trained_before - restore.step
    assert sorted({e.step for e in steps}) == list(range(1, 41))
    assert {e.samples for e in steps} == {16}  # the global batch never changes: 2 samples x 4 x 2
    assert {e.nodes_active for e in steps if e.t > restore.t} == {2}  # one pipeline of 2 nodes after the kill
    first_again = next(e for e in steps if e.t > restore.t)
    original = next(e for e in steps if e.step == first_again.step)
    assert first_again.loss == pytest.approx(original.loss, rel=1e-4)  # trained from the checkpoint's state
    (restart,) = result.restarts
    assert (restart.cause, restart.node, restart.world, restart.pipelines) == ("kill", "node1", 3, 1)
    assert restart.redone_steps == restore.discarded_steps and restart.to_step_end_s > restart.to_first_step_s > 0
    report = compute_report(events)
    assert (report.steps, report.preemptions, report.restores) == (40, 1, 1)
    assert report.redone_steps == restore.discarded_steps and report.node_hours > 0 and report.value > 0
