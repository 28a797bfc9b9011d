"""The system's reconfiguration policy, on the simulator's integers: bamboo-reconfig's rules, fast.

The simulator's ``bamboo`` strategy takes every placement and every reconfiguration decision from here.
They are the rules of ``bamboo.reconfig.plan_layout`` and ``bamboo.reconfig.decide``, computed on plain
integers because a sweep makes millions of them (on 48 nodes, building a ``ClusterView`` and calling
bamboo-reconfig costs about 2.3 ms per layout and 0.24 ms per decision; these functions about 0.37 ms per
layout and a few µs per decision). The placements, `plan_placement` and `plan_replica_ring`, are
``bamboo.bench.placement``'s (re-exported here); this module holds the decisions and the view. `plan_placement`
matches nodes to slots with the planner's own function (``bamboo.reconfig.assignment.cheapest_order``). The
simulator state maps onto the planner's inputs like this (``system_view`` builds that ``ClusterView``):

- Nodes that are allocated but still starting are not in the view (they have not registered yet). The
  owners of the current layout are ``active`` (with their slot) or ``preempted``; every other live node is
  ``standby``, as the launcher reports waiting nodes (``bamboo.launch.reconfigure.build_view``).
- The depth is the profile's P and never lower: a profile gives step times for depth P only. The view says
  so with a model of P one-byte layers and a node memory of two bytes (a node holds its stage and its
  successor's replica), so with fewer than P usable nodes the planner finds no split
  (``InfeasibleSplit``) and the job waits for nodes.
- The global batch does not bind: the view's global batch is D microbatches, so D' = min(D, usable // P).
- Node ids and zone indices become names that sort like the integers (``node_name``, ``zone_name``), so
  every tie the planner breaks by name is broken the same way here. Zone-blind placement
  (``Policy(zone_aware=False)``) is the planner on a view where every node is in one zone, which is what
  the launcher does with nodes that register without a zone (it files them under ``default``).

`plan_placement` equals ``plan_layout(system_view(...)).owners`` and `decision` equals
``decide(system_view(...))`` (when and reasons); `reconfigures` is whether that decision reconfigures, without
building its reasons (the simulator asks it at every event). The tests check all three on random clusters
(hypothesis), and ``simulate_run(..., check_policy=True)`` checks every placement and decision of a run
against bamboo-reconfig itself.

Pure data parallelism (P = 1), which bamboo-reconfig does not plan (it needs P >= 2): every node is one
replica of the whole model, and the replicas form one ring, each node's shadow being its ring successor (it
also computes its predecessor's share of the global batch). The same rules carry over with the ring of
replicas in place of a pipeline's ring of stages: `plan_replica_ring` chooses and orders the replicas so that
ring neighbours sit in different zones wherever the zone counts allow (bamboo-reconfig's placement rule for
one ring of D slots), `is_consecutive_replica_failure` is the consecutive failure (a replica lost next to a
lost one), and `reconfigures` holds unchanged (it depends on P only through ``usable // P``).
"""

from __future__ import annotations

import functools
from collections.abc import Collection, Iterable, Mapping, Sequence

from bamboo.bench.placement import NOT_A_HOLDER, plan_placement, plan_replica_ring
from bamboo.reconfig import ClusterView, LayerSpec, Layout, Node, Reason, StageSlot, When, microbatch_shares

__all__ = [
    "NOT_A_HOLDER",
    "ZONE_BLIND_NAME",
    "decision",
    "is_consecutive_failure",
    "is_consecutive_replica_failure",
    "node_name",
    "plan_placement",
    "plan_replica_ring",
    "reconfigures",
    "system_view",
    "zone_name",
]

#: The one zone of a zone-blind view (the launcher's name for nodes that register without a zone).
ZONE_BLIND_NAME = "default"


def node_name(node: int) -> str:
    """The view's name for simulator node `node`: names sort like the integers (up to 10**12 nodes)."""
    return f"n{node:012d}"


def zone_name(zone: int) -> str:
    """The view's name for simulator zone index `zone`: names sort like the integers."""
    return f"z{zone:06d}"


# ------------------------------------------------------------------------------------------- decision
def is_consecutive_failure(dead: Collection[tuple[int, int]], pipeline: int, stage: int, stages: int) -> bool:
    """Whether the lost slot (`pipeline`, `stage`) has a lost neighbour: a stage and its shadow are both gone."""
    return (pipeline, (stage - 1) % stages) in dead or (pipeline, (stage + 1) % stages) in dead


def is_consecutive_replica_failure(dead: Collection[tuple[int, int]], pipeline: int, pipelines: int) -> bool:
    """P = 1: whether losing replica `pipeline` of a ring of `pipelines` replicas is a consecutive failure.

    It is when a ring neighbour is already lost (`dead` holds ``(replica, 0)`` slots): the lost replica's
    shadow (its successor) is gone, or it was itself the shadow of its lost predecessor. A lone replica has
    no shadow, so losing it is always one.
    """
    if pipelines < 2:
        return True
    return ((pipeline - 1) % pipelines, 0) in dead or ((pipeline + 1) % pipelines, 0) in dead


def decision(
    dead: Collection[tuple[int, int]],
    layout_pipelines: int,
    stages: int,
    target_pipelines: int,
    usable: int,
    waiting: int,
) -> tuple[When, tuple[Reason, ...]]:
    """``decide``'s when and reasons for a layout of `layout_pipelines` x `stages` whose slots `dead` are lost.

    `usable` counts the live registered nodes (surviving owners and waiting nodes), `waiting` the live
    nodes outside the layout. The rules, most urgent first: a pipeline that lost a stage and its shadow
    reconfigures now; at the next step boundary when every survivor of some degraded pipeline has a lost
    neighbour (one more failure would be fatal), when a shadow carries a lost stage and a node waits, when
    the waiting nodes let more pipelines run, or after any failover (rebuild redundancy, listed after every
    other reason, the consecutive failure's included); a whole layout carries on unless more pipelines can run.
    bamboo-reconfig decides for P >= 2 only; with ``stages < 2`` this raises ValueError (`reconfigures` and
    `is_consecutive_replica_failure` cover P = 1).
    """
    if stages < 2:
        raise ValueError(f"bamboo-reconfig decides for pipelines of at least 2 stages, got {stages}")
    if not dead:
        if waiting and min(target_pipelines, usable // stages) > layout_pipelines:
            return When.NEXT_STEP_BOUNDARY, _NEW_PIPELINE
        return When.CARRY_ON, _WHOLE
    lost_by_pipeline: dict[int, set[int]] = {}
    for pipeline, stage in dead:
        if pipeline in lost_by_pipeline:
            lost_by_pipeline[pipeline].add(stage)
        else:
            lost_by_pipeline[pipeline] = {stage}
    fragile = False
    for lost in lost_by_pipeline.values():
        if any((stage - 1) % stages in lost for stage in lost):
            return When.NOW, _CONSECUTIVE
        if not fragile:
            fragile = all(
                (stage - 1) % stages in lost or (stage + 1) % stages in lost
                for stage in range(stages)
                if stage not in lost
            )
    more = bool(waiting) and min(target_pipelines, usable // stages) > layout_pipelines
    return When.NEXT_STEP_BOUNDARY, _FAILED_OVER[fragile, bool(waiting), more]


def reconfigures(
    dead: Collection[tuple[int, int]],
    layout_pipelines: int,
    stages: int,
    target_pipelines: int,
    usable: int,
    waiting: int,
) -> bool:
    """Whether `decision` on the same arguments reconfigures (now or at the next step boundary), cheaply.

    It does after any failover (some slot is lost), and when the waiting nodes let more pipelines run:
    with the rebuild after a failover, a decision carries on only while the layout is whole and cannot grow.
    """
    return bool(dead) or (waiting > 0 and min(target_pipelines, usable // stages) > layout_pipelines)


_NEW_PIPELINE = (Reason.NEW_PIPELINE,)
_WHOLE = (Reason.ALL_PIPELINES_WHOLE,)
_CONSECUTIVE = (Reason.CONSECUTIVE_FAILURE, Reason.REBUILD_REDUNDANCY)
#: The reasons after a failover that is not consecutive, by (fragile, a node waits, more pipelines can run).
_FAILED_OVER = {
    (fragile, waiting, more): tuple(
        reason for reason, holds in (
            (Reason.ONE_MORE_FAILURE_FATAL, fragile),
            (Reason.SHADOW_CARRYING_TWO_STAGES, waiting),
            (Reason.NEW_PIPELINE, more),
            (Reason.REBUILD_REDUNDANCY, True),
        ) if holds
    )
    for fragile in (False, True) for waiting in (False, True) for more in (False, True)
}


# ---------------------------------------------------------------------------------------- system view
@functools.lru_cache(maxsize=64)
def _layers(stages: int) -> tuple[LayerSpec, ...]:
    return tuple(LayerSpec(param_bytes=1, optimizer_bytes=0, compute_cost=1.0) for _ in range(stages))


def system_view(
    owners: Sequence[Sequence[int]],
    alive: Iterable[int],
    zone_of: Mapping[int, int],
    stages: int,
    pipelines: int,
    zone_aware: bool = True,
) -> ClusterView:
    """The ``ClusterView`` that bamboo-reconfig sees for this simulator state (see the module docstring).

    `owners` is the current layout's grid (empty before the first layout), dead owners included; `alive`
    the live registered nodes (owners still alive and waiting nodes); `zone_of` every node's zone index.
    """
    if stages < 2:
        raise ValueError(f"bamboo-reconfig plans pipelines of at least 2 stages, got {stages}")
    live = set(alive)

    def zone(node: int) -> str:
        return zone_name(zone_of[node]) if zone_aware else ZONE_BLIND_NAME

    nodes: list[Node] = []
    slots: set[int] = set()
    for pipeline, row in enumerate(owners):
        for stage, node in enumerate(row):
            slots.add(node)
            if node in live:
                nodes.append(Node(node_name(node), zone(node), "active", StageSlot(pipeline, stage)))
            else:
                nodes.append(Node(node_name(node), zone(node), "preempted"))
    nodes.extend(Node(node_name(node), zone(node), "standby") for node in live - slots)
    layers = _layers(stages)
    layout = None
    if owners:
        layout = Layout(
            stages=stages,
            layers=layers,
            stage_layers=[(stage, stage + 1) for stage in range(stages)],
            owners=[[node_name(node) for node in row] for row in owners],
            microbatches=microbatch_shares(pipelines, len(owners)),
        )
    return ClusterView(
        nodes=nodes, target_stages=stages, target_pipelines=pipelines, global_batch=pipelines,
        layers=layers, layout=layout, node_memory_bytes=2,
    )
