"""DeepSpeed's monitors, honoured through the libraries themselves: TensorBoard, CSV files and wandb.

The DeepSpeed config's ``tensorboard``, ``csv_monitor`` and ``wandb`` sections
(:class:`~bamboo.rc.config.MonitorConfig`) keep DeepSpeed's names and meanings:

- ``tensorboard``: a ``torch.utils.tensorboard.SummaryWriter`` on ``<output_path>/<job_name>/``;
- ``csv_monitor``: one file per event in ``<output_path>/<job_name>/``, named after the event with
  ``/`` and spaces replaced by ``_`` (``Train_Samples_train_loss.csv``), whose first row is
  ``step,<last part of the event name>`` and every other row ``<samples>,<value>``;
- ``wandb``: ``wandb.init(project=, group=, entity=team)`` then ``wandb.log`` (only where the
  ``wandb`` package is installed: otherwise :func:`check_available` raises a ConfigError saying so).

The engine writes, as DeepSpeed's pipeline engine does, ``Train/Samples/train_loss``,
``Train/Samples/lr`` (the learning rate the step's update used) and, when ``eval_batch`` runs,
``Train/Samples/eval_loss``, each against the number of samples trained so far (steps × the global
batch); bamboo adds ``Train/Samples/samples_per_second`` (the step's samples over its wall time).
Only the node that holds the job's loss writes (the host of the last stage of pipeline 0, which is
its shadow after a failover; with one stage, the first live node): one writer per job, not per node.
Writers are opened on first use, so a node that never reports creates no file; a node that takes
reporting over opens its own (TensorBoard reads every event file of a folder; the CSV files are appended
to).

Nothing here imports torch or a monitoring library until a monitor is written to.
"""

from __future__ import annotations

import csv
import importlib.util
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
from bamboo.rc.config import ConfigError, MonitorConfig

__all__ = [
    "EVAL_LOSS",
    "LEARNING_RATE",
    "SAMPLES_PER_SECOND",
    "TRAIN_LOSS",
    "Monitors",
    "StepInfo",
    "check_available",
]

TRAIN_LOSS = "Train/Samples/train_loss"
LEARNING_RATE = "Train/Samples/lr"
EVAL_LOSS = "Train/Samples/eval_loss"
SAMPLES_PER_SECOND = "Train/Samples/samples_per_second"

Event = tuple[str, float, int]
"""(name, value, samples trained so far): DeepSpeed's monitor event."""


def _number_or_none(_instance: object, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not isinstance(value, (int, float)):
        raise ValueError(f"{attribute.name} must be a number or None, got {value!r}")


@attrs.frozen
class StepInfo:
    """What one training step did, as the node that reports the job's loss saw it.

    ``step`` counts the steps done (1 after the first); ``loss`` is the step's mean loss over the global
    batch; ``lr`` the learning rate its update used; ``samples_per_second`` the global batch's samples
    over the step's wall time (a step that failed over includes its pause); ``eval_loss`` the mean loss
    of the evaluation that ran right after this step (None when none ran, or a failure interrupted it).
    """

    step: int = attrs.field(validator=attrs.validators.ge(0))
    loss: float = attrs.field(converter=float)
    lr: float = attrs.field(converter=float)
    samples_per_second: float = attrs.field(converter=float)
    eval_loss: float | None = attrs.field(default=None, validator=_number_or_none)
    samples: int = attrs.field(default=0, validator=attrs.validators.ge(0))
    """Samples trained so far (steps × the global batch): the x axis of the monitors."""

    def events(self) -> list[Event]:
        """This step's monitor events."""
        found: list[Event] = [(TRAIN_LOSS, self.loss, self.samples), (LEARNING_RATE, self.lr, self.samples)]
        if math.isfinite(self.samples_per_second):
            found.append((SAMPLES_PER_SECOND, self.samples_per_second, self.samples))
        if self.eval_loss is not None:
            found.append((EVAL_LOSS, self.eval_loss, self.samples))
        return found


_NEEDS = {"tensorboard": ("tensorboard", "pip install tensorboard"), "wandb": ("wandb", "pip install wandb")}


def check_available(configs: Sequence[MonitorConfig]) -> None:
    """ConfigError naming the package when an enabled monitor's library is not installed."""
    for config in configs:
        need = _NEEDS.get(config.kind)
        if need is not None and importlib.util.find_spec(need[0]) is None:
            raise ConfigError(
                f"the DeepSpeed config enables {config.kind!r}, but the {need[0]} package is not installed "
                f"({need[1]}, or set {config.kind}.enabled to false)"
            )


def _folder(settings: Any) -> Path:
    return Path(settings.get("output_path") or "") / str(settings.get("job_name") or "DeepSpeedJobName")


class _TensorBoard:
    def __init__(self, config: MonitorConfig) -> None:
        from torch.utils.tensorboard import SummaryWriter

        folder = _folder(config.settings)
        folder.mkdir(parents=True, exist_ok=True)
        self.writer = SummaryWriter(log_dir=str(folder))

    def write(self, events: Sequence[Event]) -> None:
        for name, value, samples in events:
            self.writer.add_scalar(name, value, samples)
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Csv:
    def __init__(self, config: MonitorConfig) -> None:
        self.folder = _folder(config.settings)
        self.folder.mkdir(parents=True, exist_ok=True)

    def write(self, events: Sequence[Event]) -> None:
        for name, value, samples in events:
            path = self.folder / (name.replace("/", "_").replace(" ", "_") + ".csv")
            new = not path.exists() or path.stat().st_size == 0
            with open(path, "a", newline="") as handle:
                writer = csv.writer(handle)
                if new:
                    writer.writerow(["step", name.split("/")[-1]])
                writer.writerow([samples, value])

    def close(self) -> None:
        pass


class _Wandb:
    def __init__(self, config: MonitorConfig) -> None:
        import wandb

        self.wandb = wandb
        settings = config.settings
        wandb.init(project=settings.get("project"), group=settings.get("group"), entity=settings.get("team"))

    def write(self, events: Sequence[Event]) -> None:
        for name, value, samples in events:
            self.wandb.log({name: value}, step=samples)

    def close(self) -> None:
        pass


_KINDS = {"tensorboard": _TensorBoard, "csv_monitor": _Csv, "wandb": _Wandb}


class Monitors:
    """The enabled monitors of a config; each opened on its first :meth:`write`."""

    def __init__(self, configs: Sequence[MonitorConfig]) -> None:
        check_available(configs)
        self.configs = tuple(configs)
        self._open: list[Any] | None = None

    @property
    def enabled(self) -> bool:
        return bool(self.configs)

    def write(self, events: Sequence[Event]) -> None:
        """Write DeepSpeed-style ``(name, value, samples)`` events to every enabled monitor."""
        if not self.configs or not events:
            return
        if self._open is None:
            self._open = [_KINDS[config.kind](config) for config in self.configs]
        for monitor in self._open:
            monitor.write(events)

    def close(self) -> None:
        for monitor in self._open or []:
            monitor.close()
        self._open = None
