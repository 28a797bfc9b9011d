"""What the simulator runs: the strategies (`Strategy`), what the planner is told about zones (`Policy`), and the
error of a run whose placements or decisions differ from bamboo-reconfig's (`PolicyMismatch`).

The strategies themselves are described in `bamboo.bench.simulator`.
"""

from __future__ import annotations

import enum

import attrs

__all__ = ["Policy", "PolicyMismatch", "Strategy"]


class Strategy(enum.Enum):
    """How a training job reacts to preemptions."""

    BAMBOO = "bamboo"
    CHECKPOINT = "checkpoint"
    ON_DEMAND = "on-demand"
    SAMPLE_DROPPING = "sample-dropping"

    @classmethod
    def parse(cls, text: str) -> Strategy:
        """The strategy named `text` (``bamboo``, ``checkpoint``, ``on-demand``, ``sample-dropping``)."""
        try:
            return cls(text.strip())
        except ValueError:
            raise ValueError(f"unknown strategy {text!r}; choose from {', '.join(s.value for s in cls)}") from None


@attrs.frozen
class Policy:
    """What the simulated cluster tells the planner about zones.

    `zone_aware` (default): nodes report their zones, and the planner (bamboo-reconfig's ``plan_layout``)
    keeps neighbouring stages in different zones wherever the zones allow. ``zone_aware=False`` is the same
    planner on a view where every node is in one zone, as when nodes register without a zone (the launcher
    files them all under ``default``): the ablation of zone-aware placement. The reconfiguration decisions
    are the system's (``bamboo.reconfig.decide``) and have no knob.
    """

    zone_aware: bool = True


class PolicyMismatch(AssertionError):
    """``check_policy``: the simulator's placement or decision differs from bamboo-reconfig's on the same state."""

