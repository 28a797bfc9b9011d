"""Unit tests of `bamboo-launch run`'s pure parts: the market plan, the agents' command line, CLI errors."""

from __future__ import annotations

import subprocess
import sys
import threading
from collections.abc import Callable

import attrs
import pytest
from bamboo.bench.emulated.market import ActionKind
from bamboo.bench.emulated.run import RunOptions, agent_command, initial_plan, run_spec_fields
from bamboo.bench.emulated.run_watch import RunEnd
from bamboo.launch.cli import agent_spec_fields, build_parser, main


def test_initial_plan_without_preemptions_spreads_nodes_over_zones() -> None:
    plan = initial_plan(RunOptions(nodes=5, stages=2, pipelines=2, zones=("x", "y")))
    assert [(a.kind, a.at_s, a.zone) for a in plan] == [(ActionKind.ADD, 0.0, z) for z in "xyxyx"]


def test_every_agent_of_a_run_gets_the_same_job_flags(tmp_path) -> None:
    options = RunOptions(nodes=5, stages=2, pipelines=2, steps=7, checkpoint_dir=str(tmp_path / "ck"),
                         size={"layers": 3}, confirm_timeout_s=9.0)
    first = agent_command(options, "j", ("127.0.0.1:1",), tmp_path, 5, "node0", "a")
    second = agent_command(options, "j", ("127.0.0.1:1",), tmp_path, 5, "node4", "b")
    assert first[:4] == [sys.executable, "-m", "bamboo.launch", "agent"]

    def flags(command: list[str]) -> dict[str, str]:
        return {command[i]: command[i + 1] for i in range(4, len(command) - 1, 2)}

    assert {k: v for k, v in flags(first).items() if k not in ("--node", "--zone")} == \
        {k: v for k, v in flags(second).items() if k not in ("--node", "--zone")}
    assert flags(first)["--min-nodes"] == "5" and flags(first)["--steps"] == "7"
    assert flags(first)["--layers"] == "3" and flags(first)["--confirm-timeout"] == "9.0"
    assert flags(first)["--checkpoint-dir"] == str((tmp_path / "ck").resolve())
    assert "--group-timeout" not in first  # not given: the runtime's default


@pytest.mark.parametrize("changes", [
    {},
    {"checkpoint_dir": "ck", "resume": True, "checkpoint_every": 3, "size": {"layers": 3}},
    {"confirm_timeout_s": 9.0, "group_timeout_s": 20, "ttl": 3, "grace_s": 1.5, "seed": 4, "redundancy": "lflb"},
    {"script": ("train.py", "--lr", "1e-3"), "reconfigure_timeout_s": 30},
])
def test_the_spec_the_launcher_writes_is_the_one_its_agents_flags_give(tmp_path, monkeypatch, changes) -> None:
    """`bamboo-launch run` writes the job's spec itself; every agent checks its flags against it, so the
    two must agree field by field (a difference would make every agent refuse to start)."""
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("")
    options = RunOptions(nodes=5, stages=2, pipelines=2, steps=7, **changes)
    command = agent_command(options, "j", ("127.0.0.1:1",), tmp_path, 5, "node0", "a")[3:]
    flags, script = (command[:command.index("--")], command[command.index("--") + 1:]) if "--" in command \
        else (command, [])
    parsed = build_parser().parse_args(flags)
    parsed.script = script or None  # as bamboo-launch's main hands the words after -- over
    assert agent_spec_fields(parsed) == run_spec_fields(options, 5)


def test_the_device_of_a_run_reaches_every_agent(tmp_path) -> None:
    options = RunOptions(nodes=4, stages=2, pipelines=2, device="cuda:1")
    command = agent_command(options, "j", ("127.0.0.1:1",), tmp_path, 4, "node0", "a")
    assert command[command.index("--device") + 1] == "cuda:1"
    assert build_parser().parse_args(command[3:]).device == "cuda:1"
    assert "--device" not in agent_command(RunOptions(nodes=4, stages=2, pipelines=2), "j", ("127.0.0.1:1",),
                                           tmp_path, 4, "node0", "a")


@pytest.mark.parametrize("command", ["run", "agent"])
def test_a_device_the_runtime_does_not_know_is_one_line(command: str, capsys: pytest.CaptureFixture[str]) -> None:
    status = main([command, "--device", "gpu", *(["--job", "j", "--etcd", "127.0.0.1:1"] if command == "agent" else [])])
    assert status == 2
    err = capsys.readouterr().err
    assert "argument --device: expected cpu, cuda, cuda:N or auto, got 'gpu'" in err and "Traceback" not in err


def test_run_options_refuse_too_few_nodes() -> None:
    with pytest.raises(ValueError, match="--nodes 3 cannot hold 2 pipelines of 2 stages"):
        RunOptions(nodes=3, stages=2, pipelines=2)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["run", "--", "no-such-train.py", "--lr", "1"], "script 'no-such-train.py' not found"),
        (["run", "--nodes", "3"], "--nodes 3 cannot hold 2 pipelines of 4 stages"),
        (["run", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["run", "--stages", "9", "--nodes", "18"], "--stages 9 is more than the example's 6 layers"),
        (["run", "--preemptions", "synthetic:lots"], "synthetic:RATE needs a number RATE"),
    ],
)
def test_run_cli_errors_are_one_line(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert message in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_run_cli_names_the_line_of_a_malformed_trace(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "bad.csv"
    trace.write_text("0,add,node1\n0,add,node2\n0,add,node3\n0,add,node4\nsoon,remove,node1\n")
    assert main(["run", "--nodes", "4", "--stages", "2", "--pipelines", "2", "--preemptions", str(trace)]) == 2
    err = capsys.readouterr().err
    assert "bad.csv" in err and "5" in err and "Traceback" not in err


def test_a_script_without_the_dash_dash_gets_a_hint(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--nodes", "4", "--stages", "2", "train.py", "--lr", "3"]) == 2
    assert "a training script goes after --, as in: bamboo-launch run [options] -- train.py --lr 3" in \
        capsys.readouterr().err


@pytest.mark.parametrize(("diff", "verdict", "status"), [(0.0, "PASSED", 0), (0.356, "FAILED (0.356 > 1e-06)", 1)])
def test_the_report_states_the_verdict_of_verify(tmp_path, capsys: pytest.CaptureFixture[str], diff: float,
                                                 verdict: str, status: int) -> None:
    import argparse

    from bamboo.bench.emulated.cli.run import finish_run
    from bamboo.bench.emulated.run import RunResult
    from bamboo.launch.events import EventLog, RunStart, Step

    events = tmp_path / "events.jsonl"
    with EventLog(events) as log:
        log.write(RunStart(t=0.0, job="j", unix_time=1.0, target_nodes=2, stages=2, pipelines=1))
        log.write(Step(t=1.0, step=1, samples=4, loss=1.0, nodes_active=2, duration_s=0.5))
    result = RunResult(run_dir=tmp_path, events=events, reports={}, failed_ranks=(), failed_nodes=(), node_of_rank={},
                       exit_codes={}, timed_out=False, seconds=1.0)
    args = argparse.Namespace(plot=None, json=False)
    code = finish_run(args, None, result, lambda result, options: {"max_relative_diff": diff, "steps": 1})
    assert code == status
    assert f"verify           {verdict}" in capsys.readouterr().out


def test_with_json_stdout_is_the_report_alone_whatever_the_verification_prints(
    tmp_path, capsys: pytest.CaptureFixture[str],
) -> None:
    """DeepSpeed, first imported by the reference run of --verify, logs its accelerator warning to stdout: it
    came before the report and broke `bamboo-launch run --json | jq`."""
    import argparse
    import json

    from bamboo.bench.emulated.cli.run import finish_run
    from bamboo.bench.emulated.run import RunResult
    from bamboo.launch.events import EventLog, RunStart, Step

    events = tmp_path / "events.jsonl"
    with EventLog(events) as log:
        log.write(RunStart(t=0.0, job="j", unix_time=1.0, target_nodes=2, stages=2, pipelines=1))
        log.write(Step(t=1.0, step=1, samples=4, loss=1.0, nodes_active=2, duration_s=0.5))
    result = RunResult(run_dir=tmp_path, events=events, reports={}, failed_ranks=(), failed_nodes=(), node_of_rank={},
                       exit_codes={}, timed_out=False, seconds=1.0)

    def verify_that_logs(result: RunResult, options: object) -> dict[str, float]:
        print("[WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator to CPU.")
        return {"max_relative_diff": 0.0, "steps": 1}

    assert finish_run(argparse.Namespace(plot=None, json=True), None, result, verify_that_logs) == 0
    printed = capsys.readouterr()
    assert json.loads(printed.out)["verify"] == "PASSED" and "Setting accelerator" in printed.err


def test_a_worker_exception_is_in_the_launchers_error(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from bamboo.bench.emulated.cli.run import finish_run
    from bamboo.bench.emulated.run import RunResult
    from bamboo.launch.events import EventLog, RunStart, Step

    events = tmp_path / "events.jsonl"
    with EventLog(events) as log:
        log.write(RunStart(t=0.0, job="j", unix_time=1.0, target_nodes=2, stages=2, pipelines=1))
        log.write(Step(t=1.0, step=1, samples=4, loss=1.0, nodes_active=2, duration_s=0.5))
    shape = "RuntimeError: mat1 and mat2 shapes cannot be multiplied (3x4 and 5x7)"
    result = RunResult(run_dir=tmp_path, events=events, reports={}, failed_ranks=(0, 1), failed_nodes=(),
                       node_of_rank={}, exit_codes={"node0": 1, "node1": 1}, timed_out=False, seconds=1.0,
                       job_error="every copy of stage(s) 0 is gone",
                       worker_errors=(("node0", shape), ("node1.2", "RuntimeError: Connection reset by peer")))
    assert finish_run(argparse.Namespace(plot=None, json=False), None, result, None) == 1
    out = capsys.readouterr().out
    assert f"job error        every copy of stage(s) 0 is gone (the first worker error: node node0: {shape})" in out
    assert f"worker errors    node0: {shape} (log {tmp_path / 'logs' / 'node0.log'})" in out
    assert f"                 node1.2: RuntimeError: Connection reset by peer (log {tmp_path / 'logs' / 'node1.log'})" \
        in out


def test_workers_that_ended_on_a_lost_peer_are_not_listed_as_errors(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    """Under ``none`` a worker whose peer dies ends with a PeerFailure, and the job restores: in a run that finished,
    those ends are listed apart, one short line each, and are not the workers' errors."""
    import argparse
    import json

    from bamboo.bench.emulated.cli.run import finish_run
    from bamboo.bench.emulated.run import RunResult
    from bamboo.launch.events import EventLog, RunStart, Step

    events = tmp_path / "events.jsonl"
    with EventLog(events) as log:
        log.write(RunStart(t=0.0, job="j", unix_time=1.0, target_nodes=2, stages=2, pipelines=1))
        log.write(Step(t=1.0, step=1, samples=4, loss=1.0, nodes_active=2, duration_s=0.5))
    peer = ("PeerFailure: peer stage 1 pipeline 0 (rank 1) failed during 0SA1>1: [gloo/transport/tcp/pair.cc:537] "
            "Read error [127.0.0.1]:14728: Connection reset by peer.")
    result = RunResult(run_dir=tmp_path, events=events, reports={}, failed_ranks=(1,), failed_nodes=(),
                       node_of_rank={}, exit_codes={"node0": 0}, timed_out=False, seconds=1.0, job_error=None,
                       worker_errors=(("node6", peer),))
    assert finish_run(argparse.Namespace(plot=None, json=False), None, result, None) == 0
    out = capsys.readouterr().out
    assert "worker errors" not in out
    assert "ended on a lost peer node6: peer stage 1 pipeline 0 (rank 1) failed during 0SA1>1\n" in out
    assert finish_run(argparse.Namespace(plot=None, json=True), None, result, None) == 0
    printed = json.loads(capsys.readouterr().out)
    assert "worker_errors" not in printed and printed["ended_on_a_lost_peer"] == [
        "node6: peer stage 1 pipeline 0 (rank 1) failed during 0SA1>1"]


def test_bamboo_bench_declares_run_market_and_report_to_bamboo_launch() -> None:
    """bamboo-launch finds ``run``, ``market`` and ``report`` through bamboo-bench's entry points (it never imports
    them)."""
    from bamboo.bench.emulated.cli import market, run
    from bamboo.bench.value import cli as report
    from bamboo.launch.cli import declared_commands

    assert declared_commands() == {"run": run, "market": market, "report": report}


class _EmptyCluster:
    """A cluster whose every agent is gone (a bulk preemption took them all)."""

    def __init__(self, *, closed: bool = False) -> None:
        self.closed = closed

    def alive(self) -> dict[str, object]:
        return {}


class _Decisions:
    """The job's decisions in etcd: only ``end``, once it is written."""

    def __init__(self) -> None:
        self.end: object | None = None

    def get_decision(self, name: str) -> object | None:
        return self.end if name == "end" else None


def test_a_run_whose_every_node_is_gone_waits_for_the_markets_next_node(tmp_path) -> None:
    """A bulk preemption that empties the cluster does not end the run while the market has nodes to start; the
    run ends when the market has none left, or at once when the job's end record is written."""
    import time

    from bamboo.bench.emulated.run_watch import wait_end
    from bamboo.launch.records import JobEnd
    from bamboo.membership import Decision

    said: list[str] = []
    asked: list[bool] = []
    events = list  # no record comes: each call returns a new empty list

    def nodes_to_come() -> bool:  # the market starts nothing for two polls, then its plan is done
        asked.append(True)
        return len(asked) <= 2

    deadline = time.monotonic() + 60
    assert wait_end(_EmptyCluster(), _Decisions(), deadline, events, False, said.append,
                    nodes_to_come=nodes_to_come) == RunEnd(stalled="every node was preempted and the market starts no other")
    assert len(asked) == 3
    assert said == ["every node is gone and the job has not ended: waiting for the market's next node"]

    ended = _Decisions()
    ended.end = Decision(name="end", value=JobEnd(steps=7, node="n0").to_dict(), won=False, revision=1)
    asked.clear()
    assert wait_end(_EmptyCluster(), ended, deadline, events, False, said.append, nodes_to_come=lambda: True) == RunEnd()
    assert len(said) == 1  # the job had ended: nothing to wait for
    # stopped (its cluster closed, as bamboo-bench measure does at --duration): the market starts no node any more
    assert wait_end(_EmptyCluster(closed=True), _Decisions(), deadline, events, False, said.append,
                    nodes_to_come=lambda: True) == RunEnd()
    assert len(said) == 1


class _ShortCluster:
    """A cluster with one live agent (too few for a pipeline) that stays up."""

    closed = False

    def alive(self) -> list[str]:
        return ["node5"]


class _StepClock:
    """A monotonic clock that moves ``tick_s`` at each reading."""

    def __init__(self, tick_s: float) -> None:
        self.now, self.tick_s = 0.0, tick_s

    def __call__(self) -> float:
        self.now += self.tick_s
        return self.now


def test_a_run_whose_market_ran_dry_with_too_few_nodes_stops_once_no_step_comes(monkeypatch) -> None:
    """The market has no node left to start and the one node alive cannot form a pipeline: the run stops once no
    step came for MARKET_DRY_STALL_S, and says why, instead of waiting to its deadline. A step meanwhile (a pipeline
    that failed over trains on fewer nodes than stages), a node still to come, or enough nodes keep it going."""
    from bamboo.bench.emulated import run_watch
    from bamboo.bench.emulated import timeouts as emulated_timeouts
    from bamboo.bench.emulated.run_watch import wait_end

    monkeypatch.setattr(run_watch, "pause", lambda seconds: None)  # the time is the test clock's
    tick = emulated_timeouts.MARKET_DRY_STALL_S / 4
    short = "the 1 node left cannot form a pipeline of 3 stages"
    said: list[str] = []
    clock = _StepClock(tick)
    end = wait_end(_ShortCluster(), _Decisions(), 100 * emulated_timeouts.MARKET_DRY_STALL_S, list, False,
                   said.append, short_of_nodes=lambda: short, last_step=lambda: 230, clock=clock)
    assert end == RunEnd(stalled=f"the market starts no more nodes and {short}")
    assert said[-1].startswith(end.stalled) and said[-1].endswith(": stopping the run")
    assert emulated_timeouts.MARKET_DRY_STALL_S <= clock.now <= 3 * emulated_timeouts.MARKET_DRY_STALL_S

    steps = iter(range(1000))  # a step at every poll: the run waits to its deadline
    end = wait_end(_ShortCluster(), _Decisions(), 3 * emulated_timeouts.MARKET_DRY_STALL_S, list, False, said.append,
                   short_of_nodes=lambda: short, last_step=lambda: next(steps), clock=_StepClock(tick))
    assert end == RunEnd(timed_out=True)
    for keeps_going in ({"nodes_to_come": lambda: True}, {"short_of_nodes": lambda: None}):
        end = wait_end(_ShortCluster(), _Decisions(), 3 * emulated_timeouts.MARKET_DRY_STALL_S, list, False,
                       said.append, **{"short_of_nodes": lambda: short, **keeps_going}, clock=_StepClock(tick))
        assert end == RunEnd(timed_out=True)


def test_a_run_every_node_of_which_was_preempted_says_so_and_where_it_stopped(tmp_path) -> None:
    from bamboo.bench.emulated.run import RunError, RunOptions, RunResult, compare_with_reference
    from bamboo.launch.events import EventLog, Step

    events = tmp_path / "events.jsonl"
    with EventLog(events) as log:
        for step in (1, 2, 3):
            log.write(Step(t=float(step), step=step, samples=8, loss=1.0, nodes_active=3, duration_s=0.1))
    result = RunResult(run_dir=tmp_path, events=events, reports={}, failed_ranks=(), failed_nodes=(),
                       node_of_rank={}, exit_codes={"node0": -9, "node1": -9}, timed_out=False, seconds=10.0,
                       stalled="every node was preempted and the market starts no other")
    with pytest.raises(RunError, match=r"every node was preempted .* stopped at step 3, unfinished"):
        compare_with_reference(result, RunOptions(stages=2, pipelines=1, steps=5))
    exited = attrs.evolve(result, exit_codes={"node0": -9, "node1": 1}, stalled=None)  # one crashed: the job ended
    with pytest.raises(RunError, match="no worker wrote a final report"):
        compare_with_reference(exited, RunOptions(stages=2, pipelines=1, steps=5))


def test_the_recorder_hands_each_record_it_wrote_once_to_the_progress_lines(tmp_path) -> None:
    """What the launcher's progress lines and live view read: the records the recorder wrote to the file, each
    once, without reading the file back."""
    import json
    import time

    from bamboo.bench.emulated.run_watch import EventRecorder
    from bamboo.launch.events import Step, event_to_dict, events_prefix, read_events
    from bamboo.membership import KeyValue

    class Log:  # a job's event log in "etcd": read once, then watched (nothing more comes here)
        def __init__(self) -> None:
            self.items: dict[str, bytes] = {}

        def revision(self) -> int:
            return len(self.items)

        def get_prefix(self, prefix: str) -> list[KeyValue]:
            return [KeyValue(k, v, 1, 1) for k, v in sorted(self.items.items()) if k.startswith(prefix)]

        def watch_prefix(self, *_: object, **__: object) -> Log:
            return self

        def cancel(self) -> None:
            pass

    kv = Log()
    steps = [Step(t=float(i), step=i, samples=1, loss=1.0, nodes_active=1, duration_s=0.1) for i in (1, 2)]
    for number, step in enumerate(steps):
        kv.items[f"{events_prefix('job')}n0.worker.1/{number:010d}"] = json.dumps(event_to_dict(step)).encode()
    recorder = EventRecorder(kv, "job", tmp_path / "events.jsonl")  # type: ignore[arg-type]
    deadline = time.monotonic() + 10
    taken: list[object] = []
    while len(taken) < 2 and time.monotonic() < deadline:
        taken += recorder.recorded()
        time.sleep(0.01)
    recorder.stop()
    assert taken == steps and recorder.recorded() == [] and recorder.last_step == 2
    assert read_events(tmp_path / "events.jsonl") == steps


def test_the_recorder_writes_each_watched_record_on_the_watch_s_thread_and_nothing_after_it_stopped(tmp_path) -> None:
    """After its first read, the recorder writes each record on the thread that delivers it (no thread of its own
    to wake per record): the record is in the file when the delivery returns. A delivery after stop() writes
    nothing."""
    import json

    from bamboo.bench.emulated.run_watch import EventRecorder
    from bamboo.launch.events import Step, event_to_dict, events_prefix, read_events
    from bamboo.membership import EventKind, KeyValue, WatchEvent

    class Log:  # a job's event log in "etcd", whose watch delivers what the test hands it
        def __init__(self) -> None:
            self.callback: Callable[[WatchEvent], None] | None = None
            self.watched = threading.Event()

        def revision(self) -> int:
            return 0

        def get_prefix(self, prefix: str) -> list[KeyValue]:
            return []

        def watch_prefix(self, _prefix: str, callback: Callable[[WatchEvent], None], **__: object) -> Log:
            self.callback = callback
            self.watched.set()
            return self

        def cancel(self) -> None:
            pass

    def deliver(step: int) -> None:
        record = Step(t=float(step), step=step, samples=1, loss=1.0, nodes_active=1, duration_s=0.1)
        key = f"{events_prefix('job')}n0.worker.1/{step:010d}"
        assert kv.callback is not None
        kv.callback(WatchEvent(EventKind.PUT, key, json.dumps(event_to_dict(record)).encode(), step, None))

    kv = Log()
    path = tmp_path / "events.jsonl"
    recorder = EventRecorder(kv, "job", path)  # type: ignore[arg-type]
    writers: list[str] = []
    write = recorder._log.write
    recorder._log.write = lambda event: (writers.append(threading.current_thread().name), write(event))[1]
    assert kv.watched.wait(10)
    deliver(1)
    assert [e.step for e in read_events(path)] == [1] and recorder.last_step == 1  # written before deliver returned
    deliver(2)
    assert [e.step for e in read_events(path)] == [1, 2]
    assert writers == [threading.current_thread().name] * 2  # by the delivering thread, not the recorder's
    recorder.stop()
    deliver(3)  # a record still in flight when the run ended: the final read took what there was
    assert [e.step for e in read_events(path)] == [1, 2] and [e.step for e in recorder.recorded()] == [1, 2]


def test_the_command_line_launcher_starts_a_job_without_importing_torch() -> None:
    """``bamboo-launch run`` describes the model in a process forked from its fork server, which imports torch
    while etcd starts, and imports torch itself only once the job trains (for the reports it reads at the end):
    none of the launcher's modules may import it on the way to the first step."""
    code = ("import sys, bamboo.launch.cli, bamboo.bench.emulated.cli.run, bamboo.bench.emulated.run, "
            "bamboo.bench.emulated.run_agents, bamboo.launch.agent_spec; print('torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout.strip()
    assert out == "False"


def test_progress_lines_are_printed_as_they_are_on_one_line_each() -> None:
    """Square brackets are text, not rich markup (``[g1]`` was dropped), and a line longer than the console is not
    cut in two (a log file had every progress line wrapped at 80 columns)."""
    import io

    from bamboo.bench.emulated.cli.run import progress_printer
    from rich.console import Console

    out = io.StringIO()
    say = progress_printer(Console(file=out, width=80))
    long = "step 2971  loss 1.4673  samples/s 177.5 (last 10 steps)  nodes 4 active, 0 standby, 4 joining"
    say("generation [g1] ranks [0] [bold]x[/bold]")
    say(long)
    assert out.getvalue().splitlines() == ["bamboo-launch: generation [g1] ranks [0] [bold]x[/bold]",
                                           f"bamboo-launch: {long}"]
