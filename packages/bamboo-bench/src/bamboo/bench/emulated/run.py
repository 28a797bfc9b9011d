"""``bamboo-launch run``: the whole system on an emulated spot cluster, as a thin composition.

:func:`run_cluster` puts together what a real cluster would have, and nothing more:

1. etcd: an :class:`bamboo.membership.EmbeddedEtcd` (real ``etcd`` on free loopback ports, its data
   dir in the run dir, stopped on exit), or an external cluster (endpoints, auth and TLS passed through);
2. the emulated spot market (:mod:`bamboo.bench.emulated.market`): for each node of the trace it starts one
   ``bamboo-launch agent`` process (the very command a cluster's machines run, see
   :mod:`bamboo.launch.agent`), leader of its own process group in the launcher's session, and replays the trace's kills (SIGKILL
   of the whole group) and additions, compressed by ``time_scale``. Trace time runs from the first
   training step. Every agent gets the same flags; ``--min-nodes`` is the trace's initial count, so the
   first layout places all of them;
3. the live view and a local mirror of the job's event log (etcd -> ``RUN_DIR/events.jsonl``).

The launcher writes the job's spec before the agents start (it reads the model itself, so that the job's
start does not wait for an agent's ``describe`` child), as a first agent started by hand would; the agents
check their flags against it. Everything else job-wide (the first layout, failure confirmation and
publication, reconfigurations, checkpoint restores, the job's end) is done by the agents through etcd,
exactly as on a cluster. The run
ends when the job's end record is in etcd and every agent has exited, or at ``timeout_s``.
:func:`compare_with_reference` checks the workers' final parameters against a fault-free
single-process run of the same steps.

Its parts: :mod:`bamboo.bench.emulated.run_options` (what a run takes and leaves), :mod:`bamboo.bench.emulated.run_agents`
(the market's plan, the agents' command lines, the spec), :mod:`bamboo.bench.emulated.run_watch` (following the job),
:mod:`bamboo.bench.emulated.run_results` (reading back what it left, ``--verify``); this module composes them.
"""

from __future__ import annotations

import importlib
import itertools
import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
from bamboo.bench.emulated import timeouts as emulated_timeouts
from bamboo.bench.emulated.market import ActionKind, MarketAction, StartedClock
from bamboo.bench.emulated.run_agents import agent_command, initial_plan, run_spec_fields, write_spec
from bamboo.bench.emulated.run_options import RunError, RunHandles, RunOptions, RunResult
from bamboo.bench.emulated.run_results import (
    MARKET_LOG,
    compare_with_reference,
    load_reports,
    read_failures,
    read_worker_errors,
    save_records,
)
from bamboo.bench.emulated.run_results import dumps_result as dumps_result
from bamboo.bench.emulated.run_watch import EventRecorder, wait_end, wait_first_step
from bamboo.bench.emulated.stop_signals import stop_signals_deferred

if TYPE_CHECKING:
    from bamboo.bench.emulated.forkserver import ForkServer
    from bamboo.bench.emulated.market import ExecutedAction
    from bamboo.bench.emulated.processes import ProcessCluster
    from bamboo.membership import EmbeddedEtcd, EtcdKV, MembershipStore

__all__ = [
    "RunError",
    "RunHandles",
    "RunOptions",
    "RunResult",
    "agent_command",
    "compare_with_reference",
    "initial_plan",
    "run_cluster",
    "run_spec_fields",
]


def run_cluster(
    options: RunOptions,
    *,
    progress: Callable[[str], None] | None = None,
    during: Callable[[RunHandles], None] | None = None,
    at_start: Callable[[RunHandles], None] | None = None,
) -> RunResult:
    """Run the emulated cluster to the end (see the module docstring); returns what it left.

    ``during``, if given, runs in a background thread once training has started; ``at_start`` as soon as the
    initial agents are started (no layout yet: its handles' ``node_of_rank`` is empty).
    """
    from bamboo.bench.emulated.market import SpotMarket

    say = progress or (lambda message: None)
    started = time.monotonic()
    plan = initial_plan(options)
    if options.preemptions is not None:
        from bamboo.bench.preemptions import size_notice  # loaded with the trace: the launcher's only

        if notice := size_notice(options.preemptions, _peak(plan), options.nodes):
            say(notice)
    options = _with_market_prior(options, plan, say)
    initial = [action for action in plan if action.kind is ActionKind.ADD and action.at_s == 0]
    if len(initial) < options.stages * options.pipelines:
        raise RunError(f"the trace starts with {len(initial)} nodes; P={options.stages} x D={options.pipelines} "
                       f"needs {options.stages * options.pipelines}")
    options, run_dir = _prepare_run_dir(options)
    events_path = Path(options.events) if options.events else run_dir / "events.jsonl"
    events_path.unlink(missing_ok=True)
    job = options.job or f"run-{uuid.uuid4().hex[:8]}"
    warming = _warm_fork_server(options, say)  # its imports overlap etcd's start; the model is described in it
    _import_torch_before_training()
    etcd, endpoints, kv, membership = _open_job(options, job, len(initial), run_dir, say, warming)
    cluster = _agents(options, job, endpoints, run_dir, len(initial), say)
    clock = StartedClock()
    (run_dir / MARKET_LOG).unlink(missing_ok=True)
    market = SpotMarket(plan, cluster, on_action=_market_lines(say, run_dir / MARKET_LOG), clock=clock)
    recorder = EventRecorder(kv, job, events_path)
    timed_out = False
    stalled: str | None = None
    node_of_rank: dict[int, str] = {}
    failed_ranks: tuple[int, ...] = ()
    failed_nodes: tuple[str, ...] = ()
    job_error: str | None = None
    worker_errors: tuple[tuple[str, str], ...] = ()

    def handles_of(node_of_rank: dict[int, str]) -> RunHandles:
        return RunHandles(etcd, cluster, membership, node_of_rank, _preempter(cluster, say, run_dir / MARKET_LOG),
                          events_path, _finisher(membership, say), lambda: recorder.last_step)

    try:
        say(f"starting {len(initial)} agents")
        with stop_signals_deferred():  # a stop raised inside Popen() would lose a node that had started
            market.run_due()  # the initial nodes start now; the rest of the plan waits for the first step
        if at_start is not None:
            handles = handles_of({})
            threading.Thread(target=at_start, args=(handles,), name="bamboo-run-at-start", daemon=True).start()
        layout = wait_first_step(recorder, cluster, membership, started + options.timeout_s, run_dir / "logs", say)
        node_of_rank = dict(layout.node_of_rank)
        say("layout: " + "; ".join(f"pipeline {d}: {' '.join(row)}" for d, row in enumerate(layout.owners))
            + (f"; standby: {' '.join(layout.standby)}" if layout.standby else ""))
        clock.start_now()  # trace time runs from the first step: no kill lands while workers start
        say("training started; replaying the trace")
        market.start()
        if during is not None:
            handles = handles_of(node_of_rank)
            threading.Thread(target=during, args=(handles,), name="bamboo-run-during", daemon=True).start()
        end = wait_end(cluster, membership, started + options.timeout_s, recorder.recorded, options.live, say,
                       options.progress_every, nodes_to_come=lambda: market.adds_pending,
                       short_of_nodes=lambda: _short_of_nodes(cluster, options.stages),
                       last_step=lambda: recorder.last_step)
        timed_out, stalled = end.timed_out, end.stalled
    finally:
        market.stop(timeout=emulated_timeouts.MARKET_STOP_S)
        cluster.close()
        recorder.stop()
        try:
            failed_ranks, failed_nodes, job_error = read_failures(membership)
            worker_errors = read_worker_errors(membership)
            save_records(membership, run_dir)
        except Exception as error:  # etcd gone: the run's figures still come from the event log
            say(f"could not read the job's failures from etcd: {error}")
        kv.close()
        if etcd is not None:
            etcd.close()
    _end_the_log(events_path, run_dir)
    codes = {node: process.returncode for node, process in cluster.snapshot().items()}
    return RunResult(run_dir=run_dir, events=events_path, reports=load_reports(run_dir / "out"),
                     failed_ranks=failed_ranks, failed_nodes=failed_nodes, node_of_rank=node_of_rank,
                     exit_codes=codes, timed_out=timed_out, seconds=time.monotonic() - started, job_error=job_error,
                     worker_errors=worker_errors, stalled=stalled)


def _short_of_nodes(cluster: ProcessCluster, stages: int) -> str | None:
    """Why the nodes alive cannot form one pipeline of ``stages`` (None: they are enough)."""
    alive = len(cluster.alive())
    nodes = "1 node" if alive == 1 else f"{alive} nodes"
    return None if alive >= stages else f"the {nodes} left cannot form a pipeline of {stages} stages"


def _peak(plan: Sequence[MarketAction]) -> int:
    """The most machines the market's ``plan`` holds at once."""
    steps = (1 if action.kind is ActionKind.ADD else -1 if action.kind is ActionKind.KILL else 0 for action in plan)
    return max(itertools.accumulate(steps), default=0)


def _with_market_prior(options: RunOptions, plan: Sequence[MarketAction],
                       say: Callable[[str], None]) -> RunOptions:
    """``options`` with ``--redundancy auto``'s prior: without ``--preemption-rate``, the market's own rate, in
    the run's wall time (a trace compressed x60 preempts 60x as often per hour of training), until the job's own
    preemption records outweigh it."""
    from bamboo.bench.emulated.market import market_rate

    if options.redundancy == "auto" and options.preemption_rate is None and options.preemptions is not None:
        span_s = max(options.hours * 3600.0 / options.time_scale, max(action.at_s for action in plan))
        options = attrs.evolve(options, preemption_rate=market_rate(plan, span_s))
        say(f"--redundancy auto starts from the market's rate: {options.preemption_rate:.3g} preemptions per "
            "node-hour of the run")
    return options


def _prepare_run_dir(options: RunOptions) -> tuple[RunOptions, Path]:
    """The run dir (a new temporary one without ``--run-dir``) with its ``out`` and ``logs`` folders, and
    ``options`` with the run dir's ``checkpoints`` folder when no ``--checkpoint-dir`` was given; a checkpoint
    folder that holds another run's checkpoints is refused (:class:`RunError`) unless the run resumes."""
    from bamboo.launch.agent_options import AgentError
    from bamboo.launch.agent_spec import refuse_used_checkpoint_dir

    try:
        refuse_used_checkpoint_dir(options.checkpoint_dir, options.resume)
    except AgentError as error:
        raise RunError(str(error)) from None
    run_dir = Path(options.run_dir or tempfile.mkdtemp(prefix="bamboo-run-")).resolve()
    if options.checkpoint_dir is None:  # a job never dies for want of a flag: it checkpoints into its run dir
        options = attrs.evolve(options, checkpoint_dir=str(run_dir / "checkpoints"))
        try:
            refuse_used_checkpoint_dir(options.checkpoint_dir, options.resume)
        except AgentError as error:
            raise RunError(f"{error} (the run dir's default checkpoint folder; give a new --run-dir)") from None
    (run_dir / "out").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    return options, run_dir


def _open_job(options: RunOptions, job: str, min_nodes: int, run_dir: Path, say: Callable[[str], None],
              warming: threading.Thread | None = None,
              ) -> tuple[EmbeddedEtcd | None, tuple[str, ...], EtcdKV, MembershipStore]:
    """etcd (embedded in the run dir unless ``--etcd`` names one), a client of it, and the new job's spec
    written there (:func:`bamboo.bench.emulated.run_agents.write_spec`): ``(embedded etcd or None, endpoints, client,
    the job's store)``. A job that already exists is refused (:class:`RunError`), and what was opened is closed.
    ``warming`` (:func:`_warm_fork_server`) is waited for before the model is described, which then runs in a process
    forked from the fork server."""
    from bamboo.membership import EmbeddedEtcd, EtcdKV, EtcdOptions, MembershipStore
    from bamboo.membership.embedded import ETCD_NICENESS

    etcd = None if options.etcd else EmbeddedEtcd(run_dir / "etcd", niceness=ETCD_NICENESS).start()
    endpoints = options.etcd or (etcd.endpoint,)  # type: ignore[union-attr]
    kv = EtcdKV(EtcdOptions(endpoints=endpoints, user=options.etcd_user, password=options.etcd_password,
                            ca_cert=options.etcd_ca, cert_cert=options.etcd_cert, cert_key=options.etcd_key))
    membership = MembershipStore(kv, job)
    if kv.get(membership.keys.root + "spec") is not None:
        kv.close()
        if etcd is not None:
            etcd.close()
        raise RunError(f"job {job} already exists in etcd; use a new --job")
    say(f"etcd at {','.join(endpoints)} ({'embedded' if etcd else 'external'}); job {job}; run dir {run_dir}")
    if warming is not None:
        warming.join()
    try:
        write_spec(kv, membership, job, options, min_nodes, run_dir, say)
    except RunError:
        kv.close()
        if etcd is not None:
            etcd.close()
        raise
    return etcd, endpoints, kv, membership


def _agents(options: RunOptions, job: str, endpoints: Sequence[str], run_dir: Path, min_nodes: int,
            say: Callable[[str], None]) -> ProcessCluster:
    """The emulated nodes, none started yet: one ``bamboo-launch agent`` each (:func:`agent_command`), forked
    from the shared fork server when ``options.fork_server``."""
    from bamboo.bench.emulated.processes import ProcessCluster

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    return ProcessCluster(lambda node, zone: agent_command(options, job, endpoints, run_dir, min_nodes, node, zone),
                          env=env, log_dir=run_dir / "logs", fork_server=_fork_server(options, say))


def _finisher(membership: MembershipStore, say: Callable[[str], None]) -> Callable[[], None]:
    """A ``RunHandles.finish``: ask the job to end at its next step boundary, and say so."""
    def finish() -> None:
        from bamboo.launch.finish import request_finish

        request_finish(membership, "bamboo-launch run")
        say("asked the job to finish at its next step boundary")

    return finish


def _note_machine(log: Path, action: str, node: str, zone: str | None) -> None:
    """Append a machine's start (``add``) or kill to ``log`` (:data:`bamboo.bench.emulated.run_results.MARKET_LOG`)."""
    with log.open("a") as out:
        out.write(json.dumps({"action": action, "node": node, "zone": zone, "unix": time.time()}) + "\n")


def _market_lines(say: Callable[[str], None], log: Path) -> Callable[[ExecutedAction], None]:
    """The market's ``on_action``: a line for each kill, and each node added after the start; and every start and
    kill noted in ``log``."""
    def record(executed: ExecutedAction) -> None:
        if executed.action.kind in (ActionKind.ADD, ActionKind.KILL):
            _note_machine(log, executed.action.kind.value, executed.live_node, executed.action.zone)
        if executed.action.kind is ActionKind.KILL:
            say(f"market: killed {executed.live_node} ({executed.action.zone})")
        elif executed.action.kind is ActionKind.ADD and executed.action.at_s > 0:
            say(f"market: started {executed.live_node} ({executed.action.zone})")

    return record


def _end_the_log(events_path: Path, run_dir: Path) -> None:
    """Write the ``run_end`` record the job did not (it timed out, or failed): the steps its workers reported."""
    from bamboo.launch.events import EventLog, RunEnd, read_events

    if not any(type(event).KIND == "run_end" for event in read_events(events_path)):
        reports = load_reports(run_dir / "out")
        with EventLog(events_path) as log:
            start = next((e.unix_time for e in read_events(events_path) if type(e).KIND == "run_start"), time.time())
            log.write(RunEnd(t=max(0.0, time.time() - start),
                             steps=max((r["steps_done"] for r in reports.values()), default=0)))


def _preempter(cluster: ProcessCluster, say: Callable[[str], None], log: Path) -> Callable[[str], None]:
    """A ``RunHandles.preempt``: SIGKILL the node's agent and worker, note the machine's kill in ``log``, and say
    so. ``node`` is an emulated node (``node2``) or one of its agent's incarnations (``node2.2``, after it came
    back as a fresh node)."""
    def preempt(node: str) -> None:
        process = node if node in cluster.processes else node.rsplit(".", 1)[0]
        cluster.kill(process)
        _note_machine(log, ActionKind.KILL.value, process, cluster.zones.get(process))
        say(f"killed {node} ({cluster.zones.get(process, 'unknown')})")

    return preempt


def _import_torch_before_training() -> None:
    """Import torch in the background from the run's start, where this process has not yet (the command line's
    launcher, which describes the model without it): the workers' reports it loads at the end are torch files.

    The import (about 2.7 CPU-s) overlaps etcd's and the nodes' start, so it is over before the first step: this
    process shares the machine's cores with the emulated nodes, and an import during the training window slowed
    the training as no launcher on another machine would (a 6-node run with the fork server, 40 steps: 6.0 and
    6.2 s from the first step to the last with the import started at the first step, 4.8 and 5.1 s with it
    started here). Started after the job, it would come after the last step instead."""
    if "torch" not in sys.modules:
        threading.Thread(target=importlib.import_module, args=("torch",), name="bamboo-run-import-torch",
                         daemon=True).start()


def _warm_fork_server(options: RunOptions, say: Callable[[str], None]) -> threading.Thread | None:
    """Start this process's shared fork server in the background (None when ``options.fork_server`` is off): its
    imports (torch and bamboo, about 4 s) then overlap etcd's start, and the model's description and the agents are
    forked from it, instead of this process importing torch to describe the model before the server starts."""
    if not options.fork_server:
        return None
    warming = threading.Thread(target=_fork_server, args=(options, say), name="bamboo-run-fork-server", daemon=True)
    warming.start()
    return warming


def _fork_server(options: RunOptions, say: Callable[[str], None]) -> ForkServer | None:
    """This process's shared fork server when ``options.fork_server`` (None when off, or when it cannot start:
    the nodes are exec'd then)."""
    if not options.fork_server:
        return None
    from bamboo.bench.emulated.forkserver import shared_fork_server
    from bamboo.launch.forkserver import ForkServerError

    try:
        return shared_fork_server(options.preload)
    except ForkServerError as error:
        say(f"{error}; starting every node by exec instead")
        return None
