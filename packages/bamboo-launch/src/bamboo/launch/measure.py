"""Measured runs: one system of a comparison on the emulated spot market, and the profile it measures.

``bamboo-launch measure SYSTEM`` (and ``bamboo-bench compare``, which runs it once per system) trains the
built-in example (or a user script) with one of three systems on the same market:

- ``bamboo``: ``bamboo-launch run`` (:func:`bamboo.launch.run.run_cluster`) with eager redundant computation,
  on the trace's nodes;
- ``checkpoint``: the checkpoint/restart system users run today (:func:`bamboo.launch.baseline.run_checkpoint_restart`:
  torchrun elastic agents, DeepSpeed's ``PipelineEngine``, checkpoints every K steps by Young's rule);
- ``on-demand``: ``bamboo-launch run`` without redundancy and without preemptions on ``P x D`` nodes (the
  cluster priced at on-demand rates).

A run ends after ``steps`` steps, or ``duration_s`` wall seconds after its first step (trace time runs from
the first step): every node is then stopped, as a budget's end would, and the report covers the run up to
then. :func:`measure_events` reads what the run cost from its event log, and :func:`profile_document` writes
it in bamboo-bench's profile format (``format`` 1, validated by ``bamboo.bench.ModelProfile``), so
``bamboo-bench simulate --model PROFILE.json`` replays the run, or a longer one, with the same constants.

How each constant is measured (``t`` are the event log's; an *interval* is the time between two consecutive
``step`` records, ends of steps; the pipelines of an interval are its layout's):

- **step time per pipeline count**: the mean of the *clean* intervals at that count: no reconfiguration,
  failover, restore, checkpoint or preemption record inside, not between a failover and the reconfiguration
  that follows it, not the run's first interval (the first step's warm-up). Counts the run never trained at take the nearest
  measured count's time (the profile's ``notes`` say which): on one machine whose nodes share its cores, a
  step's work is the global batch whatever the count;
- **start-up** (``timing.startup_s``): from the run's start to its first step's start;
- **failover pause** (bamboo): the interval of the step a failover interrupted (the one that ended at the
  failover's ``step_end_unix``) less a step time; **fallback slowdown**: the intervals after it until the
  reconfiguration, over the step time; **reconfiguration**: the interval holding a ``reconfiguration``
  record less the step time at its new pipeline count (``local_rendezvous_s`` is 0: the whole cost is here);
- **instance creation** (bamboo): from a node's ``join`` to its worker's ``warm-<node>`` record (model
  built, ready for a role), for the nodes that joined after the start;
- **restart** (checkpoint): from the last interruption (kill or join) before the restarted workers' process
  start to their first step (``RestartCost``): the simulator starts a restart over at every interruption
  during it, so a restart counted from an earlier kill it took in would count those over again; restarts
  whose last interruption was a kill give ``restart_s``, and a join's restart costs ``instance_creation_s``
  more: the mean of the join restarts less that of the kill restarts (``checkpoint_restart_on_join`` is
  ``every-join``);
- **checkpoint cost** (``timing.checkpoint_s``): the interval holding a checkpoint, less the step time; the
  interval between checkpoints is K (or bamboo's ``--checkpoint-every``) steps plus that cost.

Constants a run could not measure (no failover, no restart, ...) take a value that changes nothing in the
simulator (no pause, no slowdown) or, for a restart, the measured cold start, and ``notes`` says so.
"""

from __future__ import annotations

import json
import statistics
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs

__all__ = [
    "SYSTEMS",
    "MeasureError",
    "MeasureOptions",
    "Measurements",
    "measure_events",
    "profile_document",
    "run_measured",
]

SYSTEMS = ("bamboo", "checkpoint", "on-demand")
"""The systems ``bamboo-launch measure`` runs."""


class MeasureError(RuntimeError):
    """A run that could not be measured (it failed, or trained too few steps); the message says why."""


def _positive(_instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0):
        raise ValueError(f"{attribute.name} must be > 0, got {value!r}")


@attrs.frozen
class Measurements:
    """What one run measured; seconds unless named otherwise. ``None``: the run had nothing to measure it from.

    ``step_time_s`` maps a pipeline count to its mean clean interval, ``step_intervals`` to how many intervals
    that mean is of. ``market_start_s`` is when the market's clock started (the end of the first step).
    """

    system: str
    stages: int
    pipelines: int
    samples_per_step: int
    steps: int
    samples: int
    step_time_s: dict[int, float]
    step_intervals: dict[int, int]
    startup_s: float
    market_start_s: float
    failover_pause_s: float | None = None
    fallback_slowdown: float | None = None
    reconfiguration_s: float | None = None
    instance_creation_s: float | None = None
    restart_s: float | None = None
    join_restart_s: float | None = None
    checkpoint_s: float | None = None
    checkpoint_every: int | None = None
    counts: dict[str, int] = attrs.field(factory=dict)

    def to_dict(self) -> dict[str, Any]:
        document = attrs.asdict(self)
        document["step_time_s"] = {str(k): v for k, v in sorted(self.step_time_s.items())}
        document["step_intervals"] = {str(k): v for k, v in sorted(self.step_intervals.items())}
        return document


def _mean(values: Sequence[float]) -> float | None:
    return statistics.fmean(values) if values else None


def measure_events(
    events: Sequence[Any],
    system: str,
    *,
    warm_unix: Mapping[str, float] | None = None,
    restarts: Sequence[Any] = (),
    checkpoint_every: int | None = None,
) -> Measurements:
    """The constants of one run from its event log (see the module docstring).

    ``warm_unix`` maps a node to the wall time its worker was warm (bamboo); ``restarts`` are the baseline's
    :class:`bamboo.launch.baseline.RestartCost` values; ``checkpoint_every`` is the steps between checkpoints.
    """
    from bamboo.launch.events import (
        Checkpoint,
        Failover,
        Join,
        Preemption,
        Reconfiguration,
        Restore,
        RunStart,
        Step,
    )

    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    ordered = sorted(events, key=lambda e: e.t)
    starts = [e for e in ordered if isinstance(e, RunStart)]
    if not starts:
        raise MeasureError("the event log has no run_start record")
    start = starts[0]
    stages = start.stages
    steps = [e for e in ordered if isinstance(e, Step)]
    if len(steps) < 3:
        raise MeasureError(f"the run trained {len(steps)} step(s); a profile needs at least 3")
    samples_per_step = steps[0].samples
    seen: set[int] = set()
    samples = 0
    for step in steps:
        if step.step not in seen:
            seen.add(step.step)
            samples += step.samples

    # Which step each failover interrupted: the step record closest to the failed step's end.
    failed_steps: set[int] = set()
    for failover in (e for e in ordered if isinstance(e, Failover)):
        if failover.step_end_unix is not None:
            at = failover.step_end_unix - start.unix_time
            failed_steps.add(min(range(len(steps)), key=lambda i: abs(steps[i].t - at)))
        else:
            later = [i for i, s in enumerate(steps) if s.t >= failover.t - failover.pause_s]
            if later:
                failed_steps.add(later[0])

    marks = [e for e in ordered if isinstance(e, (Reconfiguration, Restore, Checkpoint, Preemption))]
    layout = max(1, steps[0].nodes_active // stages)  # bamboo: the first layout's pipelines
    clean: dict[int, list[float]] = {}
    failover_intervals: list[tuple[int, float]] = []
    degraded: list[tuple[int, float]] = []
    reconfigurations: list[tuple[int, float]] = []
    checkpoint_intervals: list[tuple[int, float]] = []
    in_failover = False
    cursor = 0
    for i in range(1, len(steps)):
        lo, hi = steps[i - 1].t, steps[i].t
        inside = []
        while cursor < len(marks) and marks[cursor].t <= hi:
            if marks[cursor].t > lo:
                inside.append(marks[cursor])
            cursor += 1
        reconfigured = [m for m in inside if isinstance(m, Reconfiguration)]
        if system == "checkpoint":
            pipelines = max(1, steps[i].nodes_active // stages)
        else:
            if reconfigured:
                layout = max(1, reconfigured[-1].pipelines)
            pipelines = layout
        interval = hi - lo
        if reconfigured or any(isinstance(m, Restore) for m in inside):
            reconfigurations.append((pipelines, interval))
            in_failover = False
        elif i in failed_steps:
            failover_intervals.append((pipelines, interval))
            in_failover = True
        elif in_failover:
            degraded.append((pipelines, interval))
        elif any(isinstance(m, Preemption) for m in inside):
            continue  # a kill the next records explain (a failover, a restart), or a standby node's
        elif any(isinstance(m, Checkpoint) for m in inside):
            checkpoint_intervals.append((pipelines, interval))
        elif i >= 2:  # the first interval holds the first step's warm-up
            clean.setdefault(pipelines, []).append(interval)
    step_time = {d: statistics.fmean(values) for d, values in clean.items()}
    if not step_time:
        raise MeasureError(f"no interval between two steps was free of failovers, reconfigurations, restarts and "
                           f"checkpoints in {len(steps)} steps, so there is no step time to measure")

    def base(pipelines: int) -> float:
        if pipelines in step_time:
            return step_time[pipelines]
        return step_time[min(step_time, key=lambda d: (abs(d - pipelines), -d))]

    excess = [max(0.0, interval - base(d)) for d, interval in failover_intervals]
    slowdown = [interval / base(d) for d, interval in degraded]
    reconfiguration = [max(0.0, interval - base(d)) for d, interval in reconfigurations]
    checkpoint_cost = [max(0.0, interval - base(d)) for d, interval in checkpoint_intervals]

    creation: list[float] = []
    if warm_unix:
        for join in (e for e in ordered if isinstance(e, Join) and e.t > 0.5 and e.node in warm_unix):
            creation.append(max(0.0, warm_unix[join.node] - (start.unix_time + join.t)))
    changes = sorted([(start.unix_time + e.t, "kill") for e in ordered if isinstance(e, Preemption)]
                     + [(start.unix_time + e.t, "join") for e in ordered if isinstance(e, Join) and e.t > 0.5])
    kill_restarts: list[float] = []
    join_restarts: list[float] = []
    for restart in restarts:
        # The last interruption before the restarted workers started (later ones did not restart them).
        before = [change for change in changes if change[0] <= restart.process_start_unix]
        at, cause = max(before) if before else (restart.at_unix, restart.cause)
        at, cause = max((at, cause), (restart.at_unix, restart.cause))
        (kill_restarts if cause == "kill" else join_restarts).append(restart.first_step_start_unix - at)
    first = steps[0]
    counts = {
        "steps": len(seen), "step_records": len(steps),
        "failovers": sum(isinstance(e, Failover) for e in ordered),
        "reconfigurations": sum(isinstance(e, Reconfiguration) for e in ordered),
        "restores": sum(isinstance(e, Restore) for e in ordered),
        "checkpoints": len({e.step for e in ordered if isinstance(e, Checkpoint)}),
        "preemptions": sum(isinstance(e, Preemption) for e in ordered),
        "joins": sum(isinstance(e, Join) and e.t > 0.5 for e in ordered),
        "restarts_after_kills": len(kill_restarts), "restarts_after_joins": len(join_restarts),
    }
    restart_s = _mean(kill_restarts)
    join_restart_s = _mean(join_restarts)
    return Measurements(
        system=system, stages=stages, pipelines=start.pipelines, samples_per_step=samples_per_step,
        steps=len(seen), samples=samples, step_time_s=step_time,
        step_intervals={d: len(values) for d, values in clean.items()},
        startup_s=max(0.0, first.t - first.duration_s - start.t), market_start_s=max(0.0, first.t - start.t),
        failover_pause_s=_mean(excess), fallback_slowdown=_mean(slowdown),
        reconfiguration_s=_mean(reconfiguration), instance_creation_s=_mean(creation),
        restart_s=restart_s, join_restart_s=join_restart_s, checkpoint_s=_mean(checkpoint_cost),
        checkpoint_every=checkpoint_every, counts=counts,
    )


def profile_document(
    measured: Measurements,
    *,
    name: str,
    spot_price: float,
    on_demand_price: float,
    description: str = "",
    extra_notes: Sequence[str] = (),
) -> dict[str, Any]:
    """The measured profile in bamboo-bench's format (``format`` 1; see the module docstring for each key)."""
    stages, pipelines = measured.stages, measured.pipelines
    notes = [f"Measured by bamboo-launch measure {measured.system}: {measured.steps} steps "
             f"({measured.counts.get('step_records', measured.steps)} step records), start-up "
             f"{measured.startup_s:.2f} s; counts {json.dumps(measured.counts, sort_keys=True)}."]
    table: dict[int, float] = {}
    for d in range(1, pipelines + 1):
        if d in measured.step_time_s:
            table[d] = measured.step_time_s[d]
            notes.append(f"step time with {d} pipeline(s): {1000 * table[d]:.1f} ms, the mean of "
                         f"{measured.step_intervals[d]} clean intervals")
        else:
            nearest = min(measured.step_time_s, key=lambda k: (abs(k - d), -k))
            table[d] = measured.step_time_s[nearest]
            notes.append(f"step time with {d} pipeline(s): not trained in this run; {1000 * table[d]:.1f} ms, "
                         f"the time measured with {nearest} (the nodes share one machine's cores, so a step's work is "
                         f"the global batch whatever the pipeline count)")
    full = table[pipelines]
    timing: dict[str, Any] = {"startup_s": measured.startup_s, "global_rendezvous_s": 0.0,
                              "local_rendezvous_s": 0.0}

    def noted(key: str, value: float | None, fallback: float, what: str) -> None:
        if value is None:
            timing[key] = fallback
            notes.append(f"{key}: not measured in this run ({what}); {fallback:g}")
        else:
            timing[key] = value
            notes.append(f"{key}: {value:.3f} measured ({what})")

    restart_on_join = "new-pipeline"
    if measured.system == "bamboo":
        noted("failover_pause_s", measured.failover_pause_s, 0.0, "the failed step's extra time")
        noted("fallback_slowdown", measured.fallback_slowdown, 1.0, "steps between a failover and its rebuild")
        noted("reconfiguration_s", measured.reconfiguration_s, 0.0,
              "the extra time of a step interval holding a reconfiguration")
        noted("instance_creation_s", measured.instance_creation_s, measured.startup_s,
              "from a later node's join to its warm worker; unmeasured: the cold start")
        timing["restart_s"] = 0.0
    elif measured.system == "checkpoint":
        restart = measured.restart_s
        if restart is None and measured.join_restart_s is not None:
            restart = measured.join_restart_s
            notes.append(f"restart_s: {restart:.3f}, the restarts after a join (no restart whose last interruption "
                         "was a kill reached a step; a join's restart is taken to cost the same)")
        elif restart is None:
            restart = measured.startup_s
            notes.append(f"restart_s: no restart after a kill reached a step in this run; {restart:.3f}, the cold "
                         "start (process start, imports, group, engine)")
        else:
            notes.append(f"restart_s: {restart:.3f} measured (from the last kill before the restarted workers' start "
                         f"to their first step, mean of {measured.counts.get('restarts_after_kills', 0)})")
        timing["restart_s"] = restart
        creation = 0.0 if measured.join_restart_s is None else max(0.0, measured.join_restart_s - restart)
        timing["instance_creation_s"] = creation
        if measured.join_restart_s is None or measured.restart_s is None:
            notes.append("instance_creation_s: no restart after a join and one after a kill both reached a step in "
                         "this run; 0")
        else:
            notes.append(f"instance_creation_s: {creation:.3f}, a join's restart ({measured.join_restart_s:.3f}, "
                         f"mean of {measured.counts.get('restarts_after_joins', 0)}) less a kill's")
        restart_on_join = "every-join"
        timing["failover_pause_s"] = 0.0
        timing["reconfiguration_s"] = 0.0
        timing["fallback_slowdown"] = 1.0
    else:
        timing.update(instance_creation_s=0.0, reconfiguration_s=0.0, failover_pause_s=0.0, fallback_slowdown=1.0,
                      restart_s=0.0)
    checkpoint_s = measured.checkpoint_s or 0.0
    every = measured.checkpoint_every
    if every is None:
        timing["checkpoint_interval_s"] = max(3600.0, 10 * checkpoint_s + 1.0)
        notes.append("checkpoint_interval_s: this run wrote no periodic checkpoints; 3600")
    else:
        timing["checkpoint_interval_s"] = every * full + checkpoint_s
        notes.append(f"checkpoint_interval_s: {every} steps of {1000 * full:.1f} ms and the checkpoint's "
                     f"{checkpoint_s:.3f} s")
    timing["checkpoint_s"] = checkpoint_s
    if measured.checkpoint_s is not None:
        notes.append(f"checkpoint_s: {checkpoint_s:.3f} measured (a step interval holding a checkpoint, less a step)")
    on_demand_rate = measured.samples_per_step / full
    notes.append(f"on_demand: {stages * pipelines} nodes at {on_demand_rate:.2f} samples/s, this run's "
                 f"{pipelines}-pipeline step time" + (f", {measured.startup_s:.2f} s to the first step"
                                                      if measured.system == "on-demand" else ""))
    notes.extend(extra_notes)
    document: dict[str, Any] = {
        "format": 1,
        "name": name,
        "description": description or f"measured {measured.system} run: P={stages}, D={pipelines}",
        "stages": stages,
        "pipelines": pipelines,
        "samples_per_step": measured.samples_per_step,
        "step_time_ms": [{"stages": stages, "pipelines": d, "ms": 1000.0 * table[d]} for d in sorted(table)],
        "step_time_scale": 1.0,
        "prices": {"spot_per_node_hour": spot_price, "on_demand_per_node_hour": on_demand_price},
        "on_demand": {"nodes": stages * pipelines, "samples_per_second": on_demand_rate},
        "job_samples": float(max(1, measured.samples)),
        "timing": timing,
        "notes": notes,
    }
    if measured.system == "on-demand":
        document["on_demand"]["startup_s"] = measured.startup_s
    if restart_on_join != "new-pipeline":
        document["checkpoint_restart_on_join"] = restart_on_join
    return document


# ---- running one system ----------------------------------------------------------------------------------------


@attrs.frozen
class MeasureOptions:
    """One measured run (see ``bamboo-launch measure --help``). Exactly one of ``steps`` and ``duration_s``."""

    system: str = attrs.field(validator=attrs.validators.in_(SYSTEMS))
    nodes: int
    stages: int
    pipelines: int
    run_dir: str
    steps: int | None = attrs.field(default=None, validator=_positive)
    duration_s: float | None = attrs.field(default=None, validator=_positive)
    preemptions: str | None = None
    time_scale: float = attrs.field(default=60.0, validator=_positive)
    hours: float = attrs.field(default=1.0, validator=_positive)
    trace_seed: int = 0
    zones: tuple[str, ...] | None = None
    layers: int = 4
    script: tuple[str, ...] = ()
    checkpoint_every: int = 10
    """bamboo: steps between its asynchronous checkpoints (the baseline chooses K by Young's rule)."""
    ttl: int = 10
    grace_s: float = 10.0
    timeout_s: float = 1800.0
    spot_price: float = 0.918
    on_demand_price: float = 3.06
    bins: int = 60

    def __attrs_post_init__(self) -> None:
        if (self.steps is None) == (self.duration_s is None):
            raise ValueError("give --steps or --duration (one of them)")
        if self.stages < 1 or self.pipelines < 1:
            raise ValueError(f"stages and pipelines must be >= 1, got {self.stages} and {self.pipelines}")
        if self.nodes < self.stages:
            raise ValueError(f"--nodes {self.nodes} is too few for one pipeline of {self.stages} stages")
        if self.nodes < self.stages * self.pipelines:
            raise ValueError(f"--nodes {self.nodes} cannot hold {self.pipelines} pipelines of {self.stages} stages "
                             f"(needs at least {self.stages * self.pipelines})")
        if self.system == "checkpoint" and self.script:
            raise ValueError("the checkpoint/restart baseline trains the built-in example only; give no script, or "
                             "leave checkpoint out")

    @property
    def max_steps(self) -> int:
        return self.steps if self.steps is not None else 10**9


class _Stopper:
    """Ends a run ``duration_s`` after the market started (the ``during`` callback starts with the market)."""

    def __init__(self, duration_s: float | None, say: Callable[[str], None]) -> None:
        self.duration_s = duration_s
        self.say = say
        self.done = threading.Event()

    def wait(self) -> bool:
        """Sleep until the deadline (True) or until :meth:`cancel` (False)."""
        if self.duration_s is None:
            return False
        return not self.done.wait(self.duration_s)

    def cancel(self) -> None:
        self.done.set()


def run_measured(options: MeasureOptions, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``options.system`` to its end and measure it; the JSON-ready result (``report``, ``measurements``,
    ``profile``, ``timeline``, ...). Raises :class:`MeasureError` when the run fails."""
    from bamboo.launch.events import read_events
    from bamboo.launch.report import Prices, ReportError, compute_report, compute_timeline

    say = progress or (lambda line: None)
    run_dir = Path(options.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stopper = _Stopper(options.duration_s, say)
    extra: dict[str, Any] = {}
    warm: dict[str, float] = {}
    restarts: Sequence[Any] = ()
    checkpoint_every: int | None = None
    started = time.monotonic()
    try:
        if options.system == "checkpoint":
            events_path, restarts, checkpoint_every, extra = _run_checkpoint(options, run_dir, stopper, say)
        else:
            events_path, warm, extra = _run_bamboo(options, run_dir, stopper, say)
            checkpoint_every = options.checkpoint_every if options.system == "bamboo" else None
    finally:
        stopper.cancel()
    events = read_events(events_path)
    price = options.on_demand_price if options.system == "on-demand" else options.spot_price
    prices = Prices(spot=price, on_demand=options.on_demand_price)
    try:
        report = compute_report(events, prices)
        timeline = compute_timeline(events, prices, options.bins)
    except ReportError as error:
        raise MeasureError(f"{options.system}: {error} (run dir {run_dir})") from None
    measured = measure_events(events, options.system, warm_unix=warm, restarts=restarts,
                              checkpoint_every=checkpoint_every)
    document = profile_document(measured, name=f"measured-{options.system}", spot_price=options.spot_price,
                                on_demand_price=options.on_demand_price)
    profile_path = run_dir / "profile.json"
    profile_path.write_text(json.dumps(document, indent=2) + "\n")
    return {
        "system": options.system,
        "run_dir": str(run_dir),
        "events": str(events_path),
        "profile": str(profile_path),
        "seconds": time.monotonic() - started,
        "price_per_node_hour": price,
        "report": report.to_dict(),
        "measurements": measured.to_dict(),
        "timeline": {"times": list(timeline.times), "nodes": list(timeline.nodes),
                     "throughput": list(timeline.throughput), "preemptions": list(timeline.preemption_times)},
        **extra,
    }


def _run_bamboo(options: MeasureOptions, run_dir: Path, stopper: _Stopper,
                say: Callable[[str], None]) -> tuple[Path, dict[str, float], dict[str, Any]]:
    from bamboo.launch.records import WorkerWarm
    from bamboo.launch.run import RunError, RunOptions, run_cluster

    on_demand = options.system == "on-demand"
    run_options = RunOptions(
        nodes=options.stages * options.pipelines if on_demand else options.nodes, stages=options.stages,
        pipelines=options.pipelines, steps=options.max_steps, zones=options.zones,
        preemptions=None if on_demand else options.preemptions, time_scale=options.time_scale, hours=options.hours,
        trace_seed=options.trace_seed, checkpoint_dir=None if on_demand else str(run_dir / "checkpoints"),
        checkpoint_every=options.checkpoint_every, run_dir=str(run_dir), job=None,
        redundancy="none" if on_demand else "eflb", size={} if options.script else {"layers": options.layers},
        ttl=options.ttl, grace_s=options.grace_s, timeout_s=options.timeout_s, live=False, progress_every=50,
        script=options.script)
    warm: dict[str, float] = {}
    stopped = threading.Event()

    def during(handles: Any) -> None:
        def poll() -> None:
            try:
                for item in handles.membership.kv.get_prefix(handles.membership.keys.decision("warm-")):
                    record = WorkerWarm.from_dict(json.loads(item.value))
                    warm.setdefault(record.node, record.at)
            except Exception as error:  # etcd closing at the run's end
                say(f"could not read the warm records: {error}")

        def watch() -> None:
            while not stopper.done.wait(0.5):
                poll()

        threading.Thread(target=watch, name="measure-warm", daemon=True).start()
        if stopper.wait():
            poll()
            say(f"{options.duration_s:g} s since the first step: stopping every node")
            stopped.set()
            handles.cluster.close()

    try:
        result = run_cluster(run_options, progress=say, during=during)
    except RunError as error:
        raise MeasureError(f"{options.system}: {error} (node logs: {run_dir / 'logs'})") from None
    if result.job_error and not stopped.is_set():
        raise MeasureError(f"{options.system}: the job failed: {result.job_error} (node logs: {run_dir / 'logs'})")
    if result.timed_out:
        raise MeasureError(f"{options.system}: the run did not end within {options.timeout_s:g} s "
                           f"(node logs: {run_dir / 'logs'})")
    return result.events, warm, {"stopped": stopped.is_set(), "warm_unix": warm}


def _run_checkpoint(options: MeasureOptions, run_dir: Path, stopper: _Stopper,
                    say: Callable[[str], None]) -> tuple[Path, Sequence[Any], int | None, dict[str, Any]]:
    from bamboo.launch.baseline import BaselineError, CheckpointRestartOptions, run_checkpoint_restart

    baseline = CheckpointRestartOptions(
        nodes=options.nodes, stages=options.stages, pipelines=options.pipelines, steps=options.max_steps,
        zones=options.zones, preemptions=options.preemptions, time_scale=options.time_scale, hours=options.hours,
        trace_seed=options.trace_seed, run_dir=str(run_dir), size={"layers": options.layers},
        timeout_s=options.timeout_s)

    def during(handles: Any) -> None:
        if stopper.wait():
            say(f"{options.duration_s:g} s since the first step: stopping every node")
            handles.stop()

    try:
        result = run_checkpoint_restart(baseline, progress=say, during=during)
    except BaselineError as error:
        raise MeasureError(f"checkpoint: {error} (logs: {run_dir / 'logs'})") from None
    if result.timed_out:
        raise MeasureError(f"checkpoint: the run did not end within {options.timeout_s:g} s (logs: {run_dir / 'logs'})")
    interval = result.interval
    extra = {
        "stopped": result.stopped,
        "checkpoint_interval": None if interval is None else {**interval.to_dict(), "describe": interval.describe()},
        "restarts": [r.to_dict() for r in result.restarts],
        "job_restarts": result.job_restarts,
        "interruptions": {"kills": result.interruptions.kills, "joins": result.interruptions.joins},
    }
    return result.events, result.restarts, None if interval is None else interval.steps, extra
