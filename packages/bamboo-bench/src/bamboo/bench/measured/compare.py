"""``bamboo-bench compare``: Bamboo against checkpoint/restart and on-demand, measured on one replayed trace.

Each system trains the same model on the same market, one after the other, through ``bamboo-bench measure
SYSTEM`` (:mod:`bamboo.bench.measured.run`) in a process of its own:

- ``bamboo``: bamboo-launch on the emulated spot market;
- ``checkpoint``: torchrun elastic agents (one per node, their rendezvous on a store the market never
  preempts) training DeepSpeed's ``PipelineEngine`` on the same model, global batch and data order, with
  DeepSpeed checkpoints every K steps (Young's rule); every membership change restarts the workers from the
  last checkpoint, and with fewer than P x D nodes it drops to fewer pipelines;
- ``on-demand``: the same model on P x D nodes, no preemptions, priced at on-demand rates.

The trace (a file in any bamboo-bench format, or ``synthetic:RATE``) is written once as ``OUT/trace.csv``
(generic CSV; with ``--duration`` cut to the trace time the runs replay) and every system replays that file
at ``--time-scale``; trace time runs from each system's first step.

Every run writes a **measured profile** (``OUT/profiles/<system>.json``, bamboo-bench's format): step time per
pipeline count, start-up, failover pause, reconfiguration, restart and checkpoint costs. The simulator then
replays each run with its own profile on the same trace, as that system's market saw it
(``OUT/sim/<system>.csv``: the trace compressed by the time scale, its events after the start delayed by the
run's measured start-up), and the measured and predicted throughput and value are printed side by side with
the error; the exact ``bamboo-bench simulate`` command of each prediction is printed too. With ``--long-run
FILE`` the same profiles, at full scale (as many pipelines as the trace's peak of nodes holds), are simulated
on FILE uncompressed: the long-run picture.

:func:`run_compare` does it all and returns a :class:`Comparison`; the CLI prints it, as a table or JSON,
and draws it (:func:`bamboo.bench.measured.figure.plot_comparison`, the four panels of the paper's Figure 12
with the three systems, the simulator's predictions dotted).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import IO, Any

import attrs
from bamboo.bench import timeouts
from bamboo.bench.loaders import load_trace, write_generic_csv
from bamboo.bench.measured.options import CompareError, CompareOptions
from bamboo.bench.measured.steady import VARIANTS, SteadySteps, steady_step_ms
from bamboo.bench.preemptions import load_preemptions
from bamboo.bench.profile import ModelProfile, load_profile
from bamboo.bench.simulator import Policy, RunResult, Strategy, simulate_run
from bamboo.bench.trace import EventKind, Trace, TraceEvent
from bamboo.launch.events import RedundancyChoice, Step, read_events

__all__ = [
    "Comparison",
    "LongRun",
    "SystemResult",
    "default_out",
    "full_scale_profile",
    "prepare_trace",
    "run_compare",
    "simulation_trace",
    "window_figures",
]

_STRATEGY = {"bamboo": Strategy.BAMBOO, "checkpoint": Strategy.CHECKPOINT, "on-demand": Strategy.ON_DEMAND}


# ---- the trace ------------------------------------------------------------------------------------------------


def prepare_trace(options: CompareOptions) -> Trace:
    """The trace every system replays: the file (a malformed one raises ``TraceFormatError`` naming the file
    and line) or the synthetic model, zoned by ``zones`` (:func:`bamboo.bench.preemptions.load_preemptions`),
    cut to the duration's trace time."""
    trace = load_preemptions(options.preemptions, nodes=options.nodes, zones=options.zones,
                             hours=options.trace_hours, seed=options.seed)
    if options.duration_s is not None:
        end = options.duration_s * options.time_scale
        if end < trace.duration_s:
            trace = trace.slice(0.0, end)
    at_start = trace.alive_at_start()
    need = options.stages * options.pipelines
    if at_start < need:
        raise CompareError(f"the trace {options.preemptions} starts with {at_start} nodes; {options.pipelines} "
                           f"pipelines of {options.stages} stages need {need}")
    return trace


def simulation_trace(trace: Trace, time_scale: float, market_start_s: float, end_s: float | None) -> Trace:
    """The trace as one system's market replayed it, in wall seconds from the run's start: compressed by
    ``time_scale``, the events after the start delayed by ``market_start_s`` (the market starts at the first
    step), and the window ending at ``end_s`` (None: the trace's end)."""
    events = [TraceEvent(e.time_s / time_scale + (market_start_s if e.time_s > 0 else 0.0), e.kind, e.node, e.zone)
              for e in trace.events()]
    duration = end_s if end_s is not None else market_start_s + trace.duration_s / time_scale
    return Trace.from_events(f"{trace.name} as replayed", events, duration_s=max(duration, events[-1].time_s))


# ---- results ----------------------------------------------------------------------------------------------------


@attrs.frozen
class SystemResult:
    """One measured run, and the simulator's prediction of it."""

    system: str
    throughput: float
    node_hours: float
    avg_nodes: float
    cost: float
    cost_per_hour: float
    value: float
    redone_steps: int
    lost_s: float
    steps: int
    duration_s: float
    price: float
    profile: Path
    run_dir: Path
    simulate_command: tuple[str, ...]
    predicted: RunResult
    measured: Mapping[str, Any] = attrs.field(repr=False)
    timeline: Mapping[str, Any] = attrs.field(repr=False)

    @property
    def throughput_error(self) -> float:
        """(predicted - measured) / measured."""
        return _error(self.predicted.throughput, self.throughput)

    @property
    def value_error(self) -> float:
        return _error(self.predicted.value, self.value)


def _error(predicted: float, measured: float) -> float:
    if measured == 0:
        return 0.0 if predicted == 0 else math.inf
    return (predicted - measured) / measured


@attrs.frozen
class LongRun:
    """The measured profiles at full scale, simulated on the long-run trace uncompressed."""

    trace: str
    nodes: int
    pipelines: int
    hours: float
    results: dict[str, RunResult]
    profiles: dict[str, Path]
    notes: tuple[str, ...]
    steady: SteadySteps | None = None
    """The fault-free steps one core per stage that set the full-scale step times (None: the emulated runs')."""
    step_ms: dict[str, float] = attrs.Factory(dict)
    """Each system's full-scale step with every pipeline, in ms."""


@attrs.frozen
class Comparison:
    """Everything ``compare`` measured and predicted."""

    options: CompareOptions
    trace: Trace
    results: dict[str, SystemResult]
    long_run: LongRun | None

    def ratio(self, system: str, against: str, key: str) -> float | None:
        """``system``'s ``key`` (throughput or value) over ``against``'s; None when either is missing."""
        if system not in self.results or against not in self.results:
            return None
        base = getattr(self.results[against], key)
        return math.inf if base == 0 else getattr(self.results[system], key) / base

    def records(self) -> list[dict[str, Any]]:
        """One JSON-ready object per system: the ``--json`` contract."""
        out = []
        for name, result in self.results.items():
            record: dict[str, Any] = {
                "system": name, "throughput": result.throughput, "node_hours": result.node_hours, "cost": result.cost,
                "value": result.value, "redone_steps": result.redone_steps, "lost_s": result.lost_s,
                "steps": result.steps, "duration_s": result.duration_s, "avg_nodes": result.avg_nodes,
                "price_per_node_hour": result.price,
                "vs_checkpoint": _ratios(self, name, "checkpoint"), "vs_on_demand": _ratios(self, name, "on-demand"),
                "predicted_throughput": result.predicted.throughput, "predicted_value": result.predicted.value,
                "throughput_error": result.throughput_error, "value_error": result.value_error,
                "profile": str(result.profile), "run_dir": str(result.run_dir),
                "simulate_command": " ".join(result.simulate_command),
            }
            if name == "checkpoint":
                record["checkpoint_interval"] = result.measured.get("checkpoint_interval")
                record["restarts"] = len(result.measured.get("restarts", []))
                record["job_restarts"] = result.measured.get("job_restarts", 0)
                record["interruptions"] = result.measured.get("interruptions")
            if self.long_run is not None and name in self.long_run.results:
                run = self.long_run.results[name]
                record["long_run"] = {"throughput": run.throughput, "value": run.value, "nodes": run.nodes,
                                      "cost_per_hour": run.cost_per_hour, "hours": run.duration_h,
                                      "step_ms": self.long_run.step_ms.get(name)}
            out.append(record)
        return out


def _ratios(comparison: Comparison, system: str, against: str) -> dict[str, float | None] | None:
    if against not in comparison.results:
        return None
    return {"throughput": comparison.ratio(system, against, "throughput"),
            "value": comparison.ratio(system, against, "value")}


# ---- running the systems -------------------------------------------------------------------------------------


def _measure_command(options: CompareOptions, system: str, trace_file: Path, run_dir: Path) -> list[str]:
    command = [sys.executable, "-m", "bamboo.bench", "measure", system, "--nodes", str(options.nodes),
               "--stages", str(options.stages), "--pipelines", str(options.pipelines),
               "--preemptions", str(trace_file), "--time-scale", f"{options.time_scale:g}",
               "--run-dir", str(run_dir), "--spot-price", f"{options.spot_price:g}",
               "--on-demand-price", f"{options.on_demand_price:g}", "--layers", str(options.layers),
               "--timeout", f"{options.timeout_s:g}", "--redundancy", options.redundancy, "--json"]
    command += ["--steps", str(options.steps)] if options.steps is not None else ["--duration", f"{options.duration_s:g}"]
    if options.script and system != "checkpoint":
        command += ["--", *options.script]
    return command


class _Follower:
    """Copies a run's stderr to its log file and keeps its last line (for the progress display)."""

    def __init__(self, stream: IO[str], log: Path) -> None:
        self.last = ""
        self._log = log.open("w", encoding="utf-8")
        self._thread = threading.Thread(target=self._pump, args=(stream,), daemon=True)
        self._thread.start()

    def _pump(self, stream: IO[str]) -> None:
        for line in stream:
            self._log.write(line)
            self._log.flush()
            if line.strip():
                self.last = line.strip()

    def close(self) -> None:
        self._thread.join(5.0)
        self._log.close()


def _run_system(options: CompareOptions, system: str, index: int, trace_file: Path,
                status: Callable[[str], None]) -> dict[str, Any]:
    run_dir = options.out / "runs" / system
    log = options.out / "runs" / f"{system}.log"
    command = _measure_command(options, system, trace_file, run_dir)
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu")}
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                               stdin=subprocess.DEVNULL)
    follower = _Follower(process.stderr, log)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(process.stdout), daemon=True)  # type: ignore[arg-type]
    reader.start()
    label = f"{system} ({index} of {len(options.systems)})"
    try:
        while process.poll() is None:
            elapsed = time.monotonic() - started
            status(f"running {label}: {int(elapsed // 60)}m{int(elapsed % 60):02d}s elapsed"
                   + (f"; {follower.last.split(': ', 1)[-1][:90]}" if follower.last else ""))
            time.sleep(0.5)
    except BaseException:  # stopped (Ctrl-C, SIGTERM): the run stops its own cluster first (SIGKILL left it behind)
        _stop_child(process)
        raise
    reader.join(10.0)
    follower.close()
    if process.returncode != 0:
        raise CompareError(f"the {system} run failed (exit status {process.returncode}): {follower.last} "
                           f"(its log: {log})")
    try:
        return json.loads(output[-1])
    except (IndexError, json.JSONDecodeError):
        raise CompareError(f"the {system} run printed no result (its log: {log})") from None


def _stop_child(process: subprocess.Popen[str]) -> None:
    """Stop a ``measure`` run as Ctrl-C would (SIGTERM: it kills its nodes and etcd), and kill it if it has not
    ended within :data:`bamboo.bench.timeouts.COMPARE_CHILD_STOP_S`."""
    process.terminate()
    try:
        process.wait(timeouts.COMPARE_CHILD_STOP_S)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def _predict(options: CompareOptions, system: str, trace: Trace, measured: Mapping[str, Any],
             profile_path: Path) -> tuple[RunResult, tuple[str, ...], Path]:
    """The simulator's prediction of one run, and the ``bamboo-bench simulate`` command that gives it."""
    profile = load_profile(profile_path)
    market_start = float(measured["measurements"]["market_start_s"])
    end = market_start + options.duration_s if options.duration_s is not None else None
    if system == "on-demand":
        nodes = [TraceEvent(0.0, EventKind.ADD, f"node{i}", "on-demand") for i in range(profile.on_demand_nodes)]
        replayed = Trace.from_events("on-demand", nodes, duration_s=end if end is not None else 1.0)
    else:
        replayed = simulation_trace(trace, options.time_scale, market_start, end)
    sim_file = options.out / "sim" / f"{system}.csv"
    sim_file.parent.mkdir(parents=True, exist_ok=True)
    write_generic_csv(replayed, sim_file)
    until = "trace-end" if end is not None else "completion"
    result = simulate_run(replayed, profile, _STRATEGY[system], policy=Policy(),
                          target_samples=math.inf if end is not None else None,
                          until_s=end, record=True)
    command = ("bamboo-bench", "simulate", "--trace", str(sim_file), "--model", str(profile_path),
               "--strategy", system, "--until", until, "--hold", "trace")
    return result, command, sim_file


def full_scale_profile(profile: ModelProfile, pipelines: int, trace: Trace | None, name: str,
                       step_ms: float | None = None, step_note: str | None = None) -> ModelProfile:
    """``profile`` at ``pipelines`` pipelines of the same depth: each pipeline keeps its share of the global batch
    (``samples_per_step`` grows by ``pipelines / D``), so a step with all of them takes the measured D-pipeline
    step time, and with ``d`` of them ``pipelines / d`` times that (the global batch stays; pipeline fill is
    not modelled); on-demand runs ``pipelines`` pipelines at the same rate per pipeline. The timing constants
    stay as measured, except the interval between synchronous checkpoints (``checkpoint_s > 0``), which Young's
    rule sets again for ``trace``'s mean time between interruptions (its kills and later additions).
    ``step_ms`` replaces the measured D-pipeline step (``step_note`` says where it comes from)."""
    base_d = profile.pipelines
    step = profile.step_time_s(base_d) * 1000.0 if step_ms is None else step_ms
    factor = pipelines / base_d
    table = {(profile.stages, d): step * pipelines / d for d in range(1, pipelines + 1)}
    timing = profile.timing
    notes = [f"{profile.name} at full scale: {pipelines} pipelines of {profile.stages} (measured with {base_d}); "
             f"step with d pipelines = {step:.1f} ms x {pipelines}/d; samples per step x{factor:g}"]
    if step_note is not None:
        notes.append(step_note)
    if trace is not None and timing.checkpoint_s > 0:
        summary = trace.summary()
        interruptions = summary.preemptions + max(0, summary.adds - trace.alive_at_start())
        if interruptions:
            mtbf = trace.duration_s / interruptions
            period = math.sqrt(2.0 * timing.checkpoint_s * mtbf)
            timing = attrs.evolve(timing, checkpoint_interval_s=max(period, step / 1000.0) + timing.checkpoint_s)
            notes.append(f"checkpoint interval by Young's rule on the long trace: sqrt(2 x {timing.checkpoint_s:.3f} s "
                         f"x {mtbf:.0f} s between interruptions) = {period:.1f} s")
    return attrs.evolve(
        profile, name=name, pipelines=pipelines, samples_per_step=profile.samples_per_step * factor,
        step_time_ms=table, on_demand_nodes=profile.stages * pipelines,
        on_demand_samples_per_second=profile.on_demand_samples_per_second * factor,
        job_samples=1e15, timing=timing, notes=(*profile.notes, *notes),
    )


_STEADY_VARIANT = {"checkpoint": "deepspeed", "on-demand": "none"}
"""The fault-free variant that trains as each baseline does (bamboo's is the mode its run used)."""


def bamboo_mode(run_dir: Path, configured: str) -> str:
    """The redundancy mode the bamboo run trained with: ``configured``, or under ``auto`` the mode in force for the
    most of its steps (by their layout generation; ``none`` when no step says)."""
    if configured != "auto":
        return configured
    events = read_events(run_dir / "events.jsonl")
    modes = {event.generation: event.mode for event in events if isinstance(event, RedundancyChoice)}
    counts = Counter(modes.get(event.generation, "none") for event in events if isinstance(event, Step))
    return counts.most_common(1)[0][0] if counts else "none"


def system_variants(options: CompareOptions, results: Mapping[str, SystemResult]) -> dict[str, str]:
    """Each system's fault-free variant: what its runs trained (:data:`_STEADY_VARIANT`, or bamboo's mode)."""
    return {name: _STEADY_VARIANT.get(name) or bamboo_mode(result.run_dir, options.redundancy)
            for name, result in results.items()}


def steady_steps(options: CompareOptions, results: Mapping[str, SystemResult]) -> SteadySteps | None:
    """The systems' fault-free steps one core per stage (None when ``--no-steady`` or a script is trained)."""
    if not options.steady or options.script:
        return None
    variants = set(system_variants(options, results).values()) | {"none"}
    return steady_step_ms([v for v in VARIANTS if v in variants], options.layers, options.stages, options.out)


def full_scale_steps(options: CompareOptions, results: Mapping[str, SystemResult],
                     steady: SteadySteps) -> dict[str, tuple[float, str]]:
    """Each system's D-pipeline step for the long run, and where it comes from: one measured step (on-demand's,
    the run that trained every pipeline without a failure, or else the first system's), and each system's ratio
    to it one core per stage."""
    variant = system_variants(options, results)
    anchor = "on-demand" if "on-demand" in results else next(iter(results))
    measured = load_profile(results[anchor].profile)
    anchor_ms = measured.step_time_s(measured.pipelines) * 1000.0
    out = {}
    for name in results:
        ratio = steady.ratio(variant[name], variant[anchor])
        out[name] = (anchor_ms * ratio, (
            f"step {anchor_ms * ratio:.1f} ms: {anchor}'s measured {anchor_ms:.1f} ms x {ratio:.3f}, {variant[name]} "
            f"against {variant[anchor]} fault-free one core per stage ({steady.ms[variant[name]]:.2f} against "
            f"{steady.ms[variant[anchor]]:.2f} ms, P={steady.stages} D=1: {' '.join(steady.command)})"))
    return out


def _long_run(options: CompareOptions, results: Mapping[str, SystemResult], steady: SteadySteps | None) -> LongRun:
    assert options.long_run is not None
    trace = load_trace(options.long_run)
    summary = trace.summary()
    nodes = options.long_run_nodes or summary.max_alive
    pipelines = max(1, nodes // options.stages)
    runs: dict[str, RunResult] = {}
    written: dict[str, Path] = {}
    notes = [f"the profiles measured here at {pipelines} pipelines of {options.stages} ({pipelines * options.stages} "
             f"nodes) on {trace.name} ({summary.duration_h:.2f} h, peak {summary.max_alive} nodes), uncompressed",
             "instance creation is the measured process start; a cloud VM's boot time (the paper's 45 s) is not in it"]
    if steady is None:
        notes.append("step times: each emulated run's own, with every node of the cluster sharing this machine's "
                     "cores")
    else:
        notes.append(f"step times: the systems' ratios measured fault-free one core per stage (P={steady.stages}, D=1,"
                     f" on {steady.cores} cores: " + ", ".join(f"{v} {ms:.2f} ms" for v, ms in steady.ms.items())
                     + "), applied to one measured step (the emulated runs share the cores between all their nodes, "
                     "which a GPU per node does not)")
    steps = full_scale_steps(options, results, steady) if steady is not None else {}
    step_ms: dict[str, float] = {}
    for system, result in results.items():
        override, note = steps.get(system, (None, None))
        profile = full_scale_profile(load_profile(result.profile), pipelines, trace, f"{system}-full-scale",
                                     step_ms=override, step_note=note)
        step_ms[system] = profile.step_time_s(pipelines) * 1000.0
        if note is not None:
            notes.append(f"{system}: {note}")
        target = options.out / "profiles" / f"{system}-full-scale.json"
        target.write_text(json.dumps(profile.to_dict(), indent=2) + "\n")
        written[system] = target
        runs[system] = simulate_run(trace, profile, _STRATEGY[system], policy=Policy(), target_samples=math.inf,
                                    until_s=trace.duration_s, record=True)
    return LongRun(trace=str(options.long_run), nodes=pipelines * options.stages, pipelines=pipelines,
                   hours=summary.duration_h, results=runs, profiles=written, notes=tuple(notes), steady=steady,
                   step_ms=step_ms)


def run_compare(options: CompareOptions, status: Callable[[str], None] | None = None) -> Comparison:
    """Run every system of ``options`` on the same trace, measure each, and predict each with the simulator."""
    say = status or (lambda line: None)
    trace = prepare_trace(options)
    options.out.mkdir(parents=True, exist_ok=True)
    (options.out / "runs").mkdir(exist_ok=True)
    (options.out / "profiles").mkdir(exist_ok=True)
    trace_file = options.out / "trace.csv"
    write_generic_csv(trace, trace_file)
    results: dict[str, SystemResult] = {}
    for index, system in enumerate(options.systems, start=1):
        measured = _run_system(options, system, index, trace_file, say)
        profile_path = options.out / "profiles" / f"{system}.json"
        profile_path.write_text(Path(measured["profile"]).read_text())
        load_profile(profile_path)  # a measured profile that does not load is a bug: say so here
        predicted, command, _ = _predict(options, system, trace, measured, profile_path)
        report = measured["report"]
        price = float(measured["price_per_node_hour"])
        window_s, throughput, lost_s = window_figures(report, float(measured["measurements"]["market_start_s"]),
                                                      options.duration_s, measured.get("progress"))
        cost_per_hour = report["avg_nodes"] * price
        results[system] = SystemResult(
            system=system, throughput=throughput, node_hours=report["node_hours"],
            avg_nodes=report["avg_nodes"], cost=report["node_hours"] * price, cost_per_hour=cost_per_hour,
            value=throughput / cost_per_hour if cost_per_hour > 0 else 0.0, redone_steps=report["redone_steps"],
            lost_s=lost_s, steps=report["steps"], duration_s=window_s, price=price,
            profile=profile_path, run_dir=Path(measured["run_dir"]), simulate_command=command, predicted=predicted,
            measured=measured, timeline=measured["timeline"])
        say(f"{system} done: {report['steps']} steps, {throughput:.2f} samples/s")
    long_run = None
    if options.long_run is not None:
        if options.steady and not options.script:
            say("measuring every system's fault-free step one core per stage (for the long run)")
        long_run = _long_run(options, results, steady_steps(options, results))
    return Comparison(options=options, trace=trace, results=results, long_run=long_run)


def window_figures(report: Mapping[str, Any], market_start_s: float, duration_s: float | None,
                   progress: Mapping[str, Any] | None = None) -> tuple[float, float, float]:
    """A measured run's ``(window_s, throughput, lost_s)``, as the simulator counts them.

    With ``--duration`` every system is stopped ``duration_s`` after its first step, so its window is
    ``market_start_s + duration_s`` from its start, whether or not it was training then: a checkpoint/restart
    run stopped in the middle of a restart paid for that time and trained nothing in it. Throughput is the
    samples where training stood at the end (``progress``: :mod:`bamboo.bench.measured.progress`; steps a
    restart had not trained again are lost, as to the simulator) over the window; the time after the last step
    and the lost steps' count as lost, beside the report's own lost time (start-up, pauses, redone steps). With
    ``--steps`` the window ends at the last step and the report's figures stand.
    """
    training_s = float(report["training_s"])
    if duration_s is None:
        return training_s, float(report["samples"]) / training_s, float(report["lost_s"])
    kept = progress or {"samples": report["samples"], "discarded_s": 0.0}
    window_s = max(training_s, market_start_s + duration_s)
    lost_s = float(report["lost_s"]) + (window_s - training_s) + float(kept["discarded_s"])
    return window_s, float(kept["samples"]) / window_s, lost_s


def default_out() -> Path:
    """A fresh folder for a comparison's files."""
    return Path(tempfile.mkdtemp(prefix="bamboo-compare-"))
