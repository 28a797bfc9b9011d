"""The ``bamboo-reconfig`` command line: plan a layout (and, from an old layout, the transfers).

    bamboo-reconfig plan --nodes NODES.json --stages P --pipelines D [--old LAYOUT.json] [--json]

``NODES.json`` is a list of ``{"id", "zone", "state"}``. The command prints the layout, the standby
queue, the same-zone neighbour count and, with ``--old``, the decision and the transfer plan. Bad input
gets a one-line error and exit status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from bamboo.reconfig.decide import decide
from bamboo.reconfig.layout_plan import plan_layout
from bamboo.reconfig.model import ClusterView, LayerSpec, Layout, parse_nodes
from bamboo.reconfig.partition import stage_costs
from bamboo.reconfig.transfers import TransferPlan, minimum_rounds, plan_transfers

#: Stand-in layer size when no model is given: 16 M fp32 parameters; Adam keeps two moments (2x).
DEFAULT_LAYER_PARAM_BYTES = 64 * 2**20
DEFAULT_LAYER_COUNT = 24
DEFAULT_MICROBATCHES_PER_PIPELINE = 8


class CliError(Exception):
    """Bad input; the message is printed as one line."""


class _OneLineParser(argparse.ArgumentParser):
    """Its errors (and its subcommands') are one line, ``PROG: error: MESSAGE (see PROG --help)``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def build_parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="bamboo-reconfig",
        description="Bamboo reconfiguration planning: the new layout (D, P, zone-aware placement, standby "
        "queue) and the layer-transfer plan. Every node runs the same planner on the same inputs.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    plan = commands.add_parser(
        "plan",
        help="plan a layout for a set of nodes (and the transfers from an old layout)",
        description="Plan the layout for the nodes in NODES.json: P stages (kept first), "
        "D' = min(D, usable // P) pipelines, surplus nodes in standby, consecutive stages in different "
        "zones wherever the zone counts allow. With --old, also decide whether to reconfigure and plan "
        "the layer transfers from the old layout.",
    )
    plan.add_argument("--nodes", required=True, type=Path, metavar="NODES.json",
                      help='JSON list of {"id", "zone", "state"}; state is one of active, standby, joining, '
                      "preempted")
    plan.add_argument("--stages", required=True, type=int, metavar="P",
                      help="pipeline depth P (an upper bound: lowered only when fewer than P nodes are usable); 1 is pure "
                      "data parallelism, each pipeline's shadow the next pipeline's node")
    plan.add_argument("--pipelines", required=True, type=int, metavar="D",
                      help="target number of data-parallel pipelines D (an upper bound)")
    plan.add_argument("--old", type=Path, metavar="LAYOUT.json",
                      help="the current layout (a layout object, or the output of `plan --json`); enables the "
                      "decision and the transfer plan")
    plan.add_argument("--layers", metavar="N|LAYERS.json",
                      help="the model: a count N of identical layers (compute cost 1, "
                      f"{DEFAULT_LAYER_PARAM_BYTES // 2**20} MiB parameters, twice that of optimizer state), or a "
                      'JSON list of {"param_bytes", "optimizer_bytes", "compute_cost"}. Default: the old '
                      f"layout's layers with --old, else {DEFAULT_LAYER_COUNT} identical layers")
    plan.add_argument("--global-batch", type=int, metavar="B",
                      help="global batch in microbatches, kept constant across reconfigurations. Default: the "
                      f"old layout's with --old, else {DEFAULT_MICROBATCHES_PER_PIPELINE} x D")
    plan.add_argument("--node-memory", type=int, metavar="BYTES",
                      help="state bytes one node can hold (its stage plus its successor's replica); "
                      "default: unbounded")
    plan.add_argument("--json", action="store_true",
                      help="print one JSON object (layout, and with --old decision and transfers) instead of text")
    return parser


def _read_json(path: Path, what: str) -> Any:
    try:
        return json.loads(path.read_text())
    except OSError as error:
        raise CliError(f"cannot read {what} {str(path)!r}: {error.strerror}") from None
    except json.JSONDecodeError as error:
        raise CliError(f"{what} {str(path)!r} is not valid JSON: {error.msg} at line {error.lineno}") from None


def _layers(spec: str | None, old: Layout | None) -> tuple[LayerSpec, ...]:
    if spec is None:
        if old is not None:
            return old.layers
        spec = str(DEFAULT_LAYER_COUNT)
    if spec.isdigit():
        count = int(spec)
        if count < 1:
            raise CliError(f"--layers must be at least 1, got {spec}")
        return tuple(LayerSpec(DEFAULT_LAYER_PARAM_BYTES, 2 * DEFAULT_LAYER_PARAM_BYTES, 1.0) for _ in range(count))
    data = _read_json(Path(spec), "layer file")
    if not isinstance(data, list):
        raise CliError(f"layer file {spec!r} must hold a JSON list of layers")
    return tuple(LayerSpec.from_dict(item) for item in data)


def run_plan(args: argparse.Namespace) -> dict[str, Any]:
    """Build the view from the arguments and plan; returns the JSON-ready result."""
    if args.stages < 1:
        raise CliError(f"--stages must be at least 1 (1: pure data parallelism, the shadow ring over the "
                       f"pipelines), got {args.stages}")
    if args.pipelines < 1:
        raise CliError(f"--pipelines must be at least 1, got {args.pipelines}")
    nodes = parse_nodes(_read_json(args.nodes, "node file"))
    old = None
    if args.old is not None:
        data = _read_json(args.old, "old layout")
        if isinstance(data, dict) and "layout" in data:
            data = data["layout"]
        old = Layout.from_dict(data)
    layers = _layers(args.layers, old)
    if old is not None and layers != old.layers:
        raise CliError("--layers describes a different model from the old layout's; plan with the same model")
    if args.global_batch is not None:
        global_batch = args.global_batch
    elif old is not None and old.num_pipelines:
        global_batch = old.global_batch
    else:
        global_batch = DEFAULT_MICROBATCHES_PER_PIPELINE * args.pipelines
    view = ClusterView(nodes=nodes, target_stages=args.stages, target_pipelines=args.pipelines,
                       global_batch=global_batch, layers=layers, layout=old, node_memory_bytes=args.node_memory)
    layout = plan_layout(view)
    result: dict[str, Any] = {"layout": layout.to_dict()}
    if old is not None:
        result["decision"] = decide(view).to_dict()
        result["transfers"] = plan_transfers(old, layout, [node.id for node in view.usable_nodes]).to_dict()
    return result


def _format_bytes(count: int) -> str:
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def format_text(result: dict[str, Any]) -> str:
    """The human-readable report of ``run_plan``'s result."""
    layout = Layout.from_dict(result["layout"])
    lines = [f"layout: {layout.num_pipelines} pipeline(s) x {layout.stages} stages"]
    lines.append(layout.format_grid(show_standby=False))
    costs = stage_costs(layout.layers, layout.stage_layers)
    lines.append("stage layers: " + "  ".join(
        f"s{s}=[{start},{end}) cost {cost:g}" for s, ((start, end), cost) in enumerate(zip(layout.stage_layers, costs,
                                                                                          strict=True))))
    shares = layout.microbatches
    if shares:
        equal = "equal" if len(set(shares)) == 1 else "unequal"
        lines.append(f"microbatches per pipeline: {', '.join(map(str, shares))} ({equal} shares, global batch "
                     f"{layout.global_batch})")
    lines.append(f"standby queue: {', '.join(layout.standby) if layout.standby else '(empty)'}")
    lines.append(f"same-zone neighbours: {layout.same_zone_neighbours}")
    if "decision" in result:
        decision = result["decision"]
        lines.append(f"decision: {decision['when']} ({', '.join(decision['reasons'])}): {decision['detail']}")
    if "transfers" in result:
        plan = TransferPlan.from_dict(result["transfers"])
        if plan.restore_from_checkpoint:
            lines.append(
                "transfers: RESTORE FROM CHECKPOINT: no surviving copy of stage(s) "
                f"{', '.join(map(str, plan.stages_without_copy))} (layers "
                f"{', '.join(map(str, plan.layers_without_copy))})"
            )
        else:
            ratio = plan.bytes_moved / plan.naive_bytes if plan.naive_bytes else 0.0
            lines.append(
                f"transfers: {len(plan.transfers)} in {len(plan.rounds)} round(s) (lower bound "
                f"{minimum_rounds(plan.transfers)}); {_format_bytes(plan.bytes_moved)} moved vs "
                f"{_format_bytes(plan.naive_bytes)} naive ({ratio:.1%})"
            )
            for index, round_ in enumerate(plan.rounds):
                for transfer in round_:
                    lines.append(f"  round {index}: {transfer}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        result = run_plan(args)
    except (CliError, ValueError, KeyError, TypeError) as error:
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        if isinstance(error, KeyError):
            message = f"missing key {message}"
        print(f"bamboo-reconfig: error: {message.rstrip(':')}", file=sys.stderr)
        return 2
    if args.json:
        print(json.dumps(result, indent=2, sort_keys=True))
    else:
        print(format_text(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
