"""DeepSpeed config parsing for the bamboo runtime.

A DeepSpeed user keeps their config file. This module reads the subset that bamboo supports
(micro batch size, gradient accumulation, optimizer, scheduler, gradient clipping, bf16, fp16 with its
loss scaling, and the monitors ``tensorboard``, ``csv_monitor`` and ``wandb``) into a frozen
:class:`TrainingConfig`.

Nothing is silently ignored:

- keys that change nothing in bamboo (:data:`NO_EFFECT_KEYS`, a disabled ``fp16``, ZeRO stage 0)
  are accepted with one :class:`ConfigWarning` each, naming the key;
- every other key it does not support, and every enabled feature it does not have (ZeRO stage 1
  and above, the ``comet`` monitor, ``fp16`` and ``bf16`` both enabled), raises :class:`ConfigError`
  naming that key.

Reading a config imports no torch (an agent reads the built-in example's); building its optimizer and schedule
(:func:`build_optimizer`, :func:`build_scheduler`) does.
"""

from __future__ import annotations

import json
import math
import warnings
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs
from bamboo.rc.loss_scale import LossScaleConfig
from bamboo.reconfig import microbatch_shares

if TYPE_CHECKING:
    import torch
    from bamboo.rc.optim import Optimizer, WarmupSchedule

__all__ = [
    "MONITORS",
    "NO_EFFECT_KEYS",
    "SUPPORTED_KEYS",
    "ConfigError",
    "ConfigWarning",
    "MonitorConfig",
    "OptimizerConfig",
    "SchedulerConfig",
    "TrainingConfig",
    "build_optimizer",
    "build_scheduler",
    "load_config",
]


class ConfigError(ValueError):
    """A DeepSpeed config key or value that bamboo does not support (yet)."""


class ConfigWarning(UserWarning):
    """A DeepSpeed config key that bamboo accepts but that changes nothing in bamboo."""


MONITORS: dict[str, tuple[str, ...]] = {
    "tensorboard": ("enabled", "output_path", "job_name"),
    "csv_monitor": ("enabled", "output_path", "job_name"),
    "wandb": ("enabled", "group", "team", "project"),
}
"""DeepSpeed's monitor sections that bamboo honours, with the keys each takes (DeepSpeed's names)."""

NO_EFFECT_KEYS: dict[str, str] = {
    "steps_per_print": "bamboo prints no periodic DeepSpeed log lines",
    "wall_clock_breakdown": "bamboo keeps its own per-instruction timings",
    "zero_allow_untested_optimizer": "bamboo has no ZeRO",
}
"""Top-level keys accepted with a :class:`ConfigWarning` (they have no effect in bamboo), and why."""

# Top-level keys bamboo understands. `train_batch_size` is only checked for consistency.
SUPPORTED_KEYS: tuple[str, ...] = (
    "train_batch_size",
    "train_micro_batch_size_per_gpu",
    "gradient_accumulation_steps",
    "optimizer",
    "scheduler",
    "gradient_clipping",
    "bf16",
    "fp16",
    *MONITORS,
)

# Keys that are read only to check that they enable nothing bamboo lacks (then they give a warning).
_CHECKED_KEYS: tuple[str, ...] = (*NO_EFFECT_KEYS, "zero_optimization", "comet")

FP16_KEYS: dict[str, type | tuple[type, ...]] = {
    "loss_scale": (int, float), "initial_scale_power": int, "loss_scale_window": int, "hysteresis": int,
    "consecutive_hysteresis": bool, "min_loss_scale": (int, float),
}
"""The keys of DeepSpeed's ``fp16`` section that bamboo honours, with their JSON types (they are
:class:`~bamboo.rc.precision.LossScaleConfig`'s fields), besides ``enabled`` and ``auto_cast`` (bamboo always
autocasts over fp32 master weights)."""

_OPTIMIZER_PARAMS: dict[str, tuple[str, ...]] = {
    "adam": ("lr", "betas", "eps", "weight_decay", "adam_w_mode", "torch_adam", "fused"),
    "adamw": ("lr", "betas", "eps", "weight_decay", "torch_adam", "fused"),
    "sgd": ("lr", "momentum", "weight_decay", "dampening", "nesterov"),
}

_SCHEDULER_PARAMS: dict[str, tuple[str, ...]] = {
    "warmuplr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type"),
    "warmupdecaylr": ("warmup_min_lr", "warmup_max_lr", "warmup_num_steps", "warmup_type", "total_num_steps"),
}


def _check_keys(where: str, given: Iterable[str], allowed: Iterable[str], also: Iterable[str] = ()) -> None:
    """ConfigError naming the first key of `given` outside `allowed` and `also` (the message lists `allowed`)."""
    allowed_set = set(allowed)
    for key in given:
        if key not in allowed_set and key not in also:
            raise ConfigError(
                f"unsupported DeepSpeed config key {where}{key!r} (bamboo supports: {', '.join(sorted(allowed_set))})"
            )


@attrs.frozen
class OptimizerConfig:
    """The optimizer type (lower-case DeepSpeed name) and its keyword parameters."""

    type: str = attrs.field(validator=attrs.validators.in_(tuple(_OPTIMIZER_PARAMS)))
    params: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)


@attrs.frozen
class SchedulerConfig:
    """The LR scheduler type (lower-case DeepSpeed name) and its keyword parameters."""

    type: str = attrs.field(validator=attrs.validators.in_(tuple(_SCHEDULER_PARAMS)))
    params: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)


_FINITE_NON_NEGATIVE = attrs.validators.and_(attrs.validators.ge(0.0), attrs.validators.lt(math.inf))


@attrs.frozen
class MonitorConfig:
    """One enabled DeepSpeed monitor: ``kind`` (``tensorboard``, ``csv_monitor`` or ``wandb``) and its
    settings under DeepSpeed's names (``output_path``, ``job_name``; ``group``, ``team``, ``project``
    for wandb), with DeepSpeed's defaults filled in."""

    kind: str = attrs.field(validator=attrs.validators.in_(tuple(MONITORS)))
    settings: Mapping[str, Any] = attrs.field(factory=dict, converter=dict)


@attrs.frozen
class TrainingConfig:
    """What bamboo takes from a DeepSpeed config."""

    micro_batch_size: int = attrs.field(validator=attrs.validators.ge(1))
    micro_batches: int = attrs.field(validator=attrs.validators.ge(1))
    optimizer: OptimizerConfig = attrs.field(factory=lambda: OptimizerConfig("adamw", {"lr": 1e-3}))
    scheduler: SchedulerConfig | None = None
    gradient_clipping: float = attrs.field(default=0.0, validator=_FINITE_NON_NEGATIVE)
    bf16: bool = False
    monitors: tuple[MonitorConfig, ...] = attrs.field(default=(), converter=tuple)
    """The enabled monitors (:mod:`bamboo.rc.monitor` writes them)."""
    fp16: LossScaleConfig | None = None
    """fp16 autocast with loss scaling (:mod:`bamboo.rc.precision`); None: fp32, or bf16 with :attr:`bf16`."""
    global_microbatches: int | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.ge(1)))
    """The global batch in microbatches, where the pipelines' shares of it differ (a layout of a number of pipelines
    that does not divide it); ``micro_batches`` is then this node's pipeline's share. None: every pipeline runs
    ``micro_batches``."""

    def global_count(self, pipelines: int) -> int:
        """Microbatches of the global batch over ``pipelines`` pipelines."""
        return self.micro_batches * pipelines if self.global_microbatches is None else self.global_microbatches

    def shares(self, pipelines: int) -> tuple[int, ...]:
        """Each of ``pipelines`` pipelines' microbatches, in pipeline order: the first ``G mod D`` one more than the
        others (:func:`bamboo.reconfig.microbatch_shares`, as a layout splits the global batch)."""
        return microbatch_shares(self.global_count(pipelines), pipelines)

    def share(self, pipeline: int, pipelines: int) -> tuple[int, int]:
        """``(first, count)``: where pipeline ``pipeline``'s share starts in the global batch, and its length."""
        shares = self.shares(pipelines)
        return sum(shares[:pipeline]), shares[pipeline]


def _as_int(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{key} must be an integer, got {value!r}")
    return value


def _no_effect(key: str, why: str) -> None:
    warnings.warn(f"DeepSpeed config key {key!r} has no effect in bamboo ({why})", ConfigWarning, stacklevel=3)


def _section(key: str, value: object) -> Mapping[str, Any]:
    if not isinstance(value, Mapping):
        raise ConfigError(f"{key} must be a JSON object, got {value!r}")
    return value


def _enabled(key: str, section: Mapping[str, Any]) -> bool:
    value = section.get("enabled", False)
    if not isinstance(value, bool):
        raise ConfigError(f"{key}.enabled must be true or false, got {value!r}")
    return value


def _check_without_effect(config: Mapping[str, Any]) -> None:
    """Warn about the keys that change nothing; ConfigError for enabled features bamboo lacks."""
    for key, why in NO_EFFECT_KEYS.items():
        if key in config:
            _no_effect(key, why)
    if "zero_optimization" in config:
        zero = _section("zero_optimization", config["zero_optimization"])
        stage = zero.get("stage", 0)
        if stage != 0:
            raise ConfigError(
                f"unsupported DeepSpeed config key 'zero_optimization' with stage {stage!r} (bamboo keeps every "
                "stage's optimizer state whole on its node and its shadow; only stage 0 is accepted)"
            )
        for offload in ("offload_optimizer", "offload_param"):
            device = _section(f"zero_optimization.{offload}", zero.get(offload, {})).get("device", "none")
            if device not in ("none", None):
                raise ConfigError(
                    f"unsupported DeepSpeed config key zero_optimization.{offload!r} with device {device!r} "
                    "(bamboo has no ZeRO offload)"
                )
        _no_effect("zero_optimization", "stage 0 is no ZeRO")
    if "comet" in config and _enabled("comet", _section("comet", config["comet"])):
        raise ConfigError(
            f"unsupported DeepSpeed config key 'comet' with enabled true (bamboo's monitors: {', '.join(MONITORS)})"
        )


def _monitors(config: Mapping[str, Any]) -> list[MonitorConfig]:
    """The enabled monitor sections, checked, with DeepSpeed's defaults."""
    defaults: dict[str, dict[str, Any]] = {
        "tensorboard": {"output_path": "", "job_name": "DeepSpeedJobName"},
        "csv_monitor": {"output_path": "", "job_name": "DeepSpeedJobName"},
        "wandb": {"group": None, "team": None, "project": "deepspeed"},
    }
    found = []
    for kind, keys in MONITORS.items():
        if kind not in config:
            continue
        section = _section(kind, config[kind])
        _check_keys(f"{kind}.", section, keys)
        if not _enabled(kind, section):
            continue
        settings = {**defaults[kind], **{k: v for k, v in section.items() if k != "enabled"}}
        for name, value in settings.items():
            if value is not None and not isinstance(value, str):
                raise ConfigError(f"{kind}.{name} must be a string, got {value!r}")
        found.append(MonitorConfig(kind, settings))
    return found


def load_config(config: Mapping[str, Any] | str | Path, pipelines: int = 1,
                global_microbatches: int | None = None) -> TrainingConfig:
    """Parse a DeepSpeed config dict or JSON file path into a :class:`TrainingConfig`.

    `pipelines` (the data-parallel degree D) is only used to check `train_batch_size`, which
    must equal micro batch size × gradient accumulation steps × D when it is given. Keys that
    change nothing in bamboo give one :class:`ConfigWarning` each. ``global_microbatches``: the global batch where
    the pipelines' shares of it differ (:attr:`TrainingConfig.global_microbatches`; the gradient accumulation steps
    are then this process's pipeline's share, and `train_batch_size` is checked against the global batch).
    """
    config = _read(config)
    _check_keys("", config, SUPPORTED_KEYS, _CHECKED_KEYS)
    _check_without_effect(config)
    monitors = _monitors(config)
    micro, accumulation = _batch(config, pipelines, global_microbatches)
    optimizer = _optimizer(config)
    scheduler = _scheduler(config)
    bf16 = _bf16(config)
    fp16 = _fp16(config)
    if bf16 and fp16 is not None:
        raise ConfigError("'fp16' and 'bf16' are both enabled: choose one (bf16 needs no loss scaling)")
    clip = config.get("gradient_clipping", 0.0)
    if isinstance(clip, bool) or not isinstance(clip, (int, float)):
        raise ConfigError(f"gradient_clipping must be a number, got {clip!r}")
    try:
        return TrainingConfig(
            micro_batch_size=micro,
            micro_batches=accumulation,
            optimizer=optimizer,
            scheduler=scheduler,
            gradient_clipping=float(clip),
            bf16=bf16,
            monitors=monitors,
            fp16=fp16,
            global_microbatches=global_microbatches,
        )
    except ValueError as error:
        raise ConfigError(str(error)) from None


def _read(config: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    """The config as a mapping: `config` itself, or the JSON file it names."""
    if isinstance(config, (str, Path)):
        try:
            config = json.loads(Path(config).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ConfigError(f"cannot read DeepSpeed config {str(config)!r}: {exc}") from exc
    if not isinstance(config, Mapping):
        raise ConfigError(f"a DeepSpeed config must be a dict or a JSON file path, got {type(config).__name__}")
    return config


def _batch(config: Mapping[str, Any], pipelines: int, global_microbatches: int | None = None) -> tuple[int, int]:
    """(micro batch size, gradient accumulation steps), checked against ``train_batch_size`` when it is given (the
    micro batch size times ``global_microbatches``, where the pipelines' shares differ)."""
    if "train_micro_batch_size_per_gpu" not in config:
        raise ConfigError("the DeepSpeed config needs 'train_micro_batch_size_per_gpu'")
    micro = _as_int("train_micro_batch_size_per_gpu", config["train_micro_batch_size_per_gpu"])
    accumulation = _as_int("gradient_accumulation_steps", config.get("gradient_accumulation_steps", 1))
    if "train_batch_size" in config:
        total = _as_int("train_batch_size", config["train_batch_size"])
        if global_microbatches is not None:
            if total != micro * global_microbatches:
                raise ConfigError(f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} × "
                                  f"{global_microbatches} microbatches in the global batch")
        elif total != micro * accumulation * pipelines:
            raise ConfigError(
                f"train_batch_size {total} != train_micro_batch_size_per_gpu {micro} × "
                f"gradient_accumulation_steps {accumulation} × pipelines {pipelines}"
            )
    return micro, accumulation


def _typed_section(
    key: str, raw: Mapping[str, Any], known: Mapping[str, tuple[str, ...]], names: str
) -> tuple[str, dict[str, Any]]:
    """A ``{"type": ..., "params": {...}}`` section (``optimizer``, ``scheduler``): its type, lower-case, and its
    parameters, both checked against `known` (`names`: the types as DeepSpeed spells them, for the message)."""
    _check_keys(f"{key}.", raw, ("type", "params"))
    kind = str(raw.get("type", "")).lower()
    if kind not in known:
        raise ConfigError(f"unsupported {key} type {raw.get('type')!r} (bamboo supports: {names})")
    params = dict(raw.get("params", {}))
    _check_keys(f"{key}.params.", params, known[kind])
    return kind, params


def _optimizer(config: Mapping[str, Any]) -> OptimizerConfig:
    """DeepSpeed's ``optimizer`` section (default: AdamW at lr 1e-3)."""
    if "optimizer" not in config:
        return OptimizerConfig("adamw", {"lr": 1e-3})
    return OptimizerConfig(*_typed_section("optimizer", config["optimizer"], _OPTIMIZER_PARAMS, "Adam, AdamW, SGD"))


def _scheduler(config: Mapping[str, Any]) -> SchedulerConfig | None:
    """DeepSpeed's ``scheduler`` section: None when absent."""
    if "scheduler" not in config:
        return None
    kind, params = _typed_section("scheduler", config["scheduler"], _SCHEDULER_PARAMS, "WarmupLR, WarmupDecayLR")
    if params.get("warmup_type", "log") not in ("log", "linear"):
        raise ConfigError(f"unsupported scheduler.params.warmup_type {params['warmup_type']!r}")
    if kind == "warmupdecaylr" and "total_num_steps" not in params:
        raise ConfigError("scheduler WarmupDecayLR needs scheduler.params.total_num_steps")
    return SchedulerConfig(kind, params)


def _bf16(config: Mapping[str, Any]) -> bool:
    """Whether DeepSpeed's ``bf16`` section is there and enabled."""
    if "bf16" not in config:
        return False
    raw = config["bf16"]
    _check_keys("bf16.", raw, ("enabled",))
    return bool(raw.get("enabled", False))


def _fp16(config: Mapping[str, Any]) -> LossScaleConfig | None:
    """DeepSpeed's ``fp16`` section: None when absent or disabled (a disabled one gives a warning)."""
    if "fp16" not in config:
        return None
    raw = _section("fp16", config["fp16"])
    _check_keys("fp16.", raw, ("enabled", "auto_cast", *FP16_KEYS))
    if not _enabled("fp16", raw):
        _no_effect("fp16", "it is disabled")
        return None
    if not isinstance(raw.get("auto_cast", False), bool):
        raise ConfigError(f"fp16.auto_cast must be true or false, got {raw['auto_cast']!r}")
    values: dict[str, Any] = {key: raw[key] for key in FP16_KEYS if key in raw}
    for key, value in values.items():
        wanted = FP16_KEYS[key]
        if isinstance(value, bool) != (wanted is bool) or not isinstance(value, wanted):
            kind = {bool: "true or false", int: "an integer"}.get(wanted, "a number")  # type: ignore[call-overload]
            raise ConfigError(f"fp16.{key} must be {kind}, got {value!r}")
    try:
        return LossScaleConfig(**values)
    except ValueError as error:
        raise ConfigError(f"fp16: {error}") from None


def build_optimizer(config: OptimizerConfig, parameters: Iterable[torch.nn.Parameter]) -> Optimizer:
    """Build the optimizer with the same math DeepSpeed's config names (:mod:`bamboo.rc.optim`: torch.optim's
    math, bit for bit, without importing torch._dynamo). Adam always steps with torch's fused kernel, so the keys
    that choose DeepSpeed's implementation (``torch_adam``, and ``fused``, which it passes to torch's) are
    accepted and change nothing here.

    DeepSpeed's `Adam` is AdamW unless `adam_w_mode` is false. The weight decay defaults are torch's:
    0.01 for AdamW, 0 for Adam and SGD.
    """
    from bamboo.rc.optim import SGD, Adam  # torch: reading a config needs none

    params = dict(config.params)
    params.pop("torch_adam", None)
    params.pop("fused", None)
    if "betas" in params:
        params["betas"] = tuple(params["betas"])
    if config.type in ("adam", "adamw"):
        decoupled = config.type == "adamw" or bool(params.pop("adam_w_mode", True))
        params.setdefault("weight_decay", 0.01 if decoupled else 0.0)
        return Adam(parameters, decoupled_weight_decay=decoupled, **params)
    return SGD(parameters, **params)


def build_scheduler(config: SchedulerConfig | None, optimizer: Optimizer) -> WarmupSchedule | None:
    """Build DeepSpeed's WarmupLR / WarmupDecayLR as a schedule that sets absolute LRs.

    It follows DeepSpeed's formulas exactly, including that the first optimizer step runs at
    `warmup_min_lr` (DeepSpeed's scheduler starts at iteration -1): step i uses iteration i-1,
    `lr = min + (max - min) * gamma` with a log (default) or linear warmup over
    `warmup_num_steps`, then (WarmupDecayLR) `gamma = (total - it) / (total - warmup)`, at least 0.
    """
    if config is None:
        return None
    from bamboo.rc.optim import WarmupSchedule  # torch: reading a config needs none

    params = config.params
    low = float(params.get("warmup_min_lr", 0.0))
    default_high = optimizer.param_groups[0]["lr"] if config.type == "warmuplr" else 0.001
    high = float(params.get("warmup_max_lr", default_high))
    warmup = max(2, int(params.get("warmup_num_steps", 1000)))
    kind = params.get("warmup_type", "log")
    total = int(params.get("total_num_steps", 0))
    decay = config.type == "warmupdecaylr"
    inverse_log = 1.0 / math.log(warmup)

    def gamma(iteration: int) -> float:
        if iteration < warmup:
            return inverse_log * math.log(iteration + 1) if kind == "log" else iteration / warmup
        if decay:
            return max(0.0, float(total - iteration) / float(max(1.0, total - warmup)))
        return 1.0

    def absolute_lr(step: int) -> float:
        return low if step == 0 else low + (high - low) * gamma(step - 1)

    return WarmupSchedule(optimizer, absolute_lr)
