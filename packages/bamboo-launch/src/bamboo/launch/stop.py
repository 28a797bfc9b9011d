"""What a generation does at a step boundary: go on, stop for a reconfiguration, or end the job there.

After every step the lowest live rank of the generation proposes the stop (decision ``g<g>-stop``, first
writer wins, two steps ahead so that every node can still stop there): the job's end when someone asked for
it (:mod:`bamboo.launch.finish`), else a reconfiguration when :func:`bamboo.reconfig.decide` wants one.
Every node reads the decision after each of its steps.
"""

from __future__ import annotations

import sys
from typing import Any

from bamboo.launch.finish import finish_requested
from bamboo.launch.records import StopDecision, read_record
from bamboo.launch.session import WorkerSession

__all__ = ["cluster_view", "decided_stop"]


def decided_stop(run: WorkerSession, layout: Any, executor: Any, ranks: dict[str, int]) -> tuple[int | None, str, bool]:
    """The step this generation stops at, why, and whether the job ends there, once decided (first writer
    wins); the lowest live rank proposes it: the job's end when someone asked for it (a
    :class:`FinishRequest`), else a reconfiguration when :func:`bamboo.reconfig.decide` wants one."""
    name = f"g{layout.generation}-stop"
    evaluator = min((r for r in ranks.values() if r not in executor.dead), default=min(ranks.values()))
    if executor.rank == evaluator and executor.step + 2 <= run.spec.steps:
        try:
            request = finish_requested(run.membership)
        except Exception as error:  # etcd restarting: look again after the next step
            print(f"node {run.node}: could not read the job's finish request: {error}", file=sys.stderr)
            return None, "", False
        if request is not None:  # each peer reads the decision within the two steps
            proposal = StopDecision(executor.step + 2, f"finish requested by {request.by or 'someone'}",
                                    finish=True)
        else:
            proposal = _reconfiguration_proposal(run, layout, executor)
        if proposal is not None:
            try:
                run.membership.decide(name, proposal.to_dict())
            except Exception as error:  # etcd restarting: propose again after the next step
                print(f"node {run.node}: could not propose a stop: {error}", file=sys.stderr)
                return None, "", False
    try:
        found = read_record(StopDecision, run.membership.get_decision(name))
    except Exception:
        return None, "", False
    if found is None:
        return None, "", False
    return found.step, found.reason, found.finish


def _reconfiguration_proposal(run: WorkerSession, layout: Any, executor: Any) -> StopDecision | None:
    from bamboo.reconfig import When, decide

    view = cluster_view(run, layout, executor)
    if view is None:
        return None
    decision = decide(view)  # after a failover: "rebuild redundancy after a failover", at least
    if decision.when is When.CARRY_ON:
        return None
    return StopDecision(executor.step + 2, ", ".join(r.value for r in decision.reasons))


def cluster_view(run: WorkerSession, layout: Any, executor: Any) -> Any:
    from bamboo.launch.reconfigure import build_view, warm_standby

    try:
        records = run.membership.list_nodes(skip_malformed=True)
        alive = warm_standby(run.membership, records)
    except Exception:
        return None
    ranks = layout.ranks
    dead = [n for n, r in ranks.items() if r in executor.dead]
    alive = sorted(set(alive) | {n for n in ranks if n in records})
    zones = {**layout.zones, **{n: record.zone for n, record in records.items()}}
    return build_view(layout, zones, alive, dead, run.layers, run.spec.pipelines)
