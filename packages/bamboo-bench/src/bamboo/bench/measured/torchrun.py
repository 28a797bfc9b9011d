"""The checkpoint/restart baseline: what users run today, on the same emulated spot market as Bamboo.

:func:`run_checkpoint_restart` trains the built-in example (the tiny GPT of ``bamboo-launch run``, the same
DeepSpeed config, global batch and data order) with DeepSpeed's own ``PipelineEngine`` under torchrun's
elastic agents, and replays the same preemption trace against it:

- **one torchrun elastic agent per market node** (``python -m torch.distributed.run``, ``--nproc-per-node 1``),
  started by a :class:`bamboo.bench.emulated.processes.ProcessCluster` as the leader of its own process group. torchrun
  starts its worker in a session of its own, so this cluster's kill SIGKILLs the process groups of the agent
  and of all its descendants (and the worker asks Linux to kill it when its agent dies): a market kill takes
  the agent and its worker, as a lost machine would;
- **the rendezvous** is torchrun's ``c10d`` backend on a ``TCPStore`` hosted by this process, which the
  market never preempts (as bamboo's etcd is not): ``--rdzv-conf is_host=0`` so that no agent hosts it;
- **restarts**: ``--max-restarts`` (1000) and ``--monitor-interval`` (0.1 s). A worker that fails (its
  gloo peer was killed) makes its agent restart the whole group; an agent that sees a node waiting (a
  survivor that restarted, or a node the market added) restarts too. Every membership change therefore
  restarts every worker, which loads the last DeepSpeed checkpoint and trains again the steps done since.
  torchrun drops a killed node from the rendezvous when its keep-alive heartbeats stop
  (``keep_alive_interval`` x ``keep_alive_max_attempt``, 1 s x 5 here, see
  :data:`bamboo.bench.timeouts.BASELINE_RDZV_KEEP_ALIVE_ATTEMPTS`; torchrun's defaults are 5 s x 3) and
  closes a round ``last_call_timeout`` (1 s here; default 30 s) after it has its minimum of nodes. The
  workers' gloo store is not the rendezvous store: ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, without which
  restarted workers on gloo read the previous round's addresses and fail (torch 2.13);
- **a failed rendezvous restarts the job**: a node killed inside a rendezvous round, after the round closed
  and before it wrote its rank information, makes every other agent wait for that information until the
  store's ``read_timeout`` (``rdzv_read_timeout_s``, 15 s here; torchrun's default is 60 s) and then fail,
  and an agent that fails closes the rendezvous for every other one, so every agent exits. As a cluster's
  job controller would (a Kubernetes ``PyTorchJob`` restarting its pods, a scheduler requeueing the job), the
  launcher then starts a fresh agent on every machine the market has not taken, on a new rendezvous
  (``<job>-<n>``), up to ``max_job_restarts`` times; the workers load the last checkpoint as after any
  restart, and the restart's cost (:class:`RestartCost`) counts from the kill;
- **too few nodes**: ``--nnodes MIN:MAX`` with ``MIN = P x min_pipelines``. With the default
  ``min_pipelines=1`` the job **drops to fewer pipelines** when fewer than ``P x D`` nodes are alive: ``D'``
  pipelines (the most that fit and divide the global batch, :func:`usable_pipelines`) of ``M x D / D'``
  microbatches each, so the global batch stays the same, as bamboo keeps it; the nodes left over idle
  until the next restart. With ``min_pipelines=D`` it **waits** for ``P x D`` nodes instead;
- **more nodes than needed**: ``MAX`` is the most nodes the trace ever has alive at once
  (:func:`peak_nodes`, at least ``P x D``), so every live node is in the world and the ones beyond
  ``P x D`` idle. A smaller ``MAX`` does not work on torch 2.13: a node that is still in the rendezvous's
  wait list when a round fills up to ``MAX`` stays there, every agent then sees a waiting node and restarts
  its workers, and the job restarts over and over without training;
- **checkpoints** every ``K`` steps (DeepSpeed ``save_checkpoint``/``load_checkpoint``, synchronous, as
  DeepSpeed writes them, in ``checkpoint_dir``; its ``latest`` is written by global rank 0 after a barrier,
  atomically, so it never names a checkpoint a killed node left half written), ``K`` by Young's rule (:func:`checkpoint_interval`): ``sqrt(2 x checkpoint cost x
  mean time between interruptions) / step time``, with the checkpoint cost and step time measured on the
  job's first start and the mean time between interruptions from the trace (:func:`trace_interruptions`:
  its kills and its later additions, since either restarts this system), or given.

It writes the event-log schema of :mod:`bamboo.launch.events` (``run_start``, ``join``, ``preemption``,
``step``, ``checkpoint``, ``restore`` with the steps trained again, ``run_end``), so
:func:`bamboo.bench.value.compute_report` gives its throughput, node-hours, cost, value and redone steps
exactly as for a bamboo run. A ``restore`` names every stage as lost: a restart discards the state of all
of them. What each restart cost is measured per interruption (:class:`RestartCost`: from the kill or the
addition to the restarted workers' first step, split into the agents' reaction and rendezvous, process
start and imports, process group, engine, checkpoint load).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
from bamboo.bench import timeouts
from bamboo.bench._validators import POSITIVE_INT
from bamboo.bench.emulated.market import (
    ActionKind,
    ExecutedAction,
    SpotMarket,
    StartedClock,
)
from bamboo.bench.emulated.run import RunOptions, initial_plan
from bamboo.bench.emulated.run_results import last_step
from bamboo.bench.emulated.stop_signals import pause, stop_signals_deferred
from bamboo.bench.measured.baseline import (
    SPEC_ENV,
    BaselineSpec,
    CheckpointInterval,
    Interruptions,
    RestartCost,
    current_roles,
    extension_build_roots,
    peak_nodes,
    read_records,
    remove_stale_build_locks,
    restart_costs,
    trace_interruptions,
)
from bamboo.bench.measured.machines import MachineCluster
from bamboo.bench.measured.rendezvous import RendezvousWatch
from bamboo.launch.events import EventLog, Join, Preemption, RunEnd, RunStart
from bamboo.launch.example import DEFAULT_LAYERS, EXAMPLE_CONFIG

__all__ = [
    "BaselineError",
    "BaselineHandles",
    "CheckpointRestartOptions",
    "CheckpointRestartResult",
    "run_checkpoint_restart",
    "torchrun_command",
]


class BaselineError(RuntimeError):
    """The baseline could not start or finish; the message says why."""


@attrs.frozen
class CheckpointRestartOptions:
    """A checkpoint/restart run: the cluster and trace (as ``bamboo-launch run`` reads them), the model, K.

    Timeouts (seconds): ``timeout_s`` bounds the whole run; ``finish_grace_s`` is how long the agents may
    take to exit once training is done; ``rdzv_last_call_s``, ``keep_alive_interval_s`` and
    ``keep_alive_attempts`` are torchrun's ``last_call_timeout``, ``keep_alive_interval`` and
    ``keep_alive_max_attempt`` (whole seconds, as torchrun reads them); ``monitor_interval_s`` is how often an
    agent checks its worker and the waiting nodes. ``checkpoint_every`` None: K by Young's rule, with
    ``mtbf_s`` (None: from the trace, :func:`trace_interruptions`) and a step time and checkpoint cost measured
    over the first ``measure_steps`` steps.
    """

    nodes: int = attrs.field(validator=POSITIVE_INT)
    stages: int = attrs.field(validator=POSITIVE_INT)
    pipelines: int = attrs.field(validator=POSITIVE_INT)
    steps: int = attrs.field(default=20, validator=POSITIVE_INT)
    zones: tuple[str, ...] | None = None
    preemptions: str | None = None
    time_scale: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    hours: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    trace_seed: int = 0
    allocation_delay_s: float = 0.0
    checkpoint_dir: str | None = None
    checkpoint_every: int | None = attrs.field(default=None, validator=attrs.validators.optional(POSITIVE_INT))
    mtbf_s: float | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.gt(0)))
    measure_steps: int = attrs.field(default=3, validator=POSITIVE_INT)
    min_pipelines: int = attrs.field(default=1, validator=POSITIVE_INT)
    run_dir: str | None = None
    job: str | None = None
    size: dict[str, int] = attrs.field(factory=lambda: {"layers": DEFAULT_LAYERS})
    seed: int = 0
    config: dict[str, Any] | None = None
    """The DeepSpeed config (None: the built-in example's, ``EXAMPLE_CONFIG``)."""
    timeout_s: float = attrs.field(default=timeouts.BASELINE_TIMEOUT_S, validator=attrs.validators.gt(0))
    finish_grace_s: float = attrs.field(default=timeouts.BASELINE_FINISH_GRACE_S, validator=attrs.validators.gt(0))
    rdzv_last_call_s: int = attrs.field(default=timeouts.BASELINE_RDZV_LAST_CALL_S, validator=POSITIVE_INT)
    keep_alive_interval_s: int = attrs.field(default=timeouts.BASELINE_RDZV_KEEP_ALIVE_S, validator=POSITIVE_INT)
    keep_alive_attempts: int = attrs.field(default=timeouts.BASELINE_RDZV_KEEP_ALIVE_ATTEMPTS, validator=POSITIVE_INT)
    monitor_interval_s: float = attrs.field(default=timeouts.BASELINE_MONITOR_INTERVAL_S,
                                            validator=attrs.validators.gt(0))
    max_restarts: int = attrs.field(default=1000, validator=POSITIVE_INT)
    max_nodes: int | None = attrs.field(default=None, validator=attrs.validators.optional(POSITIVE_INT))
    """torchrun's ``--nnodes`` maximum (None: the trace's peak of live nodes, at least ``P x D``)."""
    rdzv_read_timeout_s: int = attrs.field(default=timeouts.BASELINE_RDZV_READ_TIMEOUT_S, validator=POSITIVE_INT)
    """torchrun's c10d rendezvous ``read_timeout``: how long an agent waits on the rendezvous store (for the
    rank information of a round's nodes) before it fails; torchrun's default is 60 s."""
    max_job_restarts: int = attrs.field(default=100, validator=POSITIVE_INT)
    """How many times the launcher restarts the whole job after every agent exited before the last step."""

    def __attrs_post_init__(self) -> None:
        if self.nodes < self.stages * self.pipelines:
            raise ValueError(f"nodes {self.nodes} cannot hold {self.pipelines} pipelines of {self.stages} stages "
                             f"(needs at least {self.stages * self.pipelines})")
        if self.min_pipelines > self.pipelines:
            raise ValueError(f"min_pipelines {self.min_pipelines} is more than pipelines {self.pipelines}")
        if self.measure_steps < 2:
            raise ValueError(f"measure_steps must be >= 2 (the first step is warm-up), got {self.measure_steps}")
        if self.size.get("layers", DEFAULT_LAYERS) + 2 < self.stages:
            raise ValueError(f"stages {self.stages} is more than the example's {self.size.get('layers', DEFAULT_LAYERS) + 2} "
                             f"layers")

    def run_options(self) -> RunOptions:
        """The :class:`bamboo.bench.emulated.run.RunOptions` of the same cluster and trace (for ``initial_plan``)."""
        return RunOptions(nodes=self.nodes, stages=self.stages, pipelines=self.pipelines, steps=self.steps,
                          zones=self.zones, preemptions=self.preemptions, time_scale=self.time_scale,
                          hours=self.hours, trace_seed=self.trace_seed, allocation_delay_s=self.allocation_delay_s,
                          redundancy="none", size=dict(self.size), seed=self.seed)


@attrs.frozen
class CheckpointRestartResult:
    """What a checkpoint/restart run left: its folders, the event log, K, and each interruption's cost.

    ``restarts`` has one entry per restart that followed an interruption and reached a step (an
    interruption after the last step has none). ``starts`` are the raw start records of global rank 0
    (``RUN_DIR/baseline/starts.jsonl``). ``exit_codes`` are the agents' (negative: killed).
    """

    run_dir: Path
    events: Path
    checkpoint_dir: Path
    interval: CheckpointInterval | None
    interruptions: Interruptions
    restarts: tuple[RestartCost, ...]
    starts: tuple[dict[str, Any], ...]
    steps_done: int
    exit_codes: dict[str, int | None]
    timed_out: bool
    seconds: float
    command: tuple[str, ...]
    stopped: bool = False
    """The ``during`` callback ended the run before its last step (``BaselineHandles.stop``)."""
    job_restarts: int = 0
    """How many times every agent exited before the last step and the launcher restarted the job."""
    registered_unix: dict[str, float] = attrs.field(factory=dict)
    """Node -> the wall time its agent was first seen in the rendezvous (:mod:`bamboo.bench.measured.rendezvous`);
    a node killed before its agent entered is absent."""
    dropped_unix: dict[str, float] = attrs.field(factory=dict)
    """Node -> the wall time torchrun dropped its live agent from the rendezvous (heartbeats late; see
    :mod:`bamboo.bench.measured.rendezvous`): empty in a run whose restarts are torchrun's usual ones."""


@attrs.frozen
class BaselineHandles:
    """What a ``during`` callback of :func:`run_checkpoint_restart` can act on while the job trains.

    ``kill(node)`` SIGKILLs a node's process group (agent and worker), logs its ``preemption`` and returns
    the wall time of the kill; ``add(zone)`` starts a node (an agent that joins at the next round) and logs
    its ``join``; ``alive()`` lists the nodes whose agent runs; ``steps()`` is the newest step in the log;
    ``roles()`` maps each node of the newest world that has trained a step to its ``(stage, pipeline)``;
    ``stop()`` ends the run now, before its last step (every node is killed; the result says ``stopped``).
    """

    cluster: MachineCluster
    events: Path
    kill: Callable[[str], float]
    add: Callable[[str], str]
    alive: Callable[[], list[str]]
    steps: Callable[[], int]
    roles: Callable[[], dict[str, tuple[int, int]]]
    stop: Callable[[], None]


def torchrun_command(options: CheckpointRestartOptions, job: str, store_port: int, max_nodes: int) -> list[str]:
    """The ``torch.distributed.run`` command line of every node (one elastic agent, one worker), in a world of
    ``P x min_pipelines`` to ``max_nodes`` nodes; ``job`` is the rendezvous id."""
    if max_nodes < options.stages * options.pipelines:
        raise ValueError(f"max_nodes {max_nodes} is fewer than the {options.stages * options.pipelines} nodes of "
                         f"{options.pipelines} pipelines of {options.stages} stages")
    conf = ",".join([
        "is_host=0",  # the rendezvous store is the launcher's, never an agent's
        f"join_timeout={max(1, math.ceil(options.timeout_s))}",
        f"last_call_timeout={options.rdzv_last_call_s}",
        f"keep_alive_interval={options.keep_alive_interval_s}",
        f"keep_alive_max_attempt={options.keep_alive_attempts}",
        f"read_timeout={options.rdzv_read_timeout_s}",
    ])
    return [sys.executable, "-m", "torch.distributed.run",
            "--nnodes", f"{options.stages * options.min_pipelines}:{max_nodes}",
            "--nproc-per-node", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{store_port}",
            "--rdzv-id", job, "--rdzv-conf", conf, "--local-addr", "127.0.0.1",
            "--max-restarts", str(options.max_restarts), "--monitor-interval", f"{options.monitor_interval_s:g}",
            "-m", "bamboo.bench.measured.baseline_worker"]


def _tail(path: Path, lines: int = 3) -> str:
    try:
        kept = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return "no log"
    return " | ".join(kept[-lines:]) or "no output"


def _worker_error(base: Path) -> str | None:
    """The first line of a worker's setup error (``error-<rank>.txt``), if one was written."""
    for path in sorted(base.glob("error-*.txt")):
        lines = path.read_text(errors="replace").splitlines()
        return f"{lines[0] if lines else 'unknown error'} (rank {path.stem.split('-', 1)[1]}; {path})"
    return None


def run_checkpoint_restart(
    options: CheckpointRestartOptions,
    *,
    progress: Callable[[str], None] | None = None,
    during: Callable[[BaselineHandles], None] | None = None,
) -> CheckpointRestartResult:
    """Run the checkpoint/restart baseline on the emulated market to the end (see the module docstring).

    ``during``, if given, runs in a background thread once training has started (as in
    :func:`bamboo.bench.emulated.run.run_cluster`). Raises :class:`BaselineError` when the job cannot start, or when
    every agent exited before the last step.
    """
    import torch.distributed as dist  # the rendezvous store (the launcher's, never preempted)

    say = progress or (lambda message: None)
    started = time.monotonic()
    plan = initial_plan(options.run_options())
    initial = [action for action in plan if action.kind is ActionKind.ADD and action.at_s == 0]
    if len(initial) < options.stages * options.pipelines:
        raise BaselineError(f"the trace starts with {len(initial)} nodes; P={options.stages} x D={options.pipelines}"
                            f" needs {options.stages * options.pipelines}")
    interruptions = trace_interruptions(plan)
    mtbf_s = options.mtbf_s if options.mtbf_s is not None else interruptions.mtbf_s
    run_dir = Path(options.run_dir or tempfile.mkdtemp(prefix="bamboo-baseline-")).resolve()
    base = run_dir / "baseline"
    base.mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    for stale in ("done", "interval.json", "starts.jsonl", "roles.jsonl", *(p.name for p in base.glob("error-*.txt"))):
        (base / stale).unlink(missing_ok=True)
    checkpoint_dir = Path(options.checkpoint_dir or run_dir / "checkpoints").resolve()
    checkpoint_dir.mkdir(parents=True, exist_ok=True)
    if any(checkpoint_dir.iterdir()):
        raise BaselineError(f"checkpoint dir {checkpoint_dir} is not empty; a new run needs a fresh one")
    events_path = run_dir / "events.jsonl"
    events_path.unlink(missing_ok=True)
    job = options.job or f"baseline-{uuid.uuid4().hex[:8]}"
    start_unix = time.time()
    config = dict(options.config if options.config is not None else EXAMPLE_CONFIG)
    spec = BaselineSpec(stages=options.stages, pipelines=options.pipelines, steps=options.steps,
                        size=dict(options.size), seed=options.seed, config=config, run_dir=str(run_dir),
                        events=str(events_path), checkpoint_dir=str(checkpoint_dir), start_unix=start_unix,
                        checkpoint_every=options.checkpoint_every, mtbf_s=mtbf_s,
                        measure_steps=options.measure_steps, min_pipelines=options.min_pipelines)
    spec_path = base / "spec.json"
    spec_path.write_text(spec.to_json())
    if options.checkpoint_every is not None:
        say(f"checkpoints: {CheckpointInterval(steps=options.checkpoint_every, rule='given').describe()}")
    else:
        source = "given" if options.mtbf_s is not None else (
            f"the trace: {interruptions.kills} kills and {interruptions.joins} later additions over "
            f"{interruptions.span_s:.1f} s")
        say(f"checkpoints: K by Young's rule once a step and a checkpoint are measured; mean time between "
            f"interruptions {'none' if mtbf_s is None else f'{mtbf_s:.1f} s'} ({source})")

    for lock in remove_stale_build_locks(extension_build_roots()):
        say(f"removed {lock}: a C++ extension build lock a killed build left behind (every worker waits on it)")
    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=datetime.timedelta(seconds=options.timeout_s))
    max_nodes = options.max_nodes or max(options.stages * options.pipelines, peak_nodes(plan))
    command = torchrun_command(options, job, store.port, max_nodes)
    # A job restart starts its agents on a new rendezvous id; an agent started on an older one (a node the
    # market added while the job restarted) is started again on the new one once it has exited.
    current = {"rendezvous": job, "command": command}
    started_on: dict[str, str] = {}

    def node_command(node: str, zone: str) -> list[str]:
        started_on[node] = current["rendezvous"]
        command = current["command"]  # torchrun's own logs go under the run, not into a /tmp/torchelastic_* dir
        return [*command[:-2], "--log-dir", str(run_dir / "torchelastic" / node), *command[-2:]]

    log = EventLog(events_path, clock=time.time, start=start_unix)
    log.write(RunStart(t=0.0, job=job, unix_time=start_unix, target_nodes=len(initial), stages=options.stages,
                       pipelines=options.pipelines))
    env = {**os.environ, SPEC_ENV: str(spec_path), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"), "PYTHONWARNINGS": "ignore",
           "OMP_NUM_THREADS": "1"}
    cluster = MachineCluster(node_command, env=env, log_dir=run_dir / "logs")
    changes: list[tuple[str, str, float]] = []
    changes_lock = threading.Lock()
    training = threading.Event()

    def note(cause: str, node: str, at: float) -> None:
        if training.is_set():
            with changes_lock:
                changes.append((cause, node, at))

    def record(executed: ExecutedAction) -> None:
        zone = executed.action.zone
        if executed.action.kind is ActionKind.KILL:
            log.write(Preemption(t=log.now(), node=executed.live_node, zone=zone))
            note("kill", executed.live_node, time.time())
            say(f"market: killed {executed.live_node} ({zone})")
        elif executed.action.kind is ActionKind.ADD:
            log.write(Join(t=log.now(), node=executed.live_node, zone=zone))
            note("join", executed.live_node, time.time())
            if executed.action.at_s > 0:
                say(f"market: started {executed.live_node} ({zone})")

    def kill(node: str) -> float:
        cluster.kill(node)
        at = time.time()
        log.write(Preemption(t=log.now(), node=node, zone=cluster.zones.get(node, "default")))
        note("kill", node, at)
        say(f"killed {node}")
        return at

    def add(zone: str) -> str:
        node = cluster.add(zone)
        log.write(Join(t=log.now(), node=node, zone=zone))
        note("join", node, time.time())
        return node

    clock = StartedClock()
    market = SpotMarket(plan, cluster, on_action=record, clock=clock)
    watch = RendezvousWatch(store, lambda: current["rendezvous"],
                            lambda: {node: p.pid for node, p in cluster.snapshot().items() if p.poll() is None})
    watch.start()
    stop = threading.Event()
    deadline = started + options.timeout_s
    timed_out = False
    job_restarts = 0
    interval: CheckpointInterval | None = None
    try:
        # A stop signal waits for the loops' next pause: raised in a Popen.poll, it could leave a lock held.
        with stop_signals_deferred():
            say(f"starting {len(initial)} torchrun agents (job {job}, --nnodes {options.stages * options.min_pipelines}:"
                f"{max_nodes}, run dir {run_dir})")
            market.run_due()
            while not (base / "starts.jsonl").exists():
                error = _worker_error(base)
                if error is not None:
                    raise BaselineError(f"a worker cannot start: {error}")
                if not cluster.alive():
                    raise BaselineError("every agent exited before the first step: " + "; ".join(
                        f"{node}: {_tail(run_dir / 'logs' / (node + '.log'))}" for node in sorted(cluster.processes)))
                if time.monotonic() > deadline:
                    raise BaselineError(f"no training step within the timeout of {options.timeout_s:g} s")
                pause(0.05)
            training.set()
            clock.start_now()
            say("training started; replaying the trace")
            market.start()
            if during is not None:
                handles = BaselineHandles(cluster=cluster, events=events_path, kill=kill, add=add, alive=cluster.alive,
                                          steps=lambda: last_step(events_path), roles=lambda: current_roles(base),
                                          stop=stop.set)
                threading.Thread(target=during, args=(handles,), name="baseline-during", daemon=True).start()
            done_at: float | None = None
            dropped_said: set[str] = set()
            while True:
                if interval is None and (base / "interval.json").exists():
                    interval = CheckpointInterval.from_dict(json.loads((base / "interval.json").read_text()))
                    say(f"checkpoints: {interval.describe()}")
                for node in sorted(watch.dropped().keys() - dropped_said):
                    dropped_said.add(node)
                    say(f"warning: torchrun dropped {node}'s live agent from its rendezvous (its heartbeats came late): "
                        "from here on its restarts are not torchrun's usual ones")
                if stop.is_set():
                    say("stopped before the last step")
                    break
                error = _worker_error(base)
                if error is not None:
                    raise BaselineError(f"a worker failed: {error}")
                alive = cluster.alive()
                if (base / "done").exists():
                    done_at = done_at or time.monotonic()
                    if not alive or time.monotonic() - done_at > options.finish_grace_s:
                        break
                elif not alive:
                    machines = cluster.machines()
                    why = "; ".join(f"{node}: {_tail(run_dir / 'logs' / (node + '.log'), 1)}" for node in sorted(machines))
                    if job_restarts >= options.max_job_restarts:
                        raise BaselineError(f"every agent exited before the last step, {job_restarts} job restarts "
                                            f"already: {why}")
                    job_restarts += 1
                    current["rendezvous"] = f"{job}-{job_restarts}"
                    current["command"] = torchrun_command(options, current["rendezvous"], store.port, max_nodes)
                    say(f"every torchrun agent exited before the last step ({why}); restarting the job on "
                        f"{len(machines)} machines, rendezvous {current['rendezvous']}")
                    for node in sorted(machines):
                        cluster.restart_agent(node)
                else:
                    for node in sorted(cluster.machines()):
                        if started_on.get(node) != current["rendezvous"] and cluster.processes[node].poll() is not None:
                            say(f"{node}'s agent was started on an older rendezvous; starting it on "
                                f"{current['rendezvous']}")
                            cluster.restart_agent(node)
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                pause(0.1)
    finally:
        watch.stop()
        market.stop(timeout=5.0)
        cluster.close()
        steps_done = last_step(events_path) if events_path.exists() else 0
        log.write(RunEnd(t=log.now(), steps=steps_done))
        log.close()
        del store
    if interval is None and (base / "interval.json").exists():
        interval = CheckpointInterval.from_dict(json.loads((base / "interval.json").read_text()))
    if interval is None and options.checkpoint_every is not None:
        interval = CheckpointInterval(steps=options.checkpoint_every, rule="given")
    starts = read_records(base / "starts.jsonl")
    registered = watch.registered()
    (base / "registered.json").write_text(json.dumps(registered, sort_keys=True))
    return CheckpointRestartResult(
        run_dir=run_dir, events=events_path, checkpoint_dir=checkpoint_dir, interval=interval,
        interruptions=interruptions, restarts=tuple(restart_costs(changes, starts)), starts=tuple(starts),
        steps_done=steps_done, exit_codes={node: p.returncode for node, p in cluster.snapshot().items()},
        timed_out=timed_out, seconds=time.monotonic() - started, command=tuple(command), stopped=stop.is_set(),
        job_restarts=job_restarts, registered_unix=registered, dropped_unix=watch.dropped())
