"""``redundancy="auto"`` at the front door: the mode `bamboo.schedule.choose_redundancy` expects to pay best.

`initialize` resolves ``auto`` once, before it builds its executor, from what every rank knows alike (so every
rank picks the same mode): the stages' relative compute (each stage's parameter count, `layer_costs`, for its
forward; twice that for its backward), the microbatches per step, the number of nodes, and a preemption rate
(``preemptions_per_node_hour``; default `DEFAULT_PREEMPTIONS_PER_NODE_HOUR`) with an assumed step of
`ASSUMED_STEP_S`. A job under ``bamboo-launch`` decides with its measured step profile and its market's rate
instead, and again at every reconfiguration.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from bamboo.rc.model import layer_costs
from bamboo.rc.timeouts import ASSUMED_STEP_S, DEFAULT_PREEMPTIONS_PER_NODE_HOUR
from bamboo.schedule import FailureModel, RedundancyChoice, choose_redundancy, stage_work_costs

__all__ = ["ASSUMED_STEP_S", "AUTO", "DEFAULT_PREEMPTIONS_PER_NODE_HOUR", "choose_for_layers"]

AUTO = "auto"
"""The redundancy that is chosen rather than given."""

def choose_for_layers(
    specs: Sequence[Any],
    bounds: Sequence[Sequence[int]],
    microbatches: int,
    nodes: int,
    preemptions_per_node_hour: float = DEFAULT_PREEMPTIONS_PER_NODE_HOUR,
    pipelines: int = 1,
) -> RedundancyChoice:
    """The mode for ``pipelines`` pipelines of ``bounds`` over ``specs`` (its stages' compute from their parameter
    counts) on ``nodes`` nodes; no spare node is assumed (``initialize`` knows of none)."""
    compute = [cost.compute_cost for cost in layer_costs(specs)]
    costs = stage_work_costs([sum(compute[start:end]) for start, end in bounds])
    failures = FailureModel(preemptions_per_node_hour, nodes, pipelines=pipelines)
    return choose_redundancy(costs, len(bounds), microbatches, ASSUMED_STEP_S, failures)
