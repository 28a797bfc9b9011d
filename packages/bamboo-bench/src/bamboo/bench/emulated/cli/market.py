"""``bamboo-launch market --preemptions FILE|synthetic:RATE -- COMMAND``: the emulated spot market on its own.

Every trace add starts COMMAND as a new node (its own process group, with ``BAMBOO_NODE_ID`` and
``BAMBOO_ZONE`` set); every trace remove SIGKILLs that node's group (:mod:`bamboo.bench.emulated.market`).
"""

from __future__ import annotations

import argparse
import shutil
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bamboo.bench.argtypes import (
    PREEMPTIONS_HELP,
    default_of,
    non_negative_float,
    positive_float,
    positive_int,
    zones,
)
from bamboo.bench.emulated import timeouts as emulated_timeouts
from bamboo.bench.emulated.market import (
    ActionKind,
    ExecutedAction,
    MarketAction,
    SpotMarket,
    plan_market,
)
from bamboo.bench.emulated.processes import ProcessCluster
from bamboo.bench.emulated.run import RunOptions
from bamboo.launch.cli.common import fail
from bamboo.launch.events import EventLog, Join, Preemption
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

if TYPE_CHECKING:
    from bamboo.bench.trace import Trace

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``market``."""
    market = subparsers.add_parser(
        "market",
        help="replay a preemption trace against one process per node (the emulated spot market)",
        usage="bamboo-launch market --preemptions FILE|synthetic:RATE [options] -- COMMAND [ARGS...]",
        description=(
            "The emulated spot market. Every trace add starts COMMAND as a new node (its own process group, "
            "with BAMBOO_NODE_ID and BAMBOO_ZONE set); every trace remove SIGKILLs that node's whole process "
            "group; with --notice, SIGTERM reaches the node's leader process that many seconds before. "
            "Trace time is divided by --time-scale. When the trace ends, the nodes still running are killed."
        ),
    )
    market.add_argument(
        "--preemptions",
        required=True,
        metavar="FILE|synthetic:RATE",
        help=PREEMPTIONS_HELP,
    )
    market.add_argument(
        "--time-scale",
        type=positive_float,
        default=default_of(RunOptions, "time_scale"),
        help="trace seconds per wall second (default: %(default)s)",
    )
    market.add_argument(
        "--zones",
        type=zones,
        default=None,
        help="zone names: spread a zone-less trace (the EC2 CSV) round-robin over them, or name a synthetic "
        "trace's zones (default: the trace's own; synthetic: 3 zones)",
    )
    market.add_argument(
        "--nodes", type=positive_int, default=default_of(RunOptions, "nodes"),
        help="synthetic only: the desired cluster size (default: %(default)s)"
    )
    market.add_argument(
        "--hours",
        type=positive_float,
        default=default_of(RunOptions, "hours"),
        help="synthetic only: trace length in hours (default: %(default)s)",
    )
    market.add_argument(
        "--seed", type=int, default=default_of(RunOptions, "trace_seed"),
        help="synthetic only: random seed (default: %(default)s)"
    )
    market.add_argument(
        "--start", type=non_negative_float, default=None, help="replay the trace from this trace second"
    )
    market.add_argument(
        "--end", type=positive_float, default=None, help="replay the trace up to this trace second"
    )
    market.add_argument(
        "--allocation-delay",
        type=non_negative_float,
        default=default_of(RunOptions, "allocation_delay_s"),
        help="wall seconds from a trace add to the node's start, not compressed (default: %(default)s)",
    )
    market.add_argument(
        "--notice",
        type=non_negative_float,
        default=default_of(RunOptions, "notice_s"),
        help="wall seconds of preemption notice (SIGTERM) before each kill; 0 for none (default: %(default)s)",
    )
    market.add_argument(
        "--events",
        metavar="OUT.jsonl",
        default=None,
        help="append join and preemption records to this event log",
    )
    market.add_argument(
        "--log-dir", default=None, help="write each node's output to DIR/<node>.log (default: discard)"
    )
    market.add_argument(
        "--dry-run", action="store_true", help="print the plan (one action a line) and start nothing"
    )
    market.set_defaults(handler=run, script=[])


def _load_trace(args: argparse.Namespace) -> Trace:
    """The trace named by --preemptions, zoned by --zones and sliced by --start/--end."""
    from bamboo.bench.preemptions import load_preemptions  # numpy: not for the agents this CLI also starts

    trace = load_preemptions(args.preemptions, nodes=args.nodes, zones=args.zones, hours=args.hours, seed=args.seed)
    if args.start is not None or args.end is not None:
        start = args.start or 0.0
        end = args.end if args.end is not None else max(trace.duration_s, start) + 1.0
        if not end > start:
            fail(f"--end {end:g} must be after --start {start:g}")
        trace = trace.slice(start, end)
    return trace


def run(args: argparse.Namespace) -> int:
    """``market``: print the plan (``--dry-run``) or replay it against the node command."""
    trace = _load_trace(args)
    plan = plan_market(trace.events(), time_scale=args.time_scale, allocation_delay_s=args.allocation_delay,
                       notice_s=args.notice)
    if args.dry_run:
        for action in plan:
            print(action)
        kills = sum(action.kind.value == "kill" for action in plan)
        adds = len(plan) - kills - sum(action.kind.value == "notify" for action in plan)
        end = plan[-1].at_s if plan else 0.0
        print(f"# {trace.name}: {adds} nodes started, {kills} killed, over {end:.1f} s", file=sys.stderr)
        return 0
    if not args.script:
        fail("market needs the node's command after --, e.g. -- bamboo-launch agent ...")
    if shutil.which(args.script[0]) is None:
        fail(f"the node command {args.script[0]!r} is not an executable file or on PATH")
    return _replay(args, plan)


def _replay(args: argparse.Namespace, plan: Sequence[MarketAction]) -> int:
    command = list(args.script)
    log = EventLog(args.events) if args.events else None
    noticed_at: dict[str, float] = {}
    counts = {"started": 0, "killed": 0, "noticed": 0}

    def record(executed: ExecutedAction) -> None:
        action = executed.action
        if action.kind is ActionKind.ADD:
            counts["started"] += 1
            if log is not None:
                log.write(Join(t=log.now(), node=executed.live_node, zone=action.zone))
        elif action.kind is ActionKind.NOTIFY:
            counts["noticed"] += 1
            noticed_at[executed.live_node] = executed.executed_at_s
        else:
            counts["killed"] += 1
            notice = executed.executed_at_s - noticed_at.pop(executed.live_node, executed.executed_at_s)
            if log is not None:
                log.write(Preemption(t=log.now(), node=executed.live_node, zone=action.zone, notice_s=notice))

    total = plan[-1].at_s if plan else 0.0
    interrupted = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: interrupted.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        with ProcessCluster(lambda node, zone: command, log_dir=args.log_dir) as cluster:
            market = SpotMarket(plan, cluster, on_action=record)
            market.start()
            try:
                with Progress(
                    TextColumn("[bold]spot market"),
                    BarColumn(),
                    TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                    TextColumn("{task.fields[status]}"),
                    TimeElapsedColumn(),
                    console=Console(stderr=True),
                ) as progress:
                    task = progress.add_task("replay", total=max(total, 0.001), status="")
                    while not market.join(timeout=emulated_timeouts.RUN_POLL_S) and not interrupted.is_set():
                        status = f"alive {len(cluster.alive())}, started {counts['started']}, killed {counts['killed']}"
                        progress.update(task, completed=min(market.elapsed(), total), status=status)
                    progress.update(task, completed=min(market.elapsed(), total))
            finally:
                # Stop the market before the cluster closes, so no node starts after the clean-up.
                market.stop(timeout=emulated_timeouts.MARKET_STOP_S)
            failures = len(market.failures)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if log is not None:
            log.close()
    print(
        f"replayed {len(plan)} actions: {counts['started']} nodes started, {counts['killed']} killed, "
        f"{counts['noticed']} noticed, {failures} failed actions"
    )
    if interrupted.is_set():
        print("bamboo-launch: interrupted; every node was killed", file=sys.stderr)
        return 130
    return 1 if failures else 0
