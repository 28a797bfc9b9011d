"""Reconfiguration at step boundaries: the view, the barrier, the restore point.

Layouts are numbered by *generation*. Generation g's layout lives in etcd under
``/bamboo/<job>/layout`` as a :class:`bamboo.reconfig.JobLayout` (the placement, the stage bounds, the
start step, and how the state gets there), and its workers use the c10d key space and failure events of
generation g (fresh group prefixes every generation).

A generation ends at a barrier, at a step boundary:

- on a consecutive failure (bamboo-rc raises ``ConsecutiveFailure``; every survivor is at the start
  of the interrupted step), at once;
- when `bamboo.reconfig.decide` says so at a step boundary (waiting nodes can fill a pipeline, a
  pipeline cannot absorb one more failure, a shadow carries two stages and a replacement waits).
  The lowest surviving rank evaluates it after each step and proposes the stop step (four steps
  ahead, so every worker can still stop there: ``bamboo.launch.stop.STOP_AHEAD``) as decision ``g<g>-stop``, first writer wins.

At the barrier every survivor publishes which stages it holds at the barrier step (decision
``g<g>-ready-<node>``, a :class:`bamboo.launch.records.BarrierReady`). The first to see them all
computes the next layout (`bamboo.reconfig.plan_layout`: depth kept, whole pipelines only, surplus on
standby; standby nodes count once their worker is warm) and its transfer plan
(`bamboo.reconfig.plan_transfers`: each new owner fetches only the layers it lacks, from a survivor
that holds them at that step, in rounds where no node sends or receives two transfers at once; the
workers execute it round by round), and writes it as decision ``g<g>-next`` (first writer wins;
everyone uses the winner's). The global batch stays constant: D' pipelines run ``M * D / D'``
microbatches. Only when no survivor holds some stage is the last good checkpoint restored (mode
``checkpoint``): the writer of the next layout picks the newest step whose shards of *every* stage
verify (:func:`restore_point`: a corrupt, truncated or uncommitted newer one is logged with its
file and reason and skipped), and names it in the layout (its ``restore`` point; the barrier step
stays in ``barrier_step``). Every node of the next generation, survivors included,
loads exactly that folder (:func:`restore_slices`), so no node can pick a different step while
an asynchronous writer is still committing a newer one. The steps after the checkpoint are
trained again; ``history`` (the pipelines of each step, for the reference run) is cut at the
restored step (:func:`next_history`), so it describes the timeline that survived. Shards of the
abandoned steps stay on disk; the new timeline rewrites every shard of each checkpoint step it
reaches.

The next layout then starts as an *attempt* (:mod:`bamboo.launch.attempt`): if a node it needs dies
before every new owner is up, all abandon it, and the holders publish what they hold again
(``g<g>-a<k>-ready-<node>``) and decide anew (``g<g>-a<k>-next``, generation ``g+1+k``; the layout
carries ``base_generation``, ``attempt`` and ``survivors``, the holders of the barrier).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Iterable, Mapping, MutableMapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs
from bamboo.launch.records import node_of_decision

if TYPE_CHECKING:
    from bamboo.launch.copy_service import CopyService
    from bamboo.launch.spec import JobSpec
    from bamboo.membership import KeyValueStore, MembershipStore
    from bamboo.rc.state import TrainableSlice
    from bamboo.reconfig import ClusterView, JobLayout, LayerSpec, RestorePoint, TransferPlan

__all__ = [
    "build_view",
    "checkpoint_history",
    "nearest_restore",
    "next_history",
    "restore_point",
    "restore_slices",
    "stage_shards",
    "transfer_participants",
    "warm_standby",
]


def build_view(
    layout: JobLayout,
    zones: Mapping[str, str],
    alive: Sequence[str],
    dead: Sequence[str],
    layers: Sequence[LayerSpec],
    target_pipelines: int,
) -> ClusterView:
    """bamboo-reconfig's ``ClusterView`` of a generation (a :class:`bamboo.reconfig.JobLayout`): its ranked
    nodes (active, or preempted when in ``dead`` or not ``alive``) and every other ``alive`` node (standby).

    The global batch is the layout's, split over the pipelines as evenly as it goes (the first ``G mod D'`` one
    microbatch more); with one stage (the shadow ring) only over a number of pipelines that divides it. P is its
    depth and D the job's target number of pipelines.
    """
    from bamboo.reconfig import ClusterView, Node, StageSlot

    stages = layout.stages
    nodes = []
    for node, rank in layout.ranks.items():
        slot = StageSlot(rank // stages, rank % stages)
        state = "preempted" if node in dead or node not in alive else "active"
        nodes.append(Node(node, zones.get(node) or "default", state, slot if state == "active" else None))
    for node in alive:
        if node not in layout.ranks:
            nodes.append(Node(node, zones.get(node) or "default", "standby"))
    return ClusterView(nodes=nodes, target_stages=stages, target_pipelines=target_pipelines,
                       global_batch=layout.global_batch, layers=list(layers), layout=layout.plan)


def warm_standby(membership: MembershipStore, registered: Iterable[str]) -> list[str]:
    """The registered nodes whose worker is warm (it published ``warm-<node>``)."""
    warm = {node_of_decision(item.key, "warm-") for item in membership.kv.get_prefix(membership.keys.decision("warm-"))}
    return sorted(node for node in registered if node in warm)


def transfer_participants(plan: TransferPlan) -> list[str]:
    """Members of a transfer plan's gloo group, in group-rank order: every source and every receiver."""
    return sorted({t.source for t in plan.transfers} | {t.destination for t in plan.transfers})


def stage_shards(stages: Iterable[int]) -> list[str]:
    """Checkpoint shard names of ``stages`` (``stage-<s>``: pipeline 0's host of each stage writes its own)."""
    from bamboo.rc.checkpoint_files import stage_shard

    return [stage_shard(stage) for stage in sorted(stages)]


class _StderrHandler(logging.Handler):
    """Log records to whatever ``sys.stderr`` is at the time (one line each, prefixed)."""

    def emit(self, record: logging.LogRecord) -> None:
        print(f"bamboo-launch restore: {record.levelname.lower()}: {record.getMessage()}", file=sys.stderr, flush=True)


def restore_point(checkpoint_dir: str | None, stages: int, missing: Sequence[int]) -> tuple[int, str]:
    """``(step, folder)`` of the checkpoint to restart from when no survivor holds ``missing``.

    The newest step whose shards ``stage-0`` ... ``stage-<stages-1>`` all verify and load
    (:func:`bamboo.rc.checkpoint_files.load_latest_good`; each rejected shard is logged to stderr
    with its file and reason). Raises ``RuntimeError`` naming the lost stages if the run has no
    checkpoint directory or no good checkpoint in it.
    """
    from bamboo.rc.checkpoint_files import NoGoodCheckpointError, load_latest_good

    lost = ",".join(map(str, sorted(missing)))
    if checkpoint_dir is None:
        raise RuntimeError(f"every copy of stage(s) {lost} is gone and the run writes no checkpoints "
                           "(--checkpoint-dir): it cannot go on")
    logger = logging.getLogger("bamboo.launch.restore")
    if not logger.handlers:  # the worker's stderr is its node's log: say there why a checkpoint was skipped
        logger.addHandler(_StderrHandler())
        logger.propagate = False
    try:
        loaded = load_latest_good(checkpoint_dir, stage_shards(range(stages)), log=logger)
    except NoGoodCheckpointError as error:
        raise RuntimeError(f"every copy of stage(s) {lost} is gone and no checkpoint can replace them: {error}") from None
    return loaded.step, str(loaded.path)


def checkpoint_history(folder: str) -> list[tuple[int, int]]:
    """The run's ``(first step, pipelines)`` history stored with a checkpoint (every shard holds it)."""
    from bamboo.rc.checkpoint_files import load_checkpoint

    shard = next(iter(sorted(Path(folder).glob("stage-*.manifest.json"))), None)
    if shard is None:
        raise RuntimeError(f"checkpoint {folder} has no stage shard")
    loaded = load_checkpoint(folder, [shard.name.removesuffix(".manifest.json")])
    history = next(iter(loaded.shards.values())).get("history")
    if history is None:
        raise RuntimeError(f"checkpoint {folder} was written without the run's history (an older format)")
    return [(int(first), int(pipelines)) for first, pipelines in history.tolist()]


def restore_slices(layout: JobLayout, slices: MutableMapping[int, TrainableSlice],
                   copies: CopyService | None = None) -> int:
    """Load every slice (stage -> ``TrainableSlice``) from the copy of an earlier step the layout (a
    ``JobLayout``) names: in-memory copies of live nodes (through ``copies``, this worker's
    :class:`bamboo.launch.copy_service.CopyService`), or its checkpoint folder; nothing when it starts over
    from the initial state (the slices are built from the seed). Returns the step.

    Raises ``CheckpointError`` (naming the file and why) if a shard no longer verifies, RuntimeError when no
    node can give a stage from memory.
    """
    from bamboo.launch.memcopy import lineage

    restore = layout.restore
    if restore.initial:  # no copy of any step was left: the slices were built from the seed, the state of step 0
        return 0
    if restore.memory:
        if copies is None:
            raise RuntimeError(f"generation {layout.generation} restores from memory, and this node keeps no copies")
        for stage, piece in slices.items():
            bounds = (piece.indices.start, piece.indices.stop)
            piece.load_state_bytes(copies.load(stage, restore.step, restore.memory[stage], bounds,
                                               lineage(layout.history, restore.step)))
        return int(restore.step)
    from bamboo.rc.checkpoint_files import load_checkpoint

    loaded = load_checkpoint(restore.path, stage_shards(slices))
    if loaded.step != layout.start_step:
        raise RuntimeError(f"checkpoint {loaded.path} is of step {loaded.step}, the layout restarts at "
                           f"{layout.start_step}")
    for stage, piece in slices.items():
        piece.load_state_bytes(loaded.shards[f"stage-{stage}"]["state"].numpy().tobytes())
    return loaded.step


def nearest_restore(kv: KeyValueStore, spec: JobSpec, missing: Sequence[int], bounds: Sequence[Sequence[int]],
                    alive: Iterable[str], history: Sequence[Sequence[int]]) -> RestorePoint:
    """Where every stage restarts from when no live node holds ``missing`` at the current step (a
    :class:`bamboo.reconfig.RestorePoint`), the nearest copy first:

    1. the newest step at which every stage has an in-memory copy of the job's lineage (``history``, the
       restoring generation's) on an ``alive`` node (:mod:`bamboo.launch.memcopy`);
    2. the newest good checkpoint of ``spec.checkpoint_dir``, when it is newer (disk is the last resort);
    3. when neither is left (every node lost before a copy reached a survivor and before the first checkpoint,
       or a run without checkpoints), the job's seeded initial state: it starts over from step 0, exactly, and
       says in its log what was lost and what would have saved more of it.
    """
    from bamboo.launch.memcopy import memory_restore, read_indexes
    from bamboo.rc.checkpoint_files import list_checkpoints
    from bamboo.reconfig import RestorePoint

    live = set(alive)
    indexes = read_indexes(kv, spec.job)
    found = memory_restore(indexes, bounds, live, history)
    on_disk = list_checkpoints(spec.checkpoint_dir) if spec.checkpoint_dir else []
    if found is not None and (not on_disk or found[0] >= on_disk[0][0]):
        return RestorePoint(found[0], "", missing, memory=found[1])
    try:
        step, path = restore_point(spec.checkpoint_dir, spec.stages, missing)
    except RuntimeError as error:
        if found is not None:
            return RestorePoint(found[0], "", missing, memory=found[1])
        kept = "; ".join(f"{index.node} keeps stage(s) {sorted(index.copies)}" for index in indexes.values()
                         if index.copies and index.node in live) or "no live node keeps any"
        print(f"bamboo-launch restore: warning: {error}; and no step has an in-memory copy of every stage on a live "
              f"node ({kept}): the job starts over from its initial state (a checkpoint on disk, --checkpoint-dir, "
              "or a keeper that outlived the losses would have saved the steps done)", file=sys.stderr, flush=True)
        return RestorePoint(0, "", missing, initial=True)
    if found is not None and found[0] >= step:
        return RestorePoint(found[0], "", missing, memory=found[1])
    return RestorePoint(step, path, missing)


def live_restore(kv: KeyValueStore, spec: JobSpec, lost: JobLayout, alive: Iterable[str]) -> JobLayout:
    """``lost``, a start to redo (a ``JobLayout`` abandoned before its first step), as it can be redone with the
    ``alive`` nodes: unchanged, unless it restores from in-memory copies and some stage has no live keeper left.
    Then from the nearest copy there is now (:func:`nearest_restore`: an older copy in memory, the disk, or the
    initial state), at that copy's step. Redoing it as it was had failed for ever: a measured run redid a restore
    whose keepers had all died a thousand times ("no node could give stage 1 at step 60 from memory")."""
    restore, live = lost.restore, set(alive)
    if restore is None or not restore.memory or all(live & set(nodes) for nodes in restore.memory.values()):
        return lost
    bounds = [tuple(bound) for bound in lost.stage_bounds]
    point = nearest_restore(kv, spec, restore.lost_stages, bounds, live, lost.history)
    print(f"bamboo-launch restore: the in-memory copies of step {restore.step} are gone with their keepers; the "
          f"start is redone from {point.source} at step {point.step}", file=sys.stderr, flush=True)
    return attrs.evolve(lost, restore=point, start_step=point.step,
                        history=next_history(lost.history, point.step, lost.pipelines))


def next_history(history: Sequence[Sequence[int]], start_step: int, pipelines: int) -> list[tuple[int, int]]:
    """``(first step, pipelines)`` of each generation after one that starts at ``start_step``.

    Generations that start at or after ``start_step`` are dropped: after a checkpoint restore
    their steps are trained again by the new generation (and a generation that ran no step at
    all never counted).
    """
    kept = [(int(first), int(d)) for first, d in history if int(first) < start_step]
    return [*kept, (int(start_step), int(pipelines))]
