"""bamboo.schedule: the pipeline schedule IR of Bamboo, in pure Python (attrs only, no torch).

It generates (GPipe, 1F1B), transforms (the redundant-computation pass, failover merging),
validates, simulates and draws per-node instruction streams. See the package README, section
"Executing a schedule", for the exact meaning of every instruction.
"""

from bamboo.schedule.generate import add_redundancy, generate, gpipe, one_f_one_b
from bamboo.schedule.ir import COMM_KINDS, COMPUTE_KINDS, Instruction, Kind, RCMode, Schedule

__all__ = [
    "COMM_KINDS",
    "COMPUTE_KINDS",
    "Instruction",
    "Kind",
    "RCMode",
    "Schedule",
    "add_redundancy",
    "generate",
    "gpipe",
    "one_f_one_b",
]
