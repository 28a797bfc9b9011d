"""The figure of a comparison: the paper's Figure 12 with the three measured systems, the simulator dotted."""

from __future__ import annotations

from pathlib import Path

from bamboo.bench.measured.compare import Comparison

__all__ = ["plot_comparison"]

_COLOURS = {"bamboo": "tab:green", "checkpoint": "tab:red", "on-demand": "tab:gray"}


def plot_comparison(comparison: Comparison, out: Path | str) -> Path:
    """Four panels over each run's wall time (the paper's Figure 12): nodes, throughput, cost and value, one
    colour per system; measured solid, the simulator's prediction dotted; kills as red ticks on the top panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from bamboo.bench.plot import binned_mean

    figure, axes = plt.subplots(4, 1, figsize=(9, 10), sharex=True)
    for name, result in comparison.results.items():
        colour = _COLOURS[name]
        timeline = result.timeline
        times = np.asarray(timeline["times"], dtype=float)
        width = times[1] - times[0] if len(times) > 1 else result.duration_s
        minutes = (times + width / 2) / 60.0
        nodes = np.asarray(timeline["nodes"], dtype=float)
        rate = np.asarray(timeline["throughput"], dtype=float)
        cost = nodes * result.price
        value = np.divide(rate, cost, out=np.zeros_like(rate), where=cost > 0)
        axes[0].step(times / 60.0, nodes, where="post", color=colour, label=f"{name} nodes (mean {result.avg_nodes:.2f})")
        axes[1].plot(minutes, rate, color=colour, label=f"{name} (mean {result.throughput:.2f})")
        axes[2].plot(minutes, cost, color=colour, label=f"{name} (mean {result.cost_per_hour:.2f})")
        axes[3].plot(minutes, value, color=colour, label=f"{name} (mean {result.value:.2f})")
        if name == "bamboo":
            for index, t in enumerate(timeline.get("preemptions", [])):
                axes[0].axvline(t / 60.0, color="tab:red", alpha=0.4, linewidth=0.8,
                                label="preemption (bamboo run)" if index == 0 else None)
        simulated = result.predicted.timeline
        if simulated is not None and result.duration_s > 0:
            end = max(float(simulated.time_s[-1]), result.predicted.duration_h * 3600.0)
            hours, sim_rate = binned_mean(simulated.time_s, simulated.rate, end, len(times) or 60)
            _, sim_nodes = binned_mean(simulated.time_s, simulated.nodes, end, len(times) or 60)
            sim_cost = sim_nodes * result.price
            sim_value = np.divide(sim_rate, sim_cost, out=np.zeros_like(sim_rate), where=sim_cost > 0)
            axes[1].plot(hours * 60.0, sim_rate, color=colour, linestyle=":", linewidth=1.2,
                         label=f"{name} simulated (mean {result.predicted.throughput:.2f})")
            axes[3].plot(hours * 60.0, sim_value, color=colour, linestyle=":", linewidth=1.2,
                         label=f"{name} simulated (mean {result.predicted.value:.2f})")
    axes[0].set_ylabel("# instances")
    axes[1].set_ylabel("throughput\n(samples/s)")
    axes[2].set_ylabel("cost ($/h)")
    axes[3].set_ylabel("value\n(samples/s per $/h)")
    axes[3].set_xlabel("time since the run's start (minutes)")
    for axis in axes:
        axis.grid(True, alpha=0.3)
        axis.legend(loc="best", fontsize="x-small")
        axis.set_ylim(bottom=0)
    options = comparison.options
    length = f"{options.steps} steps" if options.steps is not None else f"{options.duration_s:g} s"
    axes[0].set_title(f"measured: {options.preemptions} at x{options.time_scale:g}, P={options.stages}, "
                      f"D={options.pipelines}, {length} (dotted: simulated with the measured profiles)", fontsize=9)
    figure.tight_layout()
    path = Path(out)
    figure.savefig(path, dpi=110)
    plt.close(figure)
    return path
