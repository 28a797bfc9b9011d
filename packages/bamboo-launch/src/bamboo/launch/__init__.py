"""bamboo.launch: the launcher's self-contained parts, composed later into ``bamboo-launch run``.

- :mod:`bamboo.launch.events`: the JSON-lines event log (typed records, documented schema);
- :mod:`bamboo.launch.report`: the final report from an event log (throughput, node-hours, spot
  and on-demand cost, value) and its four-panel plot;
- :mod:`bamboo.launch.checkpoint`: atomic asynchronous checkpoints, loading the newest good one;
- :mod:`bamboo.launch.market`: the emulated spot market (a pure plan, a scheduler on an injectable
  clock, real process-group kills);
- :mod:`bamboo.launch.k8s`: Kubernetes manifests for EKS and GKE spot pools, and their validation;
- :mod:`bamboo.launch.live`: the live progress view, folded from an event log as it grows;
- :mod:`bamboo.launch.cli`: the ``bamboo-launch`` command (``k8s render|validate``, ``market``,
  ``report``, ``watch``).

Importing this package does not import torch or matplotlib; the functions that need them do.
"""

from bamboo.launch.checkpoint import (
    AsyncCheckpointer,
    CheckpointError,
    CheckpointInfo,
    LoadedCheckpoint,
    NoGoodCheckpointError,
    load_checkpoint,
    load_latest_good,
    write_checkpoint,
)
from bamboo.launch.events import (
    Checkpoint,
    Event,
    EventLog,
    EventLogError,
    Failover,
    Join,
    Preemption,
    Reconfiguration,
    RunEnd,
    RunStart,
    Step,
    read_events,
)
from bamboo.launch.k8s import K8sConfig, ManifestValidationError, render_manifests, validate_manifests
from bamboo.launch.live import EventFollower, LiveState, render_live
from bamboo.launch.market import (
    ActionKind,
    MarketAction,
    MonotonicClock,
    ProcessCluster,
    SpotMarket,
    assign_zones,
    kill_process_group,
    plan_market,
)
from bamboo.launch.report import Prices, Report, ReportError, compute_report, format_report, plot_report

__all__ = [
    "ActionKind",
    "AsyncCheckpointer",
    "Checkpoint",
    "CheckpointError",
    "CheckpointInfo",
    "Event",
    "EventFollower",
    "EventLog",
    "EventLogError",
    "Failover",
    "Join",
    "K8sConfig",
    "LiveState",
    "LoadedCheckpoint",
    "ManifestValidationError",
    "MarketAction",
    "MonotonicClock",
    "NoGoodCheckpointError",
    "Preemption",
    "Prices",
    "ProcessCluster",
    "Reconfiguration",
    "Report",
    "ReportError",
    "RunEnd",
    "RunStart",
    "SpotMarket",
    "Step",
    "assign_zones",
    "compute_report",
    "format_report",
    "kill_process_group",
    "load_checkpoint",
    "load_latest_good",
    "plan_market",
    "plot_report",
    "read_events",
    "render_live",
    "render_manifests",
    "validate_manifests",
    "write_checkpoint",
]
