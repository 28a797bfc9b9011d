"""Every timeout and poll interval of the emulated cluster (``bamboo-launch run``, ``bamboo-launch market``), in
one place (seconds).

``docs/failure-model.md`` has them in its table, beside bamboo-launch's own (:mod:`bamboo.launch.timeouts`, which
the agents the cluster starts use); a test fails when a default here differs from that table.
"""

from __future__ import annotations

__all__ = [
    "FORK_SERVER_START_S",
    "LIVE_REFRESH_S",
    "MARKET_DRY_STALL_S",
    "MARKET_STOP_S",
    "PROGRESS_POLL_S",
    "REAP_TIMEOUT_S",
    "RECORDER_RETRY_S",
    "RUN_POLL_S",
    "RUN_TIMEOUT_S",
]

RUN_TIMEOUT_S = 3600.0
"""How long ``bamboo-launch run`` may take in all before every node is killed (``--timeout``)."""

RUN_POLL_S = 0.1
"""How often ``bamboo-launch run`` checks its agents and the job's records while it waits for the first step."""

RECORDER_RETRY_S = 1.0
"""How long the event recorder of ``bamboo-launch run`` waits before it tries its first read of the event log again
(etcd unreachable, a malformed record); once that read started the watch, each record is written as it comes."""

PROGRESS_POLL_S = 0.25
"""How often ``bamboo-launch run --no-live`` checks its agents and folds the new records into its progress lines
(the end of a job is noticed within this; the live view reads at :data:`LIVE_REFRESH_S`)."""

LIVE_REFRESH_S = 0.25
"""How often the live view of ``bamboo-launch run`` reads the event log again (it is redrawn when records
arrived, at most every :data:`bamboo.launch.timeouts.LIVE_REDRAW_S`)."""

MARKET_DRY_STALL_S = 30.0
"""How long ``bamboo-launch run`` waits without a new step, once its market has no node left to start and the nodes
alive are too few for one pipeline, before it stops the run (say why and exit 1) instead of waiting to its
``--timeout`` for nodes that will never come. A pipeline that failed over trains on fewer nodes than stages, and
its steps keep the run going."""

MARKET_STOP_S = 10.0
"""How long ``bamboo-launch run`` waits for the market's thread to stop at the end."""

FORK_SERVER_START_S = 120.0
"""How long an emulated cluster's fork server may take to import torch and bamboo before the launcher gives
it up (:mod:`bamboo.bench.emulated.forkserver`; a loaded machine takes seconds)."""

REAP_TIMEOUT_S = 10.0
"""How long the emulated market waits for a SIGKILLed node's process to be reaped (then it is reported)."""
