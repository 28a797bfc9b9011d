"""``bamboo-launch run [options] [-- SCRIPT ARGS]``: train on an emulated spot cluster (:mod:`bamboo.bench.emulated.run`).

Every flag defaults to :class:`bamboo.bench.emulated.run.RunOptions`'s field; the report is printed at the end, and
``--verify`` compares the final parameters with a fault-free single-process run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable
from typing import Any

from bamboo.bench.argtypes import PREEMPTIONS_HELP, default_of, non_negative_float, positive_float, zones
from bamboo.bench.emulated.run import RunError, RunOptions, RunResult, compare_with_reference, run_cluster
from bamboo.bench.emulated.run_options import Verification
from bamboo.bench.emulated.run_results import market_billing, unfinished
from bamboo.bench.emulated.stop_signals import stopped_like_ctrl_c
from bamboo.bench.value import compute_report, format_report, plot_report
from bamboo.launch.cli.common import DEVICE_HELP, device, endpoints, fail, steps_or_auto_flag
from bamboo.launch.events import read_events
from bamboo.launch.example import DEFAULT_LAYERS
from bamboo.launch.spec import AUTO_EVERY, REDUNDANCY
from bamboo.rc.timeouts import DEFAULT_PREEMPTIONS_PER_NODE_HOUR
from rich.console import Console
from rich.markup import escape

__all__ = ["VERIFY_TOLERANCE", "add_parser", "finish_run", "progress_printer", "run_command"]

VERIFY_TOLERANCE = 1e-6
_LOST_PEER = "PeerFailure:"
"""How a worker's error record starts when the worker ended because a peer died (``bamboo.rc.PeerFailure``)."""
"""``--verify`` fails above this relative difference from the fault-free single-process run."""


def _default(field: str) -> Any:
    return default_of(RunOptions, field)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``run``."""
    run = subparsers.add_parser(
        "run",
        help="train on an emulated spot cluster: embedded etcd, one agent per node, the spot market, failover",
        usage=(
            "bamboo-launch run --nodes N --stages P --pipelines D [--zones a,b,c] [--etcd URL] "
            "[--preemptions FILE|synthetic:RATE] [--time-scale X] [--checkpoint-dir DIR] [--steps S] [options] "
            "[-- SCRIPT ARGS...]"
        ),
        description=(
            "Start etcd (embedded unless --etcd), one node process per initial node of the trace (an agent that "
            "registers under a lease, serves the gRPC agent service and spawns its worker), place P x D of them "
            "with bamboo-reconfig (the rest on standby), train with redundant computation, and replay the "
            "preemption trace: a removal SIGKILLs the node's whole process group and the runtime fails over; an "
            "addition starts a new node after the allocation delay. Trace time runs from the first training "
            "step. Writes a JSON-lines event log and prints the report. The model is the built-in example (the "
            "tiny GPT of bamboo-rc) or, after --, your script: each worker runs `python SCRIPT ARGS`, which "
            "gives its layers (DeepSpeed LayerSpecs), loss and data (microbatch(step, index)) to "
            "bamboo.launch.train_worker(...); RANK, WORLD_SIZE, LOCAL_RANK and BAMBOO_* are set. The launcher "
            "runs the script once first to read its model, and once more for --verify."
        ),
    )
    run.add_argument("--nodes", type=int, default=_default("nodes"), help="initial cluster size; synthetic traces "
                     "keep about this many nodes (default: %(default)s)")
    run.add_argument("--stages", type=int, default=_default("stages"), help="pipeline depth P (default: %(default)s)")
    run.add_argument("--pipelines", type=int, default=_default("pipelines"),
                     help="data-parallel pipelines D (default: %(default)s)")
    run.add_argument("--zones", type=zones, default=None, help="zone names, comma separated (default: the "
                     "trace's own; without a trace or for a synthetic one: 3 zones)")
    run.add_argument("--steps", type=int, default=_default("steps"), help="training steps S (default: %(default)s)")
    run.add_argument("--preemptions", default=None, metavar="FILE|synthetic:RATE",
                     help=f"preemption trace: {PREEMPTIONS_HELP} (default: none)")
    run.add_argument("--time-scale", type=positive_float, default=_default("time_scale"),
                     help="trace seconds per wall second (default: %(default)s)")
    run.add_argument("--hours", type=positive_float, default=_default("hours"),
                     help="synthetic only: trace length in hours (default: %(default)s)")
    run.add_argument("--seed", type=int, default=_default("trace_seed"), help="synthetic only: the trace's random "
                     "seed (default: %(default)s)")
    run.add_argument("--allocation-delay", type=non_negative_float, default=_default("allocation_delay_s"),
                     help="wall seconds from a trace add to the node's start (default: %(default)s)")
    run.add_argument("--notice", type=non_negative_float, default=_default("notice_s"),
                     help="wall seconds of preemption notice (SIGTERM) before each kill (default: %(default)s)")
    run.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                     help="write asynchronous checkpoints here (one shard per stage; default: RUN_DIR/checkpoints)")
    run.add_argument("--checkpoint-every", type=steps_or_auto_flag, default=_default("checkpoint_every"), metavar="N|auto",
                     help="steps between checkpoints, or auto: chosen for each layout by Young's rule from the "
                     "preemption rate and the measured cost of a copy (default: %(default)s)")
    run.add_argument("--memory-copy-every", type=steps_or_auto_flag, default=_default("memory_copy_every"), metavar="N|auto",
                     help="steps between in-memory copies of every stage, kept by its holders and by keepers in "
                     "other zones; a stage whose every live copy is lost is restored from them before any "
                     "checkpoint (0: none; auto: as --checkpoint-every auto; default: %(default)s)")
    run.add_argument("--resume", action="store_true",
                     help="start from the newest good checkpoint in --checkpoint-dir, e.g. with a larger --steps "
                     "(a run never overwrites another run's checkpoints: a directory that holds some needs it)")
    _add_etcd_flags(run)
    _add_output_and_timing_flags(run)
    run.set_defaults(handler=run_command, script=[])


def _add_etcd_flags(run: argparse.ArgumentParser) -> None:
    """An external etcd instead of the embedded one, with its auth and TLS."""
    run.add_argument("--etcd", type=endpoints, default=None, metavar="URL",
                     help="external etcd endpoints host:port[,host:port] (default: start an embedded etcd)")
    run.add_argument("--etcd-user", default=None, help="external etcd: user name (with --etcd-password)")
    run.add_argument("--etcd-password", default=None, help="external etcd: password")
    run.add_argument("--etcd-ca", default=None, help="external etcd: PEM CA of the server (enables TLS)")
    run.add_argument("--etcd-cert", default=None, help="external etcd: PEM client certificate (with --etcd-key)")
    run.add_argument("--etcd-key", default=None, help="external etcd: PEM client key")


def _add_output_and_timing_flags(run: argparse.ArgumentParser) -> None:
    """The job's name and files, the report, the model, and the timeouts."""
    run.add_argument("--job", default=None, help="job name: etcd keys live under /bamboo/<job>/ (default: a "
                     "fresh random name)")
    run.add_argument("--run-dir", default=None, help="where the run's files go: RUN.json, out/, logs/<node>.log, "
                     "events.jsonl (default: a new temporary directory, kept)")
    run.add_argument("--events", default=None, metavar="OUT.jsonl",
                     help="the JSON-lines event log (default: RUN_DIR/events.jsonl)")
    run.add_argument("--plot", default=None, metavar="OUT.png", help="also write the four-panel figure here")
    run.add_argument("--json", action="store_true", help="print the report as one JSON object")
    run.add_argument("--verify", action="store_true",
                     help="after the run, compare the final parameters with a fault-free single-process run of the "
                     f"same steps (exit status 1 above {VERIFY_TOLERANCE:g} relative)")
    run.add_argument("--layers", type=int, default=DEFAULT_LAYERS, help="decoder blocks of the built-in example "
                     "GPT (not used with a script; default: %(default)s)")
    run.add_argument("--redundancy", default=_default("redundancy"), choices=REDUNDANCY,
                     help="redundant computation mode; auto: the mode each layout expects to lose least "
                     "training per hour with, from the job's measured step and preemption rate (default: %(default)s)")
    run.add_argument("--preemption-rate", type=non_negative_float, default=None, metavar="PER_NODE_HOUR",
                     help="with --redundancy auto: the preemptions per node-hour assumed before the job has history of its "
                     f"own (weighed as one node-hour against it; default: {DEFAULT_PREEMPTIONS_PER_NODE_HOUR:g})")
    run.add_argument("--ttl", type=int, default=_default("ttl"), help="node lease TTL, seconds (default: "
                     "%(default)s)")
    run.add_argument("--grace", type=positive_float, default=_default("grace_s"),
                     help="seconds a suspect must stay unresponsive before it is declared failed (default: "
                     "%(default)s)")
    run.add_argument("--reconfigure-timeout", type=positive_float, default=_default("reconfigure_timeout_s"),
                     help="seconds a reconfiguration may take to start every node of the new layout before it is "
                     "abandoned and decided again (a node that dies meanwhile is noticed sooner: at once when a "
                     "transfer fails on its closed connection, otherwise when its lease expires, --ttl; default: "
                     "%(default)s)")
    run.add_argument("--device", type=device, default=None, help=DEVICE_HELP)
    run.add_argument("--timeout", type=positive_float, default=_default("timeout_s"),
                     help="seconds the whole run may take before every node is killed (default: %(default)s)")
    run.add_argument("--no-fork-server", action="store_true",
                     help="start every node's agent and worker by exec, each importing torch on its own, instead of "
                     "forking them from one preloaded interpreter (the default: the same processes, groups and "
                     "files, started in a fraction of the CPU time)")
    run.add_argument("--preload", action="append", default=[], metavar="MODULE",
                     help="a module the fork server imports once more before it forks the nodes (repeatable): a "
                     "training script's own heavy imports, which every worker would otherwise import by itself, e.g. "
                     "transformers.models.gpt2.modeling_gpt2 for a Hugging Face GPT-2 (about 4 CPU-s a worker)")
    run.add_argument("--no-live", action="store_true",
                     help="no live view; print a progress line (step, loss, samples/s, nodes) every "
                     "--progress-every steps instead")
    run.add_argument("--progress-every", type=int, default=_default("progress_every"), metavar="N",
                     help="with --no-live: steps between progress lines (default: %(default)s)")


def _importable(name: str) -> bool:
    """Whether ``name`` names a module this interpreter can import (its parent packages are imported to tell)."""
    import importlib.util

    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def run_command(args: argparse.Namespace) -> int:
    """``run``: the emulated cluster to the end, its report, and with ``--verify`` the exactness check."""
    for name in ("nodes", "stages", "pipelines", "steps", "layers", "checkpoint_every", "ttl"):
        if getattr(args, name) != AUTO_EVERY and getattr(args, name) < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.memory_copy_every != AUTO_EVERY and args.memory_copy_every < 0:
        fail(f"--memory-copy-every must be >= 0, got {args.memory_copy_every}")
    for name in args.preload:
        if not _importable(name):
            fail(f"--preload {name}: no module of that name here")
    if not args.script and args.layers + 2 < args.stages:
        fail(f"--stages {args.stages} is more than the example's {args.layers + 2} layers (raise --layers)")
    try:
        options = RunOptions(
            nodes=args.nodes, stages=args.stages, pipelines=args.pipelines, steps=args.steps, zones=args.zones,
            etcd=args.etcd, etcd_user=args.etcd_user, etcd_password=args.etcd_password, etcd_ca=args.etcd_ca,
            etcd_cert=args.etcd_cert, etcd_key=args.etcd_key, preemptions=args.preemptions,
            time_scale=args.time_scale, hours=args.hours, trace_seed=args.seed,
            allocation_delay_s=args.allocation_delay, notice_s=args.notice, checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every, memory_copy_every=args.memory_copy_every, resume=args.resume, run_dir=args.run_dir, events=args.events,
            job=args.job,
            redundancy=args.redundancy, preemption_rate=args.preemption_rate, size={} if args.script else {"layers": args.layers}, ttl=args.ttl,
            grace_s=args.grace,
            reconfigure_timeout_s=args.reconfigure_timeout, timeout_s=args.timeout, live=not args.no_live,
            progress_every=args.progress_every, device=args.device,
            script=tuple(args.script), fork_server=not args.no_fork_server, preload=tuple(args.preload),
        )
    except ValueError as error:
        fail(str(error))
    try:
        with stopped_like_ctrl_c():
            result = run_cluster(options, progress=progress_printer(Console(stderr=True)))
        return finish_run(args, options, result, compare_with_reference if args.verify else None)
    except RunError as error:
        fail(f"{error} (node logs: {options.run_dir or 'the run directory'}/logs)")


def progress_printer(console: Console) -> Callable[[str], None]:
    """What prints a run's progress lines on ``console``: each one line as it is, after a dim prefix (no markup read
    in it, no highlighting, no wrapping: highlighting and wrapping took about 0.6 of each line's 0.9 ms, and the
    wrapping at the terminal's width cut the lines in two in a log file)."""

    def say(line: str) -> None:
        console.print(f"[dim]bamboo-launch:[/dim] {escape(line)}", highlight=False, soft_wrap=True)

    return say


def finish_run(args: argparse.Namespace, options: RunOptions, result: RunResult,
               verify: Callable[[RunResult, RunOptions], Verification] | None) -> int:
    """Print a finished run's report (and what went wrong, one line each); the exit status: 1 when the job
    failed, timed out or did not verify, else 0."""
    events = read_events(result.events)
    billing = market_billing(result.run_dir, events)  # each machine from the market's start of it to its kill
    report = compute_report(events, billing=billing)
    status = 0
    extra: dict[str, Any] = {"run_dir": str(result.run_dir), "events": str(result.events),
                             "failed_ranks": list(result.failed_ranks), "timed_out": result.timed_out}
    if result.consecutive:
        extra["consecutive_failure"] = result.consecutive
    logs = result.run_dir / "logs"
    # A worker that ends because a peer died (PeerFailure: no failover for it, as under --redundancy none) is the
    # expected end of that worker, which the job recovers from; only the other exceptions are the workers' errors.
    raised = [(node, line) for node, line in result.worker_errors if not line.startswith(_LOST_PEER)]
    lost_peers = [(node, line) for node, line in result.worker_errors if line.startswith(_LOST_PEER)]
    if result.job_error:
        extra["job_error"] = result.job_error
        if result.worker_errors:  # the cause is most often the first worker's exception, not the lost copies
            node, line = (raised or lost_peers)[0]
            extra["job_error"] += f" (the first worker error: node {node}: {line})"
        status = 1
    if raised:
        extra["worker_errors"] = [f"{node}: {line} (log {logs / (node.split('.')[0] + '.log')})" for node, line in raised]
    if lost_peers:  # one line each: the gloo detail that follows is in the log
        extra["ended_on_a_lost_peer"] = [f"{node}: {line.removeprefix(_LOST_PEER).strip().split(': [', 1)[0]}"
                                         for node, line in lost_peers]
    errors = {node: code for node, code in result.exit_codes.items() if code is not None and code > 0}
    if errors:  # a worker's error, a lost lease, a script that never called train_worker (killed nodes are < 0)
        extra["node_errors"] = {node: f"status {code}, log {logs / (node + '.log')}"
                                for node, code in sorted(errors.items())}
    if verify is not None:
        with contextlib.redirect_stdout(sys.stderr):  # DeepSpeed, imported by the reference run, logs to stdout
            comparison = verify(result, options)
        diff = comparison["max_relative_diff"]
        extra["verify"] = "PASSED" if diff <= VERIFY_TOLERANCE else f"FAILED ({diff:.3g} > {VERIFY_TOLERANCE:g})"
        extra["max_relative_diff"] = diff
        extra["compared_steps"] = comparison["steps"]
        if diff > VERIFY_TOLERANCE:
            status = 1
    if result.timed_out:
        status = 1
    if result.stalled is not None:  # (with --verify, compare_with_reference has said it already)
        extra["stopped"] = unfinished(result)
        status = 1
    if args.plot:
        plot_report(events, args.plot, billing=billing)
    if args.json:
        print(json.dumps({**report.to_dict(), **extra}))
    else:
        print(format_report(report))
        for key, value in extra.items():
            rows = value if key in ("worker_errors", "ended_on_a_lost_peer") else [value]  # one line per worker
            print(f"  {key.replace('_', ' '):<16} {rows[0]}")
            for row in rows[1:]:
                print(f"  {'':<16} {row}")
        if args.plot:
            print(f"  plot             {args.plot}")
    return status
