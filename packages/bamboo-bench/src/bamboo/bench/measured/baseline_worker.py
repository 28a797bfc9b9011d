"""The worker of the checkpoint/restart baseline: DeepSpeed's ``PipelineEngine`` under a torchrun elastic agent.

``python -m bamboo.bench.measured.baseline_worker`` is what each node's ``torch.distributed.run`` agent starts
(:func:`bamboo.bench.measured.torchrun.run_checkpoint_restart` composes them). It reads its job from the JSON
file named by ``BAMBOO_BASELINE_SPEC`` (a :class:`bamboo.bench.measured.baseline.BaselineSpec`) and torchrun's
``RANK`` / ``WORLD_SIZE`` / ``MASTER_ADDR`` / ``MASTER_PORT``, then:

1. picks the pipelines this world can run (:func:`bamboo.bench.measured.baseline.usable_pipelines`): ``D'``
   pipelines of ``P`` stages, with ``M * D / D'`` microbatches each, so the global batch never changes.
   Ranks beyond ``P * D'`` have no role; they wait, idle, for the job's end or for the next restart;
2. builds the built-in example's GPT (``gpt_layer_specs``) as a DeepSpeed ``PipelineModule`` cut with
   ``partition_method="parameters"`` (it must give bamboo's stage bounds, ``bamboo.rc.model.stage_bounds``;
   the worker refuses to train otherwise), the example's DeepSpeed config (with ``torch_adam``: torch's
   AdamW, the same math as DeepSpeed's FusedAdam, which on CPU is a JIT-compiled op that each restarted
   worker would spend seconds loading), ``deepspeed.init_distributed("gloo")`` (without the op that only
   inference uses: :func:`bamboo.bench.measured.baseline.init_deepspeed_gloo`);
3. loads the newest committed DeepSpeed checkpoint, if any (``load_checkpoint``), and trains from its
   step: pipeline ``d`` of ``D'`` takes the global microbatches ``d*M' .. d*M'+M'-1`` of each step,
   from the example's ``microbatch(step, index)``, which is the data order bamboo trains on;
4. saves a DeepSpeed checkpoint every ``K`` steps (``save_checkpoint`` without DeepSpeed's own
   ``latest``; after a barrier, global rank 0 writes ``latest`` atomically, so a node killed while it
   saves never leaves ``latest`` naming a partial checkpoint). On the job's first start, ``K`` is
   chosen after a measured checkpoint (see :func:`bamboo.bench.measured.baseline.checkpoint_interval`) and
   kept in ``RUN_DIR/baseline/interval.json`` for every later restart.

Global rank 0 appends the records of the event log (``step``, ``checkpoint``, ``restore``) and one line per
start to ``RUN_DIR/baseline/starts.jsonl`` (when the process started, its imports, its process group, its
engine, the checkpoint load, its first step), which is how the launcher measures a restart's cost. Every
training rank appends its role (node, rank, stage, pipeline, and the world's store address, new in every
rendezvous round) to ``RUN_DIR/baseline/roles.jsonl``.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bamboo.bench.measured.baseline import BaselineSpec

PROCESS_STARTED_UNIX = time.time()

__all__ = ["SetupError", "main"]


class SetupError(Exception):
    """A mistake that a restart cannot mend (a bad config, a model DeepSpeed cuts differently): the worker
    writes it to ``RUN_DIR/baseline/error-<rank>.txt``, and the launcher stops the run with it."""


def _write_json_atomically(path: Path, value: dict[str, Any]) -> None:
    partial = path.with_name(path.name + f".tmp{os.getpid()}")
    partial.write_text(json.dumps(value))
    os.replace(partial, path)


def _append_line(path: Path, value: dict[str, Any]) -> None:
    data = (json.dumps(value) + "\n").encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        os.write(fd, data)
    finally:
        os.close(fd)


def _idle(spec: BaselineSpec, rank: int, world: int, training: int) -> int:
    """A rank with no role in this world: wait for the job's end (or for the agent's next restart)."""
    print(f"baseline worker rank {rank}: idle ({world} nodes, {training} of them train)", flush=True)
    done = Path(spec.run_dir) / "baseline" / "done"
    while not done.exists():
        time.sleep(spec.idle_poll_s)
    return 0


def _folder_bytes(path: Path) -> int:
    return sum(item.stat().st_size for item in path.rglob("*") if item.is_file())


def _redone_steps(events: Path, loaded_step: int) -> int:
    """Steps already in the event log at or after ``loaded_step``: they are trained again."""
    from bamboo.launch.events import Step, read_events

    done = [event.step for event in read_events(events) if isinstance(event, Step)]
    return max(0, max(done, default=0) - loaded_step)


def train(spec: BaselineSpec) -> int:
    """Run this rank's part of the job (see the module docstring); the exit status."""
    from bamboo.bench.measured.baseline import (
        checkpoint_interval,
        init_deepspeed_gloo,
        usable_pipelines,
        with_torch_adam,
    )
    from bamboo.launch.events import Checkpoint, EventLog, Restore, Step
    from bamboo.launch.example import example_program

    rank = int(os.environ["RANK"])
    world = int(os.environ["WORLD_SIZE"])
    micro_batches = int(spec.config["gradient_accumulation_steps"])
    pipelines = usable_pipelines(world, spec.stages, spec.pipelines, micro_batches, spec.min_pipelines)
    training = pipelines * spec.stages
    if rank >= training:
        return _idle(spec, rank, world, training)
    os.environ["WORLD_SIZE"] = str(training)  # the highest ranks idle; rank 0 (the store's host) trains
    per_pipeline = micro_batches * spec.pipelines // pipelines

    import deepspeed
    import torch
    from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss, stage_bounds
    from deepspeed.pipe import LayerSpec, PipelineModule

    imported = time.time()
    torch.set_num_threads(1)  # as bamboo's workers: one intra-op thread per node
    init_deepspeed_gloo()  # without the shared-memory op that only inference uses
    grouped = time.time()
    program = example_program(spec.size, spec.config, spec.seed)
    specs = gpt_layer_specs(GPTSize(**spec.size), LayerSpec)  # DeepSpeed's PipelineModule wants its own
    torch.manual_seed(spec.seed)  # every start of a stage builds the same initial weights
    module = PipelineModule(layers=specs, num_stages=spec.stages, loss_fn=lm_loss, partition_method="parameters")
    bounds = [list(pair) for pair in stage_bounds(specs, spec.stages)]
    parts = [int(part) for part in module.parts]
    if [[parts[i], parts[i + 1]] for i in range(spec.stages)] != bounds:
        raise SetupError(f"DeepSpeed cut the layers at {parts}, bamboo at {bounds}")
    config = {**spec.config, "gradient_accumulation_steps": per_pipeline, "steps_per_print": 10**9,
              "wall_clock_breakdown": False}
    config.pop("train_batch_size", None)
    config = with_torch_adam(config)
    engine, *_ = deepspeed.initialize(model=module, config=config, model_parameters=module.parameters())
    built = time.time()
    stage, pipeline = engine.stage_id, engine.grid.data_parallel_id
    checkpoints = Path(spec.checkpoint_dir)
    base = Path(spec.run_dir) / "baseline"
    log = EventLog(spec.events, clock=time.time, start=spec.start_unix)
    lead = rank == 0
    loaded_step, load_s, path = 0, 0.0, "none: no checkpoint yet, the initial weights"
    if (checkpoints / "latest").exists():
        started = time.perf_counter()
        loaded_path, _ = engine.load_checkpoint(str(checkpoints), load_optimizer_states=True,
                                                load_lr_scheduler_states=True)
        load_s = time.perf_counter() - started
        if loaded_path is None:
            raise RuntimeError(f"DeepSpeed could not load the checkpoint named by {checkpoints / 'latest'}")
        loaded_step, path = int(engine.global_steps), str(loaded_path)
    redone = _redone_steps(Path(spec.events), loaded_step) if lead else 0
    if lead and (loaded_step or redone):  # a restart: every stage's state was discarded
        log.write(Restore(t=log.now(), step=loaded_step, path=path,
                          lost_stages=",".join(str(s) for s in range(spec.stages)), discarded_steps=redone))
    loaded = time.time()
    world_id = f"{os.environ.get('MASTER_ADDR', '')}:{os.environ.get('MASTER_PORT', '')}"  # new every round
    _append_line(base / "roles.jsonl", {"node": os.environ.get("BAMBOO_NODE_ID", ""), "rank": rank, "stage": stage,
                                        "pipeline": pipeline, "world_id": world_id})
    print(f"baseline worker rank {rank}: stage {stage} of pipeline {pipeline} of {pipelines} "
          f"({per_pipeline} microbatches each), from step {loaded_step}", flush=True)

    interval_file = base / "interval.json"
    every = spec.checkpoint_every
    if every is None and interval_file.exists():
        every = int(json.loads(interval_file.read_text())["steps"])
    samples = int(spec.config["train_micro_batch_size_per_gpu"]) * micro_batches * spec.pipelines
    step_times: list[float] = []
    start_record: dict[str, Any] = {
        "rank": rank, "node": os.environ.get("BAMBOO_NODE_ID", ""), "world": world, "pipelines": pipelines,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "process_start_unix": PROCESS_STARTED_UNIX, "imported_unix": imported, "group_unix": grouped,
        "engine_unix": built, "loaded_unix": loaded, "load_s": load_s, "loaded_step": loaded_step,
        "redone_steps": redone, "world_id": world_id,
    }

    def save() -> float:
        step = int(engine.global_steps)
        started = time.perf_counter()
        tag = f"global_step{step}"
        engine.save_checkpoint(str(checkpoints), tag=tag, save_latest=False)
        torch.distributed.barrier()  # every rank's files are written before `latest` names them
        if lead:
            latest = checkpoints / "latest"
            partial = checkpoints / "latest.tmp"
            partial.write_text(tag)
            os.replace(partial, latest)
        seconds = time.perf_counter() - started
        if lead:
            log.write(Checkpoint(t=log.now(), step=step, path=str(checkpoints / tag),
                                 bytes=_folder_bytes(checkpoints / tag), duration_s=seconds))
        return seconds

    while engine.global_steps < spec.steps:
        step = int(engine.global_steps)
        batch = [program.microbatch(step, pipeline * per_pipeline + k) for k in range(per_pipeline)]
        step_started = time.time()
        loss = float(engine.train_batch(data_iter=iter(batch)))
        duration = time.time() - step_started
        step_times.append(duration)
        if lead:
            log.write(Step(t=log.now(), step=int(engine.global_steps), samples=samples, loss=loss,
                           nodes_active=training, duration_s=duration))
            if "first_step_end_unix" not in start_record:
                start_record.update(first_step_start_unix=step_started, first_step_end_unix=time.time(),
                                    first_step=int(engine.global_steps))
                _append_line(base / "starts.jsonl", start_record)
        done = int(engine.global_steps)
        if every is None and len(step_times) >= spec.measure_steps and done < spec.steps:
            # The job's first start: measure a step and a checkpoint, then choose K once for the whole job.
            cost = save()
            measured = torch.tensor([sorted(step_times[1:])[len(step_times[1:]) // 2], cost], dtype=torch.float64)
            torch.distributed.all_reduce(measured, op=torch.distributed.ReduceOp.MAX)
            interval = checkpoint_interval(float(measured[1]), spec.mtbf_s, float(measured[0]), spec.steps)
            every = interval.steps
            if lead:
                _write_json_atomically(interval_file, interval.to_dict())
                print(f"baseline: {interval.describe()}", flush=True)
        elif every is not None and done % every == 0 and done < spec.steps:
            save()
    if lead:
        (base / "done").write_text(str(int(engine.global_steps)))
    log.close()
    torch.distributed.barrier()
    return 0


def _die_with_parent() -> None:
    """Ask Linux to SIGKILL this worker when its agent dies (``PR_SET_PDEATHSIG``): a machine lost takes both."""
    import ctypes
    import signal

    agent = os.getppid()
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, int(signal.SIGKILL))  # 1: PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != agent:  # the agent died before the request took effect
        os._exit(1)


def main() -> int:
    from bamboo.bench.measured.baseline import SPEC_ENV, BaselineSpec

    _die_with_parent()

    spec = BaselineSpec.from_json(Path(os.environ[SPEC_ENV]).read_text())
    try:
        code = train(spec)
    except (RuntimeError, OSError, TimeoutError):
        raise  # a peer died or the group broke: torchrun restarts the workers
    except BaseException as error:  # anything else is a bug or bad input; restarting will not help
        import traceback

        error_file = Path(spec.run_dir) / "baseline" / f"error-{os.environ.get('RANK', '0')}.txt"
        error_file.write_text(f"{type(error).__name__}: {error}\n{traceback.format_exc()}")
        raise
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # gloo groups of a finished job are not torn down: nothing is left to wait for


if __name__ == "__main__":  # pragma: no cover
    main()
