"""Model profiles: the data the simulator needs about a model, read from JSON files (not code).

A profile gives the step time per (stages, pipelines), the samples per step, the desired cluster
(pipelines x stages), prices, the timing constants of failover and restarts, the job size and the
on-demand reference. Optionally it gives the cluster and step times of the strategies that keep no
redundant copy (``without_redundancy``), e.g. a pure data-parallel (P = 1) profile whose Bamboo cluster
is over-provisioned 1.5x. The shipped profiles live in ``bamboo/bench/profiles/*.json``; the launcher
writes measured ones in the same format (``bamboo-bench measure``, ``bamboo-bench compare``): they add the
cost of a synchronous checkpoint (``timing.checkpoint_s``), the on-demand cluster's start-up
(``on_demand.startup_s``) and how checkpoint/restart treats a joining node (``checkpoint_restart_on_join``);
profiles without those keys load as before. The format is documented in the package README.
"""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
from bamboo.bench import timeouts

__all__ = ["JOIN_RESTARTS", "ModelProfile", "ProfileError", "Timing", "builtin_profiles", "load_profile"]

JOIN_RESTARTS = ("new-pipeline", "every-join")
"""How checkpoint/restart reacts to a node that joins (``ModelProfile.checkpoint_restart_on_join``):
``new-pipeline`` (the paper's simulator) restarts, after a fresh checkpoint, only when the waiting nodes let
another pipeline run; ``every-join`` (torchrun's elastic agents: an agent that sees a node waiting restarts its
workers) restarts every worker from the last checkpoint whenever a node joins, without a fresh checkpoint."""


class ProfileError(ValueError):
    """A profile file is missing, not JSON, or holds a bad value; the message names the file and the key."""


_POSITIVE = attrs.validators.gt(0)
_NON_NEGATIVE = attrs.validators.ge(0)


@attrs.frozen
class Timing:
    """Timing constants in seconds (the slowdown is a factor). Each one is a documented knob.

    - `instance_creation_s`: from a spot instance's allocation until it can join (paper: 45 s).
    - `global_rendezvous_s`: rendezvous timeout when the job (re)starts from nothing or after a
      fatal failure (paper: 30 s).
    - `local_rendezvous_s`: rendezvous timeout of a reconfiguration among live workers (paper: 20 s
      for BERT and GPT-2).
    - `reconfiguration_s`: extra cost of a reconfiguration on top of the rendezvous (layer moves).
    - `failover_pause_s`: pause while the shadow detects the failure, confirms it and runs the
      lost backward passes, before it carries on with the merged schedule.
    - `fallback_slowdown`: step-time factor while any pipeline runs a merged failover schedule
      (paper: 1.5), until the next reconfiguration.
    - `rebuild_delay_s`: from a failover to the step boundary where the reconfiguration that rebuilds
      redundancy is decided; training goes on meanwhile, `fallback_slowdown` slower (a system that
      prepares the next layout in the background: a measured profile's mean). 0 (default, the
      paper's model): at the end of the step in progress.
    - `restart_s`: cost of a checkpoint/restart restart: new processes, imports, framework set-up
      and the checkpoint load, on top of `global_rendezvous_s`.
    - `checkpoint_interval_s`: time between periodic checkpoints (used to roll back), in time spent
      training (a checkpoint's own `checkpoint_s` included).
    - `checkpoint_s`: how long each periodic checkpoint stops training (a synchronous write; 0 for an
      asynchronous one). Training runs `1 - checkpoint_s / checkpoint_interval_s` as fast as its steps
      alone would.
    - `startup_s`: None (default), or the seconds from the run's start to its first layout of the nodes
      present at the start, in place of their `instance_creation_s` and the first global rendezvous (a
      measured profile's cold start: process start, imports, framework set-up). Later starts are unchanged.
    """

    instance_creation_s: float = attrs.field(default=timeouts.INSTANCE_CREATION_S, validator=_NON_NEGATIVE)
    global_rendezvous_s: float = attrs.field(default=timeouts.GLOBAL_RENDEZVOUS_S, validator=_NON_NEGATIVE)
    local_rendezvous_s: float = attrs.field(default=timeouts.LOCAL_RENDEZVOUS_S, validator=_NON_NEGATIVE)
    reconfiguration_s: float = attrs.field(default=0.0, validator=_NON_NEGATIVE)
    failover_pause_s: float = attrs.field(default=0.0, validator=_NON_NEGATIVE)
    fallback_slowdown: float = attrs.field(default=1.5, validator=_POSITIVE)
    rebuild_delay_s: float = attrs.field(default=0.0, validator=_NON_NEGATIVE)
    restart_s: float = attrs.field(default=0.0, validator=_NON_NEGATIVE)
    checkpoint_interval_s: float = attrs.field(default=timeouts.CHECKPOINT_INTERVAL_S, validator=_POSITIVE)
    checkpoint_s: float = attrs.field(default=0.0, validator=_NON_NEGATIVE)
    startup_s: float | None = attrs.field(default=None, validator=attrs.validators.optional(_NON_NEGATIVE))

    def __attrs_post_init__(self) -> None:
        if not self.checkpoint_s < self.checkpoint_interval_s:
            raise ValueError(
                f"checkpoint_s ({self.checkpoint_s!r}) must be less than checkpoint_interval_s "
                f"({self.checkpoint_interval_s!r}): a checkpoint is part of the interval between checkpoints"
            )

    @property
    def checkpoint_share(self) -> float:
        """The share of training time that periodic checkpoints take (`checkpoint_s / checkpoint_interval_s`)."""
        return self.checkpoint_s / self.checkpoint_interval_s


def _step_times(value: object) -> dict[tuple[int, int], float]:
    if isinstance(value, dict):
        return {(int(k[0]), int(k[1])): float(v) for k, v in value.items()}  # already converted
    raise TypeError(f"step_time_ms must be a dict, got {type(value).__name__}")


def _optional_step_times(value: object) -> dict[tuple[int, int], float] | None:
    return None if value is None else _step_times(value)


@attrs.frozen
class ModelProfile:
    """What the simulator knows about one model on one kind of machine.

    `step_time_ms[(stages, pipelines)]` is the time of one training step (one global batch of
    `samples_per_step` samples) on `pipelines` data-parallel pipelines of depth `stages`, with Bamboo's
    redundancy. The desired spot cluster is `pipelines` x `stages` nodes. `step_time_scale` multiplies
    every step time (a profile states why it is not 1.0). `job_samples` is the training job's size: a run
    "until completion" ends when that many samples are trained.

    The strategies that keep no redundant copy (checkpoint/restart, sample dropping) run on
    `pipelines_without_redundancy` pipelines (default `pipelines`) with `step_time_ms_without_redundancy`
    (default `step_time_ms`). With ``stages == 1`` (pure data parallelism) every node is one replica and
    its shadow is its ring successor, so a profile needs ``pipelines >= 2``.

    `on_demand_startup_s` is how long the on-demand cluster takes to its first step (it is billed meanwhile;
    0: from the start). `checkpoint_restart_on_join` is one of `JOIN_RESTARTS`.
    """

    name: str
    stages: int = attrs.field(validator=_POSITIVE)
    pipelines: int = attrs.field(validator=_POSITIVE)
    samples_per_step: float = attrs.field(validator=_POSITIVE)
    step_time_ms: dict[tuple[int, int], float] = attrs.field(converter=_step_times)
    spot_price_per_node_hour: float = attrs.field(validator=_POSITIVE)
    on_demand_price_per_node_hour: float = attrs.field(validator=_POSITIVE)
    on_demand_nodes: int = attrs.field(validator=_POSITIVE)
    on_demand_samples_per_second: float = attrs.field(validator=_POSITIVE)
    job_samples: float = attrs.field(validator=_POSITIVE)
    timing: Timing = attrs.field(factory=Timing)
    step_time_scale: float = attrs.field(default=1.0, validator=_POSITIVE)
    description: str = ""
    notes: tuple[str, ...] = attrs.field(default=(), converter=tuple)
    pipelines_without_redundancy: int | None = attrs.field(default=None, validator=attrs.validators.optional(_POSITIVE))
    step_time_ms_without_redundancy: dict[tuple[int, int], float] | None = attrs.field(
        default=None, converter=_optional_step_times
    )
    on_demand_startup_s: float = attrs.field(default=0.0, validator=_NON_NEGATIVE)
    checkpoint_restart_on_join: str = attrs.field(
        default="new-pipeline", validator=attrs.validators.in_(JOIN_RESTARTS)
    )

    def __attrs_post_init__(self) -> None:
        if self.stages == 1 and self.pipelines < 2:
            raise ValueError(
                f"profile {self.name!r}: a pure data-parallel profile (stages=1) needs pipelines >= 2, because each "
                f"replica's shadow is its ring successor; got pipelines={self.pipelines}"
            )
        tables = [("step_time_ms", self.step_time_ms, self.pipelines)]
        if self.step_time_ms_without_redundancy is not None or self.pipelines_without_redundancy is not None:
            tables.append(("without_redundancy.step_time_ms", self._table(redundancy=False),
                           self.pipelines_for(redundancy=False)))
        for where, table, pipelines in tables:
            for d in range(1, pipelines + 1):
                if (self.stages, d) not in table:
                    raise ValueError(
                        f"profile {self.name!r}: {where} has no step time for stages={self.stages}, pipelines={d}; "
                        f"has {sorted(table)}"
                    )
            for key, ms in table.items():
                if not ms > 0:
                    raise ValueError(f"profile {self.name!r}: {where} step time for {key} must be > 0, got {ms!r}")

    def _table(self, redundancy: bool) -> dict[tuple[int, int], float]:
        if not redundancy and self.step_time_ms_without_redundancy is not None:
            return self.step_time_ms_without_redundancy
        return self.step_time_ms

    def pipelines_for(self, redundancy: bool = True) -> int:
        """The desired pipelines of a strategy with Bamboo's redundancy, or of one without it."""
        if not redundancy and self.pipelines_without_redundancy is not None:
            return self.pipelines_without_redundancy
        return self.pipelines

    @property
    def desired_nodes(self) -> int:
        """The desired spot cluster size, pipelines x stages (Bamboo's, with redundancy)."""
        return self.pipelines * self.stages

    def desired_nodes_for(self, redundancy: bool = True) -> int:
        """The desired spot cluster size of a strategy with Bamboo's redundancy, or of one without it."""
        return self.pipelines_for(redundancy) * self.stages

    def step_time_s(self, pipelines: int, stages: int | None = None, redundancy: bool = True) -> float:
        """Seconds per step with `pipelines` pipelines of `stages` stages (default: the profile's depth).

        `redundancy` False gives the step time of the strategies that keep no redundant copy.
        """
        key = (self.stages if stages is None else stages, pipelines)
        try:
            return self._table(redundancy)[key] * self.step_time_scale / 1000.0
        except KeyError:
            which = "" if redundancy else " without redundancy"
            raise KeyError(
                f"profile {self.name!r} has no step time{which} for stages={key[0]}, pipelines={key[1]}"
            ) from None

    def samples_per_second(self, pipelines: int, redundancy: bool = True) -> float:
        """Fault-free throughput with `pipelines` pipelines."""
        return self.samples_per_step / self.step_time_s(pipelines, redundancy=redundancy)

    @property
    def on_demand_cost_per_hour(self) -> float:
        """Dollars per hour of the on-demand reference cluster."""
        return self.on_demand_nodes * self.on_demand_price_per_node_hour

    @property
    def on_demand_value(self) -> float:
        """On-demand throughput per $/h: the reference line of the value plot."""
        return self.on_demand_samples_per_second / self.on_demand_cost_per_hour

    # ----------------------------------------------------------------- JSON
    @classmethod
    def from_dict(cls, document: dict[str, Any], source: str = "<dict>") -> ModelProfile:
        """Build a profile from the JSON document described in the README (errors name `source` and the key)."""
        def need(mapping: dict[str, Any], key: str, where: str) -> Any:
            if key not in mapping:
                raise ProfileError(f"{source}: missing key '{where}{key}'")
            return mapping[key]

        try:
            if document.get("format") != 1:
                raise ProfileError(f"{source}: 'format' must be 1, got {document.get('format')!r}")
            step_times = _read_step_times(need(document, "step_time_ms", ""), "step_time_ms", source)
            plain = document.get("without_redundancy")
            plain_pipelines: int | None = None
            plain_step_times: dict[tuple[int, int], float] | None = None
            if plain is not None:
                if not isinstance(plain, dict):
                    raise ProfileError(f"{source}: 'without_redundancy' must be an object, got {plain!r}")
                unknown_plain = set(plain) - {"pipelines", "step_time_ms"}
                if unknown_plain:
                    raise ProfileError(f"{source}: unknown without_redundancy keys {sorted(unknown_plain)}; "
                                       "known: ['pipelines', 'step_time_ms']")
                if "pipelines" in plain:
                    plain_pipelines = int(plain["pipelines"])
                if "step_time_ms" in plain:
                    plain_step_times = _read_step_times(plain["step_time_ms"], "without_redundancy.step_time_ms", source)
            prices = need(document, "prices", "")
            on_demand = need(document, "on_demand", "")
            unknown_on_demand = set(on_demand) - {"nodes", "samples_per_second", "startup_s"}
            if unknown_on_demand:
                raise ProfileError(f"{source}: unknown on_demand keys {sorted(unknown_on_demand)}; "
                                   "known: ['nodes', 'samples_per_second', 'startup_s']")
            on_join = document.get("checkpoint_restart_on_join", "new-pipeline")
            if on_join not in JOIN_RESTARTS:
                raise ProfileError(f"{source}: 'checkpoint_restart_on_join' must be one of {list(JOIN_RESTARTS)}, "
                                   f"got {on_join!r}")
            timing_doc = document.get("timing", {})
            known_timing = {f.name for f in attrs.fields(Timing)}
            unknown = set(timing_doc) - known_timing
            if unknown:
                raise ProfileError(f"{source}: unknown timing keys {sorted(unknown)}; known: {sorted(known_timing)}")
            return cls(
                name=str(need(document, "name", "")),
                stages=int(need(document, "stages", "")),
                pipelines=int(need(document, "pipelines", "")),
                samples_per_step=float(need(document, "samples_per_step", "")),
                step_time_ms=step_times,
                step_time_scale=float(document.get("step_time_scale", 1.0)),
                spot_price_per_node_hour=float(need(prices, "spot_per_node_hour", "prices.")),
                on_demand_price_per_node_hour=float(need(prices, "on_demand_per_node_hour", "prices.")),
                on_demand_nodes=int(need(on_demand, "nodes", "on_demand.")),
                on_demand_samples_per_second=float(need(on_demand, "samples_per_second", "on_demand.")),
                job_samples=float(need(document, "job_samples", "")),
                timing=Timing(**{k: None if v is None and k == "startup_s" else float(v) for k, v in timing_doc.items()}),
                description=str(document.get("description", "")),
                notes=tuple(str(n) for n in document.get("notes", [])),
                pipelines_without_redundancy=plain_pipelines,
                step_time_ms_without_redundancy=plain_step_times,
                on_demand_startup_s=float(on_demand.get("startup_s", 0.0)),
                checkpoint_restart_on_join=on_join,
            )
        except ProfileError:
            raise
        except (TypeError, ValueError) as error:
            raise ProfileError(f"{source}: {error}") from None

    def to_dict(self) -> dict[str, Any]:
        """The JSON document for this profile (round-trips through `from_dict`)."""
        document: dict[str, Any] = {
            "format": 1,
            "name": self.name,
            "description": self.description,
            "stages": self.stages,
            "pipelines": self.pipelines,
            "samples_per_step": self.samples_per_step,
            "step_time_ms": _step_time_entries(self.step_time_ms),
            "step_time_scale": self.step_time_scale,
            "prices": {
                "spot_per_node_hour": self.spot_price_per_node_hour,
                "on_demand_per_node_hour": self.on_demand_price_per_node_hour,
            },
            "on_demand": {"nodes": self.on_demand_nodes, "samples_per_second": self.on_demand_samples_per_second},
            "job_samples": self.job_samples,
            "timing": {k: v for k, v in attrs.asdict(self.timing).items() if not (k == "startup_s" and v is None)},
            "notes": list(self.notes),
        }
        if self.on_demand_startup_s:
            document["on_demand"]["startup_s"] = self.on_demand_startup_s
        if self.checkpoint_restart_on_join != "new-pipeline":
            document["checkpoint_restart_on_join"] = self.checkpoint_restart_on_join
        plain: dict[str, Any] = {}
        if self.pipelines_without_redundancy is not None:
            plain["pipelines"] = self.pipelines_without_redundancy
        if self.step_time_ms_without_redundancy is not None:
            plain["step_time_ms"] = _step_time_entries(self.step_time_ms_without_redundancy)
        if plain:
            document["without_redundancy"] = plain
        return document


def _read_step_times(entries: object, where: str, source: str) -> dict[tuple[int, int], float]:
    if not isinstance(entries, list) or not entries:
        raise ProfileError(f"{source}: '{where}' must be a non-empty list of {{stages, pipelines, ms}}")
    step_times: dict[tuple[int, int], float] = {}
    for i, entry in enumerate(entries):
        try:
            key = (int(entry["stages"]), int(entry["pipelines"]))
            ms = float(entry["ms"])
        except (KeyError, TypeError, ValueError):
            raise ProfileError(f"{source}: {where}[{i}] = {entry!r} needs stages, pipelines, ms") from None
        if key in step_times:
            raise ProfileError(f"{source}: {where}[{i}] repeats stages={key[0]}, pipelines={key[1]}")
        step_times[key] = ms
    return step_times


def _step_time_entries(table: dict[tuple[int, int], float]) -> list[dict[str, Any]]:
    return [{"stages": s, "pipelines": d, "ms": ms} for (s, d), ms in sorted(table.items())]


def builtin_profiles() -> list[str]:
    """Names of the profiles shipped with the package."""
    folder = resources.files("bamboo.bench") / "profiles"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_profile(name_or_path: str | Path) -> ModelProfile:
    """Load a shipped profile by name (``bert``, ``bert-table6``, ``gpt2``) or any profile JSON file by path."""
    text: str
    source = str(name_or_path)
    path = Path(name_or_path)
    if path.suffix == ".json" or path.exists():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise ProfileError(f"{source}: cannot read: {error.strerror or error}") from None
    else:
        resource = resources.files("bamboo.bench") / "profiles" / f"{name_or_path}.json"
        if not resource.is_file():
            raise ProfileError(f"unknown model profile {source!r}; shipped: {', '.join(builtin_profiles())}")
        text = resource.read_text(encoding="utf-8")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise ProfileError(f"{source}:{error.lineno}: not JSON: {error.msg}") from None
    if not isinstance(document, dict):
        raise ProfileError(f"{source}: a profile is a JSON object")
    return ModelProfile.from_dict(document, source)
