"""What a finished run left, read back: the failures and worker errors published in etcd, the job's records
kept for ``--verify``, the workers' final reports, the market's record of its machines (:func:`market_billing`),
and the check against a fault-free single-process run (:func:`compare_with_reference`)."""

from __future__ import annotations

import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bamboo.bench.emulated.run_options import RunError, RunOptions, RunResult, Verification, WorkerReport

if TYPE_CHECKING:
    from bamboo.launch.events import Event
    from bamboo.membership import MembershipStore

__all__ = ["MARKET_LOG", "compare_with_reference", "dumps_result", "last_step", "load_reports", "market_billing",
           "read_failures", "read_worker_errors", "save_records", "unfinished"]

MARKET_LOG = "market.jsonl"
"""The emulated market's own record of its machines, in the run dir: one JSON line per machine started or killed
(``action``: ``add`` or ``kill``, ``node``, ``zone``, ``unix``), written as the market acts."""


def market_billing(run_dir: Path, events: Sequence[Event]) -> list[Event] | None:
    """The market's machines as ``join`` and ``preemption`` records on the run's clock (the ``run_start`` of
    ``events``): what a cloud bills, from a machine's start to its kill. The job's own records bill a machine from
    its agent's registration to the confirmation of its loss, which comes a lease's TTL late for a node no
    neighbour watches (a standby node, a joiner). None when the run dir has no market record."""
    from bamboo.launch.events import Join, Preemption, RunStart

    path = run_dir / MARKET_LOG
    starts = [event.unix_time for event in events if isinstance(event, RunStart)]
    if not path.exists() or not starts:
        return None
    billed: list[Event] = []
    for line in path.read_text().splitlines():
        record = json.loads(line)
        t = max(0.0, float(record["unix"]) - starts[0])
        if record["action"] == "add":
            billed.append(Join(t=t, node=record["node"], zone=record["zone"] or "default"))
        elif record["action"] == "kill":
            billed.append(Preemption(t=t, node=record["node"], zone=record["zone"] or "default", notice_s=0.0,
                                     reason="killed by the market"))
    return billed


def read_failures(membership: MembershipStore) -> tuple[tuple[int, ...], tuple[str, ...], str | None]:
    """(ranks published as failed, nodes declared failed, the job's error) from etcd."""
    from bamboo.launch.records import JobEnd, read_record
    from bamboo.membership.records import FailureReport, decode_message
    from bamboo.rc import FailureEvent

    ranks: set[int] = set()
    for item in membership.kv.get_prefix(membership.keys.decisions):
        name = item.key.removeprefix(membership.keys.decisions)
        if name.startswith("g") and "-epoch-" in name:
            ranks.update(FailureEvent.from_json(item.value).victims)
    nodes = {decode_message(item.key, item.value, FailureReport).node
             for item in membership.kv.get_prefix(membership.keys.failures)}
    end = read_record(JobEnd, membership.get_decision("end"))
    return tuple(sorted(ranks)), tuple(sorted(nodes)), None if end is None else end.error


def read_worker_errors(membership: MembershipStore) -> tuple[tuple[str, str], ...]:
    """``(node, last exception line)`` of the workers that published an error, the earliest first."""
    from bamboo.launch.records import WorkerError

    errors = [WorkerError.from_dict(json.loads(item.value))
              for item in membership.kv.get_prefix(membership.keys.decision("error-"))]
    return tuple((error.node, error.error) for error in sorted(errors, key=lambda error: error.at))


def save_records(membership: MembershipStore, run_dir: Path) -> None:
    """Keep the job's spec and last layout in the run dir (``spec.json``, ``layout.json``) for ``--verify``."""
    for name in ("spec", "layout"):
        found = membership.kv.get(membership.keys.root + name)
        if found is not None:
            (run_dir / f"{name}.json").write_bytes(found.value)


def load_reports(out: Path) -> dict[int, WorkerReport]:
    import torch

    reports = {}
    for path in sorted(out.glob("rank*.pt")):
        report = torch.load(path, weights_only=False)
        reports[int(report["rank"])] = report
    return reports


def unfinished(result: RunResult) -> str:
    """What a run that stopped with its job unfinished (``result.stalled``) says: why, where, and what goes on."""
    return (f"{result.stalled}: the job stopped at step {last_step(result.events)}, unfinished (a longer trace, or "
            f"--resume from its checkpoints in {result.run_dir / 'checkpoints'}, goes on)")


def compare_with_reference(result: RunResult, options: RunOptions) -> Verification:
    """Compare every surviving worker's hosted stages with a fault-free single-process run.

    Returns ``{"steps", "max_relative_diff", "tensors", "history"}``. The reference trains the same global
    batches for the steps the run did, grouped by pipeline as the run's layouts were, with the run's config
    and seed (from the job's spec, kept as ``RUN_DIR/spec.json``): the built-in example in this process
    (:func:`bamboo.bench.emulated.reference.compare_reports`), a user script by running the script once more, in
    ``reference`` mode (:func:`bamboo.launch.script.reference_from_script`). Each worker's layers are
    compared with the reference's layers of the same index (the layers its executor built).
    """
    from bamboo.bench.emulated.reference import compare_reports, compare_states
    from bamboo.launch.spec import JobSpec

    if result.job_error is not None:  # the job's own error, not the missing reports it left
        raise RunError(f"the job ended with an error: {result.job_error}")
    if result.timed_out:
        raise RunError(f"the run did not finish within --timeout {options.timeout_s:g} s (after {result.steps_done} "
                       "steps): nothing to verify")
    if result.stalled is not None:
        raise RunError(unfinished(result))
    if not result.reports:
        raise RunError(f"no worker wrote a final report under {result.run_dir / 'out'}")
    spec = JobSpec.from_json((result.run_dir / "spec.json").read_text())
    reports = list(result.reports.values())
    if not spec.script:
        return compare_reports(reports, spec)
    from bamboo.launch.script import ScriptError, reference_from_script

    steps = result.steps_done
    history = max((r["history"] for r in reports), key=len)
    try:
        reference = reference_from_script(spec.script, config=spec.config, seed=spec.seed, history=history,
                                          steps=steps, work_dir=result.run_dir, timeout_s=options.timeout_s,
                                          pipelines=spec.pipelines)
    except ScriptError as error:
        raise RunError(str(error)) from None
    worst, tensors = compare_states(reports, reference)
    return {"steps": steps, "max_relative_diff": worst, "tensors": tensors, "history": history}


def last_step(events: Path) -> int:
    """The highest step in the run's event log (0 before the first)."""
    from bamboo.launch.events import Step, read_events

    return max((event.step for event in read_events(events) if isinstance(event, Step)), default=0)


def dumps_result(result: RunResult) -> str:
    """A short JSON summary of a run (for logs)."""
    return json.dumps({"run_dir": str(result.run_dir), "failed_ranks": list(result.failed_ranks),
                       "steps_done": result.steps_done, "timed_out": result.timed_out})
