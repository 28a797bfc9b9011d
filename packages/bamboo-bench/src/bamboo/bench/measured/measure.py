"""Measured runs: one system of a comparison on the emulated spot market, and the profile it measures.

``bamboo-bench measure SYSTEM`` (:mod:`bamboo.bench.measured.run`; ``bamboo-bench compare`` runs it once per
system) trains the built-in example (or a user script) with one of three systems on the same market:

- ``bamboo``: ``bamboo-launch run`` (:func:`bamboo.bench.emulated.run.run_cluster`) with eager redundant computation,
  on the trace's nodes;
- ``checkpoint``: the checkpoint/restart system users run today (:func:`bamboo.bench.measured.torchrun.run_checkpoint_restart`:
  torchrun elastic agents, DeepSpeed's ``PipelineEngine``, checkpoints every K steps by Young's rule);
- ``on-demand``: ``bamboo-launch run`` without redundancy and without preemptions on ``P x D`` nodes (the
  cluster priced at on-demand rates).

A run ends after ``steps`` steps, or ``duration_s`` wall seconds after its first step (trace time runs from
the first step): every node is then stopped, as a budget's end would, and the report covers the run up to
then. :func:`measure_events` reads what the run cost from its event log, and :func:`measured_profile` makes
it a :class:`bamboo.bench.profile.ModelProfile` (written in the profile format, ``format`` 1), so
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
  reconfiguration, over the step time; **rebuild delay**: from a failover's preemption record to the next
  reconfiguration record (the layout that rebuilt redundancy, prepared while training went on), for each
  failover that no other one followed first; **reconfiguration**: the interval holding a ``reconfiguration``
  record less the step time at its new pipeline count (``local_rendezvous_s`` is 0: the whole cost is here);
- **instance creation** (bamboo): from a node's ``join`` to its worker's ``warm-<node>`` record (model
  built, ready for a role), for the nodes that joined after the start;
- **instance creation** (checkpoint): from a node's ``join`` to its torchrun agent's entry into the rendezvous
  (``warm_unix``: :mod:`bamboo.bench.measured.rendezvous`), when the running agents see it waiting and restart,
  for the nodes added later that entered before they were killed; if none did, for the nodes of the start
  (their agents start together);
- **restart** (checkpoint): from the last interruption before the restarted workers' process start to their
  first step (``RestartCost``): the simulator starts a restart over at every interruption during it, so a
  restart counted from an earlier kill it took in would count those over again. A join interrupts at its
  agent's entry into the rendezvous, and a node killed before its entry interrupts nothing; ``restart_s`` is
  the mean over the restarts after kills and after joins. A run without the agents' entries (no
  ``warm_unix``) counts a join at the ``join`` record: restarts whose last interruption was a kill give
  ``restart_s``, and a join's restart costs ``instance_creation_s`` more: the mean of the join restarts less
  that of the kill restarts (``checkpoint_restart_on_join`` is ``every-join`` either way);
- **checkpoint cost** (``timing.checkpoint_s``): the interval holding a checkpoint, less the step time; the
  interval between checkpoints is K (or bamboo's ``--checkpoint-every``) steps plus that cost;
- **on-demand rate** (``on_demand.samples_per_second``): a step's samples over the step time, and for the runs
  of ``bamboo-launch`` (bamboo and on-demand, which write a checkpoint every ``--checkpoint-every`` steps) over
  that interval with its checkpoint: the simulator charges on-demand no checkpoints of its own.

Constants a run could not measure (no failover, no restart, ...) take a value that changes nothing in the
simulator (no pause, no slowdown) or, for a restart, the measured cold start, and ``notes`` says so.
"""

from __future__ import annotations

import json
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

import attrs
from bamboo.bench import timeouts
from bamboo.bench.measured.baseline import RestartCost
from bamboo.bench.measured.options import SYSTEMS, MeasureError
from bamboo.bench.measured.progress import interruptions
from bamboo.bench.profile import ModelProfile, Timing
from bamboo.launch.events import (
    Checkpoint,
    Event,
    Failover,
    Join,
    Preemption,
    Reconfiguration,
    Restore,
    RunStart,
    Step,
)

__all__ = ["Measurements", "measure_events", "measured_profile", "step_time_measured"]

PROFILE_MIN_STEPS = 3
"""The fewest steps a run's profile is measured from: a step time needs an interval between two steps free of
failovers and restarts, beside the first step's start-up (:func:`step_time_measured`)."""


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
    rebuild_delay_s: float | None = None
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


@attrs.define
class _Intervals:
    """The intervals between consecutive step records, sorted by what happened inside each: ``(pipelines,
    seconds)`` pairs, and the clean ones per pipeline count."""

    clean: dict[int, list[float]] = attrs.field(factory=dict)
    failover: list[tuple[int, float]] = attrs.field(factory=list)
    degraded: list[tuple[int, float]] = attrs.field(factory=list)
    reconfiguration: list[tuple[int, float]] = attrs.field(factory=list)
    checkpoint: list[tuple[int, float]] = attrs.field(factory=list)


def _failed_steps(ordered: Sequence[Event], steps: Sequence[Step], start: RunStart) -> set[int]:
    """Which step record each failover interrupted: the one closest to the failed step's end."""
    failed: set[int] = set()
    for failover in (e for e in ordered if isinstance(e, Failover)):
        if failover.step_end_unix is not None:
            at = failover.step_end_unix - start.unix_time
            failed.add(min(range(len(steps)), key=lambda i: abs(steps[i].t - at)))
        else:
            later = [i for i, s in enumerate(steps) if s.t >= failover.t - failover.pause_s]
            if later:
                failed.add(later[0])
    return failed


def _sort_intervals(ordered: Sequence[Event], steps: Sequence[Step], system: str, stages: int,
                    failed_steps: set[int]) -> _Intervals:
    marks = [e for e in ordered if isinstance(e, (Reconfiguration, Restore, Checkpoint, Preemption))]
    layout = max(1, steps[0].nodes_active // stages)  # bamboo: the first layout's pipelines
    found = _Intervals()
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
            found.reconfiguration.append((pipelines, interval))
            in_failover = False
        elif i in failed_steps:
            found.failover.append((pipelines, interval))
            in_failover = True
        elif in_failover:
            found.degraded.append((pipelines, interval))
        elif any(isinstance(m, Preemption) for m in inside):
            continue  # a kill the next records explain (a failover, a restart), or a standby node's
        elif any(isinstance(m, Checkpoint) for m in inside):
            found.checkpoint.append((pipelines, interval))
        elif i >= 2:  # the first interval holds the first step's warm-up
            found.clean.setdefault(pipelines, []).append(interval)
    return found


def _restart_times(ordered: Sequence[Event], start: RunStart, restarts: Sequence[RestartCost],
                   registered_unix: Mapping[str, float]) -> tuple[list[float], list[float]]:
    """Seconds from each restart's last interruption (:func:`~bamboo.bench.measured.progress.interruptions`) to
    its first step: ``(after kills, after joins)``."""
    changes = interruptions(ordered, start, registered_unix)
    kills: list[float] = []
    joins: list[float] = []
    for restart in restarts:
        # The last interruption before the restarted workers started (later ones did not restart them).
        before = [change for change in changes if change[0] <= restart.process_start_unix]
        at, cause = max(before) if before else (restart.at_unix, restart.cause)
        at, cause = max((at, cause), (restart.at_unix, restart.cause))
        (kills if cause == "kill" else joins).append(restart.first_step_start_unix - at)
    return kills, joins


def _read_intervals(events: Sequence[Event], system: str) -> tuple[list[Event], RunStart, list[Step], _Intervals]:
    """``events`` in time order, the run's start, its step records and their intervals sorted by what happened in
    each; raises :class:`MeasureError` when they hold no step time (see :func:`step_time_measured`)."""
    ordered = sorted(events, key=lambda e: e.t)
    start = next((e for e in ordered if isinstance(e, RunStart)), None)
    if start is None:
        raise MeasureError("the event log has no run_start record")
    steps = [e for e in ordered if isinstance(e, Step)]
    if len(steps) < PROFILE_MIN_STEPS:
        raise MeasureError(f"the run trained {len(steps)} step(s); a profile needs at least {PROFILE_MIN_STEPS}")
    found = _sort_intervals(ordered, steps, system, start.stages, _failed_steps(ordered, steps, start))
    if not found.clean:
        raise MeasureError(f"no interval between two steps was free of failovers, reconfigurations, restarts and "
                           f"checkpoints in {len(steps)} steps, so there is no step time to measure")
    return ordered, start, steps, found


def step_time_measured(events: Sequence[Event], system: str) -> bool:
    """Whether ``events`` (a run's log so far) already give a step time: at least `PROFILE_MIN_STEPS` steps, and
    an interval between two of them, after the first step's warm-up, free of failovers, reconfigurations,
    restarts and checkpoints. A measured run whose window ends without one goes on until it has one."""
    try:
        _read_intervals(events, system)
    except MeasureError:
        return False
    return True


def measure_events(
    events: Sequence[Event],
    system: str,
    *,
    warm_unix: Mapping[str, float] | None = None,
    restarts: Sequence[RestartCost] = (),
    checkpoint_every: int | None = None,
) -> Measurements:
    """The constants of one run from its event log (see the module docstring).

    ``warm_unix`` maps a node to the wall time it was ready to join: its worker was warm (bamboo), its torchrun
    agent entered the rendezvous (checkpoint); ``restarts`` are the baseline's
    :class:`bamboo.bench.measured.baseline.RestartCost` values; ``checkpoint_every`` is the steps between
    checkpoints.
    """
    if system not in SYSTEMS:
        raise ValueError(f"unknown system {system!r}; choose from {', '.join(SYSTEMS)}")
    ordered, start, steps, found = _read_intervals(events, system)
    unique = {step.step: step.samples for step in reversed(steps)}  # the first record of each step
    step_time = {d: statistics.fmean(values) for d, values in found.clean.items()}

    def extra(intervals: Sequence[tuple[int, float]]) -> float | None:
        return _mean([max(0.0, interval - _nearest(step_time, d)) for d, interval in intervals])

    warm = warm_unix or {}
    creation = _creation_times(ordered, start, warm, initial=False)
    if not creation and system == "checkpoint":
        creation = _creation_times(ordered, start, warm, initial=True)
    kill_restarts, join_restarts = _restart_times(ordered, start, restarts, warm if system == "checkpoint" else {})
    counts = {
        "steps": len(unique), "step_records": len(steps),
        "failovers": sum(isinstance(e, Failover) for e in ordered),
        "reconfigurations": sum(isinstance(e, Reconfiguration) for e in ordered),
        "restores": sum(isinstance(e, Restore) for e in ordered),
        "checkpoints": len({e.step for e in ordered if isinstance(e, Checkpoint)}),
        "preemptions": sum(isinstance(e, Preemption) for e in ordered),
        "joins": sum(isinstance(e, Join) and e.t > timeouts.MEASURE_JOIN_AFTER_START_S for e in ordered),
        "restarts_after_kills": len(kill_restarts), "restarts_after_joins": len(join_restarts),
        "joins_ready": sum(isinstance(e, Join) and e.t > timeouts.MEASURE_JOIN_AFTER_START_S and e.node in warm
                           for e in ordered),
    }
    first = steps[0]
    return Measurements(
        system=system, stages=start.stages, pipelines=start.pipelines, samples_per_step=first.samples,
        steps=len(unique), samples=sum(unique.values()), step_time_s=step_time,
        step_intervals={d: len(values) for d, values in found.clean.items()},
        startup_s=max(0.0, first.t - first.duration_s - start.t), market_start_s=max(0.0, first.t - start.t),
        failover_pause_s=extra(found.failover),
        fallback_slowdown=_mean([interval / _nearest(step_time, d) for d, interval in found.degraded]),
        rebuild_delay_s=_mean(_rebuild_delays(ordered)),
        reconfiguration_s=extra(found.reconfiguration), instance_creation_s=_mean(creation),
        restart_s=_mean(kill_restarts), join_restart_s=_mean(join_restarts), checkpoint_s=extra(found.checkpoint),
        checkpoint_every=checkpoint_every, counts=counts,
    )


def _rebuild_delays(ordered: Sequence[Event]) -> list[float]:
    """Seconds from each failover's preemption to the reconfiguration that rebuilt its redundancy: the next
    reconfiguration record, for the failovers with no other failover before it (the simulator counts the delay
    from the latest failover)."""
    delays = []
    for index, failover in enumerate(ordered):
        if not isinstance(failover, Failover):
            continue
        later = ordered[index + 1:]
        rebuild = next((e for e in later if isinstance(e, Reconfiguration | Failover)), None)
        if not isinstance(rebuild, Reconfiguration):
            continue
        killed = [e.t for e in ordered[:index] if isinstance(e, Preemption) and e.node == failover.victim]
        delays.append(max(0.0, rebuild.t - (killed[-1] if killed else failover.t)))
    return delays


def _creation_times(ordered: Sequence[Event], start: RunStart, warm_unix: Mapping[str, float],
                    initial: bool) -> list[float]:
    """Seconds from each node's ``join`` to its ``warm_unix`` time: the nodes the market added later, or
    (``initial``) the nodes of the start, which started together."""
    later = timeouts.MEASURE_JOIN_AFTER_START_S
    return [max(0.0, warm_unix[e.node] - (start.unix_time + e.t)) for e in ordered
            if isinstance(e, Join) and (e.t <= later if initial else e.t > later) and e.node in warm_unix]


def _nearest(step_time: Mapping[int, float], pipelines: int) -> float:
    """The step time at ``pipelines``, or at the nearest count measured (the larger of two as near)."""
    if pipelines in step_time:
        return step_time[pipelines]
    return step_time[min(step_time, key=lambda d: (abs(d - pipelines), -d))]


def _step_table(measured: Measurements, notes: list[str]) -> dict[int, float]:
    """Seconds per step at every pipeline count up to the run's, each measured or taken from the nearest."""
    table: dict[int, float] = {}
    for d in range(1, measured.pipelines + 1):
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
    return table


def _checkpoint_restart_timing(measured: Measurements, notes: list[str]) -> dict[str, float]:
    """The baseline's restart costs, and how long a node the market adds takes to interrupt the job."""
    if measured.instance_creation_s is None:
        return _checkpoint_restart_timing_unregistered(measured, notes)
    counts = measured.counts
    kills, joins = counts.get("restarts_after_kills", 0), counts.get("restarts_after_joins", 0)
    timed = [(measured.restart_s, kills), (measured.join_restart_s, joins)]
    total = sum(n for value, n in timed if value is not None)
    if total:
        restart = sum(value * n for value, n in timed if value is not None) / total
        notes.append(f"restart_s: {restart:.3f} measured (from the interruption that took effect last before the "
                     f"restarted workers' start, a kill or a joining agent's entry into the rendezvous, to their first "
                     f"step; mean of {kills} after kills and {joins} after joins)")
    else:
        restart = measured.startup_s
        notes.append(f"restart_s: no restart reached a step in this run; {restart:.3f}, the cold start (process "
                     "start, imports, group, engine)")
    ready, added = counts.get("joins_ready", 0), counts.get("joins", 0)
    source = (f"the {ready} of {added} nodes added later whose agent entered before it was killed" if ready else
              "no node added later entered before it was killed; the nodes of the start, whose agents started "
              "together")
    notes.append(f"instance_creation_s: {measured.instance_creation_s:.3f} measured (from a node's join to its "
                 f"torchrun agent's entry into the rendezvous, when the running agents see it and restart; {source})")
    return {"restart_s": restart, "instance_creation_s": measured.instance_creation_s, "failover_pause_s": 0.0,
            "reconfiguration_s": 0.0, "fallback_slowdown": 1.0}


def _checkpoint_restart_timing_unregistered(measured: Measurements, notes: list[str]) -> dict[str, float]:
    """Without the agents' rendezvous entries: a restart after a kill, and what a join's restart costs more."""
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
    creation = 0.0 if measured.join_restart_s is None else max(0.0, measured.join_restart_s - restart)
    if measured.join_restart_s is None or measured.restart_s is None:
        notes.append("instance_creation_s: no restart after a join and one after a kill both reached a step in "
                     "this run; 0")
    else:
        notes.append(f"instance_creation_s: {creation:.3f}, a join's restart ({measured.join_restart_s:.3f}, "
                     f"mean of {measured.counts.get('restarts_after_joins', 0)}) less a kill's")
    return {"restart_s": restart, "instance_creation_s": creation, "failover_pause_s": 0.0,
            "reconfiguration_s": 0.0, "fallback_slowdown": 1.0}


def _bamboo_timing(measured: Measurements, notes: list[str]) -> dict[str, float]:
    timing: dict[str, float] = {"restart_s": 0.0}

    def noted(key: str, value: float | None, fallback: float, what: str) -> None:
        timing[key] = fallback if value is None else value
        notes.append(f"{key}: not measured in this run ({what}); {fallback:g}" if value is None
                     else f"{key}: {value:.3f} measured ({what})")

    noted("failover_pause_s", measured.failover_pause_s, 0.0, "the failed step's extra time")
    noted("fallback_slowdown", measured.fallback_slowdown, 1.0, "steps between a failover and its rebuild")
    noted("rebuild_delay_s", measured.rebuild_delay_s, 0.0,
          "from a failover's preemption to the reconfiguration that rebuilt redundancy, trained through")
    noted("reconfiguration_s", measured.reconfiguration_s, 0.0,
          "the extra time of a step interval holding a reconfiguration")
    noted("instance_creation_s", measured.instance_creation_s, measured.startup_s,
          "from a later node's join to its warm worker; unmeasured: the cold start")
    return timing


def _checkpoint_timing(measured: Measurements, step_s: float, notes: list[str]) -> dict[str, float]:
    checkpoint_s = measured.checkpoint_s or 0.0
    every = measured.checkpoint_every
    if every is None:
        interval = max(3600.0, 10 * checkpoint_s + 1.0)
        notes.append("checkpoint_interval_s: this run wrote no periodic checkpoints; 3600")
    else:
        interval = every * step_s + checkpoint_s
        notes.append(f"checkpoint_interval_s: {every} steps of {1000 * step_s:.1f} ms and the checkpoint's "
                     f"{checkpoint_s:.3f} s")
    if measured.checkpoint_s is not None:
        notes.append(f"checkpoint_s: {checkpoint_s:.3f} measured (a step interval holding a checkpoint, less a step)")
    return {"checkpoint_interval_s": interval, "checkpoint_s": checkpoint_s}


def _on_demand_rate(measured: Measurements, step_s: float, timing: Timing) -> tuple[float, str]:
    """Samples per second of the on-demand cluster, and how it was found.

    On-demand is ``bamboo-launch run`` without redundancy, which writes its checkpoints every
    ``--checkpoint-every`` steps like bamboo's runs: for the profiles of those two systems the rate pays the
    measured checkpoint cost once per interval (the simulator charges no checkpoints to on-demand). The
    checkpoint/restart baseline's checkpoints are DeepSpeed's at its own K: its on-demand rate is the clean step's.
    """
    every = measured.checkpoint_every
    clean = f"this run's {measured.pipelines}-pipeline step time"
    if measured.system == "checkpoint" or every is None or not timing.checkpoint_s:
        return measured.samples_per_step / step_s, clean
    rate = measured.samples_per_step * every / timing.checkpoint_interval_s
    return rate, f"{clean} and a {timing.checkpoint_s:.3f} s checkpoint every {every} steps"


def measured_profile(
    measured: Measurements,
    *,
    name: str,
    spot_price: float,
    on_demand_price: float,
    description: str = "",
    extra_notes: Sequence[str] = (),
) -> ModelProfile:
    """The run's constants as a simulator profile (see the module docstring for each one); its ``notes`` say
    how each constant was measured, or what stands in for one the run could not measure."""
    stages, pipelines = measured.stages, measured.pipelines
    notes = [f"Measured by bamboo-bench measure {measured.system}: {measured.steps} steps "
             f"({measured.counts.get('step_records', measured.steps)} step records), start-up "
             f"{measured.startup_s:.2f} s; counts {json.dumps(measured.counts, sort_keys=True)}."]
    table = _step_table(measured, notes)
    full = table[pipelines]
    if measured.system == "bamboo":
        costs = _bamboo_timing(measured, notes)
    elif measured.system == "checkpoint":
        costs = _checkpoint_restart_timing(measured, notes)
    else:
        costs = {"instance_creation_s": 0.0, "reconfiguration_s": 0.0, "failover_pause_s": 0.0,
                 "fallback_slowdown": 1.0, "restart_s": 0.0}
    timing = Timing(startup_s=measured.startup_s, global_rendezvous_s=0.0, local_rendezvous_s=0.0, **costs,
                    **_checkpoint_timing(measured, full, notes))
    on_demand_rate, basis = _on_demand_rate(measured, full, timing)
    notes.append(f"on_demand: {stages * pipelines} nodes at {on_demand_rate:.2f} samples/s, {basis}"
                 + (f", {measured.startup_s:.2f} s to the first step" if measured.system == "on-demand" else ""))
    notes.extend(extra_notes)
    return ModelProfile(
        name=name, description=description or f"measured {measured.system} run: P={stages}, D={pipelines}",
        stages=stages, pipelines=pipelines, samples_per_step=measured.samples_per_step,
        step_time_ms={(stages, d): 1000.0 * seconds for d, seconds in table.items()},
        spot_price_per_node_hour=spot_price, on_demand_price_per_node_hour=on_demand_price,
        on_demand_nodes=stages * pipelines, on_demand_samples_per_second=on_demand_rate,
        job_samples=float(max(1, measured.samples)), timing=timing, notes=tuple(notes),
        on_demand_startup_s=measured.startup_s if measured.system == "on-demand" else 0.0,
        checkpoint_restart_on_join="every-join" if measured.system == "checkpoint" else "new-pipeline",
    )
