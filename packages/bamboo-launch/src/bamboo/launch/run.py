"""``bamboo-launch run``: the whole system on an emulated spot cluster.

:func:`run_cluster` composes the parts:

1. etcd: an :class:`bamboo.membership.EmbeddedEtcd` (real ``etcd`` on free loopback ports, temp
   data dir, stopped on exit), or an external cluster (endpoints, auth and TLS passed through);
2. the spot market (:mod:`bamboo.launch.market`): the initial nodes and the trace's kills (SIGKILL
   of a node's whole process group) and additions (a new node in its zone after the allocation
   delay), compressed by ``time_scale``; each node is ``python -m bamboo.launch.node``, an agent
   that spawns its worker (:mod:`bamboo.launch.node`, :mod:`bamboo.launch.worker`);
3. the first layout: once the initial nodes have registered, `bamboo.reconfig.plan_layout` places
   P×D of them (zone-aware: consecutive stages in different zones where the zones allow it), the
   rest wait on standby; the layout (node -> global rank) is written to etcd with compare-and-swap;
4. the failure authority (:class:`bamboo.launch.authority.FailureAuthority`): membership's
   confirmed failures become the runtime's failure events, which drive bamboo-rc's failover;
5. the JSON-lines event log (``run_start``, ``join``, ``preemption``, ``failover``, ``step``,
   ``run_end``), the live view, and the final report and plot.

The run ends when every node that holds a rank has exited (done, or killed), or at ``timeout_s``.
:func:`compare_with_reference` checks the workers' final parameters against a fault-free
single-process run of the same steps.

Timeouts (seconds): ``register_timeout_s`` (120) for the initial nodes to register; ``timeout_s``
(900) for the whole run; the node's lease ``ttl`` (2) and detector ``grace_s`` (2).
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "DEFAULT_RUN_CONFIG",
    "RunError",
    "RunHandles",
    "RunOptions",
    "RunResult",
    "compare_with_reference",
    "initial_plan",
    "layer_specs",
    "load_preemptions",
    "run_cluster",
    "train_reference_history",
    "train_reference_program",
]

DEFAULT_RUN_CONFIG: dict[str, Any] = {
    "train_micro_batch_size_per_gpu": 2,
    "gradient_accumulation_steps": 4,
    "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "weight_decay": 0.01}},
    "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 3e-3, "warmup_num_steps": 3}},
    "gradient_clipping": 1.0,
}


class RunError(RuntimeError):
    """The run could not start or finish; the message says why."""


def _positive(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not value > 0:
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


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

    nodes: int = attrs.field(validator=_positive)
    stages: int = attrs.field(validator=_positive)
    pipelines: int = attrs.field(validator=_positive)
    steps: int = attrs.field(default=20, validator=_positive)
    zones: tuple[str, ...] | None = None
    etcd: tuple[str, ...] | None = None
    etcd_user: str | None = None
    etcd_password: str | None = attrs.field(default=None, repr=False)
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    preemptions: str | None = None
    time_scale: float = attrs.field(default=60.0, validator=_positive)
    hours: float = attrs.field(default=1.0, validator=_positive)
    trace_seed: int = 0
    allocation_delay_s: float = 0.0
    notice_s: float = 0.0
    checkpoint_dir: str | None = None
    checkpoint_every: int = attrs.field(default=10, validator=_positive)
    confirm_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    group_timeout_s: float = attrs.field(default=60.0, validator=_positive)
    reconfigure_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    run_dir: str | None = None
    events: str | None = None
    job: str | None = None
    redundancy: str = "eflb"
    size: dict[str, int] = attrs.field(factory=dict)
    config: dict[str, Any] = attrs.field(factory=lambda: dict(DEFAULT_RUN_CONFIG))
    seed: int = 0
    ttl: int = 2
    grace_s: float = 2.0
    register_timeout_s: float = attrs.field(default=120.0, validator=_positive)
    timeout_s: float = attrs.field(default=900.0, validator=_positive)
    live: bool = False
    script: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_script_file)
    """``SCRIPT ARGS``: a training script calling :func:`bamboo.launch.train_worker`; empty: the built-in example."""

    def __attrs_post_init__(self) -> None:
        if self.nodes < self.stages * self.pipelines:
            raise ValueError(
                f"--nodes {self.nodes} cannot hold {self.pipelines} pipelines of {self.stages} stages "
                f"(needs at least {self.stages * self.pipelines})"
            )
        if self.redundancy != "none" and self.stages < 2:
            raise ValueError(f"redundancy {self.redundancy!r} needs at least 2 stages, got {self.stages}")


@attrs.frozen
class RunResult:
    """What a run left: its directory, event log, per-rank final reports and the failures seen.

    ``failed_ranks`` are the ranks published as failed (each in the layout of its time);
    ``failed_nodes`` the nodes the membership detector declared failed (standby ones included).
    ``reports`` are keyed by the final rank of each worker that finished.
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

    @property
    def consecutive(self) -> str | None:
        """The consecutive-failure message of a worker that stopped on one, if any."""
        return next((r["consecutive"] for r in self.reports.values() if r["consecutive"]), None)

    @property
    def steps_done(self) -> int:
        return min((r["steps_done"] for r in self.reports.values()), default=0)


def load_preemptions(
    text: str, *, nodes: int, zones: Sequence[str] | None, hours: float, seed: int
) -> tuple[Any, dict[str, str] | None]:
    """The trace named by ``FILE|synthetic:RATE`` and the zone of each trace node (None: the trace's own).

    A malformed file raises bamboo-bench's ``TraceFormatError`` (a ``ValueError``) naming the line.
    """
    from bamboo.launch.market import assign_zones

    if text.startswith("synthetic:"):
        from bamboo.bench.synthetic import SyntheticSpec, generate_trace

        rate_text = text.split(":", 1)[1]
        try:
            rate = float(rate_text)
        except ValueError:
            raise ValueError(f"--preemptions synthetic:RATE needs a number RATE in [0, 1], got {rate_text!r}") from None
        spec = SyntheticSpec(preemption_probability=rate, desired_nodes=nodes, zones=len(zones) if zones else 3)
        trace = generate_trace(spec, hours, seed)
        if not zones:
            return trace, None
        names = dict(zip(trace.zone_names, zones, strict=False))
        return trace, {event.node: names[event.zone] for event in trace.events()}
    from bamboo.bench.loaders import load_trace

    trace = load_trace(text)
    if not zones:
        return trace, None
    used = sorted({event.zone for event in trace.events()})
    if len(used) > 1:
        raise ValueError(f"the trace {text} already has zones {used}; --zones is for traces without zones")
    return trace, assign_zones(trace.events(), zones)


def initial_plan(options: RunOptions) -> tuple[Any, ...]:
    """The market plan: the trace's, or (without ``--preemptions``) ``nodes`` adds at t=0 over the zones."""
    from bamboo.launch.market import ActionKind, MarketAction, plan_market

    if options.preemptions is None:
        zones = options.zones or ("zone-a", "zone-b", "zone-c")
        return tuple(
            MarketAction(0.0, ActionKind.ADD, f"n{i}", zones[i % len(zones)]) for i in range(options.nodes)
        )
    trace, zone_of = load_preemptions(
        options.preemptions, nodes=options.nodes, zones=options.zones, hours=options.hours, seed=options.trace_seed
    )
    return plan_market(trace.events(), time_scale=options.time_scale, allocation_delay_s=options.allocation_delay_s,
                       notice_s=options.notice_s, zone_of=zone_of)


def layer_specs(size: dict[str, int]) -> list[Any]:
    """bamboo-reconfig's view of the example model's layers: state bytes and compute cost per layer."""
    from bamboo.launch.script import program_layer_costs
    from bamboo.rc.model import GPTSize, gpt_layer_specs

    return program_layer_costs(gpt_layer_specs(GPTSize(**size)))


def _model(options: RunOptions, run_dir: Path, say: Callable[[str], None]) -> tuple[list[Any], dict[str, Any]]:
    """The model's layers (bamboo-reconfig costs) and the run's DeepSpeed config: the built-in example's,
    or what the user script describes (it runs once in ``describe`` mode, see :mod:`bamboo.launch.script`)."""
    if not options.script:
        return layer_specs(options.size), dict(options.config)
    from bamboo.launch.script import ScriptError, describe_script

    say(f"reading the model of {' '.join(options.script)}")
    try:
        description = describe_script(options.script, run_dir / "logs" / "script-describe.log",
                                      timeout_s=options.register_timeout_s)
    except ScriptError as error:
        raise RunError(str(error)) from None
    if len(description.layers) < options.stages:
        raise RunError(f"{options.script[0]} has {len(description.layers)} layers, fewer than the "
                       f"{options.stages} stages (give it more layers or run fewer --stages)")
    config = description.config if description.config is not None else dict(options.config)
    try:
        from bamboo.rc import load_config

        load_config(config, pipelines=options.pipelines)
    except ValueError as error:
        raise RunError(f"{options.script[0]}: its DeepSpeed config: {error}") from None
    return list(description.layers), config


def _first_layout(options: RunOptions, registered: dict[str, str], layers: Sequence[Any],
                  config: dict[str, Any]) -> Any:
    from bamboo.rc import load_config
    from bamboo.reconfig import ClusterView, Node, plan_layout

    micro = load_config(config, pipelines=options.pipelines).micro_batches
    view = ClusterView(
        nodes=[Node(node, zone or "default", "joining") for node, zone in registered.items()],
        target_stages=options.stages, target_pipelines=options.pipelines,
        global_batch=micro * options.pipelines, layers=list(layers),
    )
    layout = plan_layout(view)
    if layout.stages != options.stages or len(layout.owners) != options.pipelines:
        raise RunError(
            f"the first layout has {len(layout.owners)} pipelines of {layout.stages} stages, "
            f"wanted {options.pipelines} of {options.stages}, from nodes {sorted(registered)}"
        )
    return layout


@attrs.frozen
class RunHandles:
    """The live parts of a run, handed to ``run_cluster(during=...)`` once training has started
    (chaos tests kill and restart the embedded etcd, or stop an agent, through them)."""

    etcd: Any
    cluster: Any
    membership: Any
    node_of_rank: dict[int, str]
    preempt: Callable[[str], None]
    """Kill a node now as the market would (SIGKILL of its process group) and log the preemption."""
    events: Path


def run_cluster(
    options: RunOptions,
    *,
    progress: Callable[[str], None] | None = None,
    during: Callable[[RunHandles], None] | None = None,
) -> RunResult:
    """Run the emulated cluster to the end (see the module docstring); returns what it left.

    ``during``, if given, runs in a background thread once training has started.
    """
    from bamboo.launch.authority import FailureAuthority
    from bamboo.launch.events import EventLog, Join, Preemption, RunEnd, RunStart
    from bamboo.launch.market import ActionKind, ExecutedAction, ProcessCluster, SpotMarket
    from bamboo.launch.worker import RunSpec
    from bamboo.membership import (
        DetectorConfig,
        EmbeddedEtcd,
        EtcdKV,
        EtcdOptions,
        EtcdStore,
        MembershipStore,
        c10d_prefix,
    )
    from bamboo.rc import load_config

    say = progress or (lambda message: None)
    started = time.monotonic()
    plan = initial_plan(options)
    initial = [action for action in plan if action.kind is ActionKind.ADD and action.at_s == 0]
    if len(initial) < options.stages * options.pipelines:
        raise RunError(f"the trace starts with {len(initial)} nodes; P={options.stages} x D={options.pipelines} "
                       f"needs {options.stages * options.pipelines}")
    run_dir = Path(options.run_dir or tempfile.mkdtemp(prefix="bamboo-run-"))
    (run_dir / "out").mkdir(parents=True, exist_ok=True)
    (run_dir / "logs").mkdir(exist_ok=True)
    events_path = Path(options.events) if options.events else run_dir / "events.jsonl"
    job = options.job or f"run-{uuid.uuid4().hex[:8]}"
    layers, config = _model(options, run_dir, say)
    etcd = None if options.etcd else EmbeddedEtcd(run_dir / "etcd").start()
    endpoints = options.etcd or (etcd.endpoint,)  # type: ignore[union-attr]
    etcd_options = EtcdOptions(endpoints=endpoints, user=options.etcd_user, password=options.etcd_password,
                               ca_cert=options.etcd_ca, cert_cert=options.etcd_cert, cert_key=options.etcd_key)
    say(f"etcd at {','.join(endpoints)} ({'embedded' if etcd else 'external'}); job {job}; run dir {run_dir}")
    kv = EtcdKV(etcd_options)
    membership = MembershipStore(kv, job)
    spec = RunSpec(
        job=job, etcd=endpoints, stages=options.stages, pipelines=options.pipelines, steps=options.steps,
        node_of_rank={}, out_dir=str(run_dir / "out"), events=str(events_path), run_start=started,
        redundancy=options.redundancy, size=options.size, config=config, seed=options.seed,
        etcd_user=options.etcd_user, etcd_password=options.etcd_password, etcd_ca=options.etcd_ca,
        etcd_cert=options.etcd_cert, etcd_key=options.etcd_key,
        checkpoint_dir=str(Path(options.checkpoint_dir).resolve()) if options.checkpoint_dir else None,
        checkpoint_every=options.checkpoint_every, confirm_timeout_s=options.confirm_timeout_s,
        group_timeout_s=options.group_timeout_s, reconfigure_timeout_s=options.reconfigure_timeout_s,
        script=(str(Path(options.script[0]).resolve()), *options.script[1:]) if options.script else (),
    )
    spec_path = run_dir / "RUN.json"
    _write_atomic(spec_path, spec.to_json())
    log = EventLog(events_path, start=started)
    log.write(RunStart(t=log.now(), job=job, unix_time=time.time(), target_nodes=options.nodes,
                       stages=options.stages, pipelines=options.pipelines))
    noticed_at: dict[str, float] = {}
    killed: set[str] = set()

    def record(executed: ExecutedAction) -> None:
        action = executed.action
        if action.kind is ActionKind.ADD:
            log.write(Join(t=log.now(), node=executed.live_node, zone=action.zone))
        elif action.kind is ActionKind.NOTIFY:
            noticed_at[executed.live_node] = executed.executed_at_s
        else:
            killed.add(executed.live_node)
            notice = executed.executed_at_s - noticed_at.pop(executed.live_node, executed.executed_at_s)
            log.write(Preemption(t=log.now(), node=executed.live_node, zone=action.zone, notice_s=notice))
            say(f"market: killed {executed.live_node} ({action.zone})")

    command = [sys.executable, "-m", "bamboo.launch.node", "--spec", str(spec_path),
               "--ttl", str(options.ttl), "--grace", str(options.grace_s)]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    cluster = ProcessCluster(lambda node, zone: command, env=env, log_dir=run_dir / "logs")
    clock = _TrainingClock()
    market = SpotMarket(plan, cluster, on_action=record, clock=clock)
    authority: FailureAuthority | None = None
    node_of_rank: dict[int, str] = {}
    timed_out = False
    try:
        market.run_due()  # the initial nodes start now; the rest of the plan waits for the layout
        registered = _wait_registered(membership, len(initial), options.register_timeout_s)
        layout = _first_layout(options, registered, layers, config)
        node_of_rank = {d * options.stages + s: node for d, row in enumerate(layout.owners) for s, node in enumerate(row)}
        rank_of_node = {node: rank for rank, node in node_of_rank.items()}
        _write_atomic(spec_path, attrs.evolve(spec, node_of_rank=node_of_rank).to_json())
        def roles() -> tuple[int, dict[str, int]]:
            current = membership.get_layout()
            if current is None:
                return 0, rank_of_node
            return int(current.value["generation"]), {n: int(r) for n, r in current.value["ranks"].items()}

        authority = FailureAuthority(membership, EtcdStore(kv, c10d_prefix(job, "rc")), job, roles,
                                     detector_config=DetectorConfig(grace_period=options.grace_s),
                                     batch_window_s=max(2.5, options.ttl + 0.5),
                                     on_event=lambda event, nodes: say(
                                         f"confirmed failure of {', '.join(nodes)}: ranks {list(event.victims)} "
                                         f"(runtime epoch {event.epoch})")).start()
        micro = load_config(config, pipelines=options.pipelines).micro_batches
        value = {"state": "running", "generation": 0, "stages": options.stages, "pipelines": options.pipelines,
                 "micro_batches": micro, "start_step": 0, "ranks": rank_of_node, "standby": list(layout.standby),
                 "owners": [list(row) for row in layout.owners], "plan": layout.to_dict(), "mode": "first",
                 "transfers": [], "reason": "first layout"}
        if membership.put_layout(value, 0) is None:
            raise RunError(f"job {job} already has a layout in etcd; use a new --job")
        say("layout: " + "; ".join(f"pipeline {d}: {' '.join(row)}" for d, row in enumerate(layout.owners))
            + (f"; standby: {' '.join(layout.standby)}" if layout.standby else ""))
        _wait_first_step(events_path, cluster, set(rank_of_node), started + options.timeout_s, run_dir / "logs")
        clock.start_now()  # trace time runs from the first step: no kill lands while workers start
        say("training started; replaying the trace")
        market.start()
        if during is not None:
            import threading

            def preempt(node: str) -> None:
                zone = cluster.zones.get(node, "unknown")
                cluster.kill(node)
                log.write(Preemption(t=log.now(), node=node, zone=zone or "unknown", notice_s=0.0))
                say(f"killed {node} ({zone})")

            handles = RunHandles(etcd, cluster, membership, node_of_rank, preempt, events_path)
            threading.Thread(target=during, args=(handles,),
                             name="bamboo-run-during", daemon=True).start()
        timed_out = _wait_ranked(cluster, membership, started + options.timeout_s, events_path, options.live)
    finally:
        market.stop(timeout=10)
        if authority is not None:
            authority.stop()
        _finish_layout(membership)
        cluster.close()
        reports = _load_reports(run_dir / "out")
        log.write(RunEnd(t=log.now(), steps=max((r["steps_done"] for r in reports.values()), default=0)))
        log.close()
        kv.close()
        if etcd is not None:
            etcd.close()
    codes = {node: process.returncode for node, process in cluster.processes.items()}
    failed = tuple(sorted(authority.failed_ranks())) if authority is not None else ()
    failed_nodes = tuple(sorted(authority.failed_nodes)) if authority is not None else ()
    return RunResult(run_dir=run_dir, events=events_path, reports=reports, failed_ranks=failed,
                     failed_nodes=failed_nodes,
                     node_of_rank=node_of_rank, exit_codes=codes, timed_out=timed_out,
                     seconds=time.monotonic() - started)


class _TrainingClock:
    """The market's clock: frozen until :meth:`start_now`, then monotonic from that instant.

    The initial nodes start at once (offset 0); every later action of the trace is timed from
    the first training step, so worker start-up (imports, group building) is not compressed trace
    time and no kill lands before training begins.
    """

    def __init__(self) -> None:
        self._frozen_at: float | None = time.monotonic()
        self._shift = 0.0

    def now(self) -> float:
        return self._frozen_at if self._frozen_at is not None else time.monotonic() - self._shift

    def start_now(self) -> None:
        if self._frozen_at is not None:
            self._shift = time.monotonic() - self._frozen_at
            self._frozen_at = None

    def sleep(self, seconds: float, stop: Any) -> None:
        stop.wait(max(0.0, seconds))


def _wait_first_step(events: Path, cluster: Any, ranked_nodes: set[str], deadline: float, log_dir: Path) -> None:
    from bamboo.launch.events import Step
    from bamboo.launch.live import EventFollower

    follower = EventFollower(events)
    while True:
        if any(isinstance(event, Step) for event in follower.poll()):
            return
        dead = sorted(node for node in ranked_nodes if cluster.processes[node].poll() is not None)
        if dead:
            raise RunError("before the first step, " + "; ".join(
                f"node {node} exited with status {cluster.processes[node].returncode} (log: "
                f"{log_dir / (node + '.log')})" for node in dead))
        if time.monotonic() > deadline:
            raise RunError("no training step before the run's timeout")
        time.sleep(0.1)


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".tmp")
    partial.write_text(text)
    os.replace(partial, path)


def _wait_registered(membership: Any, count: int, timeout_s: float) -> dict[str, str]:
    deadline = time.monotonic() + timeout_s
    while True:
        nodes = membership.list_nodes(skip_malformed=True)
        if len(nodes) >= count:
            return {node: record.zone for node, record in sorted(nodes.items())[:count]}
        if time.monotonic() > deadline:
            raise RunError(f"only {len(nodes)} of {count} initial nodes registered within {timeout_s:g} s")
        time.sleep(0.05)


def _wait_ranked(cluster: Any, membership: Any, deadline: float, events: Path, live: bool) -> bool:
    """Wait until every node holding a rank in the current layout has exited; True if the deadline came first."""
    ranked: set[str] = set()

    def running() -> bool:
        try:
            current = membership.get_layout()
            if current is not None:
                ranked.clear()
                ranked.update(current.value["ranks"])
        except Exception:  # etcd restarting: judge by the last layout read
            pass
        return any(cluster.processes[node].poll() is None for node in ranked if node in cluster.processes)

    if not live:
        while running():
            if time.monotonic() > deadline:
                return True
            time.sleep(0.1)
        return False
    from bamboo.launch.live import EventFollower, LiveState, render_live
    from rich.console import Console
    from rich.live import Live

    follower = EventFollower(events)
    state = LiveState()
    with Live(render_live(state), refresh_per_second=4, console=Console(stderr=True)) as view:
        while running():
            if time.monotonic() > deadline:
                return True
            state.apply_all(follower.poll())
            view.update(render_live(state))
            time.sleep(0.25)
        state.apply_all(follower.poll())
        view.update(render_live(state))
    return False


def _finish_layout(membership: Any) -> None:
    """Tell the standby nodes that the run is over (they leave and exit)."""
    try:
        for _ in range(10):
            current = membership.get_layout()
            if current is None:
                return
            if membership.put_layout({**current.value, "state": "finished"}, current.revision) is not None:
                return
    except Exception as error:  # etcd gone: cluster.close() kills the standby nodes anyway
        print(f"bamboo-launch: could not mark the layout finished: {error}", file=sys.stderr)


def _load_reports(out: Path) -> dict[int, dict[str, Any]]:
    import torch

    reports = {}
    for path in sorted(out.glob("rank*.pt")):
        report = torch.load(path, weights_only=False)
        reports[int(report["rank"])] = report
    return reports


def train_reference_program(
    specs: Sequence[Any],
    loss_fn: Callable[[Any, Any], Any],
    microbatch: Callable[[int, int], tuple[Any, Any]],
    config: dict[str, Any],
    seed: int,
    history: Sequence[Sequence[int]],
    steps: int,
) -> list[dict[str, Any]]:
    """Single-process training of the whole model for ``steps`` steps, grouped as the run was.

    ``microbatch(step, index)`` gives the ``(inputs, labels)`` at position ``index`` of the global
    batch of ``step``. ``history`` lists ``(first step, pipelines)`` of every layout generation. The
    global batch is the same at every step; at each step the microbatch gradients are accumulated per
    pipeline of that step's layout and the shares added in pipeline order, which is how the
    data-parallel all-reduce associates them (bamboo-rc's ``train_reference`` does this for one fixed
    D). So a run that changed D mid-way is compared with the same sums, associated the same way.
    """
    import torch
    from bamboo.rc import load_config
    from bamboo.rc.state import TrainableSlice, clip_coefficient

    first_d = int(history[0][1])
    base = load_config(config, pipelines=first_d)
    global_microbatches = base.micro_batches * first_d
    whole = TrainableSlice(specs, range(len(specs)), base, seed)
    for step in range(steps):
        pipelines = next(int(d) for first, d in reversed(history) if step >= int(first))
        per_pipeline = global_microbatches // pipelines
        summed: torch.Tensor | None = None
        for pipeline in range(pipelines):
            whole.zero_grads()
            for k in range(per_pipeline):
                inputs, labels = microbatch(step, pipeline * per_pipeline + k)
                with torch.autocast("cpu", dtype=torch.bfloat16, enabled=base.bf16):
                    outputs = whole.layers(inputs)
                (loss_fn(outputs, labels) / global_microbatches).backward()
            share = whole.flat_grads()
            summed = share if summed is None else summed + share
        assert summed is not None
        whole.load_flat_grads(summed)
        whole.apply_step(clip_coefficient(base.gradient_clipping, whole.squared_grad_norm()))
    return [layer.state_dict() for layer in whole.layers]


def train_reference_history(
    specs: Sequence[Any], config: dict[str, Any], size: Any, seed: int, history: Sequence[Sequence[int]], steps: int
) -> list[dict[str, Any]]:
    """:func:`train_reference_program` of the built-in example (the GPT of ``size`` on its corpus)."""
    from bamboo.launch.worker import example_program

    program = example_program(attrs.asdict(size), config, seed)
    return train_reference_program(specs, program.loss_fn, program.microbatch, config, seed, history, steps)


def compare_with_reference(result: RunResult, options: RunOptions) -> dict[str, Any]:
    """Compare every surviving worker's hosted stages with a fault-free single-process run.

    Returns ``{"steps", "max_relative_diff", "tensors", "history"}``; the relative difference of a
    tensor is ``max|a-b| / max|b|``. The reference trains the same global batches for the steps the
    run did, grouped by pipeline as the run's layouts were (:func:`train_reference_program`), with
    the run's config and seed (from its ``RUN.json``). For a user script the launcher runs the script
    once more, in ``reference`` mode (:func:`bamboo.launch.script.reference_from_script`).
    """
    from bamboo.launch.worker import RunSpec
    from bamboo.rc.model import GPTSize, gpt_layer_specs, partition_layers
    from bamboo.rc.worker import exact_mode

    if not result.reports:
        raise RunError(f"no worker wrote a final report under {result.run_dir / 'out'}")
    spec = RunSpec.from_json((result.run_dir / "RUN.json").read_text())
    steps = result.steps_done
    history = max((r.get("history", [[0, spec.pipelines]]) for r in result.reports.values()), key=len)
    if spec.script:
        from bamboo.launch.script import ScriptError, reference_from_script

        try:
            reference = reference_from_script(spec.script, config=spec.config, seed=spec.seed, history=history,
                                              steps=steps, work_dir=result.run_dir, timeout_s=options.timeout_s)
        except ScriptError as error:
            raise RunError(str(error)) from None
    else:
        exact_mode()
        size = GPTSize(**spec.size)
        reference = train_reference_history(gpt_layer_specs(size), spec.config, size, spec.seed, history, steps)
    parts = partition_layers(len(reference), spec.stages)
    worst = 0.0
    tensors = 0
    for report in result.reports.values():
        for stage in report["hosted"]:
            for offset, layer in enumerate(report["slices"][stage]):
                for name, tensor in layer.items():
                    expected = reference[parts[stage][offset]][name]
                    diff = (tensor.double() - expected.double()).abs().max().item()
                    scale = expected.double().abs().max().item()
                    worst = max(worst, diff / scale if scale > 0 else diff)
                    tensors += 1
    return {"steps": steps, "max_relative_diff": worst, "tensors": tensors, "history": history}


def dumps_result(result: RunResult) -> str:
    """A short JSON summary of a run (for logs)."""
    return json.dumps({"run_dir": str(result.run_dir), "failed_ranks": list(result.failed_ranks),
                       "steps_done": result.steps_done, "timed_out": result.timed_out})
