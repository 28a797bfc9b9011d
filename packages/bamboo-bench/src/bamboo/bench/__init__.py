"""bamboo.bench: spot preemption traces and the trace-driven simulator (throughput, cost, value).

- Traces: `Trace` (timed add/remove events with node and zone; slicing, compression, summaries)
  and loaders for the paper's EC2 event CSV, GCP count logs, AWS count curves and Auto Scaling
  Group count CSVs, SkyPilot count JSON and our generic CSV (`load_trace` picks the format; a folder of per-zone
  files is one trace, `load_trace_folder`).
- `SyntheticSpec` / `generate_trace`: the paper's synthetic preemption model, seedable.
- `ModelProfile` / `load_profile`: model profiles as JSON data (format in the package README).
- `simulate_run`, `simulate_synthetic`, `sweep`: the discrete-event simulator of the `Strategy`
  values bamboo, checkpoint, on-demand and sample-dropping, per run (`RunResult`) and averaged. The
  bamboo strategy runs the system's policy (bamboo-reconfig's ``decide`` and ``plan_layout``, on
  integers in `bamboo.bench.policy`); ``check_policy=True`` checks each run against bamboo-reconfig
  itself (`PolicyMismatch`).
- `PaperTable` / `load_table` / `reproduce` (in `bamboo.bench.paper`): the paper's tables as JSON data
  (``table6``, ``dp``), reproduced on the synthetic model and compared figure by figure (`Reproduction`).
- `load_preemptions` (in `bamboo.bench.preemptions`): the one reader of ``--preemptions FILE|synthetic:RATE``
  with ``--zones``, shared by bamboo-launch's and bamboo-bench's commands.
- `bamboo.bench.emulated` (``pip install bamboo-bench[emulated]``, a layer above bamboo-launch, not imported
  here): the emulated spot cluster, ``bamboo-launch run`` and ``bamboo-launch market`` (bamboo-launch finds them
  through the ``bamboo.launch.commands`` entry points).
- `bamboo.bench.measured` (``pip install bamboo-bench[measured]``, a layer above the emulated one, not imported
  here): the measured comparison of bamboo, checkpoint/restart and on-demand (``bamboo-bench compare``), each
  run predicted by the simulator from the profile it measured.
- `plot_runs` (in `bamboo.bench.plot`, imported lazily because it loads matplotlib): Figure-12
  style panels. The CLI is `bamboo-bench` (`bamboo.bench.cli:main`).

Importing the package imports none of its modules: each name above is loaded on first use (``from
bamboo.bench import Trace`` imports ``bamboo.bench.trace`` only), so bamboo-launch's agents and workers, which
use the ``--preemptions`` reader and the argparse helpers, never load the simulator (numpy) they do not run.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from bamboo.bench.loaders import (
        TraceFormatError,
        load_count_csv,
        load_count_curve,
        load_ec2_events,
        load_gcp_counts,
        load_generic_csv,
        load_skypilot_counts,
        load_trace,
        load_trace_folder,
        write_generic_csv,
    )
    from bamboo.bench.paper import (
        PaperTable,
        PaperTableError,
        Reproduction,
        builtin_tables,
        load_table,
        reproduce,
    )
    from bamboo.bench.preemptions import PreemptionsError, load_preemptions
    from bamboo.bench.profile import ModelProfile, ProfileError, Timing, builtin_profiles, load_profile
    from bamboo.bench.results import AveragedResult, RunResult, Timeline, average_results
    from bamboo.bench.simulator import holding_at_most, simulate_run, simulate_synthetic
    from bamboo.bench.strategy import Policy, PolicyMismatch, Strategy
    from bamboo.bench.sweep import SweepRow, sweep
    from bamboo.bench.synthetic import SyntheticSpec, SyntheticTraceGenerator, generate_trace
    from bamboo.bench.trace import EventKind, Trace, TraceEvent, TraceSummary

_MODULE_OF = {
    "AveragedResult": "results",
    "EventKind": "trace",
    "ModelProfile": "profile",
    "PaperTable": "paper",
    "PaperTableError": "paper",
    "Policy": "strategy",
    "PolicyMismatch": "strategy",
    "PreemptionsError": "preemptions",
    "ProfileError": "profile",
    "Reproduction": "paper",
    "RunResult": "results",
    "Strategy": "strategy",
    "SweepRow": "sweep",
    "SyntheticSpec": "synthetic",
    "SyntheticTraceGenerator": "synthetic",
    "Timeline": "results",
    "Timing": "profile",
    "Trace": "trace",
    "TraceEvent": "trace",
    "TraceFormatError": "loaders",
    "TraceSummary": "trace",
    "average_results": "results",
    "builtin_profiles": "profile",
    "builtin_tables": "paper",
    "generate_trace": "synthetic",
    "holding_at_most": "simulator",
    "load_count_csv": "loaders",
    "load_count_curve": "loaders",
    "load_ec2_events": "loaders",
    "load_gcp_counts": "loaders",
    "load_generic_csv": "loaders",
    "load_preemptions": "preemptions",
    "load_profile": "profile",
    "load_skypilot_counts": "loaders",
    "load_table": "paper",
    "load_trace": "loaders",
    "load_trace_folder": "loaders",
    "reproduce": "paper",
    "simulate_run": "simulator",
    "simulate_synthetic": "simulator",
    "sweep": "sweep",
    "write_generic_csv": "loaders",
}
"""Where each public name lives (loaded on first use)."""

__all__ = [
    "AveragedResult",
    "EventKind",
    "ModelProfile",
    "PaperTable",
    "PaperTableError",
    "Policy",
    "PolicyMismatch",
    "PreemptionsError",
    "ProfileError",
    "Reproduction",
    "RunResult",
    "Strategy",
    "SweepRow",
    "SyntheticSpec",
    "SyntheticTraceGenerator",
    "Timeline",
    "Timing",
    "Trace",
    "TraceEvent",
    "TraceFormatError",
    "TraceSummary",
    "average_results",
    "builtin_profiles",
    "builtin_tables",
    "generate_trace",
    "holding_at_most",
    "load_count_csv",
    "load_count_curve",
    "load_ec2_events",
    "load_gcp_counts",
    "load_generic_csv",
    "load_preemptions",
    "load_profile",
    "load_skypilot_counts",
    "load_table",
    "load_trace",
    "load_trace_folder",
    "reproduce",
    "simulate_run",
    "simulate_synthetic",
    "sweep",
    "write_generic_csv",
]


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'bamboo.bench' has no attribute {name!r}")
    value = getattr(importlib.import_module(f"bamboo.bench.{module}"), name)
    globals()[name] = value
    return value
