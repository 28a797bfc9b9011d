"""``bamboo-launch export (RUN_DIR | --checkpoint-dir DIR [--step N]) [--format bamboo|hf] -o OUT``: the trained
model as one state dict, or as a Hugging Face ``save_pretrained`` folder (:mod:`bamboo.launch.export`)."""

from __future__ import annotations

import argparse

from bamboo.bench.argtypes import non_negative_int
from bamboo.launch.cli.common import fail
from bamboo.launch.export import ExportError, export_checkpoint, export_hf, export_run, save_state_dict

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``export``."""
    export = subparsers.add_parser(
        "export",
        help="write the trained model as one state dict, loadable into your layers in order",
        usage="bamboo-launch export (RUN_DIR | --checkpoint-dir DIR [--step N]) [--format bamboo|hf] -o OUT",
        description=(
            "Gather a finished run's final model (from RUN_DIR/out/rank*.pt), or a checkpoint's (the newest good "
            "one in --checkpoint-dir, or --step N), into one state dict with the keys of "
            "torch.nn.Sequential(*layers).state_dict(): load it with "
            "torch.nn.Sequential(*[spec.build() for spec in layers]).load_state_dict(torch.load(MODEL.pt)). "
            "With --format hf, a model split by bamboo.rc.from_transformers goes to the folder OUT as "
            "transformers' save_pretrained writes it (config.json, model.safetensors): "
            "AutoModelForCausalLM.from_pretrained(OUT) loads it, and the export checks that its logits are bamboo's."
        ),
    )
    export.add_argument("run_dir", nargs="?", default=None, help="a run directory (bamboo-launch run --run-dir)")
    export.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="export a checkpoint instead")
    export.add_argument("--step", type=non_negative_int, default=None, help="with --checkpoint-dir: this step's checkpoint "
                        "(default: the newest good one)")
    export.add_argument("--format", choices=["bamboo", "hf"], default="bamboo",
                        help="bamboo: one state dict (MODEL.pt); hf: a Hugging Face save_pretrained folder, for a model "
                        "split by bamboo.rc.from_transformers (default: %(default)s)")
    export.add_argument("-o", "--output", required=True, metavar="OUT",
                        help="where the state dict (--format bamboo) or the folder (--format hf) goes")
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
    layers = len({key.split(".", 1)[0] for key in state})
    if args.format == "hf":
        try:
            folder, diff = export_hf(state, args.output)
        except ExportError as error:
            fail(str(error))
        print(f"wrote {folder}/ (config.json, model.safetensors): {source}, {layers} layers; "
              f"AutoModelForCausalLM.from_pretrained({str(folder)!r}) gives bamboo's logits (max abs diff {diff:.3g})")
        if diff != 0.0:
            fail(f"the reloaded model's logits differ from bamboo's by {diff:.3g}")
        return 0
    path = save_state_dict(state, args.output)
    print(f"wrote {path}: {source}, {layers} layers, {len(state)} tensors")
    return 0
