"""Every timeout and poll interval of bamboo-launch, in one place (seconds).

``docs/failure-model.md`` has the table of all of them (with the flag that sets each, and what happens
when it fires); a test fails when a default here differs from that table. The lease TTL, the grace
period and the runtime's timeouts are owned by bamboo-membership and bamboo-rc; the agent's flags
default to theirs.
"""

from __future__ import annotations

__all__ = [
    "ABANDONED_JOIN_S",
    "AGENT_POLL_S",
    "ATTEMPT_POLL_S",
    "ATTEMPT_READY_POLL_S",
    "ATTEMPT_STORE_POLL_MAX_S",
    "AUTO_PRIOR_NODE_HOURS",
    "COPY_INDEX_S",
    "COPY_TRANSFER_S",
    "DECISION_POLL_S",
    "ETCD_OUTAGE_S",
    "ETCD_RETRY_S",
    "K8S_API_TIMEOUT_S",
    "K8S_GRACE_PERIOD_S",
    "K8S_LEASE_PER_NODE_S",
    "LEADER_POLL_S",
    "LIVE_REDRAW_S",
    "NODE_SHORTAGE_SAY_S",
    "NOTICE_DIRECT_READ_S",
    "OWN_WRITE_SEEN_S",
    "RECONFIGURE_TIMEOUT_S",
    "RESTORE_EVERY_MAX_S",
    "ROLE_RESCAN_S",
    "SCRIPT_DESCRIBE_TIMEOUT_S",
    "SCRIPT_REFERENCE_TIMEOUT_S",
    "SPEC_POLL_S",
    "SPEC_WAIT_S",
    "THREAD_JOIN_S",
    "WATCH_POLL_S",
    "WORKER_EXIT_GRACE_S",
    "WORKER_POLL_S",
]

RECONFIGURE_TIMEOUT_S = 120.0
"""How long a reconfiguration attempt may take to start every node of the new layout before it is
abandoned and decided again (``--reconfigure-timeout``). A node that dies meanwhile is noticed sooner."""

ETCD_OUTAGE_S = 30.0
"""How long a worker's etcd calls, and an agent's agreement on the job's spec at its start, are retried while
etcd is unreachable (or too loaded to answer) before the error is raised."""

ETCD_RETRY_S = 0.1
"""The pause between two tries of an etcd call while etcd is unreachable."""

NOTICE_DIRECT_READ_S = 0.05
"""While a worker's watch of failure events is down (etcd restarting), how often a poll reads etcd directly."""

OWN_WRITE_SEEN_S = 1.0
"""How long the coordinator waits, after writing a layout, for its watch of the layout key to deliver it, so that
the rest of its round (publishing a failure reported meanwhile) works on that layout. The watch delivers in
milliseconds; when it does not, the round goes on and the watch's wake-up runs the next one."""

LEADER_POLL_S = 5.0
"""How often an agent's coordinator runs a round when nothing woke it. The coordinator's key, the layout, the
job's end, the membership, the failure reports and the workers' warm records are all watched, and a change wakes it at once (a confirmed
dead coordinator's lease is revoked, its key goes, and another agent takes over within milliseconds): this
only bounds the effect of a missed wake-up, at no cost (the watched values are read without a request)."""

AGENT_POLL_S = 1.0
"""The longest an agent sleeps between two looks at its lease and its preemption deadline. Its worker's exit,
the job's end and SIGTERM wake it at once (they are waited on, not polled), so an idle agent wakes once a
second; a lease lost under it (the node was declared dead and is fenced) is acted on within this. Also how
often a worker checks that its agent (its parent) is still there."""

SPEC_WAIT_S = 600.0
"""How long an agent waits for another agent to write the job's spec (``--spec-timeout``)."""

WORKER_EXIT_GRACE_S = 30.0
"""Once the job has ended, how long an agent waits for its worker to exit by itself before killing it."""

SCRIPT_DESCRIBE_TIMEOUT_S = 300.0
"""How long a user script may take to describe its model (``describe`` mode) before it is an error."""

SCRIPT_REFERENCE_TIMEOUT_S = 900.0
"""How long a user script may take to train the ``--verify`` reference before it is an error."""

SPEC_POLL_S = 0.2
"""How often an agent that waits for another agent to write the job's spec looks again."""

K8S_API_TIMEOUT_S = 10.0
"""Deadline of the agent's one request to the Kubernetes API (its node's zone label, ``--k8s-node``)."""

K8S_LEASE_PER_NODE_S = 0.0045
"""Seconds of lease TTL per node that ``k8s render`` gives the agents (``--ttl``, at least ``LEASE_TTL_S``): the
start-up burst measured at 1,000 agents on one etcd (p99 4.2-5.5 s, ``docs/results/scale.json``), per agent; a
lease refresh etcd answers later than the TTL loses the lease (:func:`bamboo.launch.k8s_sizing.size_for`)."""

K8S_GRACE_PERIOD_S = 15
"""The rendered pods' ``terminationGracePeriodSeconds`` (``k8s render --grace-period``): from SIGTERM (a
preemption notice) to the kill. GKE spot gives non-system pods 15 s."""

ROLE_RESCAN_S = 5.0
"""How often a worker without a role looks for a layout being prepared when nothing woke it: the layout and every
decision of the job are watched, and a change wakes it at once; this is the safety net. Each look is an etcd read,
after which gRPC's thread pool wakes for a while: at 1 s a standby worker spent 22 to 24 CPU-s per hour of
training, at 5 s 16.6 and 18.7 in two runs (`tests/benchmarks/bench_control_cost.py`)."""

WORKER_POLL_S = 0.05
"""How often a worker without a role checks the layout and the job's end (and how often holders at a
barrier that lack nodes for one pipeline try again)."""

NODE_SHORTAGE_SAY_S = 10.0
"""How often holders at a barrier that wait for enough nodes for one pipeline say so in their log."""

DECISION_POLL_S = 0.02
"""How often a worker at a barrier, or waiting for a decision, reads etcd again."""

STRAGGLER_S = 0.5
"""How long a holder at a barrier waits for another holder's ``ready`` record, and a node of a reconfiguration
attempt whose own part is done waits for another owner's ``up`` record (or whose part, or its build of a prepared
layout, has waited as long at the new groups' rendezvous, where an owner killed before it joined leaves it),
before it reports that node to its agent as a suspect (once each). Between two layouts no data flows, so a node
killed there fails no peer's operation: without the report it was found when its lease expired (the TTL: 2 s of a
measured 2.6 s decision). The agent's detector probes it: a dead one is confirmed and its lease revoked at once, a
slow one answers and is left alone."""

FIRST_STRAGGLER_S = 0.15
"""How long the first owner (by node name) of a reconfiguration attempt's layout, its own part done, waits for
the other owners' ``up`` records before it reports those missing to its agent as suspects; every other node waits
`STRAGGLER_S`. A joiner killed at the switch was found only after `STRAGGLER_S` (a pause of 1.0 to 1.2 s against
0.1 to 0.3 s without it, under heavy churn and on the GCP trace); one node reporting early costs each straggler one
probe (a live one answers and is left alone), where every node reporting early would probe it from each of them."""

ATTEMPT_POLL_S = 0.2
"""How often a node of a reconfiguration attempt checks its outcome, the nodes up and the membership while its own
part runs. Neither the end of that part nor an outcome another node writes waits for it: either wakes the node at
once (`bamboo.launch.attempt.AttemptWake`), which then publishes that it is up, or follows the outcome."""

ATTEMPT_READY_POLL_S = 0.02
"""How often a node of a reconfiguration attempt whose own part is done checks the outcome and the nodes up
(the training of the new layout waits on it)."""

ATTEMPT_STORE_POLL_MAX_S = 0.02
"""Longest pause between reads of an attempt's abandonable c10d store while it waits for a key."""

ABANDONED_JOIN_S = 0.06
"""How long a node waits for the thread of an abandoned attempt to end before it goes on (to the barrier, or back
to warm). A thread ends within one read of the attempt's store once it is abandoned (``ATTEMPT_STORE_POLL_MAX_S``,
three of them fit); one blocked in gloo on a peer does not, dead or abandoned too: it is left behind, reads the old
stage state only, and ends at the group's timeout or when the peer's connection closes, freeing what it holds.
It was 2 s, which two live nodes blocked on each other's transfer spent in full, inside a measured
reconfiguration's pause; then 0.25 s, which a node blocked on a joiner killed during the switch still spent in
full: under heavy churn it reached the next barrier 0.23 s after the others, and every abandoned switch paused
that much longer."""

COPY_TRANSFER_S = 10.0
"""Deadline of one in-memory copy sent to a keeper, or fetched from one for a restore (connection and each
read); a send that misses it is dropped (the next copy step sends again), a fetch tries the next keeper."""

COPY_INDEX_S = 0.05
"""Shortest pause between two updates of a node's index of in-memory copies in etcd (changes in between are
published together)."""

WATCH_POLL_S = 0.5
"""How often ``bamboo-launch watch`` reads the event log again (``--interval``)."""

LIVE_REDRAW_S = 1.0
"""Shortest time between two redraws of a live view (``bamboo-launch watch``, ``bamboo-launch run``): records that
arrive in between are drawn together. A redraw of the whole panel costs about 3.4 ms of CPU; redrawn at every
read that found records, the launcher of a 6-node job stepping about 17 times a second used 4.4% of a core, and
2.4% with this cap."""

THREAD_JOIN_S = 5.0
"""How long stopping waits for a background thread (the coordinator, the event recorder) to end."""

AUTO_PRIOR_NODE_HOURS = 1.0
"""Not a timeout, the one default of ``--redundancy auto`` that bamboo-launch adds: the node-hours of history at
the assumed rate (``--preemption-rate``, or bamboo-rc's ``DEFAULT_PREEMPTIONS_PER_NODE_HOUR``) that a job's own
preemption rate is weighed against (:func:`bamboo.launch.redundancy.observed_rate`): the assumed rate alone at the
start, half and half after one node-hour, the job's own rate after many."""

RESTORE_EVERY_MAX_S = 1800.0
"""The longest interval between two restore points that ``--checkpoint-every auto`` / ``--memory-copy-every auto``
choose (:mod:`bamboo.launch.restore_interval`): where preemptions are so rare that Young's rule would wait longer,
a point every half hour of steps, as a DeepSpeed user would checkpoint."""
