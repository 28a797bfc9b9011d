"""bamboo.rc: the Bamboo runtime.

A stage executor that interprets `bamboo.schedule` instruction streams over torch.distributed
(gloo groups under versioned store prefixes), with replica layers, eager FRC with a CPU stash,
exact replica sync, lazy BRC and failover at any instruction. Each node builds exactly the stage
bounds it is given (by default bamboo-reconfig's split, :func:`bamboo.rc.model.stage_bounds`).
`initialize` is the DeepSpeed-compatible front door; `bamboo-rc verify` checks an install end to
end.
"""

from bamboo.rc.comm import PeerFailure
from bamboo.rc.config import ConfigError, TrainingConfig, load_config
from bamboo.rc.coordinator import FailoverCoordinator
from bamboo.rc.engine import Engine, initialize
from bamboo.rc.executor import REDUNDANCY_MODES, ExecutorHook, StageExecutor
from bamboo.rc.failures import (
    AgreementError,
    ConsecutiveFailure,
    FailureEvent,
    FailureNoticed,
    FailureNotices,
    HandedOver,
    StoreFailureNotices,
)
from bamboo.rc.faults import FaultInjector, KillPoint, NoticePoint
from bamboo.rc.interpreter import StageInterpreter
from bamboo.rc.layout import Layout
from bamboo.rc.model import layer_costs, stage_bounds
from bamboo.rc.records import FailoverRecord, RecordError
from bamboo.rc.timeouts import CommTimeouts
from bamboo.rc.transfer import export_stage_state, import_stage_state

__all__ = [
    "REDUNDANCY_MODES",
    "AgreementError",
    "CommTimeouts",
    "ConfigError",
    "ConsecutiveFailure",
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
    "NoticePoint",
    "PeerFailure",
    "RecordError",
    "StageExecutor",
    "StageInterpreter",
    "StoreFailureNotices",
    "TrainingConfig",
    "export_stage_state",
    "import_stage_state",
    "initialize",
    "layer_costs",
    "load_config",
    "stage_bounds",
]
