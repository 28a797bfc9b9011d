"""bamboo.launch: the agent every machine of a job runs, and its parts.

- :mod:`bamboo.launch.agent`: ``bamboo-launch agent``, one per machine and the whole system: the job's
  spec, registration, failure detection, the worker it supervises; :mod:`bamboo.launch.coordinator`: the
  job-wide duties of the elected agent (publishing confirmed failures, the first layout);
- :mod:`bamboo.launch.worker`: the bamboo-rc worker an agent spawns (warm, waiting for a role; failover,
  reconfiguration at step boundaries, checkpoints); :mod:`bamboo.launch.attempt`: starting a new layout
  as an attempt that everyone commits to or abandons; :mod:`bamboo.launch.reconfigure`: the view, the
  restore point; :mod:`bamboo.launch.notices`: how a worker learns of confirmed failures;
- :mod:`bamboo.launch.reference`: the fault-free single-process run of a model (a script's ``reference`` mode);
- :mod:`bamboo.launch.script`: :func:`train_worker`, the one call of a user training script;
  :mod:`bamboo.launch.hooks`: its ``on_step`` and ``evaluate`` hooks (:class:`TrainingHooks`, :class:`Evaluation`);
- :mod:`bamboo.launch.export`: a run's final model, or a checkpoint, as one state dict (``bamboo-launch export``);
- :mod:`bamboo.launch.spec` (the job's spec, a worker's context, a program), :mod:`bamboo.launch.records`
  (the decisions in etcd), :mod:`bamboo.launch.timeouts` (every timeout): shared types;
- :mod:`bamboo.launch.events`: the event log (typed records; JSON lines, or etcd on a cluster);
- checkpoints of the live system (:class:`AsyncCheckpointer`, :func:`load_latest_good`, ...) are written in
  bamboo-rc's one checkpoint format, :mod:`bamboo.rc.checkpoint_files`, and re-exported here;
- :mod:`bamboo.launch.k8s`: Kubernetes manifests for EKS and GKE spot pools, and their validation;
- :mod:`bamboo.launch.live`: the live progress view, folded from an event log as it grows;
- :mod:`bamboo.launch.forkserver`: starting a process through the fork server that an emulated cluster
  names (an agent's worker);
- :mod:`bamboo.launch.cli`: the ``bamboo-launch`` command, one module per subcommand (``agent``, ``export``,
  ``k8s render|validate``, ``watch``, ``finish``), and the subcommands other packages declare in the
  ``bamboo.launch.commands`` entry-point group (``run``, ``market`` and ``report``, from bamboo-bench).

Three layers of bamboo-bench sit above this package, and this package never imports them: a run's value
(:mod:`bamboo.bench.value`: ``bamboo-launch report``, the final report from an event log, its cost at spot and
on-demand prices, its value and its four-panel figure), the emulated spot cluster
(:mod:`bamboo.bench.emulated`: ``bamboo-launch run``'s :func:`run_cluster`, the emulated spot market, one agent
process per node, ``--verify``), and the measured experiments (:mod:`bamboo.bench.measured`:
``bamboo-bench compare``, bamboo against checkpoint/restart and on-demand).

Importing this package does not import torch or matplotlib; the functions that need them do.
"""

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
from bamboo.launch.export import ExportError, export_checkpoint, export_run, save_state_dict
from bamboo.launch.hooks import Evaluation, TrainingHooks
from bamboo.launch.k8s import K8sConfig, ManifestValidationError, render_manifests, validate_manifests
from bamboo.launch.live import EventFollower, LiveState, render_live
from bamboo.launch.reconfigure import build_view, transfer_participants
from bamboo.launch.reference import train_reference_program
from bamboo.launch.script import ScriptError, train_worker
from bamboo.launch.spec import JobSpec, Program, WorkerContext
from bamboo.rc.checkpoint_async import AsyncCheckpointer
from bamboo.rc.checkpoint_files import (
    CheckpointError,
    CheckpointInfo,
    LoadedCheckpoint,
    NoGoodCheckpointError,
    load_checkpoint,
    load_latest_good,
    write_checkpoint,
)

__all__ = [
    "AsyncCheckpointer",
    "Checkpoint",
    "CheckpointError",
    "CheckpointInfo",
    "Evaluation",
    "Event",
    "EventFollower",
    "EventLog",
    "EventLogError",
    "ExportError",
    "Failover",
    "JobSpec",
    "Join",
    "K8sConfig",
    "LiveState",
    "LoadedCheckpoint",
    "ManifestValidationError",
    "NoGoodCheckpointError",
    "Preemption",
    "Program",
    "Reconfiguration",
    "Restore",
    "RunEnd",
    "RunStart",
    "ScriptError",
    "Step",
    "TrainingHooks",
    "WorkerContext",
    "build_view",
    "export_checkpoint",
    "export_run",
    "load_checkpoint",
    "load_latest_good",
    "read_events",
    "render_live",
    "render_manifests",
    "save_state_dict",
    "train_reference_program",
    "train_worker",
    "transfer_participants",
    "validate_manifests",
    "write_checkpoint",
]
