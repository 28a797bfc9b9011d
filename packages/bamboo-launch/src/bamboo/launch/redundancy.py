"""``--redundancy auto``: the redundancy mode of each generation, chosen when its layout is decided.

Whoever writes a layout (the coordinator's first layout and its restarts, the holders' decision at a
barrier, a layout prepared while the old one trains) calls :func:`with_mode`. For a job whose spec says
``auto`` it puts a :class:`bamboo.reconfig.ModeChoice` in the layout: the mode that
`bamboo.schedule.choose_redundancy` expects to lose the least training per hour, from

- the job's layer costs (``spec.layers``' compute costs, summed over the layout's stage bounds),
- the layout's microbatches per pipeline and its number of nodes (stages x pipelines),
- the job's fault-free step so far (:func:`measured_step`: the median ``duration_s`` of the newest
  generation's last :data:`MEASURED_STEPS` ``step`` records in its event log, in the mode that generation ran
  (the decision types no other step record); before any,
  `bamboo.rc.timeouts.ASSUMED_STEP_S` of ``none``),
- the preemption rate seen so far (:func:`observed_rate`: the job's ``preemption`` records per node-hour
  of its ``join`` records, weighed against a prior of :data:`~bamboo.launch.timeouts.AUTO_PRIOR_NODE_HOURS`
  node-hours at the rate the job was given, ``--preemption-rate``, or
  `bamboo.rc.timeouts.DEFAULT_PREEMPTIONS_PER_NODE_HOUR`),
- what a failure costs this job (:func:`failure_model`): the median pause of its failovers and of its
  reconfigurations so far, and how long after a failover the reconfiguration that follows it started (the
  schedule's defaults before any); the layout's pipelines and standby nodes (one pipeline with no spare stops
  under ``none`` until a replacement starts); and what a restore redoes: half the interval between its restore
  points (``--memory-copy-every`` steps, or ``--checkpoint-every`` with
  ``--checkpoint-dir``, whichever is shorter), and without either half the whole job (``--steps``), since a
  restore then starts from the seeded state.

The choice is a pure function of the layout and the event records read, so a decision written first-writer-
wins holds one mode for the generation, which every worker of it trains with (:func:`layout_mode`). The first
worker of the generation writes a ``redundancy_choice`` record (:func:`choice_record`) when it starts training
it; the report and the live view show the mode in force and why. Without ``auto`` nothing changes: the layout
carries no choice and every worker uses the spec's mode.
"""

from __future__ import annotations

import bisect
import heapq
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING

import attrs
from bamboo.launch.event_records import (
    Event,
    Failover,
    Join,
    Preemption,
    Reconfiguration,
    RedundancyChoice,
    Step,
)
from bamboo.launch.json_types import JSON
from bamboo.launch.spec import JobSpec
from bamboo.launch.timeouts import AUTO_PRIOR_NODE_HOURS
from bamboo.rc.timeouts import ASSUMED_STEP_S, DEFAULT_PREEMPTIONS_PER_NODE_HOUR

if TYPE_CHECKING:
    from bamboo.launch.events import EtcdEventReader
    from bamboo.membership import KeyValueStore
    from bamboo.reconfig import JobLayout, Layout, ModeChoice
    from bamboo.schedule import FailureModel

__all__ = ["AUTO", "MEASURED_STEPS", "LayoutChoices", "choice_record", "choices_for", "choose", "choose_mode",
           "describe_choice", "failure_model", "holds_replicas", "in_force", "layout_mode", "measured_step",
           "measured_steps", "mode_for", "observed_rate", "with_mode"]

AUTO = "auto"
"""The spec's redundancy that is chosen per generation rather than given."""

SECONDS_PER_HOUR = 3600.0


def layout_mode(spec: JobSpec, layout: JobLayout) -> str:
    """The redundancy mode the workers of ``layout`` (a ``JobLayout``) train with: the layout's choice under
    ``auto``, the spec's mode otherwise."""
    if layout.redundancy is not None:
        return str(layout.redundancy.mode)
    if spec.redundancy == AUTO:
        raise ValueError(f"generation {layout.generation} of job {spec.job} names no redundancy mode, and the job's "
                         "is auto (a layout written by an older launcher?)")
    return spec.redundancy


MEASURED_STEPS = 1000
"""How many of its newest steps give a generation's measured step (:func:`measured_step`): the step time now, not
one averaged over a day; and a layout decision reads no more step records than this (:func:`mode_for`)."""


def measured_step(events: Iterable[Event]) -> tuple[float, str] | None:
    """``(seconds, mode)``: the median of the newest :data:`MEASURED_STEPS` steps of the newest generation that
    trained steps in a known mode (the ``redundancy_choice`` record of that generation names it), or None before
    any."""
    modes, steps = _steps_by_generation(events)
    if not steps:
        return None
    newest = max(steps)
    recent = sorted(steps[newest], key=lambda step: step.t)[-MEASURED_STEPS:]
    return statistics.median(step.duration_s for step in recent), modes[newest]


def _steps_by_generation(events: Iterable[Event]) -> tuple[dict[int, str], dict[int, list[Step]]]:
    """The mode of each generation that has a ``redundancy_choice``, and the ``step`` records that took time of
    those generations."""
    events = list(events)
    modes = {e.generation: e.mode for e in events if isinstance(e, RedundancyChoice)}
    steps: dict[int, list[Step]] = {}
    for event in events:
        if isinstance(event, Step) and event.generation in modes and event.duration_s > 0:
            steps.setdefault(event.generation, []).append(event)
    return modes, steps


def observed_rate(events: Iterable[Event], now_t: float, prior: float, lost: Iterable[str] = ()) -> float:
    """Preemptions per node-hour: the job's ``preemption`` records over the node-hours of its nodes (from each
    ``join`` to its preemption, or ``now_t``), with :data:`AUTO_PRIOR_NODE_HOURS` node-hours at ``prior`` added:
    the prior alone before any history, the job's own rate once it has many hours of it. The preemption of an
    identity whose machine came back as a fresh node (a later ``join`` that ``returns`` it: its worker failed)
    ends that identity's hours but is no loss of the market's. ``lost`` names nodes the caller knows are gone (a
    barrier's missing holders) whose ``preemption`` record may not be written yet: each without one counts too."""
    listed = sorted(events, key=lambda e: e.t)
    returned = {e.returns for e in listed if isinstance(e, Join) and e.returns is not None}
    joined: dict[str, float] = {}
    node_s = 0.0
    preemptions = 0
    for event in listed:
        if isinstance(event, Join):
            joined.setdefault(event.node, event.t)
        elif isinstance(event, Preemption):
            preemptions += event.node not in returned
            if event.node in joined:
                node_s += max(0.0, event.t - joined.pop(event.node))
    node_s += sum(max(0.0, now_t - t) for t in joined.values())
    recorded = {e.node for e in listed if isinstance(e, Preemption)}
    preemptions += len(set(lost) - recorded)
    hours = node_s / SECONDS_PER_HOUR
    return (preemptions + prior * AUTO_PRIOR_NODE_HOURS) / (hours + AUTO_PRIOR_NODE_HOURS)


def failure_model(spec: JobSpec, nodes: int, rate: float, step_s: float, events: Sequence[Event], *,
                  pipelines: int = 1, spare_nodes: int = 0, restore_every: int | None = None) -> FailureModel:
    """The :class:`bamboo.schedule.FailureModel` of a job of ``nodes`` nodes in ``pipelines`` pipelines, with
    ``spare_nodes`` on standby, at ``rate`` preemptions per node-hour, whose fault-free step is ``step_s``: its own
    failovers' and reconfigurations' median pauses once it has some, and the median time from a failover to the
    start of the reconfiguration after it (how long a replacement took; the schedule's defaults before), and a
    restore that redoes half the interval between restore points (in-memory copies or checkpoints, whichever come
    more often; ``restore_every``: the layout's, for intervals the spec leaves to it), or half the job without
    either."""
    from bamboo.schedule import FailureModel

    pauses = [e.pause_s for e in events if isinstance(e, Failover)]
    reconfigurations = [e.duration_s for e in events if isinstance(e, Reconfiguration)]
    measured: dict[str, float] = {}
    if pauses:
        measured["detect_s"] = statistics.median(pauses)
    if reconfigurations:
        measured["reconfigure_s"] = statistics.median(reconfigurations)
    rebuilt = _rebuild_waits(events)
    if rebuilt:
        measured["rebuild_after_s"] = statistics.median(rebuilt)
    restore_points = [spec.checkpoint_interval(restore_every)] if spec.checkpoint_dir is not None else []
    copies = spec.memory_copy_interval(restore_every)
    restore_points += [copies] if copies else []
    steps_between = min(restore_points, default=spec.steps)  # the nearest copy, in memory or on disk
    return FailureModel(rate, nodes, checkpoint_interval_s=max(steps_between * step_s, 1e-3), pipelines=pipelines,
                        spare_nodes=spare_nodes, **measured)


def _rebuild_waits(events: Sequence[Event]) -> list[float]:
    """For each ``failover`` record, the seconds until the start of the first reconfiguration after it (its record's
    ``t`` less its pause): how long the job trained on the failover's merged schedule. ``events`` is read twice."""
    starts = sorted(e.t - e.duration_s for e in events if isinstance(e, Reconfiguration))
    waits = []
    for failover in (e for e in events if isinstance(e, Failover)):
        after = bisect.bisect_left(starts, failover.t)
        if after < len(starts):
            waits.append(starts[after] - failover.t)
    return waits


def choose_mode(spec: JobSpec, plan: Layout, events: Sequence[Event], now_t: float,
                lost: Iterable[str] = ()) -> ModeChoice:
    """The :class:`bamboo.reconfig.ModeChoice` for a generation placed by ``plan`` (a ``bamboo.reconfig.Layout``)
    from the job's ``events`` at ``now_t`` (seconds since the job's ``created_unix``) and the nodes known ``lost``
    (:func:`observed_rate`)."""
    chosen = choose(spec, plan, events, now_t, lost).redundancy
    if chosen is None:
        raise ValueError(f"job {spec.job} trains with {spec.redundancy}, not auto: it chooses no mode")
    return chosen


@attrs.frozen
class LayoutChoices:
    """What a layout decision chooses for the job: the redundancy mode (``--redundancy auto``) and the steps
    between restore points (``--checkpoint-every auto``, ``--memory-copy-every auto``); None where the spec
    fixes it."""

    redundancy: ModeChoice | None = None
    restore_every: int | None = None


def choose(spec: JobSpec, plan: Layout, events: Sequence[Event], now_t: float,
           lost: Iterable[str] = ()) -> LayoutChoices:
    """The :class:`LayoutChoices` of a generation placed by ``plan`` (see :func:`choose_mode` for the arguments):
    the restore interval first (:func:`bamboo.launch.restore_interval.choose_restore_every`), then the mode,
    whose failure model redoes half of that interval at a restore."""
    from bamboo.launch.restore_interval import choose_restore_every, measured_boundary
    from bamboo.reconfig import ModeChoice
    from bamboo.schedule import choose_redundancy, stage_work_costs

    measured = measured_step(events)
    step_s, measured_mode = measured if measured is not None else (ASSUMED_STEP_S, "none")
    prior = (DEFAULT_PREEMPTIONS_PER_NODE_HOUR if spec.preemptions_per_node_hour is None
             else spec.preemptions_per_node_hour)
    rate = observed_rate(events, now_t, prior, lost)
    nodes = plan.stages * plan.num_pipelines
    interval = None
    if spec.chooses_restore_points:
        interval = choose_restore_every(rate, nodes, step_s, measured_boundary(events), step_assumed=measured is None)
    restore_every = None if interval is None else interval.steps
    if spec.redundancy != AUTO:
        return LayoutChoices(restore_every=restore_every)
    compute = [float(layer["compute_cost"]) for layer in spec.layers]
    costs = stage_work_costs([sum(compute[start:end]) for start, end in plan.stage_layers])
    steps = measured_steps(events, nodes)
    if steps:  # the reference the others are scaled from: a step measured on this shape, none's where there is one
        measured_mode = "none" if "none" in steps else min(steps)
        step_s = steps[measured_mode]
    failures = failure_model(spec, nodes, rate, step_s, events, pipelines=plan.num_pipelines,
                             spare_nodes=len(plan.standby), restore_every=restore_every)
    choice = choose_redundancy(costs, plan.stages, max(plan.microbatches), step_s, failures,
                               measured_mode=measured_mode, measured_steps=steps)
    step = ("no step measured yet: an assumed step" if measured is None else
            f"the measured {measured_mode} step of {step_s:.3f} s")
    if len(steps) > 1:
        step += " (measured on this shape: " + ", ".join(f"{m} {s:.3f} s" for m, s in sorted(steps.items())) + ")"
    points = "" if interval is None else f"; restore points {interval.reason}"
    return LayoutChoices(redundancy=ModeChoice(
        mode=choice.mode, reason=f"{choice.reason}; {step}{points}",
        lost_s_per_hour={e.mode: round(e.lost_s_per_hour, 3) for e in choice.estimates},
        step_s=round(next(e.step_s for e in choice.estimates if e.mode == "none"), 6),
        preemptions_per_node_hour=round(rate, 6)), restore_every=restore_every)


def mode_for(spec: JobSpec, plan: Layout, kv: KeyValueStore, now: float | None = None,
             lost: Iterable[str] = (), *, reader: EtcdEventReader | None = None) -> ModeChoice | None:
    """The :class:`bamboo.reconfig.ModeChoice` of a generation placed by ``plan`` when the job's redundancy is
    ``auto`` (:func:`choices_for`), None otherwise."""
    return choices_for(spec, plan, kv, now, lost, reader=reader).redundancy


def choices_for(spec: JobSpec, plan: Layout, kv: KeyValueStore, now: float | None = None,
                lost: Iterable[str] = (), *, reader: EtcdEventReader | None = None) -> LayoutChoices:
    """The :class:`LayoutChoices` of a generation placed by ``plan`` (:func:`choose`, from the job's event log in
    etcd, ``kv``, and the nodes known ``lost``; a log that cannot be read counts as empty); nothing to choose
    when the spec fixes both the mode and the intervals. ``reader``, where the caller keeps one, reads the log
    instead of ``kv``: only what was written since its last read."""
    if spec.redundancy != AUTO and not spec.chooses_restore_points:
        return LayoutChoices()
    from bamboo.launch.events import EventLogError, read_etcd_events
    from bamboo.membership.kv import StoreError

    try:
        events = (reader.read(select=_choice_records) if reader is not None
                  else read_etcd_events(kv, spec.job, select=_choice_records))
    except (EventLogError, StoreError):
        events = []
    now_t = max(0.0, (time.time() if now is None else now) - spec.created_unix)
    return choose(spec, plan, events, now_t, lost)


def _choice_records(records: list[JSON]) -> Callable[[JSON], bool]:
    """Which records :func:`choose` reads: all but the ``step`` records, of which only the newest
    :data:`MEASURED_STEPS` that took time of the newest generation with a ``redundancy_choice`` (:func:`measured_step`)
    and of the newest generation of each mode and layout shape (:func:`measured_steps`). Step records are nearly
    all of a long job's log, up to 20,000 of them: typing them all took 0.85 s of every layout decision
    (``read_etcd_events``' ``select``)."""
    objects = [record for record in records if isinstance(record, dict)]  # anything else is typed, and refused
    modes = {record.get("generation"): record.get("mode") for record in objects
             if record.get("kind") == RedundancyChoice.KIND}
    if not modes:  # a job that fixes its mode: the restore interval's steps (bamboo.launch.restore_interval)
        modes = {record.get("generation"): None for record in objects if record.get("kind") == Step.KIND}
    timed: dict[int, list[dict[str, JSON]]] = {}
    for record in objects:
        if record.get("kind") == Step.KIND and (generation := record.get("generation")) in modes:
            duration, t = record.get("duration_s"), record.get("t")
            if (isinstance(generation, int) and isinstance(duration, (int, float)) and duration > 0
                    and isinstance(t, (int, float))):
                timed.setdefault(generation, []).append(record)
    newest: dict[tuple[object, object], int] = {}
    for generation, steps in timed.items():
        key = (modes[generation], max((step.get("nodes_active") for step in steps), key=_as_int))
        newest[key] = max(newest.get(key, generation), generation)
    kept = {id(record) for generation in {*newest.values(), *([max(timed)] if timed else [])}
            for record in heapq.nlargest(MEASURED_STEPS, timed[generation], key=lambda record: record["t"])}
    return lambda record: not isinstance(record, dict) or record.get("kind") != Step.KIND or id(record) in kept


def _as_int(value: JSON) -> int:
    return value if isinstance(value, int) else -1


def measured_steps(events: Iterable[Event], nodes: int) -> dict[str, float]:
    """The fault-free step of each mode the job trained on ``nodes`` nodes (stages x pipelines): the median
    ``duration_s`` of the newest :data:`MEASURED_STEPS` steps, with every node at work, of the newest generation
    that trained that mode (its ``redundancy_choice`` names it) at that shape."""
    modes, steps = _steps_by_generation(events)
    found: dict[str, float] = {}
    for generation in sorted(steps, reverse=True):
        records = steps[generation]
        mode = modes[generation]
        if mode in found or max(step.nodes_active for step in records) != nodes:
            continue
        whole = sorted((step for step in records if step.nodes_active == nodes), key=lambda step: step.t)
        found[mode] = statistics.median(step.duration_s for step in whole[-MEASURED_STEPS:])
    return found


def with_mode(spec: JobSpec, layout: JobLayout, kv: KeyValueStore, *,
              reader: EtcdEventReader | None = None) -> JobLayout:
    """``layout`` (a ``JobLayout`` that moves no state between peers) with its mode and restore interval chosen
    (:func:`choices_for`)."""
    chosen = choices_for(spec, layout.plan, kv, reader=reader)
    if chosen == LayoutChoices():
        return layout
    return attrs.evolve(layout, redundancy=chosen.redundancy, restore_every=chosen.restore_every)


def holds_replicas(spec: JobSpec, chosen: ModeChoice | None) -> bool:
    """Whether the owners of a generation with mode ``chosen`` (a ``ModeChoice``, or None: the spec's) hold their
    successor's replica (what its transfer plan must bring them)."""
    return (spec.redundancy if chosen is None else chosen.mode) != "none"


def choice_record(layout: JobLayout, t: float) -> RedundancyChoice | None:
    """The ``redundancy_choice`` record of ``layout``'s chosen mode (None without one)."""
    chosen = layout.redundancy
    if chosen is None:
        return None
    return RedundancyChoice(t=t, generation=layout.generation, mode=chosen.mode, reason=chosen.reason,
                            lost_s_per_hour=dict(chosen.lost_s_per_hour), step_s=chosen.step_s,
                            preemptions_per_node_hour=chosen.preemptions_per_node_hour)


def in_force(events: Iterable[Event]) -> RedundancyChoice | None:
    """The ``redundancy_choice`` record of the mode in force: that of the generation of the newest ``step``
    record, else the newest one (None in a job that chose none)."""
    choices: dict[int, RedundancyChoice] = {}
    newest: RedundancyChoice | None = None
    generation: int | None = None
    for event in sorted(events, key=lambda e: e.t):
        if isinstance(event, RedundancyChoice):
            choices[event.generation] = newest = event
        elif isinstance(event, Step) and event.generation is not None:
            generation = event.generation
    return choices.get(generation, newest) if generation is not None else newest


def describe_choice(choice: RedundancyChoice) -> str:
    """``eflb (auto, generation 2): <reason>``: the mode and why, one line."""
    return f"{choice.mode} (auto, generation {choice.generation}): {choice.reason}"
