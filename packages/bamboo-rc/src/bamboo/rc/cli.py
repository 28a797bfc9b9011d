"""The `bamboo-rc` command line: `bamboo-rc verify` checks an install end to end; `bamboo-rc soak`
runs many seeded kill points through it.

`verify` forks P×D local worker processes (gloo), trains the example model for N steps with the
chosen redundancy, trains a single-process reference on the same batches, prints the max
parameter difference, the max replica-versus-original difference and both loss curves, and exits
0 only when the parameters agree within 1e-6 relative and every replica is bit-equal.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from bamboo.rc.timeouts import BUILD_S, CONFIRM_S, GROUP_S, NOTICE_LEAD_S, VERIFY_DEADLINE_S

if TYPE_CHECKING:
    from bamboo.rc.faults import KillPoint, NoticePoint
    from bamboo.rc.records import FailoverRecord
    from bamboo.rc.verify import VerifyResult

__all__ = ["main"]


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{value} must be positive")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"{value} must be at least 1")
    return value


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, no usage dump, exit 2
        print(f"bamboo-rc: error: {message}", file=sys.stderr)
        raise SystemExit(2)


def build_parser() -> argparse.ArgumentParser:
    """The `bamboo-rc` parser: its `verify` and `soak` commands and their flags."""
    parser = _Parser(prog="bamboo-rc", description="Bamboo runtime tools.")
    commands = parser.add_subparsers(dest="command", required=True, parser_class=_Parser)
    verify = commands.add_parser(
        "verify",
        help="train P×D local workers and a single-process reference, and compare them",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_shape_arguments(verify)
    _add_model_arguments(verify)
    _add_timeout_arguments(verify)
    _add_fault_arguments(verify)
    soak = commands.add_parser(
        "soak",
        help="run many seeded random kill points through verify and report the pass rate",
        description="Run --runs seeded random failures (one victim, or two non-adjacent victims, at random "
                    "instructions) through verify and print how many matched the reference.",
    )
    _add_soak_arguments(soak)
    return parser


def _add_shape_arguments(parser: argparse.ArgumentParser) -> None:
    """`verify`'s run: P, D, the steps, the redundancy mode and the batch."""
    parser.add_argument("--stages", type=_positive_int, default=2, help="pipeline depth P (default 2)")
    parser.add_argument("--pipelines", type=_positive_int, default=1, help="data-parallel pipelines D (default 1)")
    parser.add_argument("--steps", type=_positive_int, default=3, help="training steps N (default 3)")
    parser.add_argument(
        "--redundancy", choices=("none", "lflb", "eflb", "efeb"), default="eflb",
        help="redundant computation: none, lazy FRC (lflb), eager FRC (eflb, default), eager FRC+BRC (efeb)",
    )
    parser.add_argument("--micro-batches", type=_positive_int, default=4,
                        help="microbatches per pipeline per step, M (gradient_accumulation_steps; default 4)")
    parser.add_argument("--global-microbatches", type=_positive_int, default=None, metavar="G",
                        help="a global batch of G microbatches split over the pipelines, the first G mod D one longer "
                             "where D does not divide G, as bamboo-launch runs after a loss (replaces --micro-batches)")
    parser.add_argument("--micro-batch-size", type=_positive_int, default=2,
                        help="samples per microbatch (train_micro_batch_size_per_gpu; default 2)")


def _add_model_arguments(parser: argparse.ArgumentParser) -> None:
    """`verify`'s example model: its size, its seed and the device it trains on."""
    parser.add_argument("--layers", type=_positive_int, default=4, help="decoder blocks of the example model (default 4)")
    parser.add_argument("--width", type=_positive_int, default=64, help="model width (default 64)")
    parser.add_argument("--heads", type=_positive_int, default=4, help="attention heads (default 4)")
    parser.add_argument("--sequence", type=_positive_int, default=32, help="bytes per sample (default 32)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the weights and the sampler (default 0)")
    parser.add_argument("--device", default=None,
                        help="where the workers and the reference train: cpu, cuda (the workers spread over the GPUs "
                             "by rank, several sharing a GPU when there are fewer GPUs), cuda:N or auto (default: "
                             "$BAMBOO_DEVICE, else auto: a GPU when CUDA is present, else cpu)")


def _add_timeout_arguments(parser: argparse.ArgumentParser) -> None:
    """`verify`'s deadline and the workers' communication timeouts."""
    parser.add_argument("--timeout", type=_positive_float, default=VERIFY_DEADLINE_S,
                        help=f"seconds before unfinished workers are killed and verify fails (default {VERIFY_DEADLINE_S:g})")
    parser.add_argument("--group-timeout", type=_positive_float, default=GROUP_S,
                        help="gloo timeout of every group: bounds a transfer or collective with a live but stuck peer "
                             f"(default {GROUP_S:g})")
    parser.add_argument("--build-timeout", type=_positive_float, default=BUILD_S,
                        help=f"seconds a group build, a store read or the final barrier may wait (default {BUILD_S:g})")
    parser.add_argument("--confirm-timeout", type=_positive_float, default=CONFIRM_S,
                        help="seconds a worker waits for a suspected failure to be confirmed, and for the other "
                             f"survivors' progress (default {CONFIRM_S:g})")


def _add_fault_arguments(parser: argparse.ArgumentParser) -> None:
    """`verify`'s fault injection: kill points and preemption notices."""
    parser.add_argument(
        "--kill", type=_kill_points, default=(),
        help="fault injection: STAGE[:PIPELINE]@INSTRUCTION[/STEP][/recovery][,...]; that worker SIGKILLs itself "
             "when it reaches the instruction (compact form such as 2B3 or 1SA0>2, or an index into its stream, -1 "
             "for the last) in step STEP (default --kill-step); survivors fail over and are compared with the "
             "reference as usual. With /recovery the point fires only while the worker runs a failover's remainder "
             "of the iteration (a second failure during the recovery, e.g. 3@3B2/1/recovery), without it only "
             "outside one. A later STEP after an earlier kill hits the merged (failed-over) schedule. A kill point "
             "that never fires is named and fails the run",
    )
    parser.add_argument("--kill-step", type=int, default=1,
                        help="the step (0-based) in which the --kill points without their own /STEP fire (default 1)")
    parser.add_argument(
        "--notice", type=_notice_points, default=(),
        help="preemption notice: STAGE[:PIPELINE]@STEP[,...]; that worker is told at the start of STEP that it "
             "will be preempted --notice-lead seconds later, finishes the iteration and hands its role to its shadow",
    )
    parser.add_argument("--notice-lead", type=float, default=NOTICE_LEAD_S,
                        help="seconds from the notice to the preemption deadline; too short a lead falls back "
                             f"to an ordinary failure at the deadline (default {NOTICE_LEAD_S:g})")


def _add_soak_arguments(parser: argparse.ArgumentParser) -> None:
    """`soak`'s flags: how many runs, their shape and the kinds of failure they mix."""
    parser.add_argument("--runs", type=_positive_int, default=200, help="number of kill points (default 200)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the kill points (default 0)")
    parser.add_argument("--stages", type=_positive_int, default=4,
                        help="pipeline depth P (default 4); 1 is pure data parallelism, whose shadows form a ring "
                             "over the pipelines")
    parser.add_argument("--pipelines", type=_positive_int, default=None,
                        help="data-parallel pipelines D (default 1, or 4 with --stages 1)")
    parser.add_argument("--steps", type=_positive_int, default=3, help="training steps per run (default 3)")
    parser.add_argument("--redundancy", choices=("lflb", "eflb", "efeb"), default="eflb",
                        help="redundancy mode (default eflb)")
    parser.add_argument("--width", type=_positive_int, default=64,
                        help="width of the example model (default 64; at 128 and more each stage's data-parallel "
                             "sum is split in two phases, see bamboo.rc.two_phase_sum)")
    parser.add_argument("--notices", action="store_true",
                        help="every run also gives a node of another pipeline (ring node, with P = 1) a preemption "
                             "notice with time to hand over, from step 1 on, and the kill comes in that step or a later "
                             "one, so hand-overs and failures mix (needs D >= 2, or D >= 3 with P = 1, and --steps >= 3; "
                             "not with --second-failures)")
    parser.add_argument("--same-pipeline", action="store_true",
                        help="with --notices (P >= 3): the node killed is in the leaver's own pipeline, in the "
                             "leaver's last step (the leaver withdraws its hand-over and stays) or, with P >= 4, "
                             "after the hand-over at a stage not adjacent to the leaver's (default: another pipeline)")
    parser.add_argument("--second-failures", action="store_true",
                        help="every kill point is a first victim and then a second, non-adjacent one after the "
                             "failover: during the recovery of the same step, or in a later step (needs P >= 4, "
                             "or P = 1 and D >= 3)")
    parser.add_argument("--global-microbatches", type=_positive_int, default=None, metavar="G",
                        help="a global batch of G microbatches over the pipelines, the first G mod D one longer where "
                             "D does not divide G (default: 4 microbatches a pipeline, every share equal)")


def _notice_points(text: str) -> tuple[tuple[int, int, int], ...]:
    points = []
    for item in text.split(","):
        where, sep, step = item.partition("@")
        stage, _, pipeline = where.partition(":")
        if not sep or not step.isdigit() or not stage.isdigit() or (pipeline and not pipeline.isdigit()):
            raise argparse.ArgumentTypeError(f"bad notice {item!r}: expected STAGE[:PIPELINE]@STEP")
        points.append((int(stage), int(pipeline or 0), int(step)))
    return tuple(points)


KillSpec = tuple[int, int, str, int | None, bool]
"""(stage, pipeline, instruction, step or None for --kill-step, only during a failover's remainder)."""


def _kill_points(text: str) -> tuple[KillSpec, ...]:
    points: list[KillSpec] = []
    for item in text.split(","):
        where, sep, rest = item.partition("@")
        stage, _, pipeline = where.partition(":")
        instruction, *options = rest.split("/")
        step: int | None = None
        recovery = False
        bad = not sep or not instruction or not stage.isdigit() or (pipeline and not pipeline.isdigit())
        for option in options:
            if option == "recovery" and not recovery:
                recovery = True
            elif option.isdigit() and step is None and not recovery:
                step = int(option)
            else:
                bad = True
        if bad:
            raise argparse.ArgumentTypeError(
                f"bad kill point {item!r}: expected STAGE[:PIPELINE]@INSTRUCTION[/STEP][/recovery]"
            )
        points.append((int(stage), int(pipeline or 0), instruction, step, recovery))
    return tuple(points)


def _verify(args: argparse.Namespace) -> int:
    from bamboo.rc.faults import KillPoint, NoticePoint
    from bamboo.rc.model import GPTSize
    from bamboo.rc.timeouts import CommTimeouts
    from bamboo.rc.verify import DEFAULT_CONFIG, RELATIVE_TOLERANCE, run_verify
    from rich.console import Console

    console = Console(highlight=False, soft_wrap=True)
    layer_count = args.layers + 2
    if args.stages > layer_count:
        raise ValueError(f"--stages {args.stages} exceeds the model's {layer_count} layers (raise --layers)")
    try:
        size = GPTSize(layers=args.layers, width=args.width, heads=args.heads, sequence=args.sequence)
    except ValueError as exc:
        raise ValueError(f"bad model size: {exc}") from None
    config = dict(DEFAULT_CONFIG)
    config["gradient_accumulation_steps"] = args.micro_batches
    config["train_micro_batch_size_per_gpu"] = args.micro_batch_size
    with console.status(
        f"training {args.stages}×{args.pipelines} workers ({args.redundancy}) and the reference for {args.steps} steps"
    ):
        kills = tuple(
            KillPoint(stage, pipeline, instruction, args.kill_step if step is None else step, in_recovery=recovery)
            for stage, pipeline, instruction, step, recovery in args.kill
        )
        result = run_verify(
            args.stages, args.pipelines, args.steps, args.redundancy, size=size, config=config,
            seed=args.seed, deadline_s=args.timeout, kills=kills,
            timeouts=CommTimeouts(group=args.group_timeout, build=args.build_timeout, confirm=args.confirm_timeout),
            notice_points=tuple(NoticePoint(stage, pipeline, step, args.notice_lead)
                                for stage, pipeline, step in args.notice),
            device=args.device, global_microbatches=args.global_microbatches,
        )
    failed = {rank: code for rank, code in result.worker_exit_codes.items() if code != 0 and rank not in result.killed}
    console.print(f"P={args.stages} D={args.pipelines} steps={args.steps} redundancy={args.redundancy} "
                  f"device={result.device} ({result.seconds:.1f} s)")
    console.print(f"max parameter difference: {result.max_relative_diff:.3e} relative, "
                  f"{result.max_abs_diff:.3e} absolute (tolerance {RELATIVE_TOLERANCE:g} relative)")
    console.print(f"max replica-versus-original difference: {result.max_replica_diff:.3e} "
                  f"over {result.replicas_compared} tensors ({'bit-equal' if result.replicas_bit_equal else 'NOT bit-equal'})")
    console.print(f"stage bounds (layers of each stage): {[list(b) for b in result.stage_bounds]}")
    console.print(f"FRC stash peak: {result.stash_peak_bytes} bytes")
    console.print("step  pipeline loss     reference loss")
    for step, reference in enumerate(result.reference_losses):
        mine = f"{result.losses[step]:.9f}" if step < len(result.losses) else "-"
        console.print(f"{step:4d}  {mine:>15}  {reference:.9f}")
    if result.killed:
        console.print(f"killed with SIGKILL: ranks {list(result.killed)}")
    if result.left:
        console.print(f"handed over to their shadows after a preemption notice: ranks {list(result.left)}")
    for kill in result.unfired_kills:
        console.print(f"kill point {kill} never fired (its node never reached that instruction)")
    shown: set[str] = set()
    for failover in result.failovers:  # one line per failover (every survivor records each one)
        victims = {d: list(nodes) for d, nodes in failover.victims.items()}
        if failover.cut is None or repr((failover.step, victims)) in shown:
            continue
        shown.add(repr((failover.step, victims)))
        console.print(f"failover in step {failover.step}: victims {victims}, cut {failover.cut}{_pause(result, failover)}")
    if result.consecutive:
        console.print(f"ConsecutiveFailure: {result.consecutive}")
        console.print(f"survivors compared with the reference after {result.compared_at_step} steps "
                      f"(the start of the failed iteration)")
    if failed:
        console.print(f"workers that failed (rank: exit code): {failed}")
    console.print("PASS" if result.passed else "FAIL")
    return 0 if result.passed else 1


def _soak(args: argparse.Namespace) -> int:
    from bamboo.rc.chaos import random_handover_plans, random_kill_points, run_chaos
    from bamboo.rc.model import GPTSize
    from rich.progress import Progress

    if args.stages == 2:
        raise ValueError(f"--stages {args.stages}: soak needs 1 stage (a ring of pipelines) or at least 3 stages")
    pipelines = args.pipelines or (4 if args.stages == 1 else (2 if args.notices else 1))
    if args.global_microbatches is not None and args.global_microbatches < pipelines:
        raise ValueError(f"a global batch of {args.global_microbatches} microbatches cannot feed {pipelines} pipelines")
    notices: list[tuple[NoticePoint, ...]] | None = None
    if args.notices:
        if args.second_failures:
            raise ValueError("--notices and --second-failures do not go together: a run mixes one hand-over and one kill")
        pairs = random_handover_plans(args.seed, args.runs, args.stages, args.steps, args.redundancy, pipelines,
                                      same_pipeline=args.same_pipeline, global_microbatches=args.global_microbatches)
        plans: list[tuple[KillPoint, ...]] = [(kill,) for _, kill in pairs]
        notices = [(notice,) for notice, _ in pairs]
    elif args.same_pipeline:
        raise ValueError("--same-pipeline places the kill relative to a leaver: it needs --notices")
    else:
        plans = random_kill_points(args.seed, args.runs, args.stages, args.steps, args.redundancy,
                                   args.second_failures, pipelines=pipelines,
                                   global_microbatches=args.global_microbatches)
    with Progress() as progress:
        task = progress.add_task("kill points", total=len(plans))
        outcomes = run_chaos(plans, args.stages, args.steps, args.redundancy, on_result=lambda *_: progress.advance(task),
                             pipelines=pipelines, notices=notices, size=GPTSize(width=args.width),
                             global_microbatches=args.global_microbatches)
    passed = sum(1 for _, result in outcomes if result.passed)
    for index, (kills, result) in enumerate(outcomes):
        if not result.passed:
            given = f" with {notices[index][0]}" if notices else ""
            refused = f", refused: {result.consecutive}" if result.consecutive else ""
            print(f"FAIL {kills}{given}: max relative {result.max_relative_diff:.3e}, "
                  f"exit codes {result.worker_exit_codes}{refused}")
    print(f"soak: {passed}/{len(outcomes)} kill points matched the reference ({100.0 * passed / len(outcomes):.1f}%)")
    refusals = sum(1 for _, result in outcomes if result.refused_exactly)
    if refusals:
        print(f"soak: {refusals} of the {len(outcomes) - passed} misses were refusals with the survivors exact at the "
              f"start of the failed step (a consecutive failure or a lost contribution: the job restores)")
    if not notices:  # with notices, every run kills one node
        killed_two = sum(1 for _, result in outcomes if len(result.killed) >= 2)
        print(f"soak: {killed_two}/{len(outcomes)} runs killed two nodes (a kill point fires only if its node "
              f"reaches it)")
    unfired = sum(len(result.unfired_kills) for _, result in outcomes)
    total = sum(len(kills) for kills, _ in outcomes)
    print(f"soak: {total - unfired}/{total} kill points fired")
    if notices:
        handed = sum(1 for _, result in outcomes if result.left)
        withdrawn = sum(1 for _, result in outcomes if result.withdrawn)
        print(f"soak: {handed}/{len(outcomes)} notices ended in a hand-over, {withdrawn} in a hand-over withdrawn "
              f"(a failure in the leaver's pipeline came first: it stayed); a node killed first, or one whose notice "
              f"came too late, fails over instead")
    return 0 if passed == len(outcomes) else 1


def _pause(result: VerifyResult, failover: FailoverRecord) -> str:
    """The failover's pause as the survivors saw it: from the kill to the last survivor resuming, and
    to the last survivor ending the failed step ('' when the kill time is not known)."""
    pause = result.pause_seconds(failover)
    if pause is None:
        return ""
    resumed, ended = pause
    end = f", {1e3 * ended:.0f} ms to the end of the failed step" if ended is not None else ""
    return f"; pause {1e3 * resumed:.0f} ms from the kill until every survivor resumed{end}"


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "verify":
            return _verify(args)
        if args.command == "soak":
            return _soak(args)
    except (ValueError, TypeError) as exc:
        print(f"bamboo-rc: error: {exc}", file=sys.stderr)
        return 2
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
