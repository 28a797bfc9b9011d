"""bamboo.rc: the Bamboo runtime.

A stage executor that interprets `bamboo.schedule` instruction streams over torch.distributed
(gloo groups under versioned store prefixes), with replica layers, eager FRC with a CPU stash,
exact replica sync, lazy BRC and failover at any instruction. Each node builds exactly the stage
bounds it is given (by default bamboo-reconfig's split, :func:`bamboo.rc.model.stage_bounds`).
`initialize` is the DeepSpeed-compatible front door (`PipelineModule`: DeepSpeed's, as a description
that needs no process group); `from_transformers` splits a Hugging Face causal LM into its layers;
`bamboo.rc.data` holds resumable token datasets; `bamboo-rc verify` checks an install end to
end. Bamboo's one checkpoint format (shards with manifests, atomic writes, newest-good loading) is
`bamboo.rc.checkpoint_files`; `AsyncCheckpointer` writes it in the background, and the engine's
`save_checkpoint` writes it too.

Importing ``bamboo.rc`` does not import torch: the failure records, the failover coordinator, the
checkpoint files and the timeouts are plain Python; the engine, the executor and the model load torch
on first use.
"""

from typing import TYPE_CHECKING, Any

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
from bamboo.rc.coordinator import FailoverCoordinator
from bamboo.rc.failures import (
    AgreementError,
    ConsecutiveFailure,
    DeclaredFailed,
    FailureEvent,
    FailureNoticed,
    FailureNotices,
    HandedOver,
    LostContribution,
    PeerFailure,
    StoreFailureNotices,
)
from bamboo.rc.layout import Layout
from bamboo.rc.pipe import PipelineModule
from bamboo.rc.records import FailoverRecord, RecordError
from bamboo.rc.timeouts import CommTimeouts

if TYPE_CHECKING:
    from bamboo.rc.config import ConfigError, ConfigWarning, MonitorConfig, TrainingConfig, load_config
    from bamboo.rc.engine import Engine, initialize
    from bamboo.rc.executor import REDUNDANCY_MODES, ExecutorHook, StageExecutor
    from bamboo.rc.faults import FaultInjector, KillPoint, NoticePoint
    from bamboo.rc.hf import from_transformers
    from bamboo.rc.interpreter import StageInterpreter
    from bamboo.rc.model import layer_costs, stage_bounds
    from bamboo.rc.monitor import StepInfo
    from bamboo.rc.transfer import export_stage_state, import_stage_state

# Names whose modules import torch: loaded on first use, so that the failure records above (which an
# agent process reads and writes) come without torch.
_LAZY = {
    "ConfigError": "config", "ConfigWarning": "config", "MonitorConfig": "config", "TrainingConfig": "config",
    "load_config": "config",
    "Engine": "engine", "initialize": "engine",
    "REDUNDANCY_MODES": "executor", "ExecutorHook": "executor", "StageExecutor": "executor",
    "FaultInjector": "faults", "KillPoint": "faults", "NoticePoint": "faults",
    "from_transformers": "hf",
    "StageInterpreter": "interpreter",
    "layer_costs": "model", "stage_bounds": "model",
    "StepInfo": "monitor",
    "export_stage_state": "transfer", "import_stage_state": "transfer",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'bamboo.rc' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"bamboo.rc.{module}"), name)


__all__ = [
    "REDUNDANCY_MODES",
    "AgreementError",
    "AsyncCheckpointer",
    "CheckpointError",
    "CheckpointInfo",
    "CommTimeouts",
    "ConfigError",
    "ConfigWarning",
    "ConsecutiveFailure",
    "DeclaredFailed",
    "Engine",
    "ExecutorHook",
    "FailoverCoordinator",
    "FailoverRecord",
    "FailureEvent",
    "FailureNoticed",
    "FailureNotices",
    "FaultInjector",
    "HandedOver",
    "KillPoint",
    "Layout",
    "LoadedCheckpoint",
    "LostContribution",
    "MonitorConfig",
    "NoGoodCheckpointError",
    "NoticePoint",
    "PeerFailure",
    "PipelineModule",
    "RecordError",
    "StageExecutor",
    "StageInterpreter",
    "StepInfo",
    "StoreFailureNotices",
    "TrainingConfig",
    "export_stage_state",
    "from_transformers",
    "import_stage_state",
    "initialize",
    "layer_costs",
    "load_checkpoint",
    "load_config",
    "load_latest_good",
    "stage_bounds",
    "write_checkpoint",
]
