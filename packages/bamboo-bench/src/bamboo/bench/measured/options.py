"""What the measured experiments take: ``bamboo-bench compare``'s options and one system's run (``measure``).

Both are frozen values validated at construction, each message naming the flag and the value; the command
line (:mod:`bamboo.bench.measured.cli`) takes its defaults from them. Nothing here starts a run.
"""

from __future__ import annotations

import math
from pathlib import Path

import attrs
from bamboo.bench import timeouts
from bamboo.bench._validators import POSITIVE_INT
from bamboo.bench.value import DEFAULT_ON_DEMAND_PRICE, DEFAULT_SPOT_PRICE
from bamboo.launch.example import DEFAULT_LAYERS
from bamboo.launch.spec import AUTO_EVERY, DEFAULT_REDUNDANCY, REDUNDANCY, Every, steps_or_auto_at_least

__all__ = [
    "BAMBOO_REDUNDANCY",
    "SYSTEMS",
    "CompareError",
    "CompareOptions",
    "MeasureError",
    "MeasureOptions",
    "parse_systems",
]

SYSTEMS = ("bamboo", "checkpoint", "on-demand")
"""The systems of a comparison, in the order ``compare`` runs them."""

BAMBOO_REDUNDANCY = DEFAULT_REDUNDANCY
"""The redundancy mode of the ``bamboo`` system unless ``--redundancy`` says otherwise: bamboo-launch's own
default, ``auto`` (on-demand runs none)."""

_POSITIVE = attrs.validators.optional(attrs.validators.gt(0))
_WHOLE = attrs.validators.optional(POSITIVE_INT)


class CompareError(ValueError):
    """Bad input, or a system whose run failed; the message names the value or the run's log."""


class MeasureError(RuntimeError):
    """A run that could not be measured (it failed, or trained too few steps); the message says why."""


def parse_systems(text: str) -> tuple[str, ...]:
    """``bamboo,checkpoint,on-demand`` (any non-empty subset, any order) as a tuple in run order."""
    names = [part.strip() for part in text.split(",") if part.strip()]
    if not names:
        raise CompareError(f"--systems needs at least one of {', '.join(SYSTEMS)}, got {text!r}")
    for name in names:
        if name not in SYSTEMS:
            raise CompareError(f"unknown system {name!r} in --systems; choose from {', '.join(SYSTEMS)}")
    return tuple(name for name in SYSTEMS if name in names)


def _check_cluster(nodes: int, stages: int, pipelines: int) -> None:
    if stages < 1 or pipelines < 1:
        raise CompareError(f"--stages and --pipelines must be >= 1, got {stages} and {pipelines}")
    if nodes < stages:
        raise CompareError(f"--nodes {nodes} is too few for one pipeline of {stages} stages (--stages {stages})")
    if nodes < stages * pipelines:
        raise CompareError(f"--nodes {nodes} cannot hold {pipelines} pipelines of {stages} stages "
                           f"(needs at least {stages * pipelines})")


def _check_length(steps: int | None, duration_s: float | None) -> None:
    if (steps is None) == (duration_s is None):
        raise CompareError("give --steps S or --duration SECONDS (one of them)")
    if duration_s is not None and not math.isfinite(duration_s):
        raise CompareError(f"--duration must be a finite number of seconds, got {duration_s!r}")


@attrs.frozen
class CompareOptions:
    """What ``bamboo-bench compare`` takes (see its ``--help``). Exactly one of ``steps`` and ``duration_s``."""

    preemptions: str
    nodes: int
    stages: int
    pipelines: int
    out: Path = attrs.field(converter=Path)
    steps: int | None = attrs.field(default=None, validator=_WHOLE)
    duration_s: float | None = attrs.field(default=None, validator=_POSITIVE)
    systems: tuple[str, ...] = SYSTEMS
    time_scale: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    hours: float | None = attrs.field(default=None, validator=_POSITIVE)
    """synthetic: the trace's hours (default: the duration's trace time, or 1 h with --steps)."""
    seed: int = 0
    zones: tuple[str, ...] | None = None
    spot_price: float = attrs.field(default=DEFAULT_SPOT_PRICE, validator=attrs.validators.gt(0))
    on_demand_price: float = attrs.field(default=DEFAULT_ON_DEMAND_PRICE, validator=attrs.validators.gt(0))
    layers: int = attrs.field(default=DEFAULT_LAYERS, validator=attrs.validators.gt(0))
    script: tuple[str, ...] = ()
    timeout_s: float = attrs.field(default=timeouts.COMPARE_TIMEOUT_S, validator=attrs.validators.gt(0))
    long_run: Path | None = None
    long_run_nodes: int | None = attrs.field(default=None, validator=_WHOLE)
    redundancy: str = attrs.field(default=BAMBOO_REDUNDANCY, validator=attrs.validators.in_(REDUNDANCY))
    """The ``bamboo`` system's ``--redundancy`` (``auto`` chooses per generation)."""
    steady: bool = True
    """With ``long_run``: the full-scale step times from a fault-free measurement one core per stage
    (:mod:`bamboo.bench.measured.steady`) instead of the emulated runs' own (``--no-steady``)."""

    def __attrs_post_init__(self) -> None:
        _check_length(self.steps, self.duration_s)
        _check_cluster(self.nodes, self.stages, self.pipelines)
        if not self.systems:
            raise CompareError(f"--systems needs at least one of {', '.join(SYSTEMS)}")
        if self.script and "checkpoint" in self.systems:
            raise CompareError("the checkpoint/restart baseline trains the built-in example only: give no script, "
                               "or --systems without checkpoint")
        if self.long_run_nodes is not None and self.long_run_nodes < self.stages:
            raise CompareError(f"--long-run-nodes {self.long_run_nodes} is too few for one pipeline of "
                               f"{self.stages} stages")

    @property
    def trace_hours(self) -> float:
        """The synthetic trace's length: ``hours``, or the duration's trace time, or 1 h."""
        if self.hours is not None:
            return self.hours
        if self.duration_s is not None:
            return self.duration_s * self.time_scale / 3600.0
        return 1.0


@attrs.frozen
class MeasureOptions:
    """One measured run (see ``bamboo-bench measure --help``). Exactly one of ``steps`` and ``duration_s``."""

    system: str = attrs.field(validator=attrs.validators.in_(SYSTEMS))
    nodes: int
    stages: int
    pipelines: int
    run_dir: str
    steps: int | None = attrs.field(default=None, validator=_WHOLE)
    duration_s: float | None = attrs.field(default=None, validator=_POSITIVE)
    preemptions: str | None = None
    time_scale: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    hours: float = attrs.field(default=1.0, validator=attrs.validators.gt(0))
    trace_seed: int = 0
    zones: tuple[str, ...] | None = None
    layers: int = attrs.field(default=DEFAULT_LAYERS, validator=attrs.validators.gt(0))
    script: tuple[str, ...] = ()
    checkpoint_every: Every = attrs.field(default=AUTO_EVERY, validator=steps_or_auto_at_least(1))
    """bamboo: steps between its asynchronous checkpoints and in-memory copies, or ``auto`` (bamboo-launch's
    default: each layout's, by Young's rule; the baseline chooses its K by Young's rule too)."""
    ttl: int = attrs.field(default=timeouts.MEASURE_TTL_S, validator=attrs.validators.gt(0))
    grace_s: float = attrs.field(default=timeouts.MEASURE_GRACE_S, validator=attrs.validators.gt(0))
    timeout_s: float = attrs.field(default=timeouts.COMPARE_TIMEOUT_S, validator=attrs.validators.gt(0))
    spot_price: float = attrs.field(default=DEFAULT_SPOT_PRICE, validator=attrs.validators.gt(0))
    on_demand_price: float = attrs.field(default=DEFAULT_ON_DEMAND_PRICE, validator=attrs.validators.gt(0))
    bins: int = attrs.field(default=60, validator=attrs.validators.gt(0))
    redundancy: str = attrs.field(default=BAMBOO_REDUNDANCY, validator=attrs.validators.in_(REDUNDANCY))
    """bamboo: its ``--redundancy``; on-demand always runs none."""

    def __attrs_post_init__(self) -> None:
        _check_length(self.steps, self.duration_s)
        _check_cluster(self.nodes, self.stages, self.pipelines)
        if self.layers + 2 < self.stages and not self.script:
            raise CompareError(f"--stages {self.stages} is more than the example's {self.layers + 2} layers "
                               "(raise --layers)")
        if self.system == "checkpoint" and self.script:
            raise CompareError("the checkpoint/restart baseline trains the built-in example only; give no script, "
                               "or leave checkpoint out")

    @property
    def max_steps(self) -> int:
        """The steps to train: ``steps``, or as many as the duration allows."""
        return self.steps if self.steps is not None else 10**9
