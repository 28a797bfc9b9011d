"""Figure-12-style plots: the trace, throughput, cost and value over time, one line per strategy.

Uses matplotlib's Agg backend (no display needed). Throughput is averaged over time bins (a pause
of a few seconds would otherwise be an invisible spike); cost follows the allocated nodes; value
is binned throughput over binned cost. The on-demand strategy is drawn as a dashed reference line
in every panel. A run that finishes before the others stops where it finished. Work that a later
rollback throws away is drawn as no throughput at the time it was done, so each curve's mean is
the run's throughput.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
from bamboo.bench.profile import ModelProfile
from bamboo.bench.simulator import RunResult, Strategy

__all__ = ["binned_mean", "plot_runs"]

_COLOURS = {
    Strategy.BAMBOO: "tab:green",
    Strategy.CHECKPOINT: "tab:red",
    Strategy.SAMPLE_DROPPING: "tab:purple",
    Strategy.ON_DEMAND: "tab:gray",
}


def binned_mean(time_s: np.ndarray, values: np.ndarray, end_s: float, bins: int) -> tuple[np.ndarray, np.ndarray]:
    """Mean of a step function (value[i] holds from time_s[i] to time_s[i+1]) over `bins` equal bins of [0, end_s].

    Returns the bin centres in hours and the means.
    """
    if end_s <= 0 or bins < 1:
        raise ValueError(f"binned_mean needs end_s > 0 and bins >= 1, got end_s={end_s}, bins={bins}")
    edges = np.linspace(0.0, end_s, bins + 1)
    t = np.append(np.asarray(time_s, dtype=np.float64), end_s)
    v = np.asarray(values, dtype=np.float64)
    # Cumulative integral of the step function, evaluated at the bin edges.
    segment = np.clip(np.diff(t), 0.0, None) * v
    cumulative = np.concatenate([[0.0], np.cumsum(segment)])
    index = np.clip(np.searchsorted(t, edges, side="right") - 1, 0, len(v) - 1)
    at_edges = cumulative[index] + (edges - t[index]).clip(min=0.0) * v[index]
    at_edges = np.minimum(at_edges, cumulative[-1])
    means = np.diff(at_edges) / np.diff(edges)
    centres = (edges[:-1] + edges[1:]) / 2.0 / 3600.0
    return centres, means


def plot_runs(
    runs: Sequence[RunResult], profile: ModelProfile, out: Path | str, title: str = "", bins: int = 240
) -> Path:
    """Draw the four panels for `runs` (each recorded with a timeline) and save them as PNG at `out`."""
    if not runs:
        raise ValueError("plot_runs needs at least one run")
    for run in runs:
        if run.timeline is None:
            raise ValueError(f"run of {run.strategy.value} has no timeline (simulate it with record=True)")
    end_s = max(run.duration_h for run in runs) * 3600.0
    on_demand = profile.on_demand_samples_per_second, profile.on_demand_cost_per_hour, profile.on_demand_value
    figure, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    # Bamboo last, so its line is on top where the strategies coincide.
    spot_runs = sorted(
        (r for r in runs if r.strategy is not Strategy.ON_DEMAND), key=lambda r: r.strategy is Strategy.BAMBOO
    )
    if spot_runs:
        timeline = spot_runs[0].timeline
        assert timeline is not None
        axes[0].step(timeline.time_s / 3600.0, timeline.nodes, where="post", color="tab:blue", label="spot nodes")
        axes[0].axhline(profile.desired_nodes, color="black", linewidth=0.8, linestyle=":", label="desired")
    axes[0].axhline(profile.on_demand_nodes, color=_COLOURS[Strategy.ON_DEMAND], linestyle="--", label="on-demand nodes")
    axes[0].set_ylabel("# instances")
    for run in spot_runs:
        timeline = run.timeline
        assert timeline is not None
        colour = _COLOURS[run.strategy]
        hours, rate = binned_mean(timeline.time_s, timeline.rate, end_s, bins)
        _, nodes = binned_mean(timeline.time_s, timeline.nodes, end_s, bins)
        cost = nodes * profile.spot_price_per_node_hour
        value = np.divide(rate, cost, out=np.zeros_like(rate), where=cost > 0)
        # A run that finished early is drawn only up to its own end.
        after = hours > run.duration_h
        rate[after] = cost[after] = value[after] = np.nan
        label = run.strategy.value
        width = 1.8 if run.strategy is Strategy.BAMBOO else 1.2
        axes[1].plot(hours, rate, color=colour, linewidth=width, label=f"{label} (mean {run.throughput:.1f})")
        axes[2].plot(hours, cost, color=colour, linewidth=width, label=f"{label} (mean {run.cost_per_hour:.1f})")
        axes[3].plot(hours, value, color=colour, linewidth=width, label=f"{label} (mean {run.value:.2f})")
    labels = ("on-demand", "on-demand", "on-demand")
    for axis, level, label, digits in zip(axes[1:], on_demand, labels, (1, 1, 2), strict=True):
        axis.axhline(level, color=_COLOURS[Strategy.ON_DEMAND], linestyle="--", label=f"{label} ({level:.{digits}f})")
    axes[1].set_ylabel("throughput\n(kept samples/s)")
    axes[2].set_ylabel("cost ($/h)")
    axes[3].set_ylabel("value\n(samples/s per $/h)")
    axes[3].set_xlabel("time (hours)")
    for axis in axes:
        axis.grid(True, alpha=0.3)
        axis.legend(loc="best", fontsize="small")
        axis.set_ylim(bottom=0)
    axes[0].set_title(title or f"{profile.name}: trace, throughput, cost and value")
    figure.tight_layout()
    path = Path(out)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
