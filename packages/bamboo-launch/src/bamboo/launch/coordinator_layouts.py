"""The layouts the elected coordinator writes (:mod:`bamboo.launch.coordinator`), as pure functions of the job's
spec and the nodes there are: the first layout, a restart of every stage on warm nodes once nobody holds the
current one, and a first start redone without a node lost before its first step. The workers write every other
layout themselves, at a barrier (:mod:`bamboo.launch.barrier`)."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import TYPE_CHECKING

from bamboo.launch.spec import JobSpec

if TYPE_CHECKING:
    from bamboo.reconfig import JobLayout, Layout

__all__ = ["first_layout", "redo_start_layout", "restart_layout"]


def first_layout(spec: JobSpec, zones: dict[str, str]) -> JobLayout:
    """Generation 0 for the registered nodes (node -> zone): bamboo-reconfig's placement of them.

    With ``spec.resume`` every stage starts from the newest good checkpoint in ``spec.checkpoint_dir``, at
    its step, with the history the checkpoint recorded (RuntimeError when there is none).
    """
    from bamboo.launch.reconfigure import checkpoint_history, restore_point
    from bamboo.reconfig import ClusterView, JobLayout, Node, RestorePoint, StartMode, plan_layout

    view = ClusterView(nodes=[Node(node, zone or "default", "standby") for node, zone in sorted(zones.items())],
                       target_stages=spec.stages, target_pipelines=spec.pipelines,
                       global_batch=spec.micro_batches * spec.pipelines, layers=spec.reconfig_layers())
    plan = plan_layout(view)
    if plan.stages != spec.stages or not plan.owners:
        raise RuntimeError(f"{len(zones)} nodes cannot form a pipeline of {spec.stages} stages")
    if not spec.resume:
        return JobLayout(generation=0, plan=plan, zones=zones)
    step, path = restore_point(spec.checkpoint_dir, spec.stages, range(spec.stages))
    history = [item for item in checkpoint_history(path) if item[0] < step] + [(step, len(plan.owners))]
    return JobLayout(generation=0, plan=plan, start_step=step, mode=StartMode.CHECKPOINT, reason="resume",
                     restore=RestorePoint(step, path, range(spec.stages)), barrier_step=step, history=history,
                     zones=zones)


def _place_afresh(spec: JobSpec, nodes: list[str], zones: Mapping[str, str], global_batch: int) -> Layout | None:
    """bamboo-reconfig's placement of ``nodes``, none of which holds state, keeping ``global_batch``
    microbatches; None when they cannot form a pipeline of ``spec.stages`` or split the global batch."""
    from bamboo.reconfig import ClusterView, Node, plan_layout

    if len(nodes) < spec.stages:
        return None
    view = ClusterView(nodes=[Node(node, zones.get(node) or "default", "standby") for node in nodes],
                       target_stages=spec.stages, target_pipelines=spec.pipelines,
                       global_batch=global_batch, layers=spec.reconfig_layers())
    plan = plan_layout(view)
    if plan.stages != spec.stages or not plan.owners:
        return None
    return plan


def restart_layout(spec: JobSpec, lost: JobLayout, warm: list[str], zones: Mapping[str, str], step: int,
                   path: str, reached: int | None = None, memory: dict[int, tuple[str, ...]] | None = None,
                   initial: bool = False, stopped_unix: float | None = None) -> JobLayout | None:
    """The generation after ``lost`` (a ``JobLayout`` none of whose nodes is alive) on the ``warm`` nodes,
    every stage restored from the checkpoint of ``step`` at ``path``; None when they cannot form a pipeline.

    ``reached`` is the last step ``lost`` completed (:func:`steps_reached`; default its start step): the
    steps after the checkpoint up to it are trained again (the ``restore`` record's ``discarded_steps``).
    ``memory`` (stage -> the live nodes that keep it at ``step``) restores from in-memory copies instead of
    ``path``; ``initial`` starts over from the seeded initial state (step 0). ``stopped_unix`` is when ``lost``
    stopped training (the end of its last step, :func:`last_step_end_unix`; default now): the layout's
    ``barrier_unix``, from which its pause counts."""
    from bamboo.launch.reconfigure import next_history
    from bamboo.reconfig import JobLayout, RestorePoint, StartMode

    plan = _place_afresh(spec, warm, zones, lost.global_batch)
    if plan is None:
        return None
    return JobLayout(generation=lost.generation + 1, plan=plan, start_step=step, mode=StartMode.CHECKPOINT,
                     reason="every holder lost",
                     restore=RestorePoint(step, path, range(spec.stages), memory=memory or {}, initial=initial),
                     barrier_step=lost.start_step if reached is None else max(lost.start_step, reached),
                     barrier_unix=time.time() if stopped_unix is None else min(stopped_unix, time.time()),
                     base_generation=lost.generation,
                     survivors=(), history=next_history(lost.history, step, len(plan.owners)),
                     zones={node: zones.get(node, "default") for node in warm})


def redo_start_layout(spec: JobSpec, lost: JobLayout, nodes: list[str],
                      zones: Mapping[str, str]) -> JobLayout | None:
    """The layout that redoes the start of ``lost`` on ``nodes``; None when they cannot form a pipeline.

    ``lost`` is a ``JobLayout`` whose start was abandoned before its first step (a node of it was lost while
    the workers built their groups) and that no node's state went into (``lost.survivors`` is empty: the
    first layout, or a restart of every stage from a checkpoint). Its start is repeated as it was (the same
    step, mode and restore point) with the nodes there are now: the next generation, one more attempt of the
    same barrier.
    """
    from bamboo.launch.reconfigure import next_history
    from bamboo.reconfig import JobLayout

    if lost.survivors:
        raise ValueError(f"generation {lost.generation} starts from the state of {list(lost.survivors)}: its "
                         "holders decide the next attempt")
    plan = _place_afresh(spec, nodes, zones, lost.global_batch)
    if plan is None:
        return None
    return JobLayout(generation=lost.generation + 1, plan=plan, start_step=lost.start_step, mode=lost.mode,
                     reason="a node lost before the first step", restore=lost.restore,
                     barrier_step=lost.barrier_step, barrier_unix=time.time(),
                     base_generation=lost.generation if lost.base_generation is None else lost.base_generation,
                     attempt=lost.attempt + 1, survivors=(),
                     history=next_history(lost.history, lost.start_step, len(plan.owners)),
                     zones={node: zones.get(node, "default") for node in nodes})
