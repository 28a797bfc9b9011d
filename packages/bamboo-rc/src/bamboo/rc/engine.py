"""The DeepSpeed-compatible front door: `bamboo.rc.initialize(...)` and `engine.train_batch(...)`.

A DeepSpeed pipeline user changes one call::

    engine = bamboo.rc.initialize(model=pipeline_module_or_layer_specs, config=ds_config, redundancy="eflb")
    loss = engine.train_batch(data_iter)

Where the process sits (its global rank, the world size, the number of stages) and the c10d store
come from keyword arguments or, like torchrun, from the environment: `RANK`, `WORLD_SIZE`,
`MASTER_ADDR`, `MASTER_PORT` and `BAMBOO_STAGES` (or the PipelineModule's `num_stages`). The store
is a client of a store hosted outside the workers (by the launcher); pass `store=` to use another
c10d store, such as bamboo-membership's etcd store.
"""

from __future__ import annotations

import datetime
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from bamboo.rc.config import load_config
from bamboo.rc.executor import REDUNDANCY_MODES, ExecutorHook, StageExecutor
from bamboo.rc.failures import FailureNotices
from bamboo.rc.layout import Layout
from bamboo.rc.timeouts import CommTimeouts
from torch.distributed import Store, TCPStore

__all__ = ["Engine", "initialize"]


class Engine:
    """One node's training engine; `train_batch` runs one step (M microbatches) of its pipeline."""

    def __init__(self, executor: StageExecutor) -> None:
        self.executor = executor

    @property
    def global_steps(self) -> int:
        return self.executor.step

    def train_batch(self, data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """Train on the next M microbatches; returns the step's mean loss over the global batch.

        Nodes that host or shadow the first or last stage read `(inputs, labels)` pairs from
        `data_iter` (M per step), as DeepSpeed's first and last stages do.
        """
        executor = self.executor
        if executor.needs_data():
            if data_iter is None:
                raise ValueError(
                    f"stage {executor.stage} hosts or shadows the first or last stage and needs a data_iter"
                )
            batches = {}
            for k in range(executor.config.micro_batches):
                tokens, labels = next(data_iter)
                batches[k] = (tokens, labels)
            executor.set_microbatches(batches)
        return torch.tensor(executor.run_iteration())

    def finish(self) -> None:
        """Complete outstanding sends and the last replica sync."""
        self.executor.finish()


def _env_int(name: str) -> int:
    value = os.environ.get(name)
    if value is None:
        raise ValueError(f"bamboo.rc.initialize needs {name} (argument or environment variable)")
    try:
        return int(value)
    except ValueError:
        raise ValueError(f"environment variable {name}={value!r} is not an integer") from None


def initialize(
    model: Any,
    config: Mapping[str, Any] | str | Path,
    redundancy: str = "eflb",
    *,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    stages: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    store: Store | None = None,
    seed: int = 0,
    job: str = "bamboo",
    timeouts: CommTimeouts | None = None,
    notices: FailureNotices | None = None,
    stage_bounds: Sequence[Sequence[int]] | None = None,
    hook: ExecutorHook | None = None,
) -> Engine:
    """Build this process's engine from a PipelineModule or a list of LayerSpecs.

    `redundancy` is one of `none`, `lflb`, `eflb`, `efeb`. The layers are cut into `stages`
    contiguous ranges, `stage_bounds` (``[(start, end), ...]``, one per stage; default
    :func:`bamboo.rc.model.stage_bounds`, bamboo-reconfig's split by parameter count), and this
    process builds exactly its stage's range and its replica's. Global rank r is stage
    `r % stages` of pipeline `r // stages`. `notices` is how the engine learns of confirmed
    failures (the launcher wires it to bamboo-membership); without it, a peer failure is fatal.
    `hook` is called around every instruction (fault injection for `verify`:
    :class:`bamboo.rc.faults.FaultInjector`). `train_batch` raises `HandedOver` on a node that
    handed its role to its shadow after a notice: that process should exit.
    """
    if redundancy not in REDUNDANCY_MODES:
        raise ValueError(f"redundancy must be one of {', '.join(REDUNDANCY_MODES)}, got {redundancy!r}")
    if hasattr(model, "_layer_specs"):
        specs: Sequence[Any] = list(model._layer_specs)
        loss_fn = loss_fn or getattr(model, "loss_fn", None)
        stages = stages or getattr(model, "num_stages", None)
    elif isinstance(model, Sequence):
        specs = list(model)
    else:
        raise TypeError(f"model must be a DeepSpeed PipelineModule or a list of LayerSpec, got {type(model).__name__}")
    if loss_fn is None:
        raise ValueError("a loss_fn is needed: pass loss_fn=, or a PipelineModule built with loss_fn")
    stages = stages or _env_int("BAMBOO_STAGES")
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    if world_size % stages:
        raise ValueError(f"WORLD_SIZE {world_size} is not a multiple of the {stages} stages")
    layout = Layout(stages, world_size // stages)
    training = load_config(config, pipelines=layout.pipelines)
    timeouts = timeouts or CommTimeouts()
    if store is None:
        host = os.environ.get("MASTER_ADDR", "127.0.0.1")
        store = TCPStore(
            host, _env_int("MASTER_PORT"), is_master=False, timeout=datetime.timedelta(seconds=timeouts.build)
        )
    stage, pipeline = layout.position(rank)
    executor = StageExecutor(
        specs, loss_fn, training, layout, stage, pipeline, store,
        redundancy=redundancy, seed=seed, job=job, timeouts=timeouts, notices=notices, stage_bounds=stage_bounds,
        hook=hook,
    )
    executor.connect()
    return Engine(executor)
