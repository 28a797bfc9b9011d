"""Your own training script under ``bamboo-launch run ... -- SCRIPT [ARGS]``.

A script describes its model, loss and data, and calls :func:`train_worker` once::

    from deepspeed.pipe import LayerSpec
    import bamboo.launch

    def microbatch(step: int, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        ...  # the (inputs, labels) at position `index` of the global batch of `step`

    if __name__ == "__main__":
        bamboo.launch.train_worker(layers=[LayerSpec(...), ...], loss_fn=my_loss, microbatch=microbatch,
                                   config={"train_micro_batch_size_per_gpu": 8, ...})

- ``layers``: the model as a list of DeepSpeed ``LayerSpec`` (or zero-argument callables returning a
  ``torch.nn.Module``); bamboo-rc splits it into the run's stages and builds each layer under its own
  seed, so every copy of a stage (and the ``--verify`` reference) starts bit-equal.
- ``loss_fn(outputs, labels)``: the loss of one microbatch, as DeepSpeed's ``PipelineModule(loss_fn=)``.
- ``microbatch(step, index)``: the data. It must depend on ``(step, index)`` only: the global batch of a
  step is ``index = 0 .. M*D-1`` whatever the number of pipelines D that share it, which is what
  keeps the result exact through failovers and reconfigurations (and what ``--verify`` replays).
- ``config``: a DeepSpeed config (``train_micro_batch_size_per_gpu``, ``gradient_accumulation_steps``,
  ``optimizer``, ``scheduler``, ``gradient_clipping``); default: the built-in example's.
- optional hooks (:mod:`bamboo.launch.hooks`): ``on_step(info)``, called once per step with a
  :class:`bamboo.rc.StepInfo` (step, loss, learning rate, samples/s, eval loss), and
  ``evaluate=(fn, every_n_steps)``, a forward-only pass through the pipelines over ``fn(step, index)``
  every N steps (``engine.eval_batch``), and ``on_phase(change)``, called in every worker as it enters a
  phase of its life (:mod:`bamboo.launch.worker_phases`).

The launcher runs the same command line (``python SCRIPT ARGS``) in three modes, chosen by the
environment variable ``BAMBOO_SCRIPT_MODE``; :func:`train_worker` does what the mode says and never
returns (it ends the process with ``os._exit``):

- ``describe``: once, by the agent that writes the job's spec: the layers' sizes, the config and the
  microbatches per pipeline go to the JSON file ``BAMBOO_SCRIPT_OUT`` (the first layout and the
  reconfiguration costs need them); exit 0 (this mode and ``reference`` run as one process:
  ``RANK=0``, ``WORLD_SIZE=1``);
- ``worker``: each node's agent spawns it in the node's process group as soon as it has registered,
  with ``BAMBOO_WORKER_CONTEXT`` (the agent's :class:`~bamboo.launch.spec.WorkerContext`),
  ``BAMBOO_NODE_ID`` and, as torchrun sets them, ``LOCAL_RANK`` (0) and ``LOCAL_WORLD_SIZE`` (1). ``RANK``
  and ``WORLD_SIZE`` are not set: the worker starts warm, before any layout gives it a rank, and a
  reconfiguration may move it to another rank within the same process. It runs the worker loop of
  :func:`bamboo.launch.worker.train` (failover, reconfiguration, checkpoints, event records), the same
  as the built-in example's; exit status as ``python -m bamboo.launch.worker``;
- ``reference``: for ``--verify``: a fault-free single-process run of the request in
  ``BAMBOO_SCRIPT_OUT`` (steps, per-generation pipelines, seed, config); its final layer states go to
  the file the request names; exit 0.

Outside ``bamboo-launch run`` (no ``BAMBOO_SCRIPT_MODE``), :func:`train_worker` raises ``RuntimeError``. A script
that calls ``bamboo.rc.initialize`` itself (the library's front door, for torchrun) is told by that call to call
:func:`train_worker` instead: ``initialize`` refuses to run where ``BAMBOO_SCRIPT_MODE`` is set, and
:func:`train_worker` removes the variable before the launcher's own code calls it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, NoReturn

from bamboo.launch import timeouts
from bamboo.launch.forkserver import run_to_end
from bamboo.launch.hooks import Evaluation, TrainingHooks
from bamboo.launch.spec import ENV_CONTEXT, Program

if TYPE_CHECKING:
    from bamboo.launch.json_types import JSON
    from bamboo.launch.spec import LayerInput, ModelDescription
    from bamboo.launch.worker_phases import PhaseChange
    from bamboo.rc.monitor import StepInfo
    from torch import Tensor

__all__ = [
    "ENV_MODE",
    "ENV_NODE",
    "ENV_OUT",
    "ENV_PIPELINES",
    "MODES",
    "ScriptError",
    "describe_script",
    "reference_from_script",
    "train_worker",
    "worker_environment",
]

ENV_MODE = "BAMBOO_SCRIPT_MODE"
ENV_OUT = "BAMBOO_SCRIPT_OUT"
ENV_NODE = "BAMBOO_NODE_ID"
ENV_PIPELINES = "BAMBOO_SCRIPT_PIPELINES"
"""``describe`` mode: the number of pipelines the microbatches per pipeline are counted for."""
MODES = ("describe", "worker", "reference")

ENTRY_POINT = "bamboo.launch.train_worker"


class ScriptError(RuntimeError):
    """A user script could not be described or replayed; the message names the script and its log."""


def worker_environment(*, context_path: str | Path, node: str) -> dict[str, str]:
    """The variables an agent adds to its environment for a script worker (see the module docstring).

    A worker is spawned warm, before any layout gives it a rank, and a reconfiguration may move it to
    another rank in the same process: ``RANK`` and ``WORLD_SIZE`` are therefore not set (the engine knows
    its rank). ``LOCAL_RANK`` and ``LOCAL_WORLD_SIZE`` are, as torchrun sets them: one worker per machine.
    """
    return {
        ENV_MODE: "worker",
        ENV_CONTEXT: str(context_path),
        ENV_NODE: node,
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }


def train_worker(
    layers: Sequence[LayerInput],
    loss_fn: Callable[[Tensor, Tensor], Tensor],
    microbatch: Callable[[int, int], tuple[Tensor, Tensor]],
    *,
    config: Mapping[str, JSON] | None = None,
    on_step: Callable[[StepInfo], object] | None = None,
    evaluate: tuple[Callable[[int, int], tuple[Tensor, Tensor]], int] | Evaluation | None = None,
    on_phase: Callable[[PhaseChange], object] | None = None,
) -> NoReturn:
    """The entry point of a training script: describe, train or replay, as the launcher asks; never returns.

    ``on_step(info)`` is called once per step with a :class:`bamboo.rc.StepInfo` (step, loss, learning rate,
    samples/s, and the evaluation's loss when one ran); ``evaluate=(fn, every_n_steps)`` runs a forward-only
    pass through the pipelines over ``fn(step, index)`` after every ``every_n_steps``-th step (see
    :mod:`bamboo.launch.hooks`); ``on_phase(change)`` is called in every worker each time it enters a phase of
    its life (:class:`bamboo.launch.worker_phases.PhaseChange`: warm, attempt, training, barrier, standby, ...).
    None of them runs in the ``describe`` and ``reference`` modes.
    """
    mode = os.environ.get(ENV_MODE)
    if mode is None:
        raise RuntimeError(f"{ENTRY_POINT} runs under `bamboo-launch run ... -- SCRIPT` ({ENV_MODE} is not set)")
    if mode not in MODES:
        raise RuntimeError(f"{ENV_MODE} must be one of {', '.join(MODES)}, got {mode!r}")
    # From here on the launcher's own code runs: bamboo.rc.initialize refuses to run where the variable is set,
    # which is how a script that calls it instead of this entry point is told so.
    del os.environ[ENV_MODE]
    if mode == "worker":
        from bamboo.launch.worker import run_worker

        run_worker(Program(layers=layers, loss_fn=loss_fn, microbatch=microbatch, config=config),
                   TrainingHooks(on_step=on_step, evaluate=evaluate, on_phase=on_phase))
    code = 1
    try:
        program = Program(layers=layers, loss_fn=loss_fn, microbatch=microbatch, config=config)
        TrainingHooks(on_step=on_step, evaluate=evaluate, on_phase=on_phase)  # a bad hook fails here, before any worker starts
        if mode == "describe":
            _describe(program, Path(_required(ENV_OUT)), int(_required(ENV_PIPELINES)))
        else:
            _reference(program, Path(_required(ENV_OUT)))
        code = 0
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)  # never gloo's destructors, which can block on a dead peer


def _required(name: str) -> str:
    value = os.environ.get(name)
    if not value:
        raise RuntimeError(f"{ENTRY_POINT}: the launcher did not set {name}")
    return value


def _describe(program: Program, out: Path, pipelines: int) -> None:
    from bamboo.launch.example import describe_program

    _write_atomic(out, json.dumps(describe_program(program, pipelines)))


def _reference(program: Program, request_path: Path) -> None:
    import torch
    from bamboo.launch.reference import train_reference_program
    from bamboo.rc.worker import exact_mode

    request = json.loads(request_path.read_text())
    exact_mode()
    states = train_reference_program(program.layers, program.loss_fn, program.microbatch, request["config"],
                                     int(request["seed"]), request["history"], int(request["steps"]),
                                     pipelines=request.get("pipelines"))
    out = Path(request["out"])
    torch.save(states, out.with_suffix(".tmp"))
    os.replace(out.with_suffix(".tmp"), out)


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".tmp")
    partial.write_text(text)
    os.replace(partial, path)


def _run_mode(script: Sequence[str], mode: str, out: Path, log: Path, timeout_s: float, what: str,
              extra: Mapping[str, str] | None = None) -> None:
    """Run ``python SCRIPT ARGS`` in ``mode``; ScriptError naming the status and the log if it fails."""
    env = {**os.environ, **(extra or {}), ENV_MODE: mode, ENV_OUT: str(out), "PYTHONWARNINGS": "ignore",
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           # one process: a script that reads torchrun's variables at import time still runs
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for name in (ENV_CONTEXT, ENV_NODE):
        env.pop(name, None)
    command = [sys.executable, *script]
    with open(log, "wb") as sink:
        try:
            status = run_to_end(command, env=env, stdout=sink, timeout_s=timeout_s)
        except subprocess.TimeoutExpired:
            raise ScriptError(f"{script[0]} did not finish {what} within {timeout_s:g} s (log: {log})") from None
    if status != 0:
        raise ScriptError(f"{script[0]} exited with status {status} {what}: {_last_line(log)} (log: {log})")


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def describe_script(script: Sequence[str], log: Path, *, pipelines: int,
                    timeout_s: float = timeouts.SCRIPT_DESCRIBE_TIMEOUT_S) -> ModelDescription:
    """Run the script in ``describe`` mode: ``{"layers", "config", "micro_batches"}`` (its layers' costs for
    the planner, its DeepSpeed config, and its microbatches per pipeline at ``pipelines`` pipelines).
    ScriptError if it fails, or exits without calling :func:`train_worker`."""
    out = log.with_suffix(".json")
    out.unlink(missing_ok=True)
    _run_mode(script, "describe", out, log, timeout_s, "while its model was read",
              {ENV_PIPELINES: str(pipelines)})
    if not out.exists():
        raise ScriptError(f"{script[0]} exited without calling {ENTRY_POINT}(layers=..., loss_fn=..., "
                          f"microbatch=...) (log: {log})")
    return json.loads(out.read_text())


def reference_from_script(
    script: Sequence[str], *, config: Mapping[str, JSON], seed: int, history: Sequence[Sequence[int]], steps: int,
    work_dir: Path, timeout_s: float = timeouts.SCRIPT_REFERENCE_TIMEOUT_S, pipelines: int | None = None,
) -> list[dict[str, Tensor]]:
    """Run the script in ``reference`` mode: the layer states of a fault-free single-process run (``pipelines``:
    the job's own, which fixes the global batch; see :func:`bamboo.launch.reference.train_reference_program`)."""
    import torch

    request = work_dir / "reference-request.json"
    out = work_dir / "reference.pt"
    out.unlink(missing_ok=True)
    _write_atomic(request, json.dumps({"config": dict(config), "seed": seed, "steps": steps, "pipelines": pipelines,
                                       "history": [list(map(int, h)) for h in history], "out": str(out)}))
    log = work_dir / "reference.log"
    _run_mode(script, "reference", request, log, timeout_s, "while it trained the --verify reference")
    if not out.exists():
        raise ScriptError(f"{script[0]} exited without calling {ENTRY_POINT} (log: {log})")
    return list(torch.load(out, weights_only=False))
