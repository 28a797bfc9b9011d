"""``bamboo-launch export (RUN_DIR | --checkpoint-dir DIR [--step N]) -o MODEL.pt``: the trained model as one
state dict (:mod:`bamboo.launch.export`)."""

from __future__ import annotations

import argparse

from bamboo.bench.argtypes import non_negative_int
from bamboo.launch.cli.common import fail
from bamboo.launch.export import ExportError, export_checkpoint, export_run, save_state_dict

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``export``."""
    export = subparsers.add_parser(
        "export",
        help="write the trained model as one state dict, loadable into your layers in order",
        usage="bamboo-launch export (RUN_DIR | --checkpoint-dir DIR [--step N]) -o MODEL.pt",
        description=(
            "Gather a finished run's final model (from RUN_DIR/out/rank*.pt), or a checkpoint's (the newest good "
            "one in --checkpoint-dir, or --step N), into one state dict with the keys of "
            "torch.nn.Sequential(*layers).state_dict(): load it with "
            "torch.nn.Sequential(*[spec.build() for spec in layers]).load_state_dict(torch.load(MODEL.pt))."
        ),
    )
    export.add_argument("run_dir", nargs="?", default=None, help="a run directory (bamboo-launch run --run-dir)")
    export.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="export a checkpoint instead")
    export.add_argument("--step", type=non_negative_int, default=None, help="with --checkpoint-dir: this step's checkpoint "
                        "(default: the newest good one)")
    export.add_argument("-o", "--output", required=True, metavar="MODEL.pt", help="where the state dict goes")
    export.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """``export``: write a run's final model, or a checkpoint's, as one state dict."""
    if (args.run_dir is None) == (args.checkpoint_dir is None):
        fail("give a run directory or --checkpoint-dir DIR (one of them)")
    if args.step is not None and args.checkpoint_dir is None:
        fail("--step goes with --checkpoint-dir")
    try:
        if args.run_dir is not None:
            state, source = export_run(args.run_dir), f"the final model of {args.run_dir}"
        else:
            step, state = export_checkpoint(args.checkpoint_dir, args.step)
            source = f"the checkpoint of step {step} in {args.checkpoint_dir}"
    except ExportError as error:
        fail(str(error))
    path = save_state_dict(state, args.output)
    layers = len({key.split(".", 1)[0] for key in state})
    print(f"wrote {path}: {source}, {layers} layers, {len(state)} tensors")
    return 0
