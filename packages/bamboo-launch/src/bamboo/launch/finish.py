"""Ending a job before its last step: ``bamboo-launch finish``.

A :class:`bamboo.launch.records.FinishRequest` in etcd (first writer wins) asks the job to end. The lowest
live rank of the running generation sees it after its next step and decides that the generation stops two
steps later (a ``StopDecision`` with ``finish``), the margin every peer needs to read the decision before it
gets there; at that boundary the nodes write their final checkpoint and report, and the job ends as it does
at its last step (``JobEnd`` with the step reached). A request during a reconfiguration, or after another
stop was decided for the generation, takes effect in the next generation. Nothing is lost: the job ends at
a step every node finished.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from bamboo.launch.records import FINISH_DECISION, FinishRequest, read_record

if TYPE_CHECKING:
    from bamboo.membership import MembershipStore

__all__ = ["finish_requested", "request_finish"]


def request_finish(membership: MembershipStore, by: str) -> tuple[FinishRequest, bool]:
    """Ask job ``membership.job`` to end at the next step boundary every node can reach; returns the request
    that stands and whether it is this one (False: someone asked first)."""
    decision = membership.decide(FINISH_DECISION, FinishRequest(by=by, unix=time.time()).to_dict())
    return FinishRequest.from_dict(decision.value), decision.won


def finish_requested(membership: MembershipStore) -> FinishRequest | None:
    """The job's finish request, if someone asked for one."""
    return read_record(FinishRequest, membership.get_decision(FINISH_DECISION))
