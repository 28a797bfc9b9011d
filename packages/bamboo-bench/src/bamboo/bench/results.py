"""What a simulated run adds up to: `RunResult` per run (with its `Timeline` when recorded), and the means of
several runs of one strategy (`AveragedResult`, `average_results`)."""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np
from bamboo.bench.strategy import Strategy

__all__ = ["AveragedResult", "RunResult", "Timeline", "average_results"]


@attrs.frozen
class Timeline:
    """Step functions over a run: after `time_s[i]`, `nodes[i]` allocated nodes and throughput `rate[i]` samples/s."""

    time_s: np.ndarray
    nodes: np.ndarray
    rate: np.ndarray


@attrs.frozen
class RunResult:
    """The outcome of one simulated run.

    `interval_h` is the mean time between consecutive preemptions (NaN with fewer than two);
    `lifetime_h` the mean lifetime of the instances (survivors count until the end); `nodes` the
    time-averaged allocated nodes; `throughput` trained samples per second of wall time (rolled
    back work does not count); `cost_per_hour` the mean $/h; `value` = throughput / cost_per_hour;
    `progress_share` the share of wall time spent on training steps that were kept.
    """

    strategy: Strategy
    completed: bool
    duration_h: float
    samples: float
    preemptions: int
    interval_h: float
    lifetime_h: float
    fatal_failures: int
    reconfigurations: int
    nodes: float
    throughput: float
    cost_per_hour: float
    value: float
    progress_share: float
    timeline: Timeline | None = attrs.field(default=None, repr=False)

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict (NaN becomes None)."""
        return _json_ready(self, skip="timeline")


@attrs.frozen
class AveragedResult:
    """Means over several runs of one strategy (NaN intervals are left out of the interval mean)."""

    strategy: Strategy
    runs: int
    completed_runs: int
    duration_h: float
    preemptions: float
    interval_h: float
    lifetime_h: float
    fatal_failures: float
    nodes: float
    throughput: float
    cost_per_hour: float
    value: float
    progress_share: float

    def as_dict(self) -> dict[str, object]:
        """A JSON-ready dict (NaN becomes None)."""
        return _json_ready(self)


def _json_ready(result: RunResult | AveragedResult, skip: str | None = None) -> dict[str, object]:
    """`result`'s fields but `skip` as a JSON-ready dict: a strategy by its name, floats to 6 places, NaN as None."""
    out: dict[str, object] = {}
    for field in attrs.fields(type(result)):
        if field.name == skip:
            continue
        value = getattr(result, field.name)
        if isinstance(value, Strategy):
            value = value.value
        elif isinstance(value, float):
            value = None if math.isnan(value) else round(value, 6)
        out[field.name] = value
    return out


def average_results(results: Sequence[RunResult]) -> AveragedResult:
    """Average per-run results (all of one strategy)."""
    if not results:
        raise ValueError("average_results needs at least one result")
    strategies = {r.strategy for r in results}
    if len(strategies) != 1:
        raise ValueError(f"average_results mixes strategies {sorted(s.value for s in strategies)}")

    def mean(name: str) -> float:
        values = np.array([getattr(r, name) for r in results], dtype=np.float64)
        values = values[~np.isnan(values)]
        return float(values.mean()) if len(values) else math.nan

    return AveragedResult(
        strategy=results[0].strategy,
        runs=len(results),
        completed_runs=sum(r.completed for r in results),
        duration_h=mean("duration_h"),
        preemptions=mean("preemptions"),
        interval_h=mean("interval_h"),
        lifetime_h=mean("lifetime_h"),
        fatal_failures=mean("fatal_failures"),
        nodes=mean("nodes"),
        throughput=mean("throughput"),
        cost_per_hour=mean("cost_per_hour"),
        value=mean("value"),
        progress_share=mean("progress_share"),
    )
