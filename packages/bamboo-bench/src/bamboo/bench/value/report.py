"""The final report of a run of bamboo-launch, computed from its event log: throughput, node-hours, cost and value.

Definitions (all times are the log's ``t``, seconds since the run started):

- **window**: from the run's start (``run_start``, else 0) to its end (``run_end``, else the last
  record). Billing covers the window.
- **throughput**: samples of all ``step`` records divided by the training time, from the run's
  start to the end of the last step. Start-up, failover pauses and reconfigurations count, as they
  do for a user waiting on the job. A step trained again after a checkpoint restore (a ``step``
  record whose step number was seen before) counts once: its samples are not new work, and its
  time counts as lost (``redone_steps`` says how many there were).
- **consecutive failures**: reconfigurations whose reason is ``consecutive failure`` (adjacent
  stages of one pipeline lost before the failover of the first completed); **restores**: the
  ``restore`` records (every copy of some stage lost, the last good checkpoint loaded).
- **node-hours**: the sum over nodes of the time from their ``join`` to their ``preemption`` (or the
  window's end for nodes still alive), in hours. ``avg_nodes`` is node-hours over the window.
- **cost**: node-hours at the spot price (default $0.918/h per GPU node, the paper's EC2 p3 price).
  The same work at on-demand prices (default $3.06/h) is priced one of two ways:

  * by default, the same node-hours at the on-demand price (an on-demand cluster of the same size
    running as long; an honest lower bound on the saving, since an on-demand cluster would not
    lose time to preemptions);
  * with ``on_demand_throughput`` (samples/s of a fault-free on-demand run, measured separately) and
    ``on_demand_nodes``: the hours that cluster needs for the same samples, at the on-demand price.
- **value**: throughput per dollar-per-hour, ``throughput / (avg_nodes * spot_price)``, the paper's
  metric; ``on_demand_value`` is the same for the on-demand reference.
- **where the time went** (:class:`bamboo.launch.events.TimeAccount`): ``startup_s`` (start to the first
  step), ``step_share`` (the share of the training window, first step to last, spent in steps),
  ``failover_s`` (failover pauses), ``reconfiguration_s`` and ``restore_s`` (reconfigurations, those that
  restarted from a checkpoint apart), ``lost_s`` (everything up to the last step that was not useful step
  time: start-up, gaps, pauses, steps trained again).

- **window throughput** (``window_throughput``): the same samples over the training window alone, from the
  start of the first step to the end of the last (start-up excluded; pauses and reconfigurations in it count).

The live view's ``samples/s`` is over its last steps, their own durations and the gaps between them, so it
compares with ``window_throughput``; the report's ``throughput`` is over the whole run, start-up included, as
a user waiting on the job sees it. The report prints both, labelled.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

import attrs
from bamboo.launch.events import (
    Checkpoint,
    Event,
    Failover,
    Join,
    Preemption,
    Reconfiguration,
    RedundancyChoice,
    Restore,
    RunEnd,
    RunStart,
    Step,
    TimeAccount,
)
from bamboo.launch.redundancy import describe_choice, in_force

__all__ = ["DEFAULT_BINS", "DEFAULT_ON_DEMAND_PRICE", "DEFAULT_SPOT_PRICE", "Prices", "Report", "ReportError",
           "compute_report", "format_report", "node_intervals", "redundancy_fields", "run_window"]

DEFAULT_SPOT_PRICE = 0.918
"""$/h per GPU node on spot (EC2 p3, from the paper)."""
DEFAULT_ON_DEMAND_PRICE = 3.06
"""$/h per GPU node on demand (EC2 p3, from the paper)."""
DEFAULT_BINS = 60
"""Time bins of a run's timeline and of its four-panel figure (``--bins``)."""


class ReportError(ValueError):
    """The event log cannot give a report (no steps, a node preempted twice, ...)."""


_PRICE = attrs.validators.and_(attrs.validators.gt(0), attrs.validators.lt(math.inf))
"""A finite price > 0 ($/h)."""


@attrs.frozen
class Prices:
    """Prices per GPU node and hour, and the optional measured on-demand reference."""

    spot: float = attrs.field(default=DEFAULT_SPOT_PRICE, validator=_PRICE)
    on_demand: float = attrs.field(default=DEFAULT_ON_DEMAND_PRICE, validator=_PRICE)
    on_demand_throughput: float | None = attrs.field(default=None, validator=attrs.validators.optional(_PRICE))
    on_demand_nodes: int | None = attrs.field(default=None)

    def __attrs_post_init__(self) -> None:
        if (self.on_demand_throughput is None) != (self.on_demand_nodes is None):
            raise ValueError(
                "on_demand_throughput and on_demand_nodes go together, got "
                f"{self.on_demand_throughput!r} and {self.on_demand_nodes!r}"
            )
        if self.on_demand_nodes is not None and self.on_demand_nodes < 1:
            raise ValueError(f"on_demand_nodes must be >= 1, got {self.on_demand_nodes!r}")


@attrs.frozen
class Report:
    """The numbers of one run. Keys of :meth:`to_dict` are the ``--json`` contract."""

    job: str
    steps: int
    samples: int
    final_loss: float
    duration_s: float
    training_s: float
    throughput: float
    window_throughput: float | None
    node_hours: float
    avg_nodes: float
    joins: int
    preemptions: int
    failovers: int
    median_pause_s: float | None
    max_pause_s: float | None
    reconfigurations: int
    bytes_moved: int
    reconfiguration_s: float
    startup_s: float
    step_share: float | None
    failover_s: float
    restore_s: float
    lost_s: float
    checkpoints: int
    consecutive_failures: int
    restores: int
    redone_steps: int
    spot_price: float
    on_demand_price: float
    cost_spot: float
    cost_on_demand: float
    on_demand_basis: str
    cost_per_hour: float
    value: float
    on_demand_value: float
    saving: float
    reconfiguration_pause_p50_s: float | None = None
    reconfiguration_pause_max_s: float | None = None
    prepared_reconfigurations: int = 0
    pause_nodes_s: float = 0.0
    pause_decide_s: float = 0.0
    pause_barrier_s: float = 0.0
    pause_transfers_s: float = 0.0
    pause_group_builds_s: float = 0.0
    pause_first_step_s: float = 0.0
    restores_from_memory: int = 0
    restore_max_s: float | None = None
    startup_process_s: float | None = None
    startup_imports_s: float | None = None
    startup_model_s: float | None = None
    startup_wait_s: float | None = None
    startup_model_build_s: float | None = None
    startup_group_build_s: float | None = None
    startup_first_step_s: float | None = None
    redundancy_mode: str | None = None  # --redundancy auto: the mode in force, why, each mode's loss (redundancy.py)
    redundancy_reason: str | None = None
    redundancy_lost_s_per_hour: dict[str, float] | None = None
    redundancy_choices: int = 0
    missing_step_records: int = 0
    """Steps the run reached that have no record (a record queued by the node that writes them, which was killed
    before it went out): counted in ``steps`` and ``samples`` with the samples of every step (the global batch
    is kept), no loss or duration of theirs known."""

    def to_dict(self) -> dict[str, Any]:
        """The report as a flat JSON-ready dict."""
        return attrs.asdict(self)


def run_window(events: Sequence[Event]) -> tuple[float, float, str]:
    """The run's ``(start, end, job)``: its ``run_start`` (else t=0, job "unknown") to its last ``run_end`` (else its
    last record), for ``events`` sorted by ``t``."""
    starts = [e for e in events if isinstance(e, RunStart)]
    ends = [e for e in events if isinstance(e, RunEnd)]
    if len(starts) > 1:
        raise ReportError(f"the log has {len(starts)} run_start records; one run per log")
    start = starts[0].t if starts else 0.0
    end = ends[-1].t if ends else max(e.t for e in events)
    job = starts[0].job if starts else "unknown"
    return start, end, job


def node_intervals(events: Sequence[Event], end: float) -> dict[str, list[tuple[float, float]]]:
    """Each node's billed intervals ``[(join, leave)]``; raises on an impossible sequence.

    A node preempted without a ``join`` record is billed nothing: a machine killed right after it registered
    may be confirmed dead before its agent's ``join`` record reached the log. Preempted twice is an error."""
    alive: dict[str, float] = {}
    gone: set[str] = set()
    intervals: dict[str, list[tuple[float, float]]] = {}
    for event in events:
        if isinstance(event, Join):
            if event.node in alive:
                raise ReportError(
                    f"node {event.node!r} joins at t={event.t:.3f} but is already alive since "
                    f"t={alive[event.node]:.3f}"
                )
            alive[event.node] = event.t
        elif isinstance(event, Preemption):
            if event.node in gone and event.node not in alive:
                raise ReportError(f"node {event.node!r} is preempted at t={event.t:.3f} again, and never joined "
                                  "in between")
            gone.add(event.node)
            joined = alive.pop(event.node, event.t)
            intervals.setdefault(event.node, []).append((joined, event.t))
    for node, joined in alive.items():
        intervals.setdefault(node, []).append((joined, max(joined, end)))
    return intervals


def compute_report(events: Sequence[Event], prices: Prices | None = None,
                   billing: Sequence[Event] | None = None) -> Report:
    """The run's report from its event log (any order; sorted by ``t`` here). ``billing``: the ``join`` and
    ``preemption`` records that bill the nodes, where a market kept its own (default: those of ``events``)."""
    prices = prices or Prices()
    if not events:
        raise ReportError("the event log is empty")
    ordered = sorted(events, key=lambda e: e.t)
    start, end, job = run_window(ordered)
    intervals = node_intervals(ordered if billing is None else sorted(billing, key=lambda e: e.t), end)
    records = [e for e in ordered if isinstance(e, Step)]
    if not records:
        raise ReportError("the event log has no step records, so there is no throughput to report")
    first_of_step: dict[int, Step] = {}
    for record in records:
        first_of_step.setdefault(record.step, record)  # a step trained again after a restore counts once
    # Steps run one after the other: every step between the first and the last recorded was trained, and trained
    # the global batch, whether or not its record went out before its writer was killed.
    missing = [step for step in range(min(first_of_step), max(first_of_step)) if step not in first_of_step]
    samples = sum(s.samples for s in first_of_step.values()) + len(missing) * records[-1].samples
    training_s = records[-1].t - start
    if training_s <= 0:
        raise ReportError(f"the last step ends at t={records[-1].t} which is not after the start t={start}")
    throughput = samples / training_s
    duration_s = end - start
    node_seconds = sum(b - a for spans in intervals.values() for a, b in spans)
    node_hours = node_seconds / 3600.0
    avg_nodes = node_seconds / duration_s if duration_s > 0 else 0.0
    account = TimeAccount()
    for event in ordered:
        account.apply(event)
    pauses = [e.pause_s for e in ordered if isinstance(e, Failover)]
    reconfigs = [e for e in ordered if isinstance(e, Reconfiguration)]
    return Report(
        job=job, steps=len(first_of_step) + len(missing), samples=samples, final_loss=records[-1].loss,
        duration_s=duration_s, missing_step_records=len(missing),
        training_s=training_s, throughput=throughput,
        window_throughput=samples / account.window_s if account.window_s > 0 else None,
        node_hours=node_hours, avg_nodes=avg_nodes, redone_steps=len(records) - len(first_of_step),
        joins=sum(isinstance(e, Join) for e in ordered), preemptions=sum(isinstance(e, Preemption) for e in ordered),
        failovers=len(pauses), median_pause_s=statistics.median(pauses) if pauses else None,
        max_pause_s=max(pauses) if pauses else None, reconfigurations=len(reconfigs),
        bytes_moved=sum(r.bytes_moved for r in reconfigs), checkpoints=sum(isinstance(e, Checkpoint) for e in ordered),
        consecutive_failures=sum(r.reason == "consecutive failure" for r in reconfigs),
        restores=sum(isinstance(e, Restore) for e in ordered),
        reconfiguration_s=account.reconfiguration_s, startup_s=account.startup_s, step_share=account.step_share,
        failover_s=account.failover_s, restore_s=account.restore_s, lost_s=account.lost_s,
        **_costs(prices, samples, throughput, node_hours, avg_nodes),
        **_pauses_and_startup(account), **redundancy_fields(ordered),
    )


def _costs(prices: Prices, samples: int, throughput: float, node_hours: float, avg_nodes: float) -> dict[str, float | str]:
    """The report's keys on cost and value: the run at spot prices, and the same work on demand (see the module's
    docstring for the two ways it is priced)."""
    cost_spot = node_hours * prices.spot
    cost_per_hour = avg_nodes * prices.spot
    if prices.on_demand_throughput is not None and prices.on_demand_nodes is not None:
        od_hours = samples / prices.on_demand_throughput / 3600.0
        cost_on_demand = od_hours * prices.on_demand_nodes * prices.on_demand
        on_demand_value = prices.on_demand_throughput / (prices.on_demand_nodes * prices.on_demand)
        basis = (
            f"measured on-demand run: {prices.on_demand_throughput:g} samples/s on "
            f"{prices.on_demand_nodes} nodes"
        )
    else:
        cost_on_demand = node_hours * prices.on_demand
        on_demand_value = throughput / (avg_nodes * prices.on_demand) if avg_nodes > 0 else 0.0
        basis = "same node-hours at the on-demand price"
    return {
        "spot_price": prices.spot, "on_demand_price": prices.on_demand, "cost_spot": cost_spot,
        "cost_on_demand": cost_on_demand, "on_demand_basis": basis, "cost_per_hour": cost_per_hour,
        "value": throughput / cost_per_hour if cost_per_hour > 0 else 0.0, "on_demand_value": on_demand_value,
        "saving": cost_on_demand / cost_spot if cost_spot > 0 else 0.0,
    }


def _pauses_and_startup(account: TimeAccount) -> dict[str, Any]:
    """The report's keys on reconfiguration pauses, restores and start-up phases (see :class:`TimeAccount`)."""
    parts = account.parts_s
    restores = [pause for pause, _source in account.restores]
    return {
        "reconfiguration_pause_p50_s": account.pause_p50_s, "reconfiguration_pause_max_s": account.pause_max_s,
        "prepared_reconfigurations": account.prepared, "pause_nodes_s": parts["nodes_s"],
        "pause_decide_s": parts["decide_s"],
        "pause_barrier_s": parts["barrier_s"], "pause_transfers_s": parts["transfers_s"],
        "pause_group_builds_s": parts["group_builds_s"], "pause_first_step_s": parts["first_step_s"],
        "restores_from_memory": sum(source == "memory" for _pause, source in account.restores),
        "restore_max_s": max(restores) if restores else None,
        **{f"startup_{part}": value for part, value in account.startup_parts().items()},
    }


def format_report(report: Report) -> str:
    """A human-readable multi-line summary of :class:`Report`."""

    def seconds(value: float | None) -> str:
        return "n/a" if value is None else f"{value:.3f} s"

    lines = [
        f"job {report.job}: {report.steps} steps, {report.samples} samples, final loss {report.final_loss:.6g}",
        f"  wall time        {report.duration_s:.1f} s (training {report.training_s:.1f} s)",
        f"  throughput       {report.throughput:.3f} samples/s over the run, start-up included "
        f"({_rate(report.window_throughput)} in the training window, first step to last, as the live view counts)",
        f"  nodes            {report.avg_nodes:.2f} on average, {report.node_hours:.4f} node-hours",
        f"  joins            {report.joins}",
        f"  preemptions      {report.preemptions}",
        f"  failovers        {report.failovers} (median pause {seconds(report.median_pause_s)}, "
        f"max {seconds(report.max_pause_s)})",
        f"  reconfigurations {report.reconfigurations} ({report.bytes_moved} bytes moved, "
        f"{report.reconfiguration_s:.3f} s; {report.consecutive_failures} after a consecutive failure)",
        f"  pauses           reconfigurations p50 {seconds(report.reconfiguration_pause_p50_s)}, max "
        f"{seconds(report.reconfiguration_pause_max_s)} ({report.prepared_reconfigurations} prepared while training); "
        f"in all: waiting for nodes {report.pause_nodes_s:.2f} s, decide {report.pause_decide_s:.2f} s, barrier "
        f"{report.pause_barrier_s:.2f} s, transfers "
        f"{report.pause_transfers_s:.2f} s, group builds {report.pause_group_builds_s:.2f} s, first steps "
        f"{report.pause_first_step_s:.2f} s",
        f"  restores         {report.restores} ({report.restores_from_memory} from a peer's memory, the rest from "
        f"disk; max pause {seconds(report.restore_max_s)}; {report.redone_steps} steps trained again)",
        f"  start-up         {_startup(report)}",
        f"  time lost        {report.lost_s:.1f} s: start-up {report.startup_s:.1f} s, failover pauses "
        f"{report.failover_s:.2f} s, reconfigurations {report.reconfiguration_s:.2f} s, restores "
        f"{report.restore_s:.2f} s; steps {_share(report.step_share)} of the training window",
        f"  checkpoints      {report.checkpoints}",
        f"  cost (spot)      ${report.cost_spot:.4f} at ${report.spot_price:g}/h per node "
        f"(${report.cost_per_hour:.3f}/h)",
        f"  cost (on-demand) ${report.cost_on_demand:.4f} at ${report.on_demand_price:g}/h per node "
        f"({report.on_demand_basis})",
        f"  saving           {report.saving:.2f}x",
        f"  value            {report.value:.4f} samples/s per $/h (on-demand {report.on_demand_value:.4f})",
    ] + ([f"  redundancy       {report.redundancy_reason}"] if report.redundancy_reason else [])
    return "\n".join(lines)


def _startup(report: Report) -> str:
    """The median phases of the first workers' start (those a record gave)."""
    phases = (("process", report.startup_process_s), ("imports", report.startup_imports_s),
              ("model", report.startup_model_s), ("waiting", report.startup_wait_s),
              ("layers", report.startup_model_build_s), ("groups", report.startup_group_build_s),
              ("first step", report.startup_first_step_s))
    shown = ", ".join(f"{name} {value:.2f} s" for name, value in phases if value is not None)
    return f"{report.startup_s:.1f} s to the first step" + (f" (median per worker: {shown})" if shown else "")


def _rate(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _share(value: float | None) -> str:
    return "n/a" if value is None else f"{100 * value:.1f}%"


def redundancy_fields(events: Iterable[Event]) -> dict[str, str | int | dict[str, float] | None]:
    """The report's keys on ``--redundancy auto``: the mode in force, why, each mode's expected loss per hour
    (all None in a job that chose none) and how many choices the job made."""
    listed = list(events)
    chosen = in_force(listed)
    return {"redundancy_mode": None if chosen is None else chosen.mode,
            "redundancy_reason": None if chosen is None else describe_choice(chosen),
            "redundancy_lost_s_per_hour": None if chosen is None else dict(chosen.lost_s_per_hour),
            "redundancy_choices": sum(isinstance(e, RedundancyChoice) for e in listed)}
