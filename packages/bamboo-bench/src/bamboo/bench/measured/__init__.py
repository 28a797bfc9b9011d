"""bamboo.bench.measured: the measured experiments, a layer above bamboo-launch (``pip install bamboo-bench[measured]``).

Bamboo against the systems users run instead, each one trained for real on the same emulated spot market:

- :mod:`~bamboo.bench.measured.compare`: ``bamboo-bench compare`` runs bamboo, checkpoint/restart and on-demand
  one after the other on one replayed trace, and predicts each run with the simulator from the profile that
  run measured (:func:`run_compare`, :class:`Comparison`); :mod:`~bamboo.bench.measured.figure` draws it;
  :mod:`~bamboo.bench.measured.seeds` runs it once per seed and takes each figure's median and range
  (:func:`run_seeds`, :func:`summarise`);
- :mod:`~bamboo.bench.measured.run`: ``bamboo-bench measure SYSTEM``, one system's run and its measured profile
  (:func:`run_measured`); :mod:`~bamboo.bench.measured.measure` reads a run's constants from its event log
  (:func:`measure_events`) and makes them a simulator profile (:func:`measured_profile`);
  :mod:`~bamboo.bench.measured.progress` says where its training stood when its window ended
  (:func:`progress_at_end`: the samples it kept, as the simulator counts them);
- :mod:`~bamboo.bench.measured.torchrun`: the checkpoint/restart baseline, torchrun elastic agents training
  DeepSpeed's ``PipelineEngine`` with checkpoints every K steps (:func:`run_checkpoint_restart`), its pure
  parts in :mod:`~bamboo.bench.measured.baseline`, its machines in :mod:`~bamboo.bench.measured.machines` and its
  worker in
  :mod:`~bamboo.bench.measured.baseline_worker`; the on-demand baseline is ``bamboo-launch run`` without
  redundancy or preemptions;
- :mod:`~bamboo.bench.measured.options`: what the commands take; :mod:`~bamboo.bench.measured.cli`: the two
  subcommands of ``bamboo-bench``.

bamboo-launch never imports this layer (an import contract in ``pyproject.toml`` says so); it imports
the emulated cluster (:mod:`bamboo.bench.emulated`: run, market) and bamboo-launch's events and reports. Importing it does not import torch.
"""

from bamboo.bench.measured.baseline import (
    CheckpointInterval,
    RestartCost,
    checkpoint_interval,
    usable_pipelines,
)
from bamboo.bench.measured.compare import Comparison, LongRun, SystemResult, run_compare
from bamboo.bench.measured.measure import Measurements, measure_events, measured_profile
from bamboo.bench.measured.options import (
    SYSTEMS,
    CompareError,
    CompareOptions,
    MeasureError,
    MeasureOptions,
    parse_systems,
)
from bamboo.bench.measured.progress import Progress, progress_at_end
from bamboo.bench.measured.run import run_measured
from bamboo.bench.measured.seeds import Spread, SystemSpread, run_seeds, summarise
from bamboo.bench.measured.torchrun import (
    BaselineError,
    CheckpointRestartOptions,
    CheckpointRestartResult,
    run_checkpoint_restart,
)

__all__ = [
    "SYSTEMS",
    "BaselineError",
    "CheckpointInterval",
    "CheckpointRestartOptions",
    "CheckpointRestartResult",
    "CompareError",
    "CompareOptions",
    "Comparison",
    "LongRun",
    "MeasureError",
    "MeasureOptions",
    "Measurements",
    "Progress",
    "RestartCost",
    "Spread",
    "SystemResult",
    "SystemSpread",
    "checkpoint_interval",
    "measure_events",
    "measured_profile",
    "parse_systems",
    "progress_at_end",
    "run_checkpoint_restart",
    "run_compare",
    "run_measured",
    "run_seeds",
    "summarise",
    "usable_pipelines",
]
