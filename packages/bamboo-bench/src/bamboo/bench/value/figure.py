"""A run's timeline and its four-panel figure (nodes, throughput, cost and value over time), from its event log.

The timeline bins the run's window (:func:`bamboo.bench.value.report.run_window`) into equal bins: the alive
nodes averaged over each bin, the samples of its steps spread over the time each step ran, and the spot cost and
value of each bin at the :class:`~bamboo.bench.value.report.Prices` given.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from pathlib import Path

import attrs
from bamboo.bench.value.report import (
    DEFAULT_BINS,
    Prices,
    ReportError,
    compute_report,
    node_intervals,
    run_window,
)
from bamboo.launch.events import Event, Preemption, Step

__all__ = ["Timeline", "compute_timeline", "plot_report"]


@attrs.frozen
class Timeline:
    """Per-bin series for the four-panel plot; ``times`` are bin starts in seconds."""

    times: tuple[float, ...]
    nodes: tuple[float, ...]
    throughput: tuple[float, ...]
    cost_per_hour: tuple[float, ...]
    value: tuple[float, ...]
    preemption_times: tuple[float, ...]


def compute_timeline(events: Sequence[Event], prices: Prices | None = None, bins: int = DEFAULT_BINS,
                     billing: Sequence[Event] | None = None) -> Timeline:
    """Bin the run into ``bins`` equal windows: average alive nodes, throughput, $/h and value.

    A step's samples are spread evenly over ``[t - duration_s, t]`` (clipped to the window). ``billing`` as for
    :func:`bamboo.bench.value.compute_report`.
    """
    prices = prices or Prices()
    if bins < 1:
        raise ValueError(f"bins must be >= 1, got {bins}")
    ordered = sorted(events, key=lambda e: e.t)
    if not ordered:
        raise ReportError("the event log is empty")
    start, end, _ = run_window(ordered)
    if end <= start:
        raise ReportError(f"the run has no duration (start t={start}, end t={end})")
    width = (end - start) / bins
    edges = [start + i * width for i in range(bins + 1)]
    billed = ordered if billing is None else sorted(billing, key=lambda e: e.t)
    intervals = [span for spans in node_intervals(billed, end).values() for span in spans]
    nodes = []
    for lo, hi in itertools.pairwise(edges):
        overlap = sum(max(0.0, min(b, hi) - max(a, lo)) for a, b in intervals)
        nodes.append(overlap / width)
    samples = [0.0] * bins
    for step in (e for e in ordered if isinstance(e, Step)):
        # Spread a step's samples evenly over the time it ran, so bins do not alias with steps.
        begin = max(start, step.t - step.duration_s)
        if step.t <= begin:
            samples[min(bins - 1, max(0, int((step.t - start) / width)))] += step.samples
            continue
        rate = step.samples / (step.t - begin)
        first = min(bins - 1, max(0, int((begin - start) / width)))
        last = min(bins - 1, max(0, int((step.t - start) / width)))
        for index in range(first, last + 1):
            overlap = min(step.t, edges[index + 1]) - max(begin, edges[index])
            if overlap > 0:
                samples[index] += rate * overlap
    throughput = [s / width for s in samples]
    cost = [n * prices.spot for n in nodes]
    value = [tp / c if c > 0 else 0.0 for tp, c in zip(throughput, cost, strict=True)]
    return Timeline(
        times=tuple(edges[:-1]),
        nodes=tuple(nodes),
        throughput=tuple(throughput),
        cost_per_hour=tuple(cost),
        value=tuple(value),
        preemption_times=tuple(e.t for e in ordered if isinstance(e, Preemption)),
    )


def plot_report(
    events: Sequence[Event],
    out: str | Path,
    prices: Prices | None = None,
    bins: int = DEFAULT_BINS,
    billing: Sequence[Event] | None = None,
) -> Path:
    """Write the four-panel figure (nodes, throughput, cost, value over time) to ``out`` (PNG).

    The layout is bamboo-bench's ``plot_runs`` (the paper's Figure 12): the cluster, then
    throughput, cost and value, with the on-demand reference dashed. ``plot_runs`` itself takes
    simulator results and a model profile, not a measured run, so the figure is drawn here with
    the same panels, labels and colours: the run in green (bench's Bamboo colour), preemptions as
    red ticks on the cluster panel, and the on-demand reference in grey on the value panel (and on
    the throughput and cost panels when a measured on-demand run is given in ``prices``). ``billing`` as for
    :func:`bamboo.bench.value.compute_report`.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prices = prices or Prices()
    report = compute_report(events, prices, billing)
    timeline = compute_timeline(events, prices, bins, billing)
    width = (timeline.times[1] - timeline.times[0]) if len(timeline.times) > 1 else 0.0
    minutes = [(t + width / 2) / 60.0 for t in timeline.times]  # bin centres
    figure, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    green, grey = "tab:green", "tab:gray"
    axes[0].step([t / 60.0 for t in timeline.times], timeline.nodes, where="post", color="tab:blue",
                 label=f"spot nodes (mean {report.avg_nodes:.2f})")  # fmt: skip
    for index, t in enumerate(timeline.preemption_times):
        axes[0].axvline(
            t / 60.0, color="tab:red", alpha=0.5, linewidth=0.8, label="preemption" if index == 0 else None
        )
    axes[0].set_ylabel("# instances")
    axes[1].plot(minutes, timeline.throughput, color=green, label=f"bamboo (mean {report.throughput:.2f})")
    axes[2].plot(
        minutes, timeline.cost_per_hour, color=green, label=f"bamboo (mean {report.cost_per_hour:.2f})"
    )
    axes[3].plot(minutes, timeline.value, color=green, label=f"bamboo (mean {report.value:.2f})")
    if prices.on_demand_throughput is not None and prices.on_demand_nodes is not None:
        on_demand_cost = prices.on_demand_nodes * prices.on_demand
        axes[1].axhline(prices.on_demand_throughput, color=grey, linestyle="--",
                        label=f"on-demand ({prices.on_demand_throughput:.1f})")  # fmt: skip
        axes[2].axhline(on_demand_cost, color=grey, linestyle="--", label=f"on-demand ({on_demand_cost:.1f})")
    axes[3].axhline(report.on_demand_value, color=grey, linestyle="--",
                    label=f"on-demand ({report.on_demand_value:.2f})")  # fmt: skip
    axes[1].set_ylabel("throughput\n(samples/s)")
    axes[2].set_ylabel("cost ($/h)")
    axes[3].set_ylabel("value\n(samples/s per $/h)")
    axes[3].set_xlabel("time (minutes)")
    for axis in axes:
        axis.grid(True, alpha=0.3)
        axis.legend(loc="upper right", fontsize="small")
        axis.set_ylim(bottom=0)
    axes[0].set_title(
        f"{report.job}: trace, throughput, cost and value ({report.preemptions} preemptions, "
        f"{report.failovers} failovers, {report.reconfigurations} reconfigurations)"
    )
    figure.tight_layout()
    path = Path(out)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
