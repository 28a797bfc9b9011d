"""bamboo.bench.value: what a run of bamboo-launch gave for its cost, from its event log; a layer above bamboo-launch.

- :mod:`~bamboo.bench.value.report`: the run's final report (:func:`compute_report`): throughput, node-hours, cost
  at spot prices against the same work on demand, value (throughput per $/h), where the time went;
- :mod:`~bamboo.bench.value.figure`: its timeline (:func:`compute_timeline`) and four-panel figure
  (:func:`plot_report`: nodes, throughput, cost and value over time, the layout of :func:`bamboo.bench.plot.plot_runs`);
- :mod:`~bamboo.bench.value.cli`: ``bamboo-launch report``, which bamboo-launch's command line finds through the
  ``bamboo.launch.commands`` entry-point group (bamboo-launch never imports this layer: an import contract in
  ``pyproject.toml`` says so).

The emulated cluster (:mod:`bamboo.bench.emulated`) prints this report after a run, and the measured experiments
(:mod:`bamboo.bench.measured`) compare runs by it; this layer imports neither. Importing it does not import torch
or matplotlib; :func:`plot_report` does.
"""

from bamboo.bench.value.figure import Timeline, compute_timeline, plot_report
from bamboo.bench.value.report import (
    DEFAULT_BINS,
    DEFAULT_ON_DEMAND_PRICE,
    DEFAULT_SPOT_PRICE,
    Prices,
    Report,
    ReportError,
    compute_report,
    format_report,
)

__all__ = [
    "DEFAULT_BINS",
    "DEFAULT_ON_DEMAND_PRICE",
    "DEFAULT_SPOT_PRICE",
    "Prices",
    "Report",
    "ReportError",
    "Timeline",
    "compute_report",
    "compute_timeline",
    "format_report",
    "plot_report",
]
