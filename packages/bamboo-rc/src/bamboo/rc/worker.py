"""One training worker process: build the executor for a (stage, pipeline), train, report.

`verify` forks one of these per node. A worker connects to the c10d store hosted by its parent,
runs with one intra-op thread and deterministic algorithms (so results are exact), trains the
example model (or the :class:`VerifyModel` it is given: layers, loss and ``microbatch(step, index)``,
inherited through the fork) for the given steps with the verify's kill and notice points (a
:class:`~bamboo.rc.faults.FaultInjector` hook), writes its final state to `<out>/rank<r>.pt` (its
failovers as :class:`~bamboo.rc.records.FailoverRecord` dictionaries) and ends with a flush and
`os._exit` (never running gloo destructors that could block on a dead peer).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import os
import sys
import time
import traceback
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch
from bamboo.rc.config import TrainingConfig, load_config
from bamboo.rc.data import GlobalBatchSampler
from bamboo.rc.device import exact_kernels, peak_memory_bytes, resolve_device
from bamboo.rc.engine import initialize
from bamboo.rc.failures import ConsecutiveFailure, HandedOver, StoreFailureNotices
from bamboo.rc.faults import FaultInjector, KillPoint, NoticePoint
from bamboo.rc.layout import Layout
from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss
from bamboo.rc.timeouts import CommTimeouts
from bamboo.reconfig import microbatch_shares
from bamboo.schedule import Costs
from torch.distributed import TCPStore

__all__ = ["VerifyModel", "WorkerSpec", "exact_mode", "example_model", "heap_frozen_for_forks", "run_config",
           "run_worker", "worker_main"]


@contextlib.contextmanager
def heap_frozen_for_forks() -> Iterator[None]:
    """Fork workers inside this block: their garbage collections then leave the heap they inherit alone.

    A process with torch imported holds hundreds of thousands of objects. A forked child's full collections walk
    every one of them and write to their headers, which copies the parent's pages into the child (copy-on-write);
    in a P = 4, D = 2 chaos test the collector had about 9% of the CPU samples. ``gc.freeze()`` moves the
    parent's objects to a generation the collector never visits, and the child inherits that. The parent takes
    them back (``gc.unfreeze()``) when the block ends, so that nothing it allocated before stays uncollectable.
    """
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()


def exact_mode() -> None:
    """One intra-op thread and deterministic algorithms: the same math gives the same bits (on a GPU too:
    cuBLAS's fixed workspace is set before CUDA starts, :func:`bamboo.rc.device.exact_kernels`).

    ``torch.use_deterministic_algorithms(True)`` sets the same flag of the eager kernels, and also inductor's
    ``deterministic`` option, whose import imports ``torch._dynamo``: 1.2 s of CPU in every worker, for a
    compiler nothing here runs. So the eager flag is set alone (the public call where torch lacks the private one).
    """
    exact_kernels()
    torch.set_num_threads(1)
    set_eager_flag = getattr(torch._C, "_set_deterministic_algorithms", None)
    if set_eager_flag is None:
        torch.use_deterministic_algorithms(True)
    else:
        set_eager_flag(True)


@attrs.frozen
class VerifyModel:
    """A model of your own for ``verify``: its layer specs, the loss of one microbatch, and the data as a
    function of its position (``microbatch(step, global index) -> (inputs, labels)``). The workers are forked,
    so anything (a ``transformers`` model, a memory-mapped token file) is inherited as it is."""

    layers: Sequence[Any]
    loss_fn: Callable[[Any, Any], torch.Tensor]
    microbatch: Callable[[int, int], tuple[Any, Any]]


@attrs.frozen
class WorkerSpec:
    """Everything a forked worker needs."""

    layout: Layout
    stage: int
    pipeline: int
    store_host: str
    store_port: int
    steps: int
    redundancy: str
    size: GPTSize
    config: dict[str, Any]
    out_dir: str
    stage_bounds: tuple[tuple[int, int], ...] | None = None
    """The layer range of every stage (default: :func:`bamboo.rc.model.stage_bounds`)."""
    seed: int = 0
    job: str = "verify"
    timeouts: CommTimeouts = attrs.field(factory=CommTimeouts)
    kills: tuple[KillPoint, ...] = ()
    notice_points: tuple[NoticePoint, ...] = ()
    device: str | None = None
    """``initialize``'s device (None: ``BAMBOO_DEVICE``, else a GPU when CUDA is present); ``cuda`` without an
    index is ``cuda:(rank mod GPUs)``."""
    model: VerifyModel | None = None
    """A model of your own instead of the example GPT of ``size``."""
    global_microbatches: int | None = None
    """The global batch in microbatches where the pipelines' shares of it differ (the first ``G mod D`` pipelines
    one longer: :meth:`bamboo.rc.config.TrainingConfig.shares`); ``config``'s gradient accumulation steps are then
    replaced by this worker's pipeline's share. None: every pipeline runs ``config``'s."""
    schedule_costs: dict[str, Any] | None = None
    """``initialize``'s ``schedule_costs`` (a ``bamboo.schedule.Costs`` as a dict; None: the unit-cost placement)."""

    def worker_config(self) -> dict[str, Any]:
        """``config`` with this worker's pipeline's share as its gradient accumulation steps (uneven shares)."""
        if self.global_microbatches is None:
            return self.config
        shares = microbatch_shares(self.global_microbatches, self.layout.pipelines)
        return {**self.config, "gradient_accumulation_steps": shares[self.pipeline]}

    def program(self, micro_batch_size: int) -> VerifyModel:
        """The model this worker trains: :attr:`model`, or the example GPT of :attr:`size` on its corpus."""
        return self.model or example_model(self.size, micro_batch_size, self.seed)


def example_model(size: GPTSize, micro_batch_size: int, seed: int) -> VerifyModel:
    """The example GPT of ``size`` on the standard library's source (:class:`~bamboo.rc.data.GlobalBatchSampler`)."""
    sampler = GlobalBatchSampler(micro_batch_size, size.sequence, seed=seed)

    def microbatch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        batch = sampler.microbatch(step, index)
        return batch.tokens, batch.labels

    return VerifyModel(gpt_layer_specs(size), lm_loss, microbatch)


def run_config(config: dict[str, Any], pipelines: int,
               global_microbatches: int | None) -> tuple[dict[str, Any], TrainingConfig]:
    """A verify run's DeepSpeed config (with ``global_microbatches``: the first pipeline's share as its gradient
    accumulation steps, each worker taking its own: :meth:`WorkerSpec.worker_config`) and the reference's
    training config."""
    if global_microbatches is not None:
        if global_microbatches < pipelines:
            raise ValueError(f"a global batch of {global_microbatches} microbatches cannot feed {pipelines} pipelines")
        config = {**config, "gradient_accumulation_steps": microbatch_shares(global_microbatches, pipelines)[0]}
        config.pop("train_batch_size", None)
    return config, load_config(config, pipelines=pipelines, global_microbatches=global_microbatches)


def run_worker(spec: WorkerSpec) -> dict[str, Any]:
    """Train as node (spec.stage, spec.pipeline); returns the report also written to disk."""
    exact_mode()
    config = load_config(spec.worker_config(), pipelines=spec.layout.pipelines,
                         global_microbatches=spec.global_microbatches)
    store = TCPStore(spec.store_host, spec.store_port, is_master=False, timeout=_seconds(spec.timeouts.build))
    model = spec.program(config.micro_batch_size)
    engine = initialize(
        list(model.layers), spec.worker_config(), spec.redundancy, loss_fn=model.loss_fn,
        stages=spec.layout.stages, rank=spec.layout.rank(spec.stage, spec.pipeline), world_size=spec.layout.world,
        store=store, seed=spec.seed, job=spec.job, timeouts=spec.timeouts,
        notices=StoreFailureNotices(store, spec.job) if spec.redundancy != "none" else None,
        stage_bounds=spec.stage_bounds,
        hook=FaultInjector.for_node(spec.stage, spec.pipeline, spec.kills, spec.notice_points),
        microbatch=model.microbatch,
        device=resolve_device(spec.device, local_rank=spec.layout.rank(spec.stage, spec.pipeline)),
        global_microbatches=spec.global_microbatches,
        schedule_costs=None if spec.schedule_costs is None else Costs.from_dict(spec.schedule_costs),
    )
    executor = engine.executor
    first, count = config.share(spec.pipeline, spec.layout.pipelines)
    data = (model.microbatch(step, first + k) for step in itertools.count() for k in range(count))
    started = time.perf_counter()
    consecutive: str | None = None
    left = False
    try:
        for _ in range(spec.steps):
            engine.train_batch(data)
        engine.finish()
    except ConsecutiveFailure as failure:
        consecutive = str(failure)
        executor.apply_replica_updates()
        executor.leave_together()
    except HandedOver:
        left = True
    report = {
        "stage": spec.stage,
        "pipeline": spec.pipeline,
        "hosted": [] if left else list(executor.hosted),
        "slices": {} if left else {s: [{name: tensor.detach().cpu() for name, tensor in layer.state_dict().items()}
                                       for layer in p.layers] for s, p in executor.slices.items()},
        "loss_scales": {} if left else {s: None if p.loss_scale is None else p.loss_scale.to_dict()
                                        for s, p in executor.slices.items()},
        "replica_stage": None if left else executor.replica_stage,
        "left": left,
        "withdrew": executor.handover_step is not None and not left,
        "handovers": executor.handovers,
        "losses": executor.losses,
        "steps_done": executor.step,
        "stash_peak_bytes": executor.stash.peak_bytes,
        "memory": {"device": str(executor.device), "device_peak_bytes": peak_memory_bytes(executor.device) or 0,
                   "stash_swapped_bytes": executor.stash.swapped_bytes_total,
                   "stash_device_peak_bytes": executor.stash.device_peak_bytes,
                   "staged_bytes": executor.interpreter.staging.staged_bytes},
        "sync_bytes": executor.sync_bytes,
        "failovers": [failover.to_dict() for failover in executor.failovers],
        "iteration_times": executor.iteration_times,
        "kind_seconds": dict(executor.kind_seconds),
        "consecutive": consecutive,
        "seconds": time.perf_counter() - started,
    }
    rank = spec.layout.rank(spec.stage, spec.pipeline)
    torch.save(report, Path(spec.out_dir) / f"rank{rank}.pt")
    if consecutive is not None:
        print(consecutive, file=sys.stderr)
    return report


def _seconds(value: float) -> Any:
    import datetime

    return datetime.timedelta(seconds=value)


def worker_main(spec: WorkerSpec) -> None:
    """Entry point of a forked worker: never returns."""
    code = 0
    try:
        report = run_worker(spec)
        if report["consecutive"] is not None:
            code = 3
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
