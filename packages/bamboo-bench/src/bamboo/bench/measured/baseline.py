"""The checkpoint/restart baseline's parts that start nothing: Young's rule for K, the interruptions of a
market plan, the pipelines a world can run, the spec every worker reads, and the cost of each restart.

:mod:`bamboo.bench.measured.torchrun` runs the baseline with them; :mod:`bamboo.bench.measured.baseline_worker`
is its worker.
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
from bamboo.bench import timeouts
from bamboo.bench._validators import POSITIVE_INT
from bamboo.bench.emulated.market import ActionKind, MarketAction

__all__ = [
    "SPEC_ENV",
    "BaselineSpec",
    "CheckpointInterval",
    "Interruptions",
    "RestartCost",
    "checkpoint_interval",
    "current_roles",
    "extension_build_roots",
    "init_deepspeed_gloo",
    "peak_nodes",
    "read_records",
    "remove_stale_build_locks",
    "restart_costs",
    "trace_interruptions",
    "usable_pipelines",
    "with_torch_adam",
]

SPEC_ENV = "BAMBOO_BASELINE_SPEC"
"""The environment variable naming the worker's :class:`BaselineSpec` file."""


@attrs.frozen
class CheckpointInterval:
    """Every how many steps the baseline checkpoints, and how that was chosen.

    ``rule`` is ``"young"`` (Young's rule from the measured inputs), ``"no interruptions"`` (the trace
    has none: one checkpoint per ``steps``) or ``"given"``. ``period_s`` is Young's optimal period in
    seconds, ``sqrt(2 x checkpoint_cost_s x mtbf_s)``.
    """

    steps: int = attrs.field(validator=POSITIVE_INT)
    rule: str = attrs.field(validator=attrs.validators.in_(("young", "no interruptions", "given")))
    checkpoint_cost_s: float | None = None
    mtbf_s: float | None = None
    step_time_s: float | None = None
    period_s: float | None = None

    def describe(self) -> str:
        """One line: K and how it was chosen."""
        if self.rule == "given":
            return f"K = {self.steps} steps (given)"
        cost = f"{self.checkpoint_cost_s:.3f} s" if self.checkpoint_cost_s is not None else "?"
        step = f"{self.step_time_s:.3f} s" if self.step_time_s is not None else "?"
        if self.rule == "no interruptions":
            return (f"K = {self.steps} steps: the trace has no interruption, so one checkpoint per run "
                    f"(measured checkpoint {cost}, step {step})")
        return (f"K = {self.steps} steps by Young's rule: sqrt(2 x {cost} checkpoint x {self.mtbf_s:.1f} s "
                f"between interruptions) = {self.period_s:.2f} s, / {step} per step")

    def to_dict(self) -> dict[str, Any]:
        return attrs.asdict(self)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CheckpointInterval:
        return cls(**dict(data))


def with_torch_adam(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` with DeepSpeed's Adam(W) stepped by torch's fused one (``torch_adam`` and ``fused``: the kernel
    bamboo's optimizer uses, so neither system's step is favoured): DeepSpeed's FusedAdam is a JIT-compiled op on
    CPU that takes seconds to load in every restarted worker (and about a minute to build the first time). Any
    other optimizer is left as it is."""
    out = dict(config)
    optimizer = out.get("optimizer")
    if isinstance(optimizer, dict) and str(optimizer.get("type", "")).lower() in ("adam", "adamw"):
        out["optimizer"] = {**optimizer, "params": {**optimizer.get("params", {}), "torch_adam": True,
                                                         "fused": True}}
    return out


SHM_COMM_OP = "deepspeed_shm_comm"
"""DeepSpeed's CPU op of shared-memory collectives (``ShareMemCommBuilder``), which :func:`init_deepspeed_gloo`
keeps from being built."""


def init_deepspeed_gloo() -> None:
    """``deepspeed.init_distributed(dist_backend="gloo")`` without DeepSpeed's shared-memory collectives op.

    DeepSpeed's torch backend loads that op at every ``init_distributed``, and JIT-compiles it on a machine's first
    use (47 s and 94 CPU-s on this project's 2-core machine), yet calls it only from ``inference_all_reduce``:
    training's all-reduce and the pipeline's sends go through ``torch.distributed`` either way. Marked
    incompatible, as DeepSpeed marks it on platforms without it, it is neither built nor loaded, and a fresh
    machine's first start of the baseline costs what every later one does."""
    import deepspeed

    deepspeed.ops.__compatible_ops__[SHM_COMM_OP] = False  # DeepSpeed keeps this one dict; build_shm_op reads it
    deepspeed.init_distributed(dist_backend="gloo", verbose=False)


def checkpoint_interval(checkpoint_cost_s: float, mtbf_s: float | None, step_time_s: float,
                        max_steps: int) -> CheckpointInterval:
    """K by Young's rule: ``round(sqrt(2 x checkpoint_cost_s x mtbf_s) / step_time_s)``, within ``[1, max_steps]``.

    ``mtbf_s`` is the mean time between interruptions in wall seconds (None: none expected, so ``K =
    max_steps``). Young's first-order optimum minimises the expected time lost to checkpoints plus the
    work redone after a failure (half an interval on average) when the checkpoint cost is small against
    the mean time between failures; Daly's higher-order terms change it by under 5% while the cost is below
    a tenth of it.
    """
    for name, value in (("checkpoint_cost_s", checkpoint_cost_s), ("step_time_s", step_time_s)):
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    if mtbf_s is not None and not (math.isfinite(mtbf_s) and mtbf_s > 0):
        raise ValueError(f"mtbf_s must be a finite number > 0 or None, got {mtbf_s!r}")
    if isinstance(max_steps, bool) or not isinstance(max_steps, int) or max_steps < 1:
        raise ValueError(f"max_steps must be an integer >= 1, got {max_steps!r}")
    if mtbf_s is None:
        return CheckpointInterval(steps=max_steps, rule="no interruptions", checkpoint_cost_s=checkpoint_cost_s,
                                  step_time_s=step_time_s)
    period = math.sqrt(2.0 * checkpoint_cost_s * mtbf_s)
    steps = min(max_steps, max(1, round(period / step_time_s)))
    return CheckpointInterval(steps=steps, rule="young", checkpoint_cost_s=checkpoint_cost_s, mtbf_s=mtbf_s,
                              step_time_s=step_time_s, period_s=period)


@attrs.frozen
class Interruptions:
    """The membership changes of a market plan after its start: ``kills`` and ``joins`` (additions at t > 0),
    over ``span_s`` wall seconds (the plan's last action); ``mtbf_s`` is ``span_s`` over their number (None
    when there are none)."""

    kills: int
    joins: int
    span_s: float

    @property
    def count(self) -> int:
        return self.kills + self.joins

    @property
    def mtbf_s(self) -> float | None:
        return self.span_s / self.count if self.count and self.span_s > 0 else None


def trace_interruptions(plan: Sequence[MarketAction]) -> Interruptions:
    """What interrupts a checkpoint/restart job in ``plan`` (:func:`bamboo.bench.emulated.market.plan_market`'s
    actions): every kill, and every addition after the start, since torchrun
    restarts all workers for either."""
    kills = sum(action.kind is ActionKind.KILL for action in plan)
    joins = sum(action.kind is ActionKind.ADD and action.at_s > 0 for action in plan)
    return Interruptions(kills=kills, joins=joins, span_s=max((action.at_s for action in plan), default=0.0))


def peak_nodes(plan: Sequence[MarketAction]) -> int:
    """The most nodes alive at once in ``plan`` (``MarketAction`` values, in execution order)."""
    alive = peak = 0
    for action in plan:
        if action.kind is ActionKind.ADD:
            alive += 1
            peak = max(peak, alive)
        elif action.kind is ActionKind.KILL:
            alive -= 1
    return peak


def usable_pipelines(world: int, stages: int, pipelines: int, micro_batches: int, min_pipelines: int = 1) -> int:
    """How many pipelines of ``stages`` a world of ``world`` nodes trains: the most, up to ``pipelines``, whose
    number divides the global batch of ``micro_batches x pipelines`` microbatches (so each gets the same
    share of it) and is at least ``min_pipelines``. ValueError when the world is too small."""
    for name, value in (("world", world), ("stages", stages), ("pipelines", pipelines),
                        ("micro_batches", micro_batches), ("min_pipelines", min_pipelines)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    total = micro_batches * pipelines
    for count in range(min(pipelines, world // stages), min_pipelines - 1, -1):
        if total % count == 0:
            return count
    raise ValueError(f"{world} nodes cannot train {min_pipelines} or more pipelines of {stages} stages that split "
                     f"{total} microbatches evenly")


@attrs.frozen
class BaselineSpec:
    """The job every baseline worker runs (JSON in the file named by ``BAMBOO_BASELINE_SPEC``)."""

    stages: int = attrs.field(validator=POSITIVE_INT)
    pipelines: int = attrs.field(validator=POSITIVE_INT)
    steps: int = attrs.field(validator=POSITIVE_INT)
    size: dict[str, int]
    seed: int
    config: dict[str, Any]
    run_dir: str
    events: str
    checkpoint_dir: str
    start_unix: float
    checkpoint_every: int | None = attrs.field(default=None, validator=attrs.validators.optional(POSITIVE_INT))
    mtbf_s: float | None = attrs.field(default=None, validator=attrs.validators.optional(attrs.validators.gt(0)))
    measure_steps: int = attrs.field(default=3, validator=POSITIVE_INT)
    min_pipelines: int = attrs.field(default=1, validator=POSITIVE_INT)
    idle_poll_s: float = attrs.field(default=timeouts.BASELINE_IDLE_POLL_S, validator=attrs.validators.gt(0))

    def to_json(self) -> str:
        return json.dumps(attrs.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> BaselineSpec:
        return cls(**json.loads(text))


@attrs.frozen
class RestartCost:
    """What one restart cost: from its interruption (a kill or an addition) at ``at_unix`` to the restarted
    workers' first step.

    The stamps are the restarted global rank 0's: its process start (the agents noticed, stopped their
    workers and formed a new rendezvous), imports done, process group formed, engine built, checkpoint
    loaded (``load_s`` of it), and its first step's start and end. ``redone_steps`` were trained again.
    """

    cause: str
    node: str
    at_unix: float
    process_start_unix: float
    imported_unix: float
    group_unix: float
    engine_unix: float
    loaded_unix: float
    load_s: float
    loaded_step: int
    redone_steps: int
    first_step_start_unix: float
    first_step_end_unix: float
    world: int
    pipelines: int
    absorbed: tuple[str, ...] = ()
    """Other interruptions (``"kill node3"``, ``"join node7"``) that this same restart took in."""

    @property
    def to_first_step_s(self) -> float:
        """From the interruption to the start of the first step after the restart."""
        return self.first_step_start_unix - self.at_unix

    @property
    def to_step_end_s(self) -> float:
        """From the interruption to the end of the first step after the restart (the pause)."""
        return self.first_step_end_unix - self.at_unix

    def phases(self) -> dict[str, float]:
        """Seconds of each phase: reaction and rendezvous, imports, group, engine, load, first step."""
        return {"rendezvous": self.process_start_unix - self.at_unix,
                "imports": self.imported_unix - self.process_start_unix,
                "group": self.group_unix - self.imported_unix,
                "engine": self.engine_unix - self.group_unix,
                "load": self.loaded_unix - self.engine_unix,
                "first step": self.first_step_end_unix - self.first_step_start_unix}

    def to_dict(self) -> dict[str, Any]:
        return {**attrs.asdict(self), "to_first_step_s": self.to_first_step_s, "to_step_end_s": self.to_step_end_s}


def extension_build_roots() -> list[Path]:
    """Where torch builds C++ extensions: ``TORCH_EXTENSIONS_DIR`` when set, and torch's default cache."""
    roots = [Path(os.environ["TORCH_EXTENSIONS_DIR"])] if os.environ.get("TORCH_EXTENSIONS_DIR") else []
    return [*roots, Path.home() / ".cache" / "torch_extensions"]


def remove_stale_build_locks(roots: Sequence[Path], older_than_s: float = timeouts.BASELINE_BUILD_LOCK_STALE_S,
                             now: float | None = None) -> list[Path]:
    """Remove every extension build ``lock`` under ``roots`` (``<root>/<python>/<extension>/lock``) last
    touched more than ``older_than_s`` ago, a lock a killed build left behind: torch's build waits on it
    forever, and with it every baseline worker. Returns the locks removed."""
    now = time.time() if now is None else now
    removed = []
    for root in roots:
        for lock in sorted(root.glob("*/*/lock")):
            try:
                if now - lock.stat().st_mtime > older_than_s:
                    lock.unlink()
                    removed.append(lock)
            except FileNotFoundError:  # the build that held it ended meanwhile
                continue
    return removed


def read_records(path: Path) -> list[dict[str, Any]]:
    """The JSON objects of a JSON-lines file the workers append to (none when it does not exist yet)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def current_roles(base: str | os.PathLike[str]) -> dict[str, tuple[int, int]]:
    """Node -> ``(stage, pipeline)`` in the newest world that trained a step, from the files the workers
    append to ``RUN_DIR/baseline`` (``roles.jsonl``, ``starts.jsonl``); empty before the first step."""
    folder = Path(base)
    starts = read_records(folder / "starts.jsonl")
    if not starts:
        return {}
    world = max(starts, key=lambda start: start["process_start_unix"])["world_id"]
    return {role["node"]: (role["stage"], role["pipeline"]) for role in read_records(folder / "roles.jsonl")
            if role["world_id"] == world}


def restart_costs(interruptions: Sequence[tuple[str, str, float]], starts: Sequence[dict[str, Any]]) -> list[RestartCost]:
    """One cost per restart of global rank 0 that reached a step after an interruption.

    A restart follows the interruptions since the previous start; its cost is counted from the first kill
    among them (a kill always restarts the workers), else from the first addition (an addition restarts
    them only while fewer than ``P x D`` nodes train). The others are listed in ``absorbed``.
    """
    costs = []
    ordered = sorted(starts, key=lambda s: s["process_start_unix"])
    previous = -math.inf
    for start in ordered:
        since = [change for change in interruptions if previous < change[2] < start["process_start_unix"]]
        previous = start["process_start_unix"]
        if not since:
            continue
        kills = [change for change in since if change[0] == "kill"]
        cause, node, at = min(kills or since, key=lambda change: change[2])
        costs.append(RestartCost(
            cause=cause, node=node, at_unix=at, process_start_unix=start["process_start_unix"],
            imported_unix=start["imported_unix"], group_unix=start["group_unix"], engine_unix=start["engine_unix"],
            loaded_unix=start["loaded_unix"], load_s=start["load_s"], loaded_step=start["loaded_step"],
            redone_steps=start["redone_steps"], first_step_start_unix=start["first_step_start_unix"],
            first_step_end_unix=start["first_step_end_unix"], world=start["world"], pipelines=start["pipelines"],
            absorbed=tuple(f"{c} {n}" for c, n, a in since if (c, n, a) != (cause, node, at))))
    return costs
