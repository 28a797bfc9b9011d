"""``bamboo-launch run``: the whole system on an emulated spot cluster, as a thin composition.

:func:`run_cluster` puts together what a real cluster would have, and nothing more:

1. etcd: an :class:`bamboo.membership.EmbeddedEtcd` (real ``etcd`` on free loopback ports, its data
   dir in the run dir, stopped on exit), or an external cluster (endpoints, auth and TLS passed through);
2. the emulated spot market (:mod:`bamboo.launch.market`): for each node of the trace it starts one
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
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from bamboo.launch import timeouts
from bamboo.launch.market import ActionKind, MarketAction, StartedClock, plan_market
from bamboo.launch.spec import (
    DEFAULT_CHECKPOINT_EVERY,
    DEFAULT_REDUNDANCY,
    DEFAULT_STEPS,
    MEMORY_COPY_EVERY,
    REDUNDANCY,
)
from bamboo.membership import timeouts as membership_timeouts

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


class RunError(RuntimeError):
    """The run could not start or finish; the message says why."""


_POSITIVE = attrs.validators.gt(0)


def _script_file(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        return
    path = Path(value[0])
    if not path.exists():
        raise ValueError(f"script {value[0]!r} not found")
    if not path.is_file():
        raise ValueError(f"script {value[0]!r} is not a file")


@attrs.frozen
class RunOptions:
    """Everything ``bamboo-launch run`` takes (see ``bamboo-launch run --help``)."""

    nodes: int = attrs.field(default=8, validator=_POSITIVE)
    stages: int = attrs.field(default=4, validator=_POSITIVE)
    pipelines: int = attrs.field(default=2, validator=_POSITIVE)
    steps: int = attrs.field(default=DEFAULT_STEPS, validator=_POSITIVE)
    zones: tuple[str, ...] | None = None
    etcd: tuple[str, ...] | None = None
    etcd_user: str | None = None
    etcd_password: str | None = attrs.field(default=None, repr=False)
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    preemptions: str | None = None
    time_scale: float = attrs.field(default=60.0, validator=_POSITIVE)
    hours: float = attrs.field(default=1.0, validator=_POSITIVE)
    trace_seed: int = 0
    allocation_delay_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    notice_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    checkpoint_dir: str | None = None
    """Where the job's checkpoints go (None: ``RUN_DIR/checkpoints``; a job never runs without them)."""
    checkpoint_every: int = attrs.field(default=DEFAULT_CHECKPOINT_EVERY, validator=_POSITIVE)
    memory_copy_every: int = attrs.field(default=MEMORY_COPY_EVERY, validator=attrs.validators.ge(0))
    """Steps between in-memory copies of every stage (0: none)."""
    resume: bool = False
    """Start from the newest good checkpoint in ``checkpoint_dir`` (refused when it has none)."""
    confirm_timeout_s: float | None = None
    """The runtime's confirm timeout (None: bamboo-rc's default)."""
    group_timeout_s: float | None = None
    """The runtime's gloo group timeout (None: bamboo-rc's default)."""
    reconfigure_timeout_s: float = attrs.field(default=timeouts.RECONFIGURE_TIMEOUT_S, validator=_POSITIVE)
    run_dir: str | None = None
    events: str | None = None
    job: str | None = None
    redundancy: str = attrs.field(default=DEFAULT_REDUNDANCY, validator=attrs.validators.in_(REDUNDANCY))
    preemption_rate: float | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.ge(0)))
    """Preemptions per node-hour that ``--redundancy auto`` assumes before the job's own history (None: default)."""
    size: dict[str, int] = attrs.field(factory=dict)
    seed: int = 0
    ttl: int = attrs.field(default=membership_timeouts.LEASE_TTL_S, validator=_POSITIVE)
    grace_s: float = attrs.field(default=membership_timeouts.GRACE_PERIOD_S, validator=_POSITIVE)
    timeout_s: float = attrs.field(default=timeouts.RUN_TIMEOUT_S, validator=_POSITIVE)
    live: bool = False
    progress_every: int = attrs.field(default=10, validator=_POSITIVE)
    """Without the live view, a progress line each time the step crosses a multiple of this."""
    device: str | None = None
    """Every worker's device (``--device``: ``cpu``, ``cuda``, ``cuda:N``, ``auto``); None: the workers' default."""
    fork_server: bool = True
    """Fork every node's agent and worker from one preloaded interpreter (:mod:`bamboo.launch.forkserver`)
    instead of exec'ing each; the same processes, groups and files."""
    script: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_script_file)
    """``SCRIPT ARGS``: a training script calling :func:`bamboo.launch.train_worker`; empty: the built-in example."""

    def __attrs_post_init__(self) -> None:
        if self.nodes < self.stages * self.pipelines:
            raise ValueError(
                f"--nodes {self.nodes} cannot hold {self.pipelines} pipelines of {self.stages} stages "
                f"(needs at least {self.stages * self.pipelines})"
            )
        if self.resume and self.checkpoint_dir is None and self.run_dir is None:
            raise ValueError("--resume needs --checkpoint-dir, or the --run-dir of the run to resume (its checkpoints)")


@attrs.frozen
class RunResult:
    """What a run left: its directory, event log, per-rank final reports and the failures seen.

    ``failed_ranks`` are the ranks published as failed (each in the layout of its time);
    ``failed_nodes`` the nodes the membership detector declared failed (standby ones included).
    ``reports`` are keyed by the final rank of each worker that finished. ``exit_codes`` are the agents'
    (negative: killed by the market). ``job_error`` is the error the job ended with, if it could not go on.
    """

    run_dir: Path
    events: Path
    reports: dict[int, dict[str, Any]]
    failed_ranks: tuple[int, ...]
    failed_nodes: tuple[str, ...]
    node_of_rank: dict[int, str]
    exit_codes: dict[str, int | None]
    timed_out: bool
    seconds: float
    job_error: str | None = None
    worker_errors: tuple[tuple[str, str], ...] = ()
    """``(node, last exception line)`` of every worker that failed with an exception, the earliest first."""

    @property
    def consecutive(self) -> str | None:
        """The consecutive-failure message of a worker that stopped on one, if any."""
        return next((r["consecutive"] for r in self.reports.values() if r["consecutive"]), None)

    @property
    def steps_done(self) -> int:
        return min((r["steps_done"] for r in self.reports.values()), default=0)


def initial_plan(options: RunOptions) -> tuple[MarketAction, ...]:
    """The market plan: the trace's, or (without ``--preemptions``) ``nodes`` adds at t=0 over the zones."""
    from bamboo.bench.preemptions import load_preemptions  # numpy and the loaders: the launcher's only

    if options.preemptions is None:
        zones = options.zones or ("zone-a", "zone-b", "zone-c")
        return tuple(
            MarketAction(0.0, ActionKind.ADD, f"n{i}", zones[i % len(zones)]) for i in range(options.nodes)
        )
    trace = load_preemptions(options.preemptions, nodes=options.nodes, zones=options.zones, hours=options.hours,
                             seed=options.trace_seed)
    return plan_market(trace.events(), time_scale=options.time_scale, allocation_delay_s=options.allocation_delay_s,
                       notice_s=options.notice_s)


def agent_command(options: RunOptions, job: str, endpoints: Sequence[str], run_dir: Path, min_nodes: int,
                  node: str, zone: str) -> list[str]:
    """The ``bamboo-launch agent`` command line of one emulated node (the same flags for every node): its job
    flags are :func:`run_spec_fields` written as flags, so they match the spec the launcher writes."""
    from bamboo.launch.spec import FLAG_OF

    command = [sys.executable, "-m", "bamboo.launch", "agent", "--job", job, "--node", node, "--zone", zone,
               "--host", "127.0.0.1", "--port", "0", "--run-dir", str(run_dir)]
    script: tuple[str, ...] = ()
    for field, value in run_spec_fields(options, min_nodes).items():
        if field == "script":
            script = value
        elif field == "size":
            command += ["--layers", str(value["layers"])]
        elif field == "resume":
            command += ["--resume"]
        else:
            command += [FLAG_OF[field], str(value)]
    for endpoint in endpoints:
        command += ["--etcd", endpoint]
    for flag, secret in (("--etcd-user", options.etcd_user), ("--etcd-password", options.etcd_password),
                         ("--etcd-ca", options.etcd_ca), ("--etcd-cert", options.etcd_cert),
                         ("--etcd-key", options.etcd_key)):
        if secret is not None:
            command += [flag, secret]
    if options.notice_s > 0:  # the market's SIGTERM comes this long before its kill
        command += ["--notice-window", str(options.notice_s)]
    if options.device is not None:
        command += ["--device", options.device]
    if script:
        command += ["--", *script]
    return command


def run_spec_fields(options: RunOptions, min_nodes: int) -> dict[str, Any]:
    """The job-spec fields of a run (field -> value, as an agent's flags parse them): what the launcher writes
    as the job's spec before it starts the agents, and what :func:`agent_command` passes each agent."""
    fields: dict[str, Any] = {
        "stages": options.stages, "pipelines": options.pipelines, "steps": options.steps, "min_nodes": min_nodes,
        "redundancy": options.redundancy, "seed": options.seed, "ttl": options.ttl, "grace_s": float(options.grace_s),
        "reconfigure_timeout_s": float(options.reconfigure_timeout_s), "checkpoint_every": options.checkpoint_every,
        "memory_copy_every": options.memory_copy_every,
    }
    if options.preemption_rate is not None:
        fields["preemptions_per_node_hour"] = float(options.preemption_rate)
    if options.resume:
        fields["resume"] = True
    if options.confirm_timeout_s is not None:
        fields["confirm_timeout_s"] = float(options.confirm_timeout_s)
    if options.group_timeout_s is not None:
        fields["group_timeout_s"] = float(options.group_timeout_s)
    if options.checkpoint_dir:
        fields["checkpoint_dir"] = str(Path(options.checkpoint_dir).resolve())
    if options.script:
        fields["script"] = (str(Path(options.script[0]).resolve()), *options.script[1:])
    elif "layers" in options.size:
        fields["size"] = {"layers": int(options.size["layers"])}
    return fields


def _write_spec(kv: Any, membership: Any, job: str, options: RunOptions, min_nodes: int, run_dir: Path,
                say: Callable[[str], None]) -> None:
    """Write the job's spec (and its ``run_start`` record) before any agent starts, so that no agent has to
    read the model: the launcher describes it (the built-in example in this process), as the first agent of
    a job started by hand would. The agents check their flags against it as against any stored spec."""
    from bamboo.launch.agent import AgentError, describe_model, new_spec
    from bamboo.launch.events import EtcdEventLog, RunStart

    fields = run_spec_fields(options, min_nodes)
    say("reading the model")
    try:
        spec = new_spec(job, fields, describe_model(fields, run_dir / "logs" / "describe.log", in_process=True))
    except AgentError as error:
        raise RunError(str(error)) from None
    won, _ = kv.create(membership.keys.root + "spec", spec.to_json().encode())
    if not won:
        raise RunError(f"job {job} already exists in etcd; use a new --job")
    events = EtcdEventLog(kv, job, "launcher", spec.created_unix)
    events.write(RunStart(t=events.now(), job=job, unix_time=spec.created_unix,
                          target_nodes=spec.first_layout_nodes, stages=spec.stages, pipelines=spec.pipelines))
    events.close()


@attrs.frozen
class RunHandles:
    """What a ``during`` callback of :func:`run_cluster` can act on while the job trains."""

    etcd: Any
    cluster: Any
    membership: Any
    node_of_rank: dict[int, str]
    preempt: Callable[[str], None]
    events: Path
    finish: Callable[[], None]
    """Ask the job to end at its next step boundary (:func:`bamboo.launch.finish.request_finish`)."""
    step: Callable[[], int]
    """The last step in the job's event log so far (0 before the first)."""


class _Recorder:
    """Mirrors the job's event log from etcd into a local JSON-lines file, in a background thread."""

    def __init__(self, kv: Any, job: str, path: Path) -> None:
        from bamboo.launch.events import EtcdEventFollower, EventLog

        self.path = path
        self._follower = EtcdEventFollower(kv, job)
        self._log = EventLog(path)
        self._stop = threading.Event()
        self.last_step = 0  # the highest step recorded (0 before the first)
        self.error: Exception | None = None
        self._thread = threading.Thread(target=self._run, name="bamboo-run-recorder", daemon=True)
        self._thread.start()

    def _drain(self) -> None:
        from bamboo.launch.events import Step

        for event in self._follower.poll():
            self._log.write(event)
            if isinstance(event, Step):
                self.last_step = max(self.last_step, event.step)

    def _run(self) -> None:
        while not self._stop.wait(timeouts.RUN_POLL_S):
            try:
                self._drain()
            except Exception as error:  # etcd restarting: the watch resumes; a malformed record is reported
                self.error = error

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeouts.THREAD_JOIN_S)
        try:
            self._drain()
        except Exception as error:
            print(f"bamboo-launch: the last event records could not be read: {error}", file=sys.stderr)
        self._follower.close()
        self._log.close()


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
    from bamboo.launch.events import RunEnd, read_events
    from bamboo.launch.market import ExecutedAction, SpotMarket, market_rate
    from bamboo.launch.processes import ProcessCluster
    from bamboo.membership import EmbeddedEtcd, EtcdKV, EtcdOptions, MembershipStore

    say = progress or (lambda message: None)
    started = time.monotonic()
    plan = initial_plan(options)
    if options.redundancy == "auto" and options.preemption_rate is None and options.preemptions is not None:
        # auto's prior: the market's own rate, in the run's wall time (a trace compressed x60 preempts 60x as often
        # per hour of training), until the job's own preemption records outweigh it
        span_s = max(options.hours * 3600.0 / options.time_scale, max(action.at_s for action in plan))
        options = attrs.evolve(options, preemption_rate=market_rate(plan, span_s))
        say(f"--redundancy auto starts from the market's rate: {options.preemption_rate:.3g} preemptions per "
            "node-hour of the run")
    initial = [action for action in plan if action.kind is ActionKind.ADD and action.at_s == 0]
    if len(initial) < options.stages * options.pipelines:
        raise RunError(f"the trace starts with {len(initial)} nodes; P={options.stages} x D={options.pipelines} "
                       f"needs {options.stages * options.pipelines}")
    from bamboo.launch.agent import AgentError, refuse_used_checkpoint_dir

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
    events_path = Path(options.events) if options.events else run_dir / "events.jsonl"
    events_path.unlink(missing_ok=True)
    job = options.job or f"run-{uuid.uuid4().hex[:8]}"
    etcd = None if options.etcd else EmbeddedEtcd(run_dir / "etcd").start()
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
    try:
        _write_spec(kv, membership, job, options, len(initial), run_dir, say)
    except RunError:
        kv.close()
        if etcd is not None:
            etcd.close()
        raise

    def record(executed: ExecutedAction) -> None:
        if executed.action.kind is ActionKind.KILL:
            say(f"market: killed {executed.live_node} ({executed.action.zone})")
        elif executed.action.kind is ActionKind.ADD and executed.action.at_s > 0:
            say(f"market: started {executed.live_node} ({executed.action.zone})")

    env = {**os.environ, "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    cluster = ProcessCluster(lambda node, zone: agent_command(options, job, endpoints, run_dir, len(initial),
                                                              node, zone),
                             env=env, log_dir=run_dir / "logs", fork_server=_fork_server(options, say))
    clock = StartedClock()
    market = SpotMarket(plan, cluster, on_action=record, clock=clock)
    recorder = _Recorder(kv, job, events_path)
    timed_out = False
    node_of_rank: dict[int, str] = {}
    failed_ranks: tuple[int, ...] = ()
    failed_nodes: tuple[str, ...] = ()
    job_error: str | None = None
    worker_errors: tuple[tuple[str, str], ...] = ()

    def finish() -> None:
        from bamboo.launch.finish import request_finish

        request_finish(membership, "bamboo-launch run")
        say("asked the job to finish at its next step boundary")

    def handles_of(node_of_rank: dict[int, str]) -> RunHandles:
        return RunHandles(etcd, cluster, membership, node_of_rank, _preempter(cluster, say), events_path,
                          finish, lambda: recorder.last_step)

    try:
        say(f"starting {len(initial)} agents")
        market.run_due()  # the initial nodes start now; the rest of the plan waits for the first step
        if at_start is not None:
            handles = handles_of({})
            threading.Thread(target=at_start, args=(handles,), name="bamboo-run-at-start", daemon=True).start()
        layout = _wait_first_step(recorder, cluster, membership, started + options.timeout_s, run_dir / "logs", say)
        node_of_rank = dict(layout.node_of_rank)
        say("layout: " + "; ".join(f"pipeline {d}: {' '.join(row)}" for d, row in enumerate(layout.owners))
            + (f"; standby: {' '.join(layout.standby)}" if layout.standby else ""))
        clock.start_now()  # trace time runs from the first step: no kill lands while workers start
        say("training started; replaying the trace")
        market.start()
        if during is not None:
            handles = handles_of(node_of_rank)
            threading.Thread(target=during, args=(handles,), name="bamboo-run-during", daemon=True).start()
        timed_out = _wait_end(cluster, membership, started + options.timeout_s, events_path, options.live, say,
                              options.progress_every)
    finally:
        market.stop(timeout=timeouts.MARKET_STOP_S)
        cluster.close()
        recorder.stop()
        try:
            failed_ranks, failed_nodes, job_error = _failures(membership)
            worker_errors = _worker_errors(membership)
            _save_records(membership, run_dir)
        except Exception as error:  # etcd gone: the run's figures still come from the event log
            say(f"could not read the job's failures from etcd: {error}")
        kv.close()
        if etcd is not None:
            etcd.close()
    if not any(type(event).KIND == "run_end" for event in read_events(events_path)):
        from bamboo.launch.events import EventLog

        reports = _load_reports(run_dir / "out")
        with EventLog(events_path) as log:
            start = next((e.unix_time for e in read_events(events_path) if type(e).KIND == "run_start"), time.time())
            log.write(RunEnd(t=max(0.0, time.time() - start),
                             steps=max((r["steps_done"] for r in reports.values()), default=0)))
    codes = {node: process.returncode for node, process in cluster.processes.items()}
    return RunResult(run_dir=run_dir, events=events_path, reports=_load_reports(run_dir / "out"),
                     failed_ranks=failed_ranks, failed_nodes=failed_nodes, node_of_rank=node_of_rank,
                     exit_codes=codes, timed_out=timed_out, seconds=time.monotonic() - started, job_error=job_error,
                     worker_errors=worker_errors)


def _preempter(cluster: Any, say: Callable[[str], None]) -> Callable[[str], None]:
    """A ``RunHandles.preempt``: SIGKILL the node's agent and worker, and say so. ``node`` is an emulated
    node (``node2``) or one of its agent's incarnations (``node2.2``, after it came back as a fresh node)."""
    def preempt(node: str) -> None:
        process = node if node in cluster.processes else node.rsplit(".", 1)[0]
        cluster.kill(process)
        say(f"killed {node} ({cluster.zones.get(process, 'unknown')})")

    return preempt


def _fork_server(options: RunOptions, say: Callable[[str], None]) -> Any:
    """This process's shared fork server when ``options.fork_server`` (None when off, or when it cannot start:
    the nodes are exec'd then)."""
    if not options.fork_server:
        return None
    from bamboo.launch.forkserver import ForkServerError, shared_fork_server

    try:
        return shared_fork_server()
    except ForkServerError as error:
        say(f"{error}; starting every node by exec instead")
        return None


def _last_line(path: Path) -> str:
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return lines[-1][:300] if lines else "no output"


def _wait_first_step(recorder: _Recorder, cluster: Any, membership: Any, deadline: float, log_dir: Path,
                     say: Callable[[str], None]) -> Any:
    """The layout that trains, once a training step was recorded; RunError when the job cannot start."""
    from bamboo.launch.coordinator import read_layout
    from bamboo.launch.records import JobEnd, WorkerError, read_record

    reported: set[str] = set()
    while True:
        if recorder.last_step:
            return read_layout(membership)
        for item in membership.kv.get_prefix(membership.keys.decision("error-")):
            error = WorkerError.from_dict(json.loads(item.value))
            raise RunError(f"before the first step, node {error.node} failed: {error.error} "
                           f"(log: {log_dir / (error.node.split('.')[0] + '.log')})")
        end = read_record(JobEnd, membership.get_decision("end"))
        if end is not None and end.error is not None:
            raise RunError(f"the job ended before its first step: {end.error}")
        exited = {node: process.returncode for node, process in cluster.processes.items()
                  if process.poll() is not None}
        # An agent killed by a signal is a lost node: the start is redone without it. One that exited by itself
        # failed (bad flags, a crash): that is the run's error, as is every agent gone.
        failed = sorted(node for node, code in exited.items() if code >= 0 or len(exited) == len(cluster.processes))
        if failed:
            raise RunError("before the first step, " + "; ".join(
                f"node {node} exited with status {exited[node]}: "
                f"{_last_line(log_dir / (node + '.log'))} (log: {log_dir / (node + '.log')})" for node in failed))
        for node in sorted(set(exited) - reported):
            say(f"node {node} was lost before the first step (signal {-exited[node]}); the start goes on without it")
            reported.add(node)
        if time.monotonic() > deadline:
            raise RunError("no training step before the run's timeout")
        time.sleep(timeouts.RUN_POLL_S)


def _wait_end(cluster: Any, membership: Any, deadline: float, events: Path, live: bool,
              say: Callable[[str], None], progress_every: int = 10) -> bool:
    """Wait until the job has ended and every agent has exited; True if the deadline came first."""
    def running() -> bool:
        return bool(cluster.alive())  # an agent exits once the job's end record is in etcd

    if not live:
        from bamboo.launch.live import EventFollower, LiveState, ProgressLines

        follower, state, lines = EventFollower(events), LiveState(), ProgressLines(progress_every)
        while running():
            if time.monotonic() > deadline:
                return True
            state.apply_all(follower.poll())
            line = lines.line(state)
            if line is not None:
                say(line)
            time.sleep(timeouts.RUN_POLL_S)
        state.apply_all(follower.poll())
        if state.step is not None and state.step != lines.last:
            say(state.progress_line())  # the last step too
        return False
    from bamboo.launch.live import EventFollower, LiveView
    from rich.console import Console

    with LiveView(EventFollower(events).poll, Console(stderr=True)) as view:  # redrawn when a record arrives
        while running():
            if time.monotonic() > deadline:
                return True
            view.update()
            time.sleep(timeouts.LIVE_REFRESH_S)
        view.update()
    return False


def _failures(membership: Any) -> tuple[tuple[int, ...], tuple[str, ...], str | None]:
    """(ranks published as failed, nodes declared failed, the job's error) from etcd."""
    from bamboo.launch.records import JobEnd, read_record
    from bamboo.membership.records import FailureReport, decode_message
    from bamboo.rc import FailureEvent

    ranks: set[int] = set()
    for item in membership.kv.get_prefix(membership.keys.decisions):
        name = item.key.removeprefix(membership.keys.decisions)
        if name.startswith("g") and "-epoch-" in name:
            ranks.update(FailureEvent.from_json(item.value).victims)
    nodes = {decode_message(item.key, item.value, FailureReport).node
             for item in membership.kv.get_prefix(membership.keys.failures)}
    end = read_record(JobEnd, membership.get_decision("end"))
    return tuple(sorted(ranks)), tuple(sorted(nodes)), None if end is None else end.error


def _worker_errors(membership: Any) -> tuple[tuple[str, str], ...]:
    """``(node, last exception line)`` of the workers that published an error, the earliest first."""
    from bamboo.launch.records import WorkerError

    errors = [WorkerError.from_dict(json.loads(item.value))
              for item in membership.kv.get_prefix(membership.keys.decision("error-"))]
    return tuple((error.node, error.error) for error in sorted(errors, key=lambda error: error.at))


def _save_records(membership: Any, run_dir: Path) -> None:
    """Keep the job's spec and last layout in the run dir (``spec.json``, ``layout.json``) for ``--verify``."""
    for name in ("spec", "layout"):
        found = membership.kv.get(membership.keys.root + name)
        if found is not None:
            (run_dir / f"{name}.json").write_bytes(found.value)


def _load_reports(out: Path) -> dict[int, dict[str, Any]]:
    import torch

    reports = {}
    for path in sorted(out.glob("rank*.pt")):
        report = torch.load(path, weights_only=False)
        reports[int(report["rank"])] = report
    return reports


def compare_with_reference(result: RunResult, options: RunOptions) -> dict[str, Any]:
    """Compare every surviving worker's hosted stages with a fault-free single-process run.

    Returns ``{"steps", "max_relative_diff", "tensors", "history"}``. The reference trains the same global
    batches for the steps the run did, grouped by pipeline as the run's layouts were, with the run's config
    and seed (from the job's spec, kept as ``RUN_DIR/spec.json``): the built-in example in this process
    (:func:`bamboo.launch.reference.compare_reports`), a user script by running the script once more, in
    ``reference`` mode (:func:`bamboo.launch.script.reference_from_script`). Each worker's layers are
    compared with the reference's layers of the same index (the layers its executor built).
    """
    from bamboo.launch.reference import compare_reports, compare_states
    from bamboo.launch.spec import JobSpec

    if result.job_error is not None:  # the job's own error, not the missing reports it left
        raise RunError(f"the job ended with an error: {result.job_error}")
    if result.timed_out:
        raise RunError(f"the run did not finish within --timeout {options.timeout_s:g} s (after {result.steps_done} "
                       "steps): nothing to verify")
    if not result.reports:
        raise RunError(f"no worker wrote a final report under {result.run_dir / 'out'}")
    spec = JobSpec.from_json((result.run_dir / "spec.json").read_text())
    reports = list(result.reports.values())
    if not spec.script:
        return compare_reports(reports, spec)
    from bamboo.launch.script import ScriptError, reference_from_script

    steps = result.steps_done
    history = max((r["history"] for r in reports), key=len)
    try:
        reference = reference_from_script(spec.script, config=spec.config, seed=spec.seed, history=history,
                                          steps=steps, work_dir=result.run_dir, timeout_s=options.timeout_s)
    except ScriptError as error:
        raise RunError(str(error)) from None
    worst, tensors = compare_states(reports, reference)
    return {"steps": steps, "max_relative_diff": worst, "tensors": tensors, "history": history}


def dumps_result(result: RunResult) -> str:
    """A short JSON summary of a run (for logs)."""
    return json.dumps({"run_dir": str(result.run_dir), "failed_ranks": list(result.failed_ranks),
                       "steps_done": result.steps_done, "timed_out": result.timed_out})
