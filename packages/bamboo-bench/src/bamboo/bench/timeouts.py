"""Every duration default of bamboo-bench, in one place (seconds).

Two kinds:

- the simulator's timing constants when a profile does not give its own (``bamboo.bench.profile.Timing``):
  the paper's figures for the machines it measured;
- the limits and polls of the measured experiments (:mod:`bamboo.bench.measured`: ``bamboo-bench compare``
  and ``bamboo-bench measure``, the checkpoint/restart baseline under torchrun).

The system's own timeouts (the lease, the grace period, the runtime's) are bamboo-membership's, bamboo-rc's and
bamboo-launch's, in their ``timeouts`` modules, with the table in ``docs/failure-model.md``.
"""

from __future__ import annotations

__all__ = [
    "BASELINE_DROPPED_AGENT_S",
    "BASELINE_FINISH_GRACE_S",
    "BASELINE_IDLE_POLL_S",
    "BASELINE_MONITOR_INTERVAL_S",
    "BASELINE_RDZV_KEEP_ALIVE_ATTEMPTS",
    "BASELINE_RDZV_KEEP_ALIVE_S",
    "BASELINE_RDZV_LAST_CALL_S",
    "BASELINE_RDZV_POLL_S",
    "BASELINE_RDZV_READ_TIMEOUT_S",
    "BASELINE_TIMEOUT_S",
    "CHECKPOINT_INTERVAL_S",
    "COMPARE_CHILD_STOP_S",
    "COMPARE_TIMEOUT_S",
    "GLOBAL_RENDEZVOUS_S",
    "INSTANCE_CREATION_S",
    "LOCAL_RENDEZVOUS_S",
    "MEASURE_GRACE_S",
    "MEASURE_JOIN_AFTER_START_S",
    "MEASURE_STATUS_S",
    "MEASURE_STEP_POLL_S",
    "MEASURE_TTL_S",
    "MEASURE_WARM_POLL_S",
    "STEADY_TIMEOUT_S",
]

# ---- the simulator's defaults (the paper's figures) -------------------------------------------------------

INSTANCE_CREATION_S = 45.0
"""From a spot instance's allocation until it can join (the paper's 45 s)."""

GLOBAL_RENDEZVOUS_S = 30.0
"""The rendezvous of a job that starts from nothing or after a fatal failure (the paper's 30 s)."""

LOCAL_RENDEZVOUS_S = 20.0
"""The rendezvous of a reconfiguration among live workers (the paper's 20 s for BERT and GPT-2)."""

CHECKPOINT_INTERVAL_S = 1800.0
"""Training time between two periodic checkpoints of a profile that does not measure its own."""

# ---- the measured experiments ---------------------------------------------------------------------------------

COMPARE_TIMEOUT_S = 1800.0
"""How long one system's run of ``bamboo-bench compare`` (or ``measure``) may take (``--timeout``)."""

COMPARE_CHILD_STOP_S = 30.0
"""How long a stopped ``bamboo-bench compare`` (Ctrl-C, SIGTERM) waits for the ``measure`` run it started to kill
its own cluster (it is sent SIGTERM) before it kills that run outright."""

STEADY_TIMEOUT_S = 600.0
"""How long ``compare --long-run``'s fault-free measurement one core per stage
(:mod:`bamboo.bench.measured.steady`) may take."""

MEASURE_TTL_S = 10
"""The lease TTL of a measured bamboo run (``bamboo-bench measure --ttl``): longer than ``bamboo-launch run``'s,
so that a loaded machine does not lose leases of live nodes in the middle of a measurement."""

MEASURE_GRACE_S = 10.0
"""The failure detector's grace period in a measured bamboo run (``--grace``); a killed node's closed
connections are seen at once whatever it is."""

MEASURE_WARM_POLL_S = 0.5
"""How often a measured bamboo run reads its workers' ``warm`` records (for the instance-creation cost)."""

MEASURE_STEP_POLL_S = 0.1
"""How often a measured run whose ``--duration`` is over reads its event log while it waits for a step time
(:func:`bamboo.bench.measured.measure.step_time_measured`)."""

MEASURE_JOIN_AFTER_START_S = 0.5
"""A ``join`` record later than this after a measured run's start is a node the market added, not one of the
initial cluster's."""

MEASURE_STATUS_S = 15.0
"""How often ``bamboo-bench compare`` prints a progress line when its output is not a terminal."""

BASELINE_TIMEOUT_S = 900.0
"""How long a checkpoint/restart run may take in all before every node is killed."""

BASELINE_BUILD_LOCK_STALE_S = 600.0
"""A torch C++-extension build lock (a DeepSpeed op that a worker JIT-compiles on a machine's first use; the
baseline's own setup builds none, see :func:`bamboo.bench.measured.baseline.init_deepspeed_gloo`) older than
this was left by a killed build; the baseline removes it before it starts, since every worker would otherwise wait
on it forever."""

BASELINE_FINISH_GRACE_S = 30.0
"""Once the baseline's training is done, how long its torchrun agents may take to exit."""

BASELINE_RDZV_LAST_CALL_S = 1
"""torchrun's ``last_call_timeout`` (whole seconds; torchrun's default is 30): how long a rendezvous round
stays open once it has its minimum of nodes."""

BASELINE_RDZV_KEEP_ALIVE_S = 1
"""torchrun's ``keep_alive_interval`` (whole seconds; default 5)."""

BASELINE_RDZV_KEEP_ALIVE_ATTEMPTS = 5
"""torchrun's ``keep_alive_max_attempt`` (default 3): a node whose heartbeat is older than this many intervals is
dropped from the rendezvous, so a killed node holds up the survivors' restart that long. Fewer than 5 on the 2-core
machine split the job: at a restart the agents' heartbeats were late by over 2 s (1 s x 2), a newcomer dropped
every running agent from the round, torchrun never lets a dropped agent beat again, and the next nodes added
formed a second job of their own instead of restarting the running one (which trained on undisturbed: a
measured checkpoint/restart 15% faster than the simulator's, which restarts at every join)."""

BASELINE_DROPPED_AGENT_S = 3.0
"""A live torchrun agent seen in the rendezvous and missing from it this long was dropped by torchrun
(:mod:`bamboo.bench.measured.rendezvous`); an agent leaves the state only for milliseconds when it restarts its
workers."""

BASELINE_RDZV_READ_TIMEOUT_S = 15
"""torchrun's c10d rendezvous ``read_timeout`` (whole seconds; default 60): how long an agent waits on the
rendezvous store for a round's rank information before it fails (and the launcher restarts the job)."""

BASELINE_MONITOR_INTERVAL_S = 0.1
"""How often a torchrun agent checks its worker and the waiting nodes (``--monitor-interval``)."""

BASELINE_RDZV_POLL_S = 0.1
"""How often the baseline's launcher reads the rendezvous state to see which agents have entered it
(:mod:`bamboo.bench.measured.rendezvous`): the resolution of the measured ``instance_creation_s``."""

BASELINE_IDLE_POLL_S = 0.2
"""How often a baseline worker without a role in its world looks for the job's end."""
