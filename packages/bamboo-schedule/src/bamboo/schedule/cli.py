"""The `bamboo-schedule` command: generate, fail over, validate, simulate and draw a schedule.

    bamboo-schedule show --stages P --microbatches M --rc {none,lflb,eflb,efeb}
                         [--fail STAGES@INDEX] [--costs FILE] [--trace OUT.json] [--json]

It prints the grid and a summary, or with ``--json`` one JSON object with at least ``makespan``,
``overhead_pct``, ``bubble_pct``, ``frc_hidden_pct``, ``peak_stash`` and ``valid``. Bad input gives
a one-line error and exit status 2; adjacent victims (a consecutive failure) exit with status 3.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

from bamboo.schedule.cut import progress_at
from bamboo.schedule.engine import execute
from bamboo.schedule.export import chrome_trace, text_grid, time_grid
from bamboo.schedule.failover import failover_schedule
from bamboo.schedule.failover_plan import ConsecutiveFailure
from bamboo.schedule.failover_validate import validate_failover
from bamboo.schedule.generate import generate
from bamboo.schedule.ir import RCMode, Schedule
from bamboo.schedule.simulate import Costs, measure, simulate
from bamboo.schedule.validate import ScheduleError, validate

__all__ = ["main", "parse_failure"]

EXIT_USAGE = 2
EXIT_CONSECUTIVE = 3
EXIT_INVALID = 4


class UsageError(ValueError):
    """Bad command-line input; the message names the bad value."""


def parse_failure(text: str, stages: int) -> tuple[tuple[int, ...], int]:
    """``"3@10"`` -> ((3,), 10); ``"2,5@10"`` -> ((2, 5), 10). Raises UsageError naming the bad part."""
    victims_text, sep, index_text = text.partition("@")
    if not sep or not victims_text or not index_text:
        raise UsageError(f"--fail {text!r}: expected STAGES@INDEX, e.g. 3@10 or 2,5@10")
    try:
        victims = tuple(int(v) for v in victims_text.split(","))
        index = int(index_text)
    except ValueError:
        raise UsageError(f"--fail {text!r}: stages and index must be integers, e.g. 2,5@10") from None
    bad = [v for v in victims if not 0 <= v < stages]
    if bad:
        raise UsageError(f"--fail {text!r}: stage {bad[0]} out of range 0..{stages - 1}")
    if len(set(victims)) != len(victims):
        raise UsageError(f"--fail {text!r}: a stage is listed twice")
    if index < 0:
        raise UsageError(f"--fail {text!r}: index must be >= 0, got {index}")
    return victims, index


class _OneLineParser(argparse.ArgumentParser):
    """Its errors (and its subcommands') are one line, ``PROG: error: MESSAGE (see PROG --help)``, exit status 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def _parser() -> argparse.ArgumentParser:
    parser = _OneLineParser(
        prog="bamboo-schedule",
        description="Pipeline schedules with redundant computation and failover (Bamboo).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    show = sub.add_parser(
        "show",
        help="generate a schedule (optionally fail stages), validate, simulate and draw it",
        description="Generate a schedule, optionally fail stages mid-iteration, validate and simulate it, "
        "then print the grid and a summary (or one JSON object with --json).",
    )
    show.add_argument("--stages", "-P", type=int, required=True, help="pipeline depth P (number of stages, >= 1)")
    show.add_argument("--microbatches", "-M", type=int, required=True, help="microbatches per iteration M (>= 1)")
    show.add_argument(
        "--rc",
        choices=[m.value for m in RCMode],
        default="eflb",
        help="redundant computation: none, lflb (lazy FRC/BRC), eflb (eager FRC, lazy BRC; default), "
        "efeb (eager FRC and BRC)",
    )
    show.add_argument("--policy", choices=["1f1b", "gpipe"], default="1f1b", help="pipeline schedule (default 1f1b)")
    show.add_argument(
        "--fail",
        metavar="STAGES@INDEX",
        help="fail these stages (comma-separated) just before the victim's instruction INDEX (0-based), "
        "e.g. 3@10 or 2,5@10; all listed stages fail at the same moment, the first to reach INDEX",
    )
    show.add_argument(
        "--costs",
        metavar="FILE",
        help="JSON cost model: latency_ms, link_gb_per_s, swap_gb_per_s, default {forward_ms, backward_ms, "
        "frc_ms, brc_ms, optimizer_ms, activation_mb, stash_mb, grad_mb} and per-stage overrides in stages "
        "[...] (default: built-in costs)",
    )
    show.add_argument("--trace", metavar="OUT.json", help="write a Chrome trace (open in ui.perfetto.dev)")
    show.add_argument("--json", action="store_true", help="print one JSON object instead of the grid and summary")
    show.add_argument(
        "--grid",
        choices=["time", "stream", "none"],
        default="time",
        help="text drawing: compute at simulated times (time, default), every instruction in stream "
        "order (stream), or none",
    )
    return parser


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 4)


def _show(args: argparse.Namespace) -> tuple[int, str]:
    if args.stages < 1:
        raise UsageError(f"--stages must be >= 1, got {args.stages}")
    if args.microbatches < 1:
        raise UsageError(f"--microbatches must be >= 1, got {args.microbatches}")
    if args.rc != "none" and args.stages < 2:
        raise UsageError(f"--rc {args.rc} needs --stages >= 2, got {args.stages}")
    try:
        costs = Costs.from_json(args.costs) if args.costs else Costs()
    except ValueError as error:
        raise UsageError(str(error)) from None
    failure = parse_failure(args.fail, args.stages) if args.fail else None
    if failure and args.rc == "none":
        raise UsageError("--fail needs redundancy: use --rc lflb, eflb or efeb")
    schedule = generate(args.policy, args.stages, args.microbatches, args.rc, costs.linearizer_cost(), refine=True)
    result = simulate(schedule, costs)
    out: dict[str, Any] = {
        "stages": args.stages,
        "microbatches": args.microbatches,
        "rc": args.rc,
        "policy": args.policy,
        "makespan": _round(result.makespan),
        "baseline_makespan": _round(result.baseline_makespan),
        "overhead_pct": _round(result.overhead_pct),
        "overhead_bound_pct": _round(result.overhead_bound_pct),
        "bubble_pct": _round(result.bubble_pct),
        "frc_hidden_pct": _round(result.frc_hidden_pct),
        "peak_stash": {str(n): _round(v) for n, v in result.peak_stash.items()},
        "per_node": {
            str(n): {
                "bubble": _round(result.bubble[n]),
                "baseline_bubble": _round(result.baseline_bubble[n]) if result.baseline_bubble else None,
                "frc": _round(result.frc[n]),
                "frc_hidden": _round(result.frc_hidden(n)),
            }
            for n in schedule.nodes
        },
    }
    valid, problem = True, None
    shown: Schedule = schedule
    timeline = result.timeline
    drawing_streams = schedule.streams
    split = None
    try:
        validate(schedule)
    except ScheduleError as error:
        valid, problem = False, str(error)
    if failure is not None:
        victims, index = failure
        for v in victims:
            if index > len(schedule.streams[v]):
                raise UsageError(f"--fail index {index} is past the end of stage {v}'s stream "
                                 f"({len(schedule.streams[v])} instructions)")
        progress = progress_at(schedule, dict.fromkeys(victims, index), result.timeline)
        plan = failover_schedule(schedule, victims, progress, costs.linearizer_cost())
        try:
            validate_failover(plan)
        except ScheduleError as error:
            valid, problem = False, str(error)
        streams = dict(plan.iteration_streams())
        streams.update({v: plan.executed.get(v, ()) for v in victims})
        streams = dict(sorted(streams.items()))
        duration = costs.duration(schedule.rc)
        failing = execute(streams, duration)
        shown = Schedule(schedule.stages, schedule.microbatches, schedule.policy, schedule.rc,
                         plan.remainder.placement, streams, plan.remainder.shadows)
        _busy, bubble, _frc, peak = measure(shown, failing, costs)
        steady = simulate(plan.steady, costs, baseline=generate(args.policy, args.stages, args.microbatches,
                                                                  "none", costs.linearizer_cost()))
        out.update(
            {
                "fault_free_makespan": out["makespan"],
                "makespan": _round(failing.makespan),
                "bubble_pct": _round(100.0 * sum(bubble[n] for n in plan.survivors)
                                     / (failing.makespan * len(plan.survivors))),
                "peak_stash": {str(n): _round(v) for n, v in peak.items()},
                "victims": list(victims),
                "progress": {str(n): i for n, i in progress.items()},
                "resent": {str(n): [str(i) for i in r] for n, r in plan.resent.items()},
                "failing_iteration_slowdown_pct": _round(100.0 * (failing.makespan - result.makespan)
                                                         / result.makespan),
                "steady_makespan": _round(steady.makespan),
                "steady_overhead_pct": _round(steady.overhead_pct),
                "placement_after": list(plan.steady.placement),
            }
        )
        timeline = failing
        drawing_streams = streams
        split = {n: len(plan.executed[n]) for n in plan.survivors}
    out["valid"] = valid
    if problem is not None:
        out["problem"] = problem.splitlines()[0]
    if args.trace:
        try:
            Path(args.trace).write_text(json.dumps(chrome_trace(shown, timeline)))
        except OSError as error:
            raise UsageError(f"cannot write trace {args.trace!r}: {error.strerror}") from None
    if args.json:
        return (0 if valid else EXIT_INVALID), json.dumps(out)
    lines = []
    if args.grid == "time":
        lines.append(time_grid(shown, timeline))
    elif args.grid == "stream":
        lines.append(text_grid(drawing_streams, (), split))
    title = f"{args.policy} P={args.stages} M={args.microbatches} rc={args.rc}"
    if failure is not None:
        title += f", stages {out['victims']} failed at index {failure[1]} (failing iteration shown)"
    lines.append(title)
    for key in ("makespan", "overhead_pct", "overhead_bound_pct", "bubble_pct", "frc_hidden_pct", "fault_free_makespan",
                "failing_iteration_slowdown_pct", "steady_makespan", "steady_overhead_pct", "placement_after"):
        if key in out:
            lines.append(f"  {key:32} {out[key]}")
    lines.append(f"  {'peak_stash (MB per node)':32} {out['peak_stash']}")
    if "resent" in out:
        lines.append(f"  {'resent':32} {out['resent']}")
    lines.append(f"  {'valid':32} {valid}")
    if problem is not None:
        lines.append(problem)
    if args.trace:
        lines.append(f"  trace written to {args.trace}")
    return (0 if valid else EXIT_INVALID), "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point; returns the exit status (0 ok, 2 bad input, 3 consecutive failure, 4 invalid)."""
    args = _parser().parse_args(argv)
    try:
        status, text = _show(args)
    except UsageError as error:
        print(f"bamboo-schedule: error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except ConsecutiveFailure as error:
        print(f"bamboo-schedule: error: {error}", file=sys.stderr)
        return EXIT_CONSECUTIVE
    print(text)
    return status


if __name__ == "__main__":
    raise SystemExit(main())
