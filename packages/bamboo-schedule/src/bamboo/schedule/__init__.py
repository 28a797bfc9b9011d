"""bamboo.schedule: the pipeline schedule IR of Bamboo, in pure Python (attrs only, no torch).

It generates (GPipe, 1F1B), transforms (the redundant-computation pass, failover merging),
validates, simulates and draws per-node instruction streams. See the package README, section
"Executing a schedule", for the exact meaning of every instruction.
"""

from bamboo.schedule.choose import (
    FailureModel,
    ModeEstimate,
    RedundancyChoice,
    choose_redundancy,
    stage_work_costs,
)
from bamboo.schedule.cut import progress_at
from bamboo.schedule.engine import Deadlock, ExecutionError, Mismatch, Timeline, counterpart, execute
from bamboo.schedule.export import chrome_trace, text_grid, time_grid
from bamboo.schedule.failover import failover_schedule
from bamboo.schedule.failover_plan import (
    ConsecutiveFailure,
    FailoverPlan,
    check_victims,
    merged_schedule,
    placement_after,
)
from bamboo.schedule.failover_validate import validate_failover
from bamboo.schedule.generate import add_redundancy, generate, gpipe, one_f_one_b
from bamboo.schedule.ir import BUFFERED_SENDS, COMM_KINDS, COMPUTE_KINDS, Instruction, Kind, RCMode, Schedule
from bamboo.schedule.simulate import Costs, SimResult, StageCost, simulate
from bamboo.schedule.validate import ScheduleError, validate

__all__ = [
    "BUFFERED_SENDS",
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "ConsecutiveFailure",
    "Costs",
    "Deadlock",
    "ExecutionError",
    "FailoverPlan",
    "FailureModel",
    "Instruction",
    "Kind",
    "Mismatch",
    "ModeEstimate",
    "RCMode",
    "RedundancyChoice",
    "Schedule",
    "ScheduleError",
    "SimResult",
    "StageCost",
    "Timeline",
    "add_redundancy",
    "check_victims",
    "choose_redundancy",
    "chrome_trace",
    "counterpart",
    "execute",
    "failover_schedule",
    "generate",
    "gpipe",
    "merged_schedule",
    "one_f_one_b",
    "placement_after",
    "progress_at",
    "simulate",
    "stage_work_costs",
    "text_grid",
    "time_grid",
    "validate",
    "validate_failover",
]
