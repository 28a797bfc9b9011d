"""``bamboo-launch report (EVENTS.jsonl | --etcd URL --job J)``: a run's final report from its event log.

Throughput, node-hours, cost at spot prices against the same work at on-demand prices, and value, from a
local JSON-lines file or the job's log in etcd; ``--json`` prints it as one object, ``--plot`` draws it.

bamboo-launch's command line finds this module through the ``bamboo.launch.commands`` entry-point group that
bamboo-bench's ``pyproject.toml`` declares (bamboo-launch never imports this layer).
"""

from __future__ import annotations

import argparse
import json
import sys

from bamboo.bench.argtypes import positive_float, positive_int
from bamboo.bench.value.figure import plot_report
from bamboo.bench.value.report import (
    DEFAULT_BINS,
    DEFAULT_ON_DEMAND_PRICE,
    DEFAULT_SPOT_PRICE,
    Prices,
    compute_report,
    format_report,
)
from bamboo.launch.cli.common import add_etcd_source, fail, source_events

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``report``."""
    report = subparsers.add_parser(
        "report",
        help="the final report of a run from its JSON-lines event log",
        description=(
            "Compute throughput, node-hours, cost at spot prices against the same work at on-demand prices, "
            "and value (throughput per $/h) from a run's event log. Without --on-demand-throughput the "
            "on-demand cost is the same node-hours at the on-demand price."
        ),
    )
    report.add_argument(
        "events",
        nargs="*",
        help="the run's event log (JSON lines, see bamboo.launch.events); several logs of one run "
        "(say the launcher's and the market's, written with a shared start) are merged by time",
    )
    add_etcd_source(report)
    report.add_argument("--json", action="store_true", help="print the report as one JSON object")
    report.add_argument(
        "--plot", metavar="OUT.png", help="also write the four-panel figure (nodes, throughput, cost, value)"
    )
    report.add_argument("--bins", type=positive_int, default=DEFAULT_BINS, help="time bins in the figure (default: %(default)s)")
    report.add_argument(
        "--spot-price",
        type=positive_float,
        default=DEFAULT_SPOT_PRICE,
        help="$/h per spot GPU node (default: %(default)s)",
    )
    report.add_argument(
        "--on-demand-price",
        type=positive_float,
        default=DEFAULT_ON_DEMAND_PRICE,
        help="$/h per on-demand GPU node (default: %(default)s)",
    )
    report.add_argument(
        "--on-demand-throughput",
        type=positive_float,
        default=None,
        help="samples/s of a measured fault-free on-demand run (with --on-demand-nodes) to price the same work",
    )
    report.add_argument("--on-demand-nodes", type=positive_int, default=None, help="nodes of that on-demand run")
    report.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """``report``: print the report of the event log (or etcd's), and draw it with ``--plot``."""
    try:
        prices = Prices(
            spot=args.spot_price,
            on_demand=args.on_demand_price,
            on_demand_throughput=args.on_demand_throughput,
            on_demand_nodes=args.on_demand_nodes,
        )
    except ValueError as error:
        fail(
            str(error)
            .replace("on_demand_throughput", "--on-demand-throughput")
            .replace("on_demand_nodes", "--on-demand-nodes")
        )
    events = source_events(args)
    report = compute_report(events, prices)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(format_report(report))
    if args.plot:
        out = plot_report(events, args.plot, prices, args.bins)
        print(f"wrote {out}", file=sys.stderr)
    return 0
