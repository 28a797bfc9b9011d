"""bamboo.rc: the Bamboo runtime.

A stage executor that interprets `bamboo.schedule` instruction streams over torch.distributed
(gloo groups under versioned store prefixes), with replica layers, eager FRC with a CPU stash,
exact replica sync, lazy BRC and failover at any instruction. `initialize` is the
DeepSpeed-compatible front door; `bamboo-rc verify` checks an install end to end.
"""

from bamboo.rc.comm import CommTimeouts, PeerFailure
from bamboo.rc.config import ConfigError, TrainingConfig, load_config
from bamboo.rc.engine import Engine, initialize
from bamboo.rc.executor import REDUNDANCY_MODES, KillPoint, Layout, StageExecutor
from bamboo.rc.failures import (
    ConsecutiveFailure,
    FailureEvent,
    FailureNotices,
    StoreFailureNotices,
)
from bamboo.rc.transfer import export_stage_state, import_stage_state

__all__ = [
    "REDUNDANCY_MODES",
    "CommTimeouts",
    "ConfigError",
    "ConsecutiveFailure",
    "Engine",
    "FailureEvent",
    "FailureNotices",
    "KillPoint",
    "Layout",
    "PeerFailure",
    "StageExecutor",
    "StoreFailureNotices",
    "TrainingConfig",
    "export_stage_state",
    "import_stage_state",
    "initialize",
    "load_config",
]
