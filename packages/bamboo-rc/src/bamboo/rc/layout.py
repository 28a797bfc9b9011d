"""Where every node sits: D pipelines of P stages, global ranks, and the groups of a placement.

Global rank ``r`` is stage ``r % P`` of pipeline ``r // P`` (node ``r % P`` of that pipeline in the
fault-free layout). After failovers a pipeline's stages run on fewer nodes (its ``placement``),
and :meth:`Layout.group_members` gives the gloo groups of the placements.

With one stage (P = 1, pure data parallelism) every node holds the whole model, and the shadow of a
node is its *ring successor*: the next live pipeline, in pipeline order, last to first. Pipeline
``d``'s microbatches (its *share* of the global batch, global microbatches ``d·M .. d·M+M-1``) are
computed by their *owner*: the first live node at or after ``d`` in the ring
(:meth:`Layout.ring_owners`). That is a function of the set of dead nodes alone, so nodes that learn
of several deaths together or one by one derive the same owners. No torch.
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

    def ring_owner(self, share: int, dead: set[int] | frozenset[int]) -> int:
        """P = 1: the live node that computes pipeline `share`'s microbatches (the first live node at or
        after `share` in the ring). ValueError when every node is dead."""
        self._require_ring()
        for offset in range(self.pipelines):
            rank = (share + offset) % self.pipelines
            if rank not in dead:
                return rank
        raise ValueError(f"every node of the {self.pipelines} pipelines is dead: no owner for share {share}")

    def ring_owners(self, dead: set[int] | frozenset[int]) -> dict[int, int]:
        """P = 1: share -> the live node that computes it (:meth:`ring_owner`), for every share."""
        return {share: self.ring_owner(share, dead) for share in range(self.pipelines)}

    def ring_shares(self, rank: int, dead: set[int] | frozenset[int]) -> tuple[int, ...]:
        """P = 1: the shares live node `rank` computes, in share order."""
        return tuple(share for share, owner in self.ring_owners(dead).items() if owner == rank)

    def ring_shadow(self, rank: int, dead: set[int] | frozenset[int]) -> int | None:
        """P = 1: the shadow of live node `rank`: the next live node in the ring (None when it is alone)."""
        self._require_ring()
        for offset in range(1, self.pipelines):
            other = (rank + offset) % self.pipelines
            if other not in dead:
                return other
        return None

    def ring_shadowed(self, rank: int, dead: set[int] | frozenset[int]) -> int | None:
        """P = 1: the live node whose shadow `rank` is (the previous live node; None when it is alone)."""
        self._require_ring()
        for offset in range(1, self.pipelines):
            other = (rank - offset) % self.pipelines
            if other not in dead:
                return other
        return None

    def _require_ring(self) -> None:
        if self.stages != 1:
            raise ValueError(f"the shadow ring of the data-parallel nodes exists for P = 1 only, got P = {self.stages}")

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
