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
import functools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from bamboo.rc.auto import AUTO, DEFAULT_PREEMPTIONS_PER_NODE_HOUR, choose_for_layers
from bamboo.rc.config import load_config
from bamboo.rc.data import bind_global_batch
from bamboo.rc.device import resolve_device
from bamboo.rc.executor import REDUNDANCY_MODES, ExecutorHook, StageExecutor
from bamboo.rc.failures import FailureNotices
from bamboo.rc.layout import Layout
from bamboo.rc.monitor import EVAL_LOSS, StepInfo
from bamboo.rc.timeouts import CommTimeouts
from bamboo.schedule import Costs, RedundancyChoice
from torch.distributed import Store, TCPStore

__all__ = ["Engine", "initialize"]

_log = logging.getLogger(__name__)

LAUNCHER_SCRIPT_MODE = "BAMBOO_SCRIPT_MODE"
"""Set by ``bamboo-launch run`` in the processes of a user script (bamboo-launch's ``ENV_MODE``): such a script
must call ``bamboo.launch.train_worker``, and :func:`initialize` says so."""


class Engine:
    """One node's training engine, under DeepSpeed's names: ``train_batch`` runs one step (M microbatches)
    of its pipeline, ``eval_batch`` a forward-only pass, ``save_checkpoint``/``load_checkpoint`` its stages'
    state. Every node calls each of them, in the same order, as with DeepSpeed."""

    def __init__(self, executor: StageExecutor, redundancy_choice: RedundancyChoice | None = None) -> None:
        from bamboo.rc.evaluation import ForwardOnlyPass
        from bamboo.rc.monitor import Monitors

        self.executor = executor
        self.redundancy_choice = redundancy_choice
        """With ``redundancy="auto"``: the mode chosen and every mode's estimate (``.reason`` says why)."""
        self.monitors = Monitors(executor.config.monitors)
        self.last_step: StepInfo | None = None
        """What the last ``train_batch`` did (its loss, learning rate and samples/s), on every node."""
        self.last_eval_loss: float | None = None
        """The last ``eval_batch``'s loss; None when a failure interrupted it."""
        self._forward_only = ForwardOnlyPass(executor)
        self._saves = 0
        self.build_seconds: dict[str, float] = {}
        """How long :func:`initialize` took to build this node's layers (``model``) and its first groups
        (``groups``), in seconds."""

    # ---------------------------------------------------------------------------------- DeepSpeed's views
    @property
    def global_steps(self) -> int:
        return self.executor.step

    @property
    def global_samples(self) -> int:
        """Samples trained so far: steps × the global batch."""
        return self.executor.step * self.train_batch_size()

    def train_batch_size(self) -> int:
        """The global batch in samples: micro batch size × the global batch's microbatches (M × D)."""
        config, layout = self.executor.config, self.executor.layout
        return config.micro_batch_size * config.global_count(layout.pipelines)

    def train_micro_batch_size_per_gpu(self) -> int:
        return self.executor.config.micro_batch_size

    def gradient_accumulation_steps(self) -> int:
        return self.executor.config.micro_batches

    def microbatch_share(self) -> tuple[int, int]:
        """``(first, count)``: this node's pipeline's share of every global batch, the ``count`` microbatches from
        global index ``first`` (``pipeline * M`` and ``M`` where the shares are even)."""
        executor = self.executor
        return executor.config.share(executor.pipeline, executor.layout.pipelines)

    def get_lr(self) -> list[float]:
        """The learning rate of each parameter group of this node's stage, for the next step."""
        piece = self.executor.slices[min(self.executor.hosted)]
        return [float(group["lr"]) for group in piece.optimizer.param_groups]

    def is_first_stage(self) -> bool:
        return 0 in self.executor.hosted

    def is_last_stage(self) -> bool:
        return self.executor.layout.stages - 1 in self.executor.hosted

    def reports(self) -> bool:
        """Whether this node reports the job's loss (writes the monitors): it hosts the last stage of
        pipeline 0 (after a failover, the shadow that took that stage over); with one stage (every node
        holds the whole model), the first live node. One node per job."""
        executor = self.executor
        if executor.layout.stages == 1:
            return executor.rank == min(r for r in range(executor.layout.world) if r not in executor.dead)
        return executor.pipeline == 0 and self.is_last_stage()

    # ---------------------------------------------------------------------------------- training
    def _read(self, data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]] | None, count: int,
              what: str) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        if data_iter is None:
            raise ValueError(
                f"stage {self.executor.stage} hosts or shadows the first or last stage and needs a data_iter "
                f"for {what}"
            )
        batches = {}
        for k in range(count):
            tokens, labels = next(data_iter)
            batches[k] = (tokens, labels)
        return batches

    def train_batch(self, data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """Train on the next M microbatches; returns the step's mean loss over the global batch.

        Nodes that host or shadow the first or last stage read `(inputs, labels)` pairs from
        `data_iter` (M per step), as DeepSpeed's first and last stages do. The reporting node
        (:meth:`reports`) writes the step to the config's monitors.
        """
        executor = self.executor
        if executor.needs_data():
            executor.set_microbatches(self._read(data_iter, executor.config.micro_batches, "train_batch"))
        lr = self.get_lr()[0]
        started = time.perf_counter()
        loss = executor.run_iteration()
        seconds = time.perf_counter() - started
        self.last_step = StepInfo(step=executor.step, loss=loss, lr=lr, samples=self.global_samples,
                                  samples_per_second=self.train_batch_size() / seconds if seconds > 0 else math.inf)
        if self.reports():
            self.monitors.write(self.last_step.events())
        return torch.tensor(loss)

    def eval_batch(self, data_iter: Iterator[tuple[torch.Tensor, torch.Tensor]] | None = None, *,
                   num_micro_batches: int | None = None,
                   microbatch: Callable[[int], tuple[torch.Tensor, torch.Tensor]] | None = None) -> torch.Tensor:
        """A forward-only pass through the pipeline over the next M microbatches (``num_micro_batches``
        if given) of every pipeline; returns the mean loss over those M × D microbatches on every node.

        With one stage (P = 1), a node that took over a failed node's share (after a failover, until the
        next rebuild) evaluates that share too when ``microbatch(global index) -> (inputs, labels)`` gives
        the evaluation's data by position (share d's microbatch k is ``d*M + k``); without it, that share is
        left out, the loss is the mean over the microbatches evaluated, and a warning says so.

        As DeepSpeed's ``eval_batch``: the layers run in eval mode without gradients, and nodes that run the
        first or the last stage read ``(inputs, labels)`` pairs from ``data_iter``. It changes no parameter,
        optimizer state, step counter or replica, and draws no random number the next ``train_batch``
        would see: that step is bit-identical to one without the evaluation. If a failure strikes, the
        evaluation is given up on every node (the loss is NaN, :attr:`last_eval_loss` None, and a warning
        says so) and the next ``train_batch`` handles the failure. The reporting node writes the loss to the
        monitors (``Train/Samples/eval_loss``).
        """
        executor = self.executor
        micro_batches = executor.config.micro_batches if num_micro_batches is None else num_micro_batches
        if micro_batches < 1:
            raise ValueError(f"num_micro_batches must be at least 1, got {micro_batches}")
        executor.apply_replica_updates()  # a taken-over stage runs on its replica: bring it up to date
        batches = self._read(data_iter, micro_batches, "eval_batch") if self._forward_only.needs_data() else {}
        skipped = () if microbatch is not None else self._forward_only.taken_over_shares()
        if skipped:
            _log.warning("eval_batch after step %d leaves out the taken-over share(s) %s: no microbatch= gives "
                         "their evaluation data (the loss is the mean over the other shares)",
                         executor.step, list(skipped))
        loss = self._forward_only.run(batches, micro_batches, microbatch)
        self.last_eval_loss = loss
        if loss is None:
            _log.warning("eval_batch after step %d was given up: a node failed (the next train_batch handles it)",
                         executor.step)
            return torch.tensor(math.nan)
        if self.reports():
            self.monitors.write([(EVAL_LOSS, loss, self.global_samples)])
        return torch.tensor(loss)

    # ---------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, save_dir: str | os.PathLike[str], tag: str | None = None,
                        client_state: Mapping[str, Any] | None = None, save_latest: bool = True) -> bool:
        """Save every stage's state under ``save_dir/<tag>/`` (``tag`` defaults to ``global_step<N>``, as
        DeepSpeed's) and, with ``save_latest``, write ``tag`` to ``save_dir/latest`` once every stage is saved.

        The nodes of pipeline 0 write the stages they host (``stage-<s>.pt``: the parameters, optimizer and
        scheduler state and step of :class:`~bamboo.rc.state.TrainableSlice`, its layer indices and
        ``client_state``); every node returns once every stage is on disk (True), or False with a warning
        when a node failed before it wrote its stage (``latest`` is then left as it was). ``save_dir`` must
        be a folder every node reads and writes (DeepSpeed's pipeline checkpoints ask the same).
        """
        from bamboo.rc import checkpoints

        self._saves += 1
        return checkpoints.save(self.executor, Path(save_dir), tag, client_state, save_latest, self._saves)

    def load_checkpoint(self, load_dir: str | os.PathLike[str],
                        tag: str | None = None) -> tuple[str | None, dict[str, Any] | None]:
        """Load the state of every stage this node builds (its own and its replica) from ``load_dir/<tag>/``
        (``tag`` defaults to the content of ``load_dir/latest``); training then continues bit-identically to
        the run that saved it. Returns ``(checkpoint folder, client_state)``, or ``(None, None)`` with a
        warning when there is no ``latest`` file, as DeepSpeed's. The stage bounds must be those of the run
        that saved it (the pipelines may differ)."""
        from bamboo.rc import checkpoints

        return checkpoints.load(self.executor, Path(load_dir), tag)

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
    preemptions_per_node_hour: float | None = None,
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
    microbatch: Callable[[int, int], tuple[torch.Tensor, torch.Tensor]] | None = None,
    device: str | torch.device | None = None,
    global_microbatches: int | None = None,
    schedule_costs: Costs | None = None,
) -> Engine:
    """Build this process's engine from a PipelineModule or a list of LayerSpecs.

    `model` is DeepSpeed's ``PipelineModule`` (built after ``deepspeed.init_distributed``, as DeepSpeed needs),
    :class:`bamboo.rc.PipelineModule` (the same arguments, no process group needed), or a list of LayerSpecs.
    Under ``bamboo-launch run`` (``BAMBOO_SCRIPT_MODE`` set) it raises a RuntimeError that names
    ``bamboo.launch.train_worker``, the call such scripts make instead.

    `redundancy` is one of `none`, `lflb`, `eflb` (the default), `efeb`, or `auto`: the mode expected to lose the least
    training per hour (:mod:`bamboo.rc.auto`) at `preemptions_per_node_hour` (default 0.1), which every rank
    works out alike; ``engine.redundancy_choice.reason`` says which and why. The layers are cut into `stages`
    contiguous ranges, `stage_bounds` (``[(start, end), ...]``, one per stage; default
    :func:`bamboo.rc.model.stage_bounds`, bamboo-reconfig's split by parameter count), and this
    process builds exactly its stage's range and its replica's. Global rank r is stage
    `r % stages` of pipeline `r // stages`. `notices` is how the engine learns of confirmed
    failures (the launcher wires it to bamboo-membership); without it, a peer failure is fatal.
    `hook` is called around every instruction (fault injection for `verify`:
    :class:`bamboo.rc.faults.FaultInjector`). `train_batch` raises `HandedOver` on a node that
    handed its role to its shadow after a notice: that process should exit.

    With one stage (``stages=1``: pure data parallelism) and redundancy, the shadow of a node is the next
    pipeline's node (see ``bamboo.rc.ring``), which computes the microbatches of a node that fails (lazy,
    ``lflb``) or every step (eager, ``eflb``/``efeb``): it needs ``microbatch(step, global index) ->
    (inputs, labels)``, the data as a function of its position in the global batch (pipeline d's share is
    global microbatches ``d*M .. d*M+M-1`` of every step).

    `device` is where the layers, the replica, the optimizer state and the activations live: ``"cpu"``,
    ``"cuda"``, ``"cuda:N"`` or a ``torch.device``; None reads ``BAMBOO_DEVICE``, and without it takes
    ``cuda:LOCAL_RANK`` (modulo the GPUs present) when CUDA is present, else the CPU
    (:func:`bamboo.rc.device.resolve_device`). Messages travel in host memory either way
    (:mod:`bamboo.rc.transport`).

    `global_microbatches` is the global batch in microbatches where the pipelines' shares of it differ (bamboo-launch
    after a reconfiguration to a number of pipelines that does not divide it): the config's gradient accumulation
    steps are then this pipeline's share (:meth:`bamboo.rc.config.TrainingConfig.shares`: the first ``G mod D``
    pipelines one microbatch more). With one stage, the shares must be even. `schedule_costs` (a
    :class:`bamboo.schedule.Costs`, the same on every rank) runs the placement of the redundant work searched for
    those costs; not the default (no consistent gain at P = 2 on a CPU: ``tests/benchmarks/bench_rc.py --costed``).
    """
    _check_call(redundancy)
    specs, loss_fn, stages = _unpack_model(model, loss_fn, stages)
    layout, rank = _place(stages, rank, world_size)
    place = resolve_device(device)
    training = load_config(config, pipelines=layout.pipelines, global_microbatches=global_microbatches)
    timeouts = timeouts or CommTimeouts()
    store = _store_client(timeouts) if store is None else store
    stage, pipeline = layout.position(rank)
    choice = None
    if redundancy == AUTO:
        redundancy, choice = _resolve_auto(specs, layout, training.micro_batches, stage_bounds,
                                           preemptions_per_node_hour)
    if microbatch is not None:  # a data source whose order of samples depends on the global batch (TokenFile)
        bind_global_batch(microbatch, training.global_count(layout.pipelines), training.micro_batch_size)
    build = functools.partial(
        StageExecutor, specs, loss_fn, training, layout, stage, pipeline, store,
        redundancy=redundancy, seed=seed, job=job, timeouts=timeouts, notices=notices, stage_bounds=stage_bounds,
        hook=hook, microbatch=microbatch, device=place, schedule_costs=schedule_costs,
    )
    return _timed_engine(build, choice)


def _check_call(redundancy: str) -> None:
    """Raise when :func:`initialize` cannot run here (a script under ``bamboo-launch run``) or `redundancy` is
    not a mode."""
    if os.environ.get(LAUNCHER_SCRIPT_MODE):
        raise RuntimeError(
            "bamboo.rc.initialize cannot run under `bamboo-launch run`: the launcher runs scripts that call "
            "bamboo.launch.train_worker(layers=..., loss_fn=..., microbatch=..., config=...) instead of initialize "
            "and a train_batch loop (see bamboo-launch's README); to run this script as it is, start it with "
            "torchrun: BAMBOO_STAGES=<P> torchrun --nproc_per_node <P*D> SCRIPT"
        )
    if redundancy not in (*REDUNDANCY_MODES, AUTO):
        raise ValueError(f"redundancy must be one of {', '.join((*REDUNDANCY_MODES, AUTO))}, got {redundancy!r}")


def _unpack_model(
    model: Any, loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None, stages: int | None
) -> tuple[list[Any], Callable[[torch.Tensor, torch.Tensor], torch.Tensor], int | None]:
    """The layer specs of `model` (a PipelineModule or a list of LayerSpecs), and the loss function and number of
    stages given, else the PipelineModule's; raises when there is no loss function."""
    if hasattr(model, "_layer_specs"):
        specs: list[Any] = list(model._layer_specs)
        loss_fn = loss_fn or getattr(model, "loss_fn", None)
        stages = stages or getattr(model, "num_stages", None)
    elif isinstance(model, Sequence):
        specs = list(model)
    else:
        raise TypeError(f"model must be a DeepSpeed PipelineModule or a list of LayerSpec, got {type(model).__name__}")
    if loss_fn is None:
        raise ValueError("a loss_fn is needed: pass loss_fn=, or a PipelineModule built with loss_fn")
    return specs, loss_fn, stages


def _place(stages: int | None, rank: int | None, world_size: int | None) -> tuple[Layout, int]:
    """The job's layout and this process's global rank, from the arguments given, else the environment
    (``BAMBOO_STAGES``, ``RANK``, ``WORLD_SIZE``)."""
    stages = stages or _env_int("BAMBOO_STAGES")
    rank = _env_int("RANK") if rank is None else rank
    world_size = _env_int("WORLD_SIZE") if world_size is None else world_size
    if world_size % stages:
        raise ValueError(f"WORLD_SIZE {world_size} is not a multiple of the {stages} stages")
    return Layout(stages, world_size // stages), rank


def _store_client(timeouts: CommTimeouts) -> Store:
    """A client of the store the launcher hosts at ``MASTER_ADDR`` (default 127.0.0.1) and ``MASTER_PORT``."""
    host = os.environ.get("MASTER_ADDR", "127.0.0.1")
    return TCPStore(host, _env_int("MASTER_PORT"), is_master=False, timeout=datetime.timedelta(seconds=timeouts.build))


def _timed_engine(build: Callable[[], StageExecutor], choice: RedundancyChoice | None) -> Engine:
    """Build the executor, connect its first groups, and keep how long each took in the engine's
    ``build_seconds``."""
    started = time.perf_counter()
    executor = build()
    built = time.perf_counter()
    executor.connect()
    engine = Engine(executor, choice)
    engine.build_seconds = {"model": built - started, "groups": time.perf_counter() - built}
    return engine


def _resolve_auto(
    specs: Sequence[Any], layout: Layout, micro_batches: int, bounds: Sequence[Sequence[int]] | None,
    rate: float | None,
) -> tuple[str, RedundancyChoice | None]:
    """``auto``'s mode for this job. One stage (pure data parallelism) takes the lazy ring, which does no work
    until a failure, whenever preemptions are expected and there is a second pipeline to hold the copy; the
    schedule's model covers pipelines."""
    rate = DEFAULT_PREEMPTIONS_PER_NODE_HOUR if rate is None else rate
    if layout.stages == 1:
        return ("lflb" if rate > 0 and layout.pipelines > 1 else "none"), None
    from bamboo.rc.model import stage_bounds as default_bounds

    bounds = bounds if bounds is not None else default_bounds(specs, layout.stages)
    choice = choose_for_layers(specs, bounds, micro_batches, layout.stages * layout.pipelines, rate,
                               pipelines=layout.pipelines)
    _log.info("redundancy auto: %s", choice.reason)
    return choice.mode, choice
