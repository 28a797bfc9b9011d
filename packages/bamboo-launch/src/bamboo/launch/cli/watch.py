"""``bamboo-launch watch (EVENTS.jsonl | --etcd URL --job J)``: the live progress view of a run.

It follows the event log as it grows (a local file, or the job's log in etcd, from any machine) until the
``run_end`` record, or Ctrl-C; ``--once`` shows the current state and exits.
"""

from __future__ import annotations

import argparse
import json
import signal
import sys
import threading

from bamboo.bench.argtypes import positive_float, positive_int
from bamboo.launch import timeouts
from bamboo.launch.cli.common import add_etcd_source, check_source, etcd_kv, fail
from bamboo.launch.events import EtcdEventFollower
from bamboo.launch.live import DEFAULT_WINDOW, EventFollower, LiveState, LiveView, render_live

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``watch``."""
    watch = subparsers.add_parser(
        "watch",
        help="live progress view of a run from its event log",
        description=(
            "Follow an event log as it grows (a local JSON-lines file, or the job's log in etcd with --etcd URL "
            "--job J, from any machine) and show step, loss, samples/s, nodes active, on standby and "
            "joining, the counts of preemptions, failovers, reconfigurations and checkpoints, and the last "
            "events. Stops at the run_end record, or on Ctrl-C."
        ),
    )
    watch.add_argument("events", nargs="?", default=None,
                       help="the run's event log (JSON lines; it may not exist yet)")
    add_etcd_source(watch)
    watch.add_argument("--once", action="store_true", help="show the current state once and exit")
    watch.add_argument("--json", action="store_true", help="with --once: print the state as one JSON object")
    watch.add_argument(
        "--interval",
        type=positive_float,
        default=timeouts.WATCH_POLL_S,
        help="seconds between reads of the log (default: %(default)s)",
    )
    watch.add_argument(
        "--window", type=positive_int, default=DEFAULT_WINDOW,
        help="steps averaged for samples/s (default: %(default)s)"
    )
    watch.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """``watch``: the live view until the run ends (or its state once, with ``--once``)."""
    from rich.console import Console  # here, not above: every bamboo-launch command would import rich

    if args.json and not args.once:
        fail("--json needs --once (the live view is for a terminal)")
    check_source(args, [args.events] if args.events else [])
    follower: EtcdEventFollower | EventFollower
    if args.etcd is not None:
        follower = EtcdEventFollower(etcd_kv(args), args.job)
    else:
        follower = EventFollower(args.events)
    state = LiveState(window=args.window)
    if args.once:
        if isinstance(follower, EventFollower) and not follower.path.exists():
            fail(f"cannot read {args.events}: No such file or directory")
        state.apply_all(follower.poll())
        if args.json:
            print(json.dumps(state.summary()))
        else:
            Console().print(render_live(state))
        return 0
    state.apply_all(follower.poll())  # an etcd that does not answer fails here, before the view is drawn
    if isinstance(follower, EventFollower) and not follower.path.exists():  # a run not started yet, or a typo
        print(f"bamboo-launch watch: waiting for {args.events} to appear (Ctrl-C to stop)", file=sys.stderr,
              flush=True)
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        with LiveView(follower.poll, Console(), state=state) as view:  # redrawn when records arrive, at most 1/s
            while not interrupted.is_set():
                view.update()
                if state.finished:
                    return 0
                interrupted.wait(args.interval)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 130
