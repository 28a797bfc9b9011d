"""``bamboo-bench measure SYSTEM``: one system of a comparison run to its end on the emulated market, measured.

- ``bamboo``: ``bamboo-launch run`` (:func:`bamboo.bench.emulated.run.run_cluster`) with eager redundant computation on
  the trace's nodes, its workers' ``warm`` records read while it trains (for the instance-creation cost);
- ``checkpoint``: the checkpoint/restart baseline (:func:`bamboo.bench.measured.torchrun.run_checkpoint_restart`),
  with when each node's torchrun agent entered the rendezvous (for the instance-creation cost);
- ``on-demand``: ``bamboo-launch run`` without redundancy and without preemptions on ``P x D`` nodes (the
  cluster priced at on-demand rates).

A run ends after ``steps`` steps, or ``duration_s`` wall seconds after its first step: every node is then
stopped, as a budget's end would. :func:`run_measured` returns the JSON-ready result (the report, the
measurements, the measured profile's path, the timeline) that ``bamboo-bench compare`` reads.
"""

from __future__ import annotations

import itertools
import json
import statistics
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import attrs
from bamboo.bench import timeouts
from bamboo.bench.emulated.run import RunError, RunHandles, RunOptions, run_cluster
from bamboo.bench.emulated.run_results import market_billing
from bamboo.bench.measured.baseline import RestartCost
from bamboo.bench.measured.measure import (
    PROFILE_MIN_STEPS,
    measure_events,
    measured_profile,
    step_time_measured,
)
from bamboo.bench.measured.options import MeasureError, MeasureOptions
from bamboo.bench.measured.progress import progress_at_end
from bamboo.bench.measured.torchrun import (
    BaselineError,
    BaselineHandles,
    CheckpointRestartOptions,
    run_checkpoint_restart,
)
from bamboo.bench.value import Prices, ReportError, compute_report, compute_timeline
from bamboo.launch.events import Event, EventLogError, Step, read_events
from bamboo.launch.records import WorkerWarm
from bamboo.launch.spec import AUTO_EVERY

__all__ = ["run_measured"]


class _Stopper:
    """Ends a run ``duration_s`` after the market started (the ``during`` callback starts with the market), or
    later, once its events give a step time (:func:`~bamboo.bench.measured.measure.step_time_measured`): on a
    busy machine a short window can end before that (too few steps, or a kill between the only two after the
    warm-up), and the run would have been for nothing."""

    def __init__(self, duration_s: float | None, say: Callable[[str], None],
                 sleep: Callable[[float], bool] | None = None) -> None:
        self.duration_s = duration_s
        self.say = say
        self.done = threading.Event()
        self._sleep = sleep or self.done.wait  # sleep(seconds) -> whether the run was cancelled meanwhile
        self.extended = False  # the window went on past duration_s until the events gave a step time

    def wait(self, measured: Callable[[], bool]) -> bool:
        """Sleep until the deadline and ``measured()`` (whether the run's events so far give a step time) (True),
        or until :meth:`cancel` (False)."""
        if self.duration_s is None or self._sleep(self.duration_s):
            return False
        if measured():
            return True
        self.extended = True
        self.say(f"{self.duration_s:g} s since the first step and no step time yet (it needs {PROFILE_MIN_STEPS} steps "
                 f"at least, and an interval between two of them after the first step's warm-up free of failovers, "
                 f"reconfigurations, restarts and checkpoints): going on until the run has one")
        while not self._sleep(timeouts.MEASURE_STEP_POLL_S):
            if measured():
                return True
        return False

    def stopping(self) -> str:
        """The line that says why the run stops now (after :meth:`wait` returned True)."""
        extra = " and a step time measured" if self.extended else ""
        return f"{self.duration_s:g} s since the first step{extra}: stopping every node"

    def cancel(self) -> None:
        self.done.set()


def _measured_so_far(events: Path, system: str) -> bool:
    """Whether the run's event log, as written so far, gives a step time (a record still being written, or a log
    not created yet, reads as not yet)."""
    try:
        return step_time_measured(read_events(events), system)
    except (OSError, EventLogError):
        return False


def run_measured(options: MeasureOptions, *, progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run ``options.system`` to its end and measure it; the JSON-ready result (``report``, ``measurements``,
    ``profile``, ``timeline``, ...). Raises :class:`MeasureError` when the run fails."""
    say = progress or (lambda line: None)
    run_dir = Path(options.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    stopper = _Stopper(options.duration_s, say)
    extra: dict[str, Any] = {}
    warm: dict[str, float] = {}
    restarts: Sequence[RestartCost] = ()
    checkpoint_every: int | None = None
    started = time.monotonic()
    try:
        if options.system == "checkpoint":
            events_path, restarts, checkpoint_every, extra = _run_checkpoint(options, run_dir, stopper, say)
            warm = dict(extra["registered_unix"])  # a node is ready to interrupt once its agent is in the rendezvous
        else:
            events_path, warm, extra = _run_bamboo(options, run_dir, stopper, say)
    finally:
        stopper.cancel()
    events = read_events(events_path)
    if options.system != "checkpoint":  # bamboo-launch always checkpoints, on-demand too
        checkpoint_every = (restore_spacing(events) if options.checkpoint_every == AUTO_EVERY
                            else int(options.checkpoint_every))
    price = options.on_demand_price if options.system == "on-demand" else options.spot_price
    prices = Prices(spot=price, on_demand=options.on_demand_price)
    # Every system is billed by the market, as a cloud bills: a Bamboo run's market left its record in the run
    # dir (its own records confirm a loss only when it is seen: a standby node's a lease's TTL after its kill);
    # the checkpoint baseline has none, and its own records are the market's.
    billing = market_billing(run_dir, events)
    try:
        report = compute_report(events, prices, billing)
        timeline = compute_timeline(events, prices, options.bins, billing)
    except ReportError as error:
        raise MeasureError(f"{options.system}: {error} (run dir {run_dir})") from None
    measured = measure_events(events, options.system, warm_unix=warm, restarts=restarts,
                              checkpoint_every=checkpoint_every)
    progress = progress_at_end(events, restarts_at_interruptions=options.system == "checkpoint",
                               registered_unix=warm if options.system == "checkpoint" else None)
    profile = measured_profile(measured, name=f"measured-{options.system}", spot_price=options.spot_price,
                               on_demand_price=options.on_demand_price)
    profile_path = run_dir / "profile.json"
    profile_path.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
    return {
        "system": options.system,
        "run_dir": str(run_dir),
        "events": str(events_path),
        "profile": str(profile_path),
        "seconds": time.monotonic() - started,
        "price_per_node_hour": price,
        "report": report.to_dict(),
        "measurements": measured.to_dict(),
        "progress": attrs.asdict(progress),
        "timeline": {"times": list(timeline.times), "nodes": list(timeline.nodes),
                     "throughput": list(timeline.throughput), "preemptions": list(timeline.preemption_times)},
        **extra,
    }


def _run_bamboo(options: MeasureOptions, run_dir: Path, stopper: _Stopper,
                say: Callable[[str], None]) -> tuple[Path, dict[str, float], dict[str, Any]]:
    on_demand = options.system == "on-demand"
    run_options = RunOptions(
        nodes=options.stages * options.pipelines if on_demand else options.nodes, stages=options.stages,
        pipelines=options.pipelines, steps=options.max_steps, zones=options.zones,
        preemptions=None if on_demand else options.preemptions, time_scale=options.time_scale, hours=options.hours,
        trace_seed=options.trace_seed, checkpoint_dir=None if on_demand else str(run_dir / "checkpoints"),
        checkpoint_every=options.checkpoint_every, memory_copy_every=options.checkpoint_every, run_dir=str(run_dir),
        job=None,
        redundancy="none" if on_demand else options.redundancy, size={} if options.script else {"layers": options.layers},
        ttl=options.ttl, grace_s=options.grace_s, timeout_s=options.timeout_s, live=False, progress_every=50,
        script=options.script,
        fork_server=False)  # every process exec'd and importing torch, as the baselines' are and real machines' are
    warm: dict[str, float] = {}
    stopped = threading.Event()
    # ``during`` runs in a thread that run_cluster does not wait for, and so does its reader of the warm records:
    # once run_cluster returned (``ended``), neither adds to ``warm`` while the measurement iterates it
    # ("dictionary changed size during iteration" once ended a compare run)
    ended = threading.Event()
    warm_lock = threading.Lock()

    def during(handles: RunHandles) -> None:
        def poll() -> None:
            try:
                items = handles.membership.kv.get_prefix(handles.membership.keys.decision("warm-"))
                records = [WorkerWarm.from_dict(json.loads(item.value)) for item in items]
                with warm_lock:
                    if ended.is_set():
                        return
                    for record in records:
                        warm.setdefault(record.node, record.at)
            except Exception as error:  # etcd closing at the run's end: the last poll came before
                if not stopped.is_set():
                    say(f"could not read the warm records: {error}")

        def watch() -> None:
            while not ended.wait(timeouts.MEASURE_WARM_POLL_S) and not stopper.done.is_set() and not stopped.is_set():
                poll()

        threading.Thread(target=watch, name="measure-warm", daemon=True).start()
        if stopper.wait(lambda: _measured_so_far(handles.events, options.system)):
            poll()
            say(stopper.stopping())
            stopped.set()
            handles.cluster.close()

    try:
        result = run_cluster(run_options, progress=say, during=during)
    except RunError as error:
        raise MeasureError(f"{options.system}: {error} (node logs: {run_dir / 'logs'})") from None
    finally:
        with warm_lock:
            ended.set()
    if result.job_error and not stopped.is_set():
        raise MeasureError(f"{options.system}: the job failed: {result.job_error} (node logs: {run_dir / 'logs'})")
    if result.timed_out:
        raise MeasureError(f"{options.system}: the run did not end within {options.timeout_s:g} s "
                           f"(node logs: {run_dir / 'logs'})")
    return result.events, warm, {"stopped": stopped.is_set(), "warm_unix": warm}


def _run_checkpoint(options: MeasureOptions, run_dir: Path, stopper: _Stopper,
                    say: Callable[[str], None]) -> tuple[Path, Sequence[RestartCost], int | None, dict[str, Any]]:
    baseline = CheckpointRestartOptions(
        nodes=options.nodes, stages=options.stages, pipelines=options.pipelines, steps=options.max_steps,
        zones=options.zones, preemptions=options.preemptions, time_scale=options.time_scale, hours=options.hours,
        trace_seed=options.trace_seed, run_dir=str(run_dir), size={"layers": options.layers},
        timeout_s=options.timeout_s)

    def during(handles: BaselineHandles) -> None:
        if stopper.wait(lambda: _measured_so_far(handles.events, "checkpoint")):
            say(stopper.stopping())
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
        "registered_unix": result.registered_unix,
        "dropped_agents": result.dropped_unix,
        "interruptions": {"kills": result.interruptions.kills, "joins": result.interruptions.joins},
    }
    return result.events, result.restarts, None if interval is None else interval.steps, extra


def restore_spacing(events: Sequence[Event]) -> int | None:
    """The steps between a ``bamboo-launch`` run's restore points when it chose them (``auto``): the median gap
    between the steps whose ``step`` record took one, within a generation (with the same step counted once);
    None when the run took fewer than two in any generation."""
    taken: dict[int | None, set[int]] = {}
    for event in events:
        if isinstance(event, Step) and event.restore_point:
            taken.setdefault(event.generation, set()).add(event.step)
    gaps = [later - earlier for steps in taken.values() for earlier, later in itertools.pairwise(sorted(steps))]
    return round(statistics.median(gaps)) if gaps else None
