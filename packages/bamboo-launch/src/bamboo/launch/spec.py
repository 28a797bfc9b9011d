"""The shared types of bamboo-launch: the job's spec, what an agent tells its worker, a training program.

This module is a leaf: of ``bamboo.launch`` it imports only the leaves ``timeouts`` and ``json_types`` (an import
check in ``make test`` enforces the package's directions), so the agent, the worker, the user-script entry point
and the composition in ``bamboo-launch run`` can all share these types without importing each other.

- :class:`JobSpec`: what every node of a job must agree on (P, D, steps, the model's description, the
  checkpoint settings, the job-wide timeouts). The first agent writes it into etcd at
  ``/bamboo/<job>/spec`` (first writer wins); every later agent reads it and checks its own flags
  against it (:meth:`JobSpec.conflicts`). Versioned JSON.
- :class:`WorkerContext`: what an agent hands the worker it spawns (the node, its agent's address, how
  to reach etcd, the fence that guards the node's writes, where to write its files). Written as a JSON
  file whose path the worker gets in ``BAMBOO_WORKER_CONTEXT``.
- :class:`Program`: a training program (layers, loss, data, DeepSpeed config): the built-in example's,
  or a user script's through :func:`bamboo.launch.train_worker`; its layers are :data:`LayerInput` values.
- :class:`SpecFields` (the spec's fields an agent's flags give) and :class:`ModelDescription` (what reading a
  model gives the spec).
- Exit statuses of agents and workers.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Protocol, TypeAlias, TypedDict, TypeVar, cast

import attrs
from bamboo.launch import timeouts
from bamboo.launch.json_types import JSON, JSONObject
from bamboo.membership import timeouts as membership_timeouts
from bamboo.rc import timeouts as rc_timeouts

if TYPE_CHECKING:
    from bamboo.membership import EtcdOptions
    from bamboo.reconfig import LayerSpec
    from torch import Tensor, nn

__all__ = [
    "AGENT_DONE",
    "AGENT_JOB_FAILED",
    "AGENT_USAGE",
    "AUTO_EVERY",
    "DEFAULT_CHECKPOINT_EVERY",
    "DEFAULT_REDUNDANCY",
    "DEFAULT_STEPS",
    "ENV_CONTEXT",
    "FLAG_OF",
    "MEMORY_COPY_EVERY",
    "REDUNDANCY",
    "SPEC_VERSION",
    "WORKER_DONE",
    "WORKER_ERROR",
    "EtcdAccess",
    "Every",
    "JobSpec",
    "LayerBuilder",
    "LayerInput",
    "ModelDescription",
    "ModuleFactory",
    "Program",
    "SpecError",
    "SpecFields",
    "WorkerContext",
    "steps_or_auto",
    "steps_or_auto_at_least",
]

SPEC_VERSION = 1
Every: TypeAlias = "int | str"
"""Steps between restore points as a spec holds them: a number, or :data:`AUTO_EVERY`."""
MEMORY_COPY_EVERY = 10
"""Steps between in-memory copies of every stage in a generation whose layout names no interval (one written by
an older launcher) when ``--memory-copy-every`` is ``auto``. A copy costs CPU on every node (a clone on the
training thread, then serialising, hashing and sending it): one every step cost the emulated 6-node P = 3,
D = 2 job 29% of its throughput (55.4 against 78.5 samples/s with none), one every 10 steps, with a checkpoint at
each, 7.6% and 8.4% (the step interval after each boundary, in two fault-free 400-step runs), while the restores
they serve follow only the loss of every live copy of a stage. ``auto`` chooses the interval of each generation
instead (:mod:`bamboo.launch.restore_interval`)."""
AUTO_EVERY = "auto"
"""``--checkpoint-every`` and ``--memory-copy-every`` (the default of both): the steps between restore points
chosen for each generation when its layout is decided (:mod:`bamboo.launch.restore_interval`)."""
DEFAULT_STEPS = 20
"""A job's training steps when no ``--steps`` is given (``bamboo-launch agent`` and ``run``)."""
DEFAULT_CHECKPOINT_EVERY = 10
"""Steps between two asynchronous checkpoints in a generation whose layout names no interval, when
``--checkpoint-every`` is ``auto``."""
ENV_CONTEXT = "BAMBOO_WORKER_CONTEXT"
"""The environment variable that names a worker's :class:`WorkerContext` file."""

WORKER_DONE = 0
"""A worker that trained every step, or left because the job ended."""
WORKER_ERROR = 1
"""A worker that failed: its agent goes back to standby as a fresh node (or gives up after repeated failures)."""
AGENT_DONE = 0
"""An agent whose job ended."""
AGENT_JOB_FAILED = 1
"""An agent whose job cannot go on (the job's end record names the error), or whose worker keeps failing."""
AGENT_USAGE = 2
"""Bad input: a malformed flag, or a flag that conflicts with the job's stored spec."""


class SpecError(ValueError):
    """A spec or context that is malformed or of an unknown version; the message names the key."""


_WHOLE = attrs.validators.instance_of(int)
_POSITIVE_INT = attrs.validators.and_(_WHOLE, attrs.validators.ge(1))
_NON_NEGATIVE_INT = attrs.validators.and_(_WHOLE, attrs.validators.ge(0))
_POSITIVE_NUMBER = attrs.validators.and_(attrs.validators.instance_of((int, float)), attrs.validators.gt(0),
                                         attrs.validators.lt(math.inf))


def _job_name(_instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, str) or not value or "/" in value or value != value.strip():
        raise ValueError(f"{attribute.name} must be a non-empty name without '/' or surrounding spaces, got {value!r}")


def _interval(given: Every, layout_every: int | None, fallback: int) -> int:
    """``given`` steps, or with ``auto`` the layout's (``fallback`` for a layout that names none)."""
    if given != AUTO_EVERY:
        return int(given)
    return fallback if layout_every is None else layout_every


def steps_or_auto_at_least(minimum: int) -> Callable[[object, attrs.Attribute, object], None]:
    """The attrs validator of a field that holds :data:`AUTO_EVERY` or a whole number >= ``minimum``."""
    def check(_instance: object, attribute: attrs.Attribute, value: object) -> None:
        if value != AUTO_EVERY and (type(value) is not int or value < minimum):
            raise ValueError(f"{attribute.name} must be {AUTO_EVERY!r} or a whole number >= {minimum}, got {value!r}")
    return check


def steps_or_auto(text: str) -> Every:
    """An ``--checkpoint-every``/``--memory-copy-every`` value: ``auto`` or a whole number (ValueError otherwise)."""
    return AUTO_EVERY if text.strip() == AUTO_EVERY else int(text)


def _plain_json(value: Mapping[str, JSON]) -> JSONObject:
    return json.loads(json.dumps(dict(value)))


REDUNDANCY = ("none", "lflb", "eflb", "efeb", "auto")
DEFAULT_REDUNDANCY = "auto"
"""A job's ``--redundancy`` when none is given: chosen per generation (:mod:`bamboo.launch.redundancy`)."""
"""The redundant computation modes (``--redundancy``): none, lazy (``lflb``) or eager (``eflb``, ``efeb``), or
``auto``: the mode each generation's layout names, chosen when it is decided (:mod:`bamboo.launch.redundancy`)."""

# The fields of a spec that an agent's flags set, with the flag that sets each (for conflict messages).
FLAG_OF = {
    "stages": "--stages",
    "pipelines": "--pipelines",
    "steps": "--steps",
    "min_nodes": "--min-nodes",
    "redundancy": "--redundancy",
    "preemptions_per_node_hour": "--preemption-rate",
    "script": "-- SCRIPT ARGS",
    "size": "--layers",
    "seed": "--seed",
    "checkpoint_dir": "--checkpoint-dir",
    "checkpoint_every": "--checkpoint-every",
    "memory_copy_every": "--memory-copy-every",
    "resume": "--resume",
    "ttl": "--ttl",
    "grace_s": "--grace",
    "confirm_timeout_s": "--confirm-timeout",
    "group_timeout_s": "--group-timeout",
    "reconfigure_timeout_s": "--reconfigure-timeout",
}


class SpecFields(TypedDict, total=False):
    """The fields of a :class:`JobSpec` that an agent's flags set (:data:`FLAG_OF`), those that were given."""

    stages: int
    pipelines: int
    steps: int
    min_nodes: int
    redundancy: str
    preemptions_per_node_hour: float
    script: tuple[str, ...]
    size: dict[str, int]
    seed: int
    checkpoint_dir: str
    checkpoint_every: Every
    memory_copy_every: Every
    resume: bool
    ttl: int
    grace_s: float
    confirm_timeout_s: float
    group_timeout_s: float
    reconfigure_timeout_s: float


class ModelDescription(TypedDict):
    """A model as the job's spec describes it (read by the first agent): its layers' costs for the planner
    (bamboo-reconfig ``LayerSpec`` dicts), its DeepSpeed config and its microbatches per pipeline."""

    layers: list[JSONObject]
    config: JSONObject
    micro_batches: int


@attrs.frozen
class JobSpec:
    """What every node of a job agrees on, stored in etcd at ``/bamboo/<job>/spec`` by the first agent.

    ``layers`` is the model's description for the planner (bamboo-reconfig ``LayerSpec`` dicts: state
    bytes and compute cost per layer) and ``config`` its DeepSpeed config; both come from the first
    agent's reading of the model (the built-in example of ``size``, or ``script`` run in ``describe``
    mode). ``created_unix`` is the job's time zero: event records count seconds from it.
    """

    job: str = attrs.field(validator=_job_name)
    stages: int = attrs.field(validator=_POSITIVE_INT)
    pipelines: int = attrs.field(validator=_POSITIVE_INT)
    layers: tuple[JSONObject, ...] = attrs.field(converter=lambda v: tuple(_plain_json(x) for x in v))
    config: JSONObject = attrs.field(converter=_plain_json)
    micro_batches: int = attrs.field(validator=_POSITIVE_INT)
    """Microbatches per pipeline per step at ``pipelines`` pipelines (the global batch is ``micro_batches *
    pipelines`` microbatches, kept when the number of pipelines changes)."""
    created_unix: float = attrs.field(validator=_POSITIVE_NUMBER)
    steps: int = attrs.field(default=DEFAULT_STEPS, validator=_POSITIVE_INT)
    min_nodes: int = attrs.field(default=0, validator=_NON_NEGATIVE_INT)
    """Registered nodes the first layout waits for (0: P x D)."""
    redundancy: str = attrs.field(default=DEFAULT_REDUNDANCY, validator=attrs.validators.in_(REDUNDANCY))
    preemptions_per_node_hour: float | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.and_(attrs.validators.instance_of((int, float)), attrs.validators.ge(0),
                              attrs.validators.lt(math.inf))))
    """The preemption rate ``auto`` assumes until the job has history of its own (None: bamboo-rc's default)."""
    script: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    """``SCRIPT ARGS`` of a user script (every worker runs ``python SCRIPT ARGS``); empty: the built-in example."""
    size: dict[str, int] = attrs.field(factory=dict, converter=_plain_json)
    """The built-in example's ``GPTSize`` keywords."""
    seed: int = attrs.field(default=0, validator=_NON_NEGATIVE_INT)
    checkpoint_dir: str | None = None
    checkpoint_every: Every = attrs.field(default=AUTO_EVERY, validator=steps_or_auto_at_least(1))
    """Steps between checkpoints, or ``auto``: each generation's (its layout's ``restore_every``)."""
    memory_copy_every: Every = attrs.field(default=AUTO_EVERY, validator=steps_or_auto_at_least(0))
    """Steps between in-memory copies of every stage (:mod:`bamboo.launch.memcopy`; 0: none), or ``auto``: each
    generation's."""
    resume: bool = False
    """Start from the newest good checkpoint in ``checkpoint_dir`` (a run that ended, or was stopped)."""
    ttl: int = attrs.field(default=membership_timeouts.LEASE_TTL_S, validator=_POSITIVE_INT)
    grace_s: float = attrs.field(default=membership_timeouts.GRACE_PERIOD_S, validator=_POSITIVE_NUMBER)
    confirm_timeout_s: float = attrs.field(default=rc_timeouts.CONFIRM_S, validator=_POSITIVE_NUMBER)
    group_timeout_s: float = attrs.field(default=rc_timeouts.GROUP_S, validator=_POSITIVE_NUMBER)
    reconfigure_timeout_s: float = attrs.field(default=timeouts.RECONFIGURE_TIMEOUT_S, validator=_POSITIVE_NUMBER)

    def __attrs_post_init__(self) -> None:
        if len(self.layers) < self.stages:
            raise ValueError(f"the model has {len(self.layers)} layers, fewer than the {self.stages} stages")
        if self.resume and self.checkpoint_dir is None:
            raise ValueError("resume needs a checkpoint_dir to resume from")
        if self.min_nodes and self.min_nodes < self.stages * self.pipelines:
            raise ValueError(f"min_nodes {self.min_nodes} is fewer than the {self.stages * self.pipelines} nodes "
                             f"of {self.pipelines} pipelines of {self.stages} stages")

    @property
    def first_layout_nodes(self) -> int:
        """How many registered nodes the first layout waits for."""
        return self.min_nodes or self.stages * self.pipelines

    @property
    def chooses_restore_points(self) -> bool:
        """Whether each generation's layout names the steps between its restore points (``restore_every``)."""
        return AUTO_EVERY in (self.checkpoint_every, self.memory_copy_every)

    def checkpoint_interval(self, layout_every: int | None) -> int:
        """Steps between checkpoints in a generation whose layout names ``layout_every`` (None: none)."""
        return _interval(self.checkpoint_every, layout_every, DEFAULT_CHECKPOINT_EVERY)

    def memory_copy_interval(self, layout_every: int | None) -> int:
        """Steps between in-memory copies in a generation whose layout names ``layout_every`` (0: none)."""
        return _interval(self.memory_copy_every, layout_every, MEMORY_COPY_EVERY)

    def reconfig_layers(self) -> list[LayerSpec]:
        """The model's layers as bamboo-reconfig ``LayerSpec`` values."""
        from bamboo.reconfig import LayerSpec

        return [LayerSpec.from_dict(layer) for layer in self.layers]

    def conflicts(self, given: SpecFields) -> list[str]:
        """One line per flag in ``given`` (field -> value) whose value differs from this spec's."""
        lines = []
        for field, value in sorted(given.items()):
            stored = getattr(self, field)
            if field == "script":
                value = tuple(cast("Iterable[str]", value))  # a list, as a flag gives it, is the same script
            if value != stored:
                flag = FLAG_OF.get(field, field)
                lines.append(f"{flag} {_show(value)} conflicts with the job's stored {field} {_show(stored)}")
        return lines

    def to_dict(self) -> JSONObject:
        data = attrs.asdict(self)
        data["layers"] = [dict(layer) for layer in self.layers]
        data["script"] = list(self.script)
        return {"v": SPEC_VERSION, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, JSON]) -> JobSpec:
        return _from_dict(cls, "job spec", data)

    @classmethod
    def from_json(cls, text: str | bytes) -> JobSpec:
        return _from_dict(cls, "job spec", _loads("job spec", text))


def _show(value: object) -> str:
    if isinstance(value, tuple):
        return " ".join(map(str, value)) or "(none)"
    if value is None:
        return "(none)"
    return str(value)


def _loads(what: str, text: str | bytes) -> JSON:
    try:
        return json.loads(text)
    except ValueError as error:
        raise SpecError(f"{what}: not JSON ({error})") from None


S = TypeVar("S", "JobSpec", "WorkerContext")


def _from_dict(cls: type[S], what: str, data: object) -> S:
    if not isinstance(data, Mapping):
        raise SpecError(f"{what}: must be a JSON object, got {type(data).__name__}")
    version = data.get("v")
    if version != SPEC_VERSION:
        raise SpecError(f"{what}: unknown version {version!r} (this reader knows version {SPEC_VERSION})")
    names = {field.name for field in attrs.fields(cls)}
    unknown = sorted(set(data) - names - {"v"})
    if unknown:
        raise SpecError(f"{what}: unknown key(s) {', '.join(map(repr, unknown))}")
    required = [f.name for f in attrs.fields(cls) if f.default is attrs.NOTHING and f.name not in data]
    if required:
        raise SpecError(f"{what}: missing key {required[0]!r}")
    values = {key: value for key, value in data.items() if key != "v"}
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise SpecError(f"{what}: {error.args[0] if error.args else error}") from None


@attrs.frozen
class EtcdAccess:
    """How a process reaches etcd: endpoints, and user/password or TLS files (all optional)."""

    endpoints: tuple[str, ...] = attrs.field(converter=tuple)
    user: str | None = None
    password: str | None = attrs.field(default=None, repr=False)
    ca: str | None = None
    cert: str | None = None
    key: str | None = None

    def options(self) -> EtcdOptions:
        from bamboo.membership import EtcdOptions

        return EtcdOptions(endpoints=self.endpoints, user=self.user, password=self.password, ca_cert=self.ca,
                           cert_cert=self.cert, cert_key=self.key)


@attrs.frozen
class WorkerContext:
    """What an agent tells the worker it spawns (a JSON file named by ``BAMBOO_WORKER_CONTEXT``).

    ``fence_key``, ``fence_revision`` and ``fence_lease`` are the agent's registration in etcd (its node
    record, that record's create revision and its lease): every write of the worker is guarded by them,
    so once the node is declared dead (its lease revoked or expired) nothing it writes reaches the job. ``agent_token_file``
    / ``agent_tls_*`` are what the worker needs to call its agent's gRPC service.
    """

    job: str = attrs.field(validator=_job_name)
    node: str
    zone: str
    agent_address: str
    etcd: EtcdAccess = attrs.field(converter=lambda v: v if isinstance(v, EtcdAccess) else EtcdAccess(**v))
    run_dir: str
    fence_key: str = ""
    fence_revision: int = 0
    fence_lease: int = 0
    agent_token_file: str | None = None
    agent_tls_ca: str | None = None
    agent_tls_cert: str | None = None
    agent_tls_key: str | None = None
    agent_tls_server_name: str | None = None

    @property
    def out_dir(self) -> Path:
        return Path(self.run_dir) / "out"

    def to_dict(self) -> JSONObject:
        data = attrs.asdict(self)
        return {"v": SPEC_VERSION, **data}

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, data: Mapping[str, JSON]) -> WorkerContext:
        return _from_dict(cls, "worker context", data)

    @classmethod
    def from_json(cls, text: str | bytes) -> WorkerContext:
        return _from_dict(cls, "worker context", _loads("worker context", text))

    @classmethod
    def from_environment(cls) -> WorkerContext:
        """The context named by ``BAMBOO_WORKER_CONTEXT`` (a clear error when it is not set)."""
        path = os.environ.get(ENV_CONTEXT)
        if not path:
            raise RuntimeError(f"{ENV_CONTEXT} is not set: workers are started by `bamboo-launch agent`")
        return cls.from_json(Path(path).read_text())

    def write(self, path: Path) -> None:
        partial = path.with_suffix(path.suffix + ".tmp")
        partial.write_text(self.to_json())
        os.chmod(partial, 0o600)  # it may carry the etcd password
        os.replace(partial, path)


class LayerBuilder(Protocol):
    """A layer that is built where a stage needs it, as DeepSpeed's ``LayerSpec`` is: its ``build()`` returns the
    module (a ``LayerSpec``, ``bamboo.rc.model.ModuleSpec``, a :class:`ModuleFactory`)."""

    def build(self) -> nn.Module: ...


LayerInput: TypeAlias = "LayerBuilder | Callable[[], nn.Module]"
"""A layer as a training script gives it: a :class:`LayerBuilder`, or a zero-argument callable that returns a
``torch.nn.Module`` (the launcher wraps it in a :class:`ModuleFactory`)."""


class ModuleFactory:
    """A zero-argument callable that returns a module, seen through DeepSpeed ``LayerSpec``'s ``build()``."""

    def __init__(self, factory: Callable[[], nn.Module]) -> None:
        self.factory = factory

    def build(self) -> nn.Module:
        return self.factory()

    def __repr__(self) -> str:
        return f"ModuleFactory({self.factory!r})"


def _as_layers(value: Sequence[LayerInput]) -> tuple[LayerBuilder, ...]:
    if isinstance(value, (str, bytes)) or not isinstance(value, Sequence):
        raise TypeError(f"layers must be a list of LayerSpec or module factories, got {type(value).__name__}")
    from torch import nn

    layers: list[LayerBuilder] = []
    for index, layer in enumerate(value):
        if callable(getattr(layer, "build", None)):
            layers.append(cast("LayerBuilder", layer))
        elif callable(layer) and not isinstance(layer, nn.Module):
            layers.append(ModuleFactory(layer))
        else:
            raise TypeError(f"layer {index} is a {type(layer).__name__}: give a DeepSpeed LayerSpec or a "
                            "zero-argument callable that returns a torch.nn.Module (not a built module)")
    if not layers:
        raise ValueError("layers is empty: the model needs at least one layer per stage")
    return tuple(layers)


def _as_config(value: Mapping[str, JSON] | None) -> JSONObject | None:
    if value is None:
        return None
    if not isinstance(value, Mapping):
        raise TypeError(f"config must be a DeepSpeed config dict, got {type(value).__name__}")
    return _plain_json(value)  # a plain JSON value: it travels in the job spec


@attrs.frozen
class Program:
    """What a training script gives the launcher: its model, loss, data and DeepSpeed config."""

    layers: tuple[LayerBuilder, ...] = attrs.field(converter=_as_layers)
    loss_fn: Callable[[Tensor, Tensor], Tensor] = attrs.field(validator=attrs.validators.is_callable())
    microbatch: Callable[[int, int], tuple[Tensor, Tensor]] = attrs.field(validator=attrs.validators.is_callable())
    config: JSONObject | None = attrs.field(default=None, converter=_as_config)
