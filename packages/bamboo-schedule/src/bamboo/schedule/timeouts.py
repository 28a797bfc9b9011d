"""Every default number of seconds of ``bamboo.schedule`` in one place: the failure model's assumed costs of the
system's reactions, which `choose_redundancy` weighs against the fault-free price of each redundancy mode.

They are this system's order of magnitude on a small job (see docs/failure-model.md for the running system's
measured figures); each one is a field of `bamboo.schedule.FailureModel`, so a caller with its own measurements
passes them instead.
"""

from __future__ import annotations

__all__ = [
    "CHECKPOINT_INTERVAL_S",
    "DETECT_S",
    "REBUILD_AFTER_S",
    "RECONFIGURE_S",
    "RESTORE_S",
    "SECONDS_PER_HOUR",
]

SECONDS_PER_HOUR = 3600.0
"""Rates are given per hour; the schedule's figures are in seconds."""

DETECT_S = 0.1
"""From a kill to every survivor of the pipeline knowing the confirmed failure (the demo's measured median)."""

RECONFIGURE_S = 2.0
"""The pause of the reconfiguration that rebuilds redundancy after a failover."""

REBUILD_AFTER_S = 60.0
"""How long a pipeline runs its merged failover schedule before that reconfiguration (a replacement's start)."""

RESTORE_S = 30.0
"""A restart from the newest checkpoint, when a stage has no live copy."""

CHECKPOINT_INTERVAL_S = 600.0
"""Time between checkpoints; a restore redoes half of it on average."""
