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

The launcher runs the same command line (``python SCRIPT ARGS``) in three modes, chosen by the
environment variable ``BAMBOO_SCRIPT_MODE``; :func:`train_worker` does what the mode says and never
returns (it ends the process with ``os._exit``):

- ``describe``: once, before the cluster starts: the layers' sizes and the config go to the JSON file
  ``BAMBOO_SCRIPT_OUT`` (the first layout and the reconfiguration costs need them); exit 0 (this
  mode and ``reference`` run as one process: ``RANK=0``, ``WORLD_SIZE=1``);
- ``worker``: each node's agent spawns it in the node's process group, with ``BAMBOO_RUN_SPEC`` (the
  run's ``RUN.json``), ``BAMBOO_NODE_ID``, ``BAMBOO_AGENT`` (the agent's gRPC address) and, as torchrun
  sets them, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` (0) and ``LOCAL_WORLD_SIZE`` (1) of the layout it was
  spawned for (a reconfiguration may move the node to another rank within the same process): the
  worker loop of :func:`bamboo.launch.worker.train` (failover, reconfiguration, checkpoints, event
  records), the same as the built-in example's; exit status as ``python -m bamboo.launch.worker``;
- ``reference``: for ``--verify``: a fault-free single-process run of the request in
  ``BAMBOO_SCRIPT_OUT`` (steps, per-generation pipelines, seed, config); its final layer states go to
  the file the request names; exit 0.

Outside ``bamboo-launch run`` (no ``BAMBOO_SCRIPT_MODE``), :func:`train_worker` raises ``RuntimeError``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs

__all__ = [
    "ENV_AGENT",
    "ENV_ENTRY_MARK",
    "ENV_MODE",
    "ENV_NODE",
    "ENV_OUT",
    "ENV_SPEC",
    "MODES",
    "ModuleFactory",
    "Program",
    "ScriptDescription",
    "ScriptError",
    "describe_script",
    "program_layer_costs",
    "reference_from_script",
    "train_worker",
    "worker_environment",
]

ENV_MODE = "BAMBOO_SCRIPT_MODE"
ENV_OUT = "BAMBOO_SCRIPT_OUT"
ENV_SPEC = "BAMBOO_RUN_SPEC"
ENV_NODE = "BAMBOO_NODE_ID"
ENV_AGENT = "BAMBOO_AGENT"
ENV_ENTRY_MARK = "BAMBOO_ENTRY_MARK"
"""A file the entry point creates as it starts: the agent tells "the script never called it" by its absence."""
MODES = ("describe", "worker", "reference")

ENTRY_POINT = "bamboo.launch.train_worker"


class ScriptError(RuntimeError):
    """A user script could not be described or replayed; the message names the script and its log."""


class ModuleFactory:
    """A zero-argument callable that returns a module, seen through DeepSpeed ``LayerSpec``'s ``build()``."""

    def __init__(self, factory: Callable[[], Any]) -> None:
        self.factory = factory

    def build(self) -> Any:
        return self.factory()

    def __repr__(self) -> str:
        return f"ModuleFactory({self.factory!r})"


def _as_layers(value: Sequence[Any]) -> tuple[Any, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"layers must be a list of LayerSpec or module factories, got {type(value).__name__}")
    from torch import nn

    layers = []
    for index, layer in enumerate(value):
        if callable(getattr(layer, "build", None)):
            layers.append(layer)
        elif callable(layer) and not isinstance(layer, nn.Module):
            layers.append(ModuleFactory(layer))
        else:
            raise TypeError(f"layer {index} is a {type(layer).__name__}: give a DeepSpeed LayerSpec or a "
                            "zero-argument callable that returns a torch.nn.Module (not a built module)")
    if not layers:
        raise ValueError("layers is empty: the model needs at least one layer per stage")
    return tuple(layers)


def _callable(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not callable(value):
        raise TypeError(f"{attribute.name} must be callable, got {type(value).__name__}")


def _as_config(value: Mapping[str, Any] | None) -> dict[str, Any] | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"config must be a DeepSpeed config dict, got {type(value).__name__}")
    return json.loads(json.dumps(dict(value)))  # a plain JSON value: it travels in RUN.json


@attrs.frozen
class Program:
    """What a training script gives the launcher: its model, loss, data and DeepSpeed config."""

    layers: tuple[Any, ...] = attrs.field(converter=_as_layers)
    loss_fn: Callable[[Any, Any], Any] = attrs.field(validator=_callable)
    microbatch: Callable[[int, int], tuple[Any, Any]] = attrs.field(validator=_callable)
    config: dict[str, Any] | None = attrs.field(default=None, converter=_as_config)


def program_layer_costs(layers: Sequence[Any]) -> list[Any]:
    """bamboo-reconfig's ``LayerSpec`` of each layer: fp32 parameters, Adam state, cost by parameter count."""
    from bamboo.reconfig import LayerSpec

    costs = []
    for layer in layers:
        module = layer.build()
        params = sum(p.numel() for p in module.parameters())
        costs.append(LayerSpec(param_bytes=4 * params, optimizer_bytes=8 * params, compute_cost=float(params)))
    return costs


def worker_environment(
    *, spec_path: str | Path, node: str, agent: str, rank: int, world_size: int, entry_mark: str | Path
) -> dict[str, str]:
    """The variables an agent adds to its environment for a script worker (see the module docstring)."""
    return {
        ENV_MODE: "worker",
        ENV_SPEC: str(spec_path),
        ENV_NODE: node,
        ENV_AGENT: agent,
        ENV_ENTRY_MARK: str(entry_mark),
        "RANK": str(rank),
        "WORLD_SIZE": str(world_size),
        "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }


def train_worker(
    layers: Sequence[Any],
    loss_fn: Callable[[Any, Any], Any],
    microbatch: Callable[[int, int], tuple[Any, Any]],
    *,
    config: Mapping[str, Any] | None = None,
) -> NoReturn:
    """The entry point of a training script: describe, train or replay, as the launcher asks; never returns."""
    mode = os.environ.get(ENV_MODE)
    if mode is None:
        raise RuntimeError(f"{ENTRY_POINT} runs under `bamboo-launch run ... -- SCRIPT` ({ENV_MODE} is not set)")
    if mode not in MODES:
        raise RuntimeError(f"{ENV_MODE} must be one of {', '.join(MODES)}, got {mode!r}")
    mark = os.environ.get(ENV_ENTRY_MARK)
    if mark:
        Path(mark).touch()
    code = 1
    try:
        program = Program(layers=layers, loss_fn=loss_fn, microbatch=microbatch, config=config)
        if mode == "describe":
            _describe(program, Path(_required(ENV_OUT)))
            code = 0
        elif mode == "reference":
            _reference(program, Path(_required(ENV_OUT)))
            code = 0
        else:
            from bamboo.launch.worker import STANDBY_EXIT, RunSpec, train

            spec = RunSpec.from_json(Path(_required(ENV_SPEC)).read_text())
            report = train(spec, _required(ENV_NODE), os.environ.get(ENV_AGENT) or None, program)
            code = STANDBY_EXIT if report.get("standby") else 0
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


def _describe(program: Program, out: Path) -> None:
    description = {
        "layers": [layer.to_dict() for layer in program_layer_costs(program.layers)],
        "config": program.config,
    }
    _write_atomic(out, json.dumps(description))


def _reference(program: Program, request_path: Path) -> None:
    import torch
    from bamboo.launch.run import train_reference_program
    from bamboo.rc.worker import exact_mode

    request = json.loads(request_path.read_text())
    exact_mode()
    states = train_reference_program(program.layers, program.loss_fn, program.microbatch, request["config"],
                                     int(request["seed"]), request["history"], int(request["steps"]))
    out = Path(request["out"])
    torch.save(states, out.with_suffix(".tmp"))
    os.replace(out.with_suffix(".tmp"), out)


def _write_atomic(path: Path, text: str) -> None:
    partial = path.with_suffix(path.suffix + ".tmp")
    partial.write_text(text)
    os.replace(partial, path)


@attrs.frozen
class ScriptDescription:
    """A script's model as the launcher needs it: bamboo-reconfig layer costs and its DeepSpeed config."""

    layers: tuple[Any, ...] = attrs.field(converter=tuple)
    config: dict[str, Any] | None


def _run_mode(script: Sequence[str], mode: str, out: Path, log: Path, timeout_s: float, what: str) -> None:
    """Run ``python SCRIPT ARGS`` in ``mode``; ScriptError naming the status and the log if it fails."""
    env = {**os.environ, ENV_MODE: mode, ENV_OUT: str(out), "PYTHONWARNINGS": "ignore",
           "DS_ACCELERATOR": os.environ.get("DS_ACCELERATOR", "cpu"),
           # one process: a script that reads torchrun's variables at import time still runs
           "RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    for name in (ENV_SPEC, ENV_NODE, ENV_AGENT, ENV_ENTRY_MARK):
        env.pop(name, None)
    command = [sys.executable, *script]
    with open(log, "wb") as sink:
        try:
            process = subprocess.run(command, env=env, stdout=sink, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, timeout=timeout_s, check=False)
        except subprocess.TimeoutExpired:
            raise ScriptError(f"{script[0]} did not finish {what} within {timeout_s:g} s (log: {log})") from None
    if process.returncode != 0:
        raise ScriptError(f"{script[0]} exited with status {process.returncode} {what}: {_last_line(log)} "
                          f"(log: {log})")


def _last_line(log: Path) -> str:
    lines = [line.strip() for line in log.read_text(errors="replace").splitlines() if line.strip()]
    return lines[-1] if lines else "no output"


def describe_script(script: Sequence[str], log: Path, *, timeout_s: float = 300.0) -> ScriptDescription:
    """Run the script in ``describe`` mode: its layers' costs and its config (ScriptError if it fails,
    or exits without calling :func:`train_worker`)."""
    from bamboo.reconfig import LayerSpec

    out = log.with_suffix(".json")
    out.unlink(missing_ok=True)
    _run_mode(script, "describe", out, log, timeout_s, "while the launcher read its model")
    if not out.exists():
        raise ScriptError(f"{script[0]} exited without calling {ENTRY_POINT}(layers=..., loss_fn=..., "
                          f"microbatch=...) (log: {log})")
    description = json.loads(out.read_text())
    return ScriptDescription(layers=[LayerSpec.from_dict(layer) for layer in description["layers"]],
                             config=description["config"])


def reference_from_script(
    script: Sequence[str], *, config: Mapping[str, Any], seed: int, history: Sequence[Sequence[int]], steps: int,
    work_dir: Path, timeout_s: float = 900.0,
) -> list[dict[str, Any]]:
    """Run the script in ``reference`` mode: the layer states of a fault-free single-process run."""
    import torch

    request = work_dir / "reference-request.json"
    out = work_dir / "reference.pt"
    out.unlink(missing_ok=True)
    _write_atomic(request, json.dumps({"config": dict(config), "seed": seed, "steps": steps,
                                       "history": [list(map(int, h)) for h in history], "out": str(out)}))
    log = work_dir / "reference.log"
    _run_mode(script, "reference", request, log, timeout_s, "while it trained the --verify reference")
    if not out.exists():
        raise ScriptError(f"{script[0]} exited without calling {ENTRY_POINT} (log: {log})")
    return list(torch.load(out, weights_only=False))
