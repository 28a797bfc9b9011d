"""Where every node sits: D pipelines of P stages, global ranks, and the groups of a placement.

Global rank ``r`` is stage ``r % P`` of pipeline ``r // P`` (node ``r % P`` of that pipeline in the
fault-free layout). After failovers a pipeline's stages run on fewer nodes (its ``placement``),
and :meth:`Layout.group_members` gives the gloo groups of the placements. No torch.
"""

from __future__ import annotations

import attrs

__all__ = ["Layout"]


@attrs.frozen
class Layout:
    """D pipelines of P stages; global rank = pipeline × P + stage."""

    stages: int = attrs.field(validator=attrs.validators.ge(1))
    pipelines: int = attrs.field(validator=attrs.validators.ge(1))

    @property
    def world(self) -> int:
        return self.stages * self.pipelines

    def rank(self, stage: int, pipeline: int) -> int:
        return pipeline * self.stages + stage

    def position(self, rank: int) -> tuple[int, int]:
        """(stage, pipeline) of a global rank."""
        return rank % self.stages, rank // self.stages

    def name(self, rank: int) -> str:
        stage, pipeline = self.position(rank)
        return f"stage {stage} pipeline {pipeline}"

    def group_members(self, placements: dict[int, tuple[int, ...]]) -> dict[str, list[int]]:
        """Every group for the given placements (pipeline -> the node that runs each stage):
        P2P pairs of nodes within a pipeline, per-stage data-parallel groups (the host of the stage
        in each pipeline), and per-pipeline groups (its live nodes)."""
        members: dict[str, list[int]] = {}
        for d, placement in placements.items():
            nodes = sorted({self.rank(n, d) for n in placement})
            members[f"pipe-d{d}"] = nodes
            for i, a in enumerate(nodes):
                for b in nodes[i + 1 :]:
                    members[f"p2p-{a}-{b}"] = [a, b]
        for s in range(self.stages):
            members[f"dp-s{s}"] = [self.rank(placements[d][s], d) for d in sorted(placements)]
        return members
