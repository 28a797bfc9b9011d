"""bamboo.launch: the launcher, ``bamboo-launch run``, and its self-contained parts.

- :mod:`bamboo.launch.run`: :func:`run_cluster` composes everything (embedded etcd, the market,
  one agent per node, the first layout, the failure authority, the event log) and
  :func:`compare_with_reference` checks a run against a fault-free single-process run;
- :mod:`bamboo.launch.node` / :mod:`bamboo.launch.worker`: one node's agent process and the
  bamboo-rc worker it spawns (``python -m bamboo.launch.node|worker``);
- :mod:`bamboo.launch.script`: :func:`train_worker`, the one call of a user training script run by
  ``bamboo-launch run ... -- SCRIPT ARGS`` (its layers, loss and data; the same worker loop);
- :mod:`bamboo.launch.authority`: the runtime's failure interface wired to bamboo-membership
  (imports torch; not re-exported here);
- :mod:`bamboo.launch.reconfigure`: the cluster view and layer-transfer plan of a reconfiguration;
- :mod:`bamboo.launch.events`: the JSON-lines event log (typed records, documented schema);
- :mod:`bamboo.launch.report`: the final report from an event log (throughput, node-hours, spot
  and on-demand cost, value) and its four-panel plot;
- :mod:`bamboo.launch.checkpoint`: atomic asynchronous checkpoints, loading the newest good one;
- :mod:`bamboo.launch.market`: the emulated spot market (a pure plan, a scheduler on an injectable
  clock, real process-group kills);
- :mod:`bamboo.launch.k8s`: Kubernetes manifests for EKS and GKE spot pools, and their validation;
- :mod:`bamboo.launch.live`: the live progress view, folded from an event log as it grows;
- :mod:`bamboo.launch.cli`: the ``bamboo-launch`` command (``run``, ``k8s render|validate``,
  ``market``, ``report``, ``watch``).

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
    Restore,
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
from bamboo.launch.reconfigure import build_view, transfer_participants, transfer_plan
from bamboo.launch.report import Prices, Report, ReportError, compute_report, format_report, plot_report
from bamboo.launch.run import (
    RunError,
    RunHandles,
    RunOptions,
    RunResult,
    compare_with_reference,
    run_cluster,
    train_reference_history,
    train_reference_program,
)
from bamboo.launch.script import Program, ScriptError, train_worker

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
    "Program",
    "Reconfiguration",
    "Report",
    "ReportError",
    "Restore",
    "RunEnd",
    "RunError",
    "RunHandles",
    "RunOptions",
    "RunResult",
    "RunStart",
    "ScriptError",
    "SpotMarket",
    "Step",
    "assign_zones",
    "build_view",
    "compare_with_reference",
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
    "run_cluster",
    "train_reference_history",
    "train_reference_program",
    "train_worker",
    "transfer_participants",
    "transfer_plan",
    "validate_manifests",
    "write_checkpoint",
]
