"""End to end: pure data parallelism (P = 1) with redundancy in `bamboo-launch run`, and a kill.

3 nodes (P=1, D=3, lazy redundancy, a checkpoint every 5 steps): once training runs, the test SIGKILLs the
node of pipeline 0, the node that wrote the steps and checkpoints. Its ring successor (pipeline 1's node)
computes the lost microbatches from ``microbatch(step, index)`` and
contributes them to the step's all-reduce, so the step commits with the whole global batch; at the next
step boundary the job reconfigures to 2 pipelines with the global batch kept, and the first live node
goes on writing the steps and checkpoints. The result must be bit-equal (0.0) to a fault-free
single-process run of the same batches. The run is then resumed from its last checkpoint for 5 more
steps (the checkpoint was written by the 2-pipeline layout; the resumed run has 3 pipelines again),
bit-equal as well.

The other tests: a node with a preemption notice hands its share over at a step boundary (no failover), and
losing every working node at once restarts the job on standby nodes from the newest checkpoint.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from pathlib import Path

import attrs
import pytest
from bamboo.bench.emulated.run import RunHandles, RunOptions, compare_with_reference, run_cluster
from bamboo.launch.events import Checkpoint, Failover, Preemption, Reconfiguration, Restore, Step, read_events

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]


def test_a_killed_data_parallel_node_s_shadow_takes_its_share_and_the_run_is_exact(
    tmp_path: Path, assert_preempted: Callable[..., None],
) -> None:
    killed: list[str] = []

    def kill_pipeline_0(handles: RunHandles) -> None:
        deadline = time.monotonic() + 120.0
        while max((e.step for e in read_events(handles.events) if isinstance(e, Step)), default=0) < 5:
            assert time.monotonic() < deadline, "training never reached step 5"
            time.sleep(0.02)
        node = handles.node_of_rank[0]
        handles.cluster.kill(node)
        killed.append(node)

    options = RunOptions(nodes=3, stages=1, pipelines=3, steps=20, zones=("a", "b", "c"), time_scale=1.0,
                         redundancy="lflb", run_dir=str(tmp_path / "run"), timeout_s=200.0, group_timeout_s=20.0,
                         checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_every=5, size={"layers": 2})
    result = run_cluster(options, during=kill_pipeline_0)
    events = read_events(result.events)
    assert len(killed) == 1 and not result.timed_out, result
    assert_preempted(events, set(killed))
    failovers = [e for e in events if isinstance(e, Failover)]
    assert [f.victim for f in failovers] == killed, failovers
    assert failovers[0].shadow == result.node_of_rank[1]  # the ring successor
    assert any(e.pipelines == 2 for e in events if isinstance(e, Reconfiguration)), events
    assert result.steps_done == 20
    assert max(e.step for e in events if isinstance(e, Step)) == 20  # a survivor took the steps over
    assert {e.step for e in events if isinstance(e, Checkpoint)} >= {10, 15, 20}
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == 20
    assert comparison["max_relative_diff"] == 0.0, comparison

    resumed_options = attrs.evolve(options, steps=25, resume=True, run_dir=str(tmp_path / "resumed"))
    resumed = run_cluster(resumed_options)
    steps = sorted(e.step for e in read_events(resumed.events) if isinstance(e, Step))
    assert steps == list(range(21, 26)) and resumed.steps_done == 25, steps
    comparison = compare_with_reference(resumed, resumed_options)
    assert comparison["steps"] == 25
    assert comparison["max_relative_diff"] == 0.0, comparison


def test_a_data_parallel_node_with_notice_hands_its_share_over_at_a_step_boundary(
    tmp_path: Path, write_trace: Callable[[int, list[tuple[int, str, str]]], str],
    finish_when: Callable[..., None],
) -> None:
    """The trace removes node1 (pipeline 1) with 3 s of notice: it hands its share over to its ring
    successor after a step and leaves, no failover; the job goes on with 2 pipelines, exact."""
    trace = write_trace(3, [(4000, "remove", "node2")])  # trace node2 is the launcher's node1
    options = RunOptions(nodes=3, stages=1, pipelines=3, steps=600, zones=("a", "b", "c"), time_scale=1.0,
                         redundancy="eflb", preemptions=trace, notice_s=3.0, run_dir=str(tmp_path / "run"),
                         timeout_s=200.0, size={"layers": 2})
    # once the job trains on 2 pipelines, it is asked to finish (`bamboo-launch finish`)
    result = run_cluster(options, during=lambda handles: finish_when(handles, lambda events: any(
        isinstance(e, Reconfiguration) and e.pipelines == 2 for e in events)))
    events = read_events(result.events)
    assert not [e for e in events if isinstance(e, Failover)], "a notice of 3 s must not end in a failover"
    [left] = [e for e in events if isinstance(e, Preemption)]
    assert left.node == "node1" and left.notice_s > 0.5, left
    assert any(e.pipelines == 2 for e in events if isinstance(e, Reconfiguration)), events
    # which pipeline node1 runs is the zone-aware ring's choice (consecutive pipelines in different zones)
    log = (result.run_dir / "logs" / "node1.log").read_text()
    assert re.search(r"handed stage 0 of pipeline \d over to its shadow", log), log
    assert not result.timed_out and result.steps_done < 600
    comparison = compare_with_reference(result, options)
    assert comparison["steps"] == result.steps_done
    assert comparison["max_relative_diff"] == 0.0, comparison


def test_every_data_parallel_node_lost_restores_the_last_checkpoint_on_standby_nodes(
    tmp_path: Path, finish_when: Callable[..., None],
    assert_preempted: Callable[..., None],
) -> None:
    """4 nodes, P=1, D=2 (2 on standby), a checkpoint every 5 steps: once checkpoint 10 is written and two
    more steps are done, both working nodes are killed together. No node holds the model any more, so the
    coordinator restarts on the standby nodes from the newest checkpoint; the steps done after it are trained
    again (the restore record counts them), and the result is bit-equal to a fault-free run."""
    options = RunOptions(nodes=4, stages=1, pipelines=2, steps=300, zones=("a", "b", "c"), time_scale=1.0,
                         redundancy="lflb", run_dir=str(tmp_path / "run"), timeout_s=200.0, group_timeout_s=20.0,
                         checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_every=5, size={"layers": 2},
                         memory_copy_every=0)  # no in-memory copies on the standby nodes: disk is the last resort
    killed: list[str] = []

    def kill_every_worker(handles: RunHandles) -> None:
        deadline = time.monotonic() + 120.0
        while True:
            events = read_events(handles.events)
            done = max((e.step for e in events if isinstance(e, Step)), default=0)
            if done >= 12 and any(isinstance(e, Checkpoint) and e.step == 10 for e in events):
                break
            assert time.monotonic() < deadline, "training never reached step 12 with checkpoint 10"
            time.sleep(0.02)
        killed.extend(handles.node_of_rank[rank] for rank in (0, 1))
        for node in killed:
            handles.preempt(node)
        finish_when(handles, lambda events: any(isinstance(e, Restore) for e in events))

    result = run_cluster(options, during=kill_every_worker)
    events = read_events(result.events)
    assert not result.timed_out, result
    assert_preempted(events, set(killed))
    [restore] = [e for e in events if isinstance(e, Restore)]
    assert restore.lost_stages == "0" and restore.step >= 10
    assert [(r.reason, r.pipelines) for r in events if isinstance(r, Reconfiguration)][-1:] == [
        ("every holder lost", 2)]
    numbers = [e.step for e in events if isinstance(e, Step)]
    twice = sorted(n for n in set(numbers) if numbers.count(n) == 2)
    if restore.step == 10:
        assert restore.discarded_steps >= 2  # steps 11 and 12 at least were done before the kill
    assert twice == list(range(restore.step + 1, restore.step + restore.discarded_steps + 1))
    assert sorted(set(numbers)) == list(range(1, result.steps_done + 1))
    comparison = compare_with_reference(result, options)
    assert comparison["history"] == [[0, 2], [restore.step, 2]]
    assert comparison["steps"] == result.steps_done
    assert comparison["max_relative_diff"] == 0.0, comparison
