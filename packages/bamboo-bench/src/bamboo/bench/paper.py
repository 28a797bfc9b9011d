"""The paper's tables and their reproduction: simulated against published figures, with relative errors.

A `PaperTable` is data (``bamboo/bench/paper_tables/*.json``, format below): which model profiles,
strategies and preemption probabilities a table of the Bamboo paper covers, the figures it publishes per
cell (`PaperFigure`), and the aggregates it states over its cells (`PaperRatio`, e.g. "Bamboo has 1.64x the
throughput of checkpointing"). `reproduce` runs the table's cells on the synthetic model with `sweep` (the
same machinery as ``bamboo-bench sweep``; on-demand is the profile's reference, never preempted) and returns
a `Reproduction`: every cell's simulated value beside the paper's, the relative error, and whether it is
within the table's tolerance for that metric. ``bamboo-bench paper TABLE`` prints it.

Shipped tables: ``table6`` (simulated BERT, the paper's Table 6) and ``dp`` (pure data parallelism, ResNet
and VGG). A figure the paper publishes but that is not available here is left out, never guessed; the table's
``missing`` text says which.

JSON format (``format`` 1)::

    {"format": 1, "key": "dp", "title": "...", "source": "where the figures come from",
     "models": ["resnet-dp", ...], "strategies": ["bamboo", "checkpoint", "on-demand"],
     "probabilities": [0.1, 0.16, 0.33], "metrics": ["throughput", "value"],
     "tolerances": {"throughput": 0.1},            # relative; a metric without one is shown, not checked
     "figures": [{"model": "...", "strategy": "bamboo", "metric": "value", "by_probability": {"0.1": 1.88}}],
     "ratios": [{"metric": "throughput", "numerator": "bamboo", "denominator": "checkpoint", "value": 1.64}],
     "missing": "what the paper publishes that is not here"}
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping, Sequence
from importlib import resources
from pathlib import Path
from typing import Any

import attrs
from bamboo.bench._validators import PROBABILITY
from bamboo.bench.profile import ModelProfile, load_profile
from bamboo.bench.simulator import AveragedResult, Policy, Strategy, average_results, simulate_run
from bamboo.bench.sweep import sweep

__all__ = [
    "METRICS",
    "ComparedCell",
    "ComparedRatio",
    "PaperFigure",
    "PaperRatio",
    "PaperTable",
    "PaperTableError",
    "Reproduction",
    "builtin_tables",
    "cell_text",
    "columns",
    "grouped_rows",
    "load_table",
    "reproduce",
]

#: The metrics a table may compare: keys of `AveragedResult`.
METRICS = ("throughput", "value", "nodes", "cost_per_hour", "fatal_failures", "preemptions", "progress_share")


class PaperTableError(ValueError):
    """A paper table file is missing, not JSON, or inconsistent; the message names the file and the key."""


def _metric(_instance: object, _attribute: attrs.Attribute, value: str) -> None:
    if value not in METRICS:
        raise ValueError(f"unknown metric {value!r}; known: {', '.join(METRICS)}")


def _finite(_instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{attribute.name} must be a finite number, got {value!r}")


@attrs.frozen
class PaperFigure:
    """One published figure: `metric` of `strategy` on `model` at preemption probability `probability`."""

    model: str
    strategy: Strategy
    probability: float = attrs.field(validator=PROBABILITY)
    metric: str = attrs.field(validator=_metric)
    value: float = attrs.field(validator=_finite)


@attrs.frozen
class PaperRatio:
    """A published aggregate: the mean over the table's (model, probability) cells of numerator / denominator."""

    metric: str = attrs.field(validator=_metric)
    numerator: Strategy
    denominator: Strategy
    value: float = attrs.field(validator=_finite)


@attrs.frozen
class PaperTable:
    """One table of the paper: what it covers, the figures it publishes, and the tolerance per metric."""

    key: str
    title: str
    source: str
    models: tuple[str, ...] = attrs.field(converter=tuple)
    strategies: tuple[Strategy, ...] = attrs.field(converter=tuple)
    probabilities: tuple[float, ...] = attrs.field(converter=tuple,
                                                  validator=attrs.validators.deep_iterable(PROBABILITY))
    metrics: tuple[str, ...] = attrs.field(converter=tuple)
    tolerances: Mapping[str, float] = attrs.field(factory=dict)
    figures: tuple[PaperFigure, ...] = attrs.field(default=(), converter=tuple)
    ratios: tuple[PaperRatio, ...] = attrs.field(default=(), converter=tuple)
    missing: str = ""

    def __attrs_post_init__(self) -> None:
        for name in ("models", "strategies", "probabilities", "metrics"):
            values = getattr(self, name)
            if not values:
                raise ValueError(f"table {self.key!r}: {name} must not be empty")
            if len(set(values)) != len(values):
                raise ValueError(f"table {self.key!r}: {name} repeats a value: {list(values)}")
        for metric in self.metrics:
            _metric(self, attrs.fields(PaperTable).metrics, metric)
        for metric, tolerance in self.tolerances.items():
            if metric not in self.metrics:
                raise ValueError(f"table {self.key!r}: a tolerance for {metric!r}, which is not one of its metrics "
                                 f"{list(self.metrics)}")
            if not tolerance > 0:
                raise ValueError(f"table {self.key!r}: tolerance for {metric!r} must be > 0, got {tolerance!r}")
        seen: set[tuple[str, Strategy, float, str]] = set()
        for figure in self.figures:
            key = (figure.model, figure.strategy, figure.probability, figure.metric)
            where = f"table {self.key!r}: figure {figure.metric} of {figure.strategy.value} on {figure.model} at p={figure.probability:g}"
            if figure.model not in self.models or figure.strategy not in self.strategies:
                raise ValueError(f"{where}: model and strategy must be among {list(self.models)} and "
                                 f"{[s.value for s in self.strategies]}")
            if figure.probability not in self.probabilities or figure.metric not in self.metrics:
                raise ValueError(f"{where}: probability and metric must be among {list(self.probabilities)} and "
                                 f"{list(self.metrics)}")
            if key in seen:
                raise ValueError(f"{where} is given twice")
            seen.add(key)
        for ratio in self.ratios:
            if ratio.numerator not in self.strategies or ratio.denominator not in self.strategies:
                raise ValueError(f"table {self.key!r}: ratio {ratio.numerator.value}/{ratio.denominator.value} needs "
                                 f"both strategies among {[s.value for s in self.strategies]}")
            if ratio.metric not in self.metrics:
                raise ValueError(f"table {self.key!r}: ratio of {ratio.metric!r}, which is not one of its metrics "
                                 f"{list(self.metrics)}")

    def figure(self, model: str, strategy: Strategy, probability: float, metric: str) -> float | None:
        """The published figure for this cell, or None when the table has none."""
        for figure in self.figures:
            if (figure.model, figure.strategy, figure.probability, figure.metric) == (model, strategy, probability, metric):
                return figure.value
        return None

    @classmethod
    def from_dict(cls, document: Mapping[str, Any], source: str = "<dict>") -> PaperTable:
        """Build a table from its JSON document (errors name `source` and the key)."""
        try:
            if document.get("format") != 1:
                raise PaperTableError(f"{source}: 'format' must be 1, got {document.get('format')!r}")
            missing = [key for key in ("key", "title", "source", "models", "strategies", "probabilities", "metrics")
                       if key not in document]
            if missing:
                raise PaperTableError(f"{source}: missing key {missing[0]!r}")
            figures = []
            for i, entry in enumerate(document.get("figures", [])):
                try:
                    by_probability = entry["by_probability"]
                    for probability, value in by_probability.items():
                        figures.append(PaperFigure(str(entry["model"]), Strategy.parse(str(entry["strategy"])),
                                                   float(probability), str(entry["metric"]), float(value)))
                except (KeyError, TypeError, AttributeError):
                    raise PaperTableError(
                        f"{source}: figures[{i}] = {entry!r} needs model, strategy, metric and by_probability"
                    ) from None
                except ValueError as error:
                    raise PaperTableError(f"{source}: figures[{i}]: {error}") from None
            ratios = []
            for i, entry in enumerate(document.get("ratios", [])):
                try:
                    ratios.append(PaperRatio(str(entry["metric"]), Strategy.parse(str(entry["numerator"])),
                                             Strategy.parse(str(entry["denominator"])), float(entry["value"])))
                except (KeyError, TypeError):
                    raise PaperTableError(
                        f"{source}: ratios[{i}] = {entry!r} needs metric, numerator, denominator and value"
                    ) from None
                except ValueError as error:
                    raise PaperTableError(f"{source}: ratios[{i}]: {error}") from None
            return cls(
                key=str(document["key"]),
                title=str(document["title"]),
                source=str(document["source"]),
                models=tuple(str(m) for m in document["models"]),
                strategies=tuple(Strategy.parse(str(s)) for s in document["strategies"]),
                probabilities=tuple(float(p) for p in document["probabilities"]),
                metrics=tuple(str(m) for m in document["metrics"]),
                tolerances={str(k): float(v) for k, v in document.get("tolerances", {}).items()},
                figures=tuple(figures),
                ratios=tuple(ratios),
                missing=str(document.get("missing", "")),
            )
        except PaperTableError:
            raise
        except (TypeError, ValueError, AttributeError) as error:
            raise PaperTableError(f"{source}: {error}") from None


def builtin_tables() -> list[str]:
    """Keys of the paper tables shipped with the package."""
    folder = resources.files("bamboo.bench") / "paper_tables"
    return sorted(p.name[: -len(".json")] for p in folder.iterdir() if p.name.endswith(".json"))


def load_table(key_or_path: str | Path) -> PaperTable:
    """Load a shipped table by key (``table6``, ``dp``) or any table JSON file by path."""
    source = str(key_or_path)
    path = Path(key_or_path)
    if path.suffix == ".json" or path.exists():
        try:
            text = path.read_text(encoding="utf-8")
        except OSError as error:
            raise PaperTableError(f"{source}: cannot read: {error.strerror or error}") from None
    else:
        resource = resources.files("bamboo.bench") / "paper_tables" / f"{key_or_path}.json"
        if not resource.is_file():
            raise PaperTableError(f"unknown paper table {source!r}; shipped: {', '.join(builtin_tables())}")
        text = resource.read_text(encoding="utf-8")
    try:
        document = json.loads(text)
    except json.JSONDecodeError as error:
        raise PaperTableError(f"{source}:{error.lineno}: not JSON: {error.msg}") from None
    if not isinstance(document, dict):
        raise PaperTableError(f"{source}: a paper table is a JSON object")
    return PaperTable.from_dict(document, source)


def _relative_error(simulated: float, paper: float | None) -> float | None:
    if paper is None or paper == 0 or math.isnan(simulated):
        return None
    return simulated / paper - 1.0


@attrs.frozen
class ComparedCell:
    """One cell: the simulated mean beside the paper's figure (None when the table has none)."""

    model: str
    probability: float
    strategy: Strategy
    metric: str
    simulated: float
    paper: float | None
    tolerance: float | None

    @property
    def relative_error(self) -> float | None:
        """simulated / paper - 1, or None without a paper figure."""
        return _relative_error(self.simulated, self.paper)

    @property
    def within(self) -> bool | None:
        """Whether the relative error is within the tolerance; None when nothing is checked."""
        error = self.relative_error
        if error is None or self.tolerance is None:
            return None
        return abs(error) <= self.tolerance

    def as_dict(self) -> dict[str, object]:
        """The JSON object printed by ``bamboo-bench paper --json``."""
        error = self.relative_error
        return {"kind": "cell", "model": self.model, "prob": self.probability, "strategy": self.strategy.value,
                "metric": self.metric, "simulated": round(self.simulated, 4), "paper": self.paper,
                "relative_error": None if error is None else round(error, 4), "tolerance": self.tolerance,
                "within": self.within}


@attrs.frozen
class ComparedRatio:
    """A published aggregate beside the simulated one (the mean of the per-cell ratios listed in `per_cell`)."""

    ratio: PaperRatio
    per_cell: tuple[tuple[str, float, float], ...]
    tolerance: float | None

    @property
    def simulated(self) -> float:
        """The mean over the cells of numerator / denominator."""
        return sum(value for _model, _probability, value in self.per_cell) / len(self.per_cell)

    @property
    def relative_error(self) -> float | None:
        """simulated / paper - 1."""
        return _relative_error(self.simulated, self.ratio.value)

    @property
    def within(self) -> bool | None:
        """Whether the relative error is within the tolerance of the ratio's metric; None when not checked."""
        error = self.relative_error
        if error is None or self.tolerance is None:
            return None
        return abs(error) <= self.tolerance

    @property
    def label(self) -> str:
        """E.g. ``bamboo / checkpoint throughput``."""
        return f"{self.ratio.numerator.value} / {self.ratio.denominator.value} {self.ratio.metric}"

    def as_dict(self) -> dict[str, object]:
        """The JSON object printed by ``bamboo-bench paper --json``."""
        error = self.relative_error
        return {"kind": "ratio", "metric": self.ratio.metric, "numerator": self.ratio.numerator.value,
                "denominator": self.ratio.denominator.value, "simulated": round(self.simulated, 4),
                "paper": self.ratio.value, "relative_error": None if error is None else round(error, 4),
                "tolerance": self.tolerance, "within": self.within,
                "per_cell": [{"model": m, "prob": p, "ratio": round(v, 4)} for m, p, v in self.per_cell]}


@attrs.frozen
class Reproduction:
    """A table reproduced: the averaged results per (model, strategy, probability) and the comparisons."""

    table: PaperTable
    runs: int
    results: Mapping[tuple[str, Strategy, float], AveragedResult]
    cells: tuple[ComparedCell, ...]
    ratios: tuple[ComparedRatio, ...]

    @property
    def checked(self) -> int:
        """How many cells and ratios carry a paper figure and a tolerance."""
        return sum(1 for item in (*self.cells, *self.ratios) if item.within is not None)

    @property
    def failures(self) -> list[str]:
        """One line for each checked cell or ratio outside its tolerance."""
        lines = []
        for cell in self.cells:
            if cell.within is False:
                lines.append(f"{cell.metric} of {cell.strategy.value} on {cell.model} at p={cell.probability:g}: "
                             f"simulated {cell.simulated:.4g}, paper {cell.paper:g} ({cell.relative_error:+.1%}, "
                             f"tolerance {cell.tolerance:.0%})")
        for ratio in self.ratios:
            if ratio.within is False:
                lines.append(f"{ratio.label}: simulated {ratio.simulated:.3f}, paper {ratio.ratio.value:g} "
                             f"({ratio.relative_error:+.1%}, tolerance {ratio.tolerance:.0%})")
        return lines


def _on_demand(profile: ModelProfile) -> AveragedResult:
    """The on-demand reference: never preempted, so one run says it all (its length is the job's)."""
    return average_results([simulate_run([], profile, Strategy.ON_DEMAND)])


def reproduce(
    table: PaperTable,
    runs: int,
    *,
    workers: int | None = None,
    zones: int = 3,
    bulk_mean: float = 2.0,
    policy: Policy | None = None,
    profiles: Mapping[str, ModelProfile] | None = None,
    progress: Callable[[int], None] | None = None,
) -> Reproduction:
    """Simulate every (model, spot strategy) of `table` with `sweep` (`runs` seeds per probability) and compare.

    `profiles` overrides the shipped profile of a model (by name); the rest are loaded with `load_profile`.
    `progress(n)` is called as runs finish (``runs * probabilities`` per model and spot strategy).
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    given = dict(profiles or {})
    results: dict[tuple[str, Strategy, float], AveragedResult] = {}
    for model in table.models:
        profile = given[model] if model in given else load_profile(model)
        for strategy in table.strategies:
            if strategy is Strategy.ON_DEMAND:
                reference = _on_demand(profile)
                for probability in table.probabilities:
                    results[(model, strategy, probability)] = reference
                continue
            rows = sweep(profile, table.probabilities, runs, strategy=strategy, zones=zones, bulk_mean=bulk_mean,
                         policy=policy, workers=workers, progress=progress)
            for row in rows:
                results[(model, strategy, row.probability)] = row.result
    cells = tuple(
        ComparedCell(model, probability, strategy, metric, float(getattr(results[(model, strategy, probability)], metric)),
                     table.figure(model, strategy, probability, metric), table.tolerances.get(metric))
        for model in table.models for probability in table.probabilities
        for strategy in table.strategies for metric in table.metrics
    )
    ratios = tuple(
        ComparedRatio(
            ratio,
            tuple(
                (model, probability, _ratio(results, model, probability, ratio))
                for model in table.models for probability in table.probabilities
            ),
            table.tolerances.get(ratio.metric),
        )
        for ratio in table.ratios
    )
    return Reproduction(table, runs, results, cells, ratios)


def _ratio(results: Mapping[tuple[str, Strategy, float], AveragedResult], model: str, probability: float,
           ratio: PaperRatio) -> float:
    numerator = float(getattr(results[(model, ratio.numerator, probability)], ratio.metric))
    denominator = float(getattr(results[(model, ratio.denominator, probability)], ratio.metric))
    return numerator / denominator if denominator > 0 else math.inf


def cell_text(simulated: float, paper: float | None, digits: int = 2) -> str:
    """``85.64`` or, with a paper figure, ``85.64 / 87.99 (-2.7%)``."""
    text = "-" if math.isnan(simulated) else f"{simulated:.{digits}f}"
    if paper is None:
        return text
    error = _relative_error(simulated, paper)
    return f"{text} / {paper:g}" + ("" if error is None else f" ({error:+.1%})")


def grouped_rows(reproduction: Reproduction) -> list[tuple[str, float, dict[tuple[Strategy, str], ComparedCell]]]:
    """The cells grouped by (model, probability), keyed by (strategy, metric): one printed row each."""
    rows: dict[tuple[str, float], dict[tuple[Strategy, str], ComparedCell]] = {}
    for cell in reproduction.cells:
        rows.setdefault((cell.model, cell.probability), {})[(cell.strategy, cell.metric)] = cell
    return [(model, probability, cells) for (model, probability), cells in rows.items()]


def columns(table: PaperTable) -> Sequence[tuple[Strategy, str]]:
    """The printed columns, metric-major: each metric's strategies side by side."""
    return [(strategy, metric) for metric in table.metrics for strategy in table.strategies]
