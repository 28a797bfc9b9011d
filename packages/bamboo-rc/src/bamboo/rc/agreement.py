"""What a failover agreement decides: the same values, derived from the same facts, on every node.

:class:`Agreement` (a pipeline-parallel job: a :class:`PipelinePlan` per failed pipeline, the plan, the cut it
was derived from and the step) and :class:`RingAgreement` (a P = 1 ring: the step the survivors run, the
laggards and who sends them the reduced gradients). Frozen values, no torch.
"""

from __future__ import annotations

import attrs
from bamboo.rc.records import CommitResult
from bamboo.schedule import FailoverPlan

__all__ = ["Agreement", "PipelinePlan", "RingAgreement"]


@attrs.frozen
class PipelinePlan:
    """The agreed failover of one pipeline: the plan, the cut it was derived from, and the step."""

    plan: FailoverPlan
    cut: dict[int, int]
    """Node -> instructions completed (the survivors' published progress, with transfers that one
    side completed counted as completed on the other side too)."""
    step: int
    """The step in which the pipeline failed."""
    lagging: frozenset[int] = frozenset()
    """Survivors that had not completed the commit of step ``step - 1`` when the failure struck,
    while the others had (the victim died during the commit's all-reduce). They finish it with
    ``commit`` and then run their remainder from its start (``cut`` is 0 for them)."""
    commit: CommitResult | None = None
    """The result of the commit of step ``step - 1`` (None unless some survivors are ``lagging``)."""


@attrs.frozen
class Agreement:
    """What every node derived from the same facts once a failure was agreed on."""

    epoch: int
    victims: dict[int, frozenset[int]]
    """Pipeline -> the nodes that failed in it (in this failover)."""
    plans: dict[int, PipelinePlan]
    """Pipeline -> its failover (every pipeline in ``victims``)."""


@attrs.frozen
class RingAgreement:
    """What every node of a P = 1 ring derived from the same facts once a failure was agreed on.

    The reduced gradients of a step are a function of the step's parameters and data alone (every
    share is reduced in its own slot and the slots are added in share order), so a node that completed
    a step's all-reduce holds exactly what a redo would give: the laggards take it from ``source``
    instead of anybody recomputing it.
    """

    epoch: int
    victims: frozenset[int]
    """Ranks that died (or left) in this failover."""
    step: int
    """The step every survivor runs once the laggards finished theirs: the latest step a survivor is in."""
    lagging: frozenset[int] = frozenset()
    """Survivors still in step ``step - 1``: its all-reduce failed on them while others completed it."""
    source: int | None = None
    """The survivor that sends the laggards the reduced gradients of step ``step - 1`` (None when none lags)."""
    commit: CommitResult | None = None
    """The result of step ``step - 1`` (squared norm, loss) as the survivors ahead published it (None when none lags)."""
    owners: dict[int, int] = attrs.field(factory=dict)
    """Share (pipeline) -> the live node that computes it from now on."""
    progress: dict[int, int] = attrs.field(factory=dict)
    """Live rank -> the instructions it had completed in its step (as published)."""
