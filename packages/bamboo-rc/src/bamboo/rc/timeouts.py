"""Every timeout and poll interval of bamboo-rc, in seconds, in one place.

Each constant ends in ``_S`` and says what it bounds and what happens when it fires. The four
that a deployment tunes are the defaults of :class:`CommTimeouts` (``GROUP_S``, ``BUILD_S``,
``CONFIRM_S``, ``NOTICE_POLL_S``), which every worker takes as an argument; the launcher and
``bamboo-rc verify`` set them from their flags. The others are poll intervals of
loops that wait on the store (how quickly a wait notices what it waits for), and the defaults of
the self-check (``verify``, ``soak``, the chaos tests).
"""

from __future__ import annotations

import attrs

__all__ = [
    "ASSUMED_STEP_S",
    "BUILD_S",
    "CHAOS_BUILD_S",
    "CHAOS_CONFIRM_S",
    "CHAOS_DEADLINE_S",
    "CHAOS_GROUP_S",
    "COLLECTIVE_SPIN_S",
    "CONFIRM_S",
    "DEFAULT_PREEMPTIONS_PER_NODE_HOUR",
    "EVENT_POLL_S",
    "FINISH_POLL_S",
    "GROUP_S",
    "LEFT_POLL_S",
    "NOTICE_LEAD_S",
    "NOTICE_POLL_S",
    "STORE_POLL_S",
    "STRAGGLER_S",
    "VERIFY_BATCH_WINDOW_S",
    "VERIFY_DEADLINE_S",
    "VERIFY_HOLD_LIMIT_S",
    "VERIFY_STORE_S",
    "VERIFY_WAIT_POLL_S",
    "CommTimeouts",
]

# ---------------------------------------------------------------- the worker (CommTimeouts defaults)
GROUP_S = 60.0
"""The gloo timeout of every group (``CommTimeouts.group``). It bounds a send, receive or
collective whose peer is alive but stuck (a dead peer is noticed within tens of milliseconds
anyway), a group's build (the ones an event changed start in the background when the event is
applied), and the wait in the store for a group's members before a first build on first use. When it
fires, gloo raises and the operation (or the first use of a group whose build failed) becomes a
:class:`~bamboo.rc.PeerFailure`; the store wait gives up and lets the gloo build time out on its own."""

BUILD_S = 120.0
"""``CommTimeouts.build``: how long building a group, or a c10d store client's connection and
reads, may wait for the peers; and how long :meth:`StageExecutor.finish` waits for every live
rank to finish (with several pipelines). When it fires: a RuntimeError (store or gloo timeout,
or ``not every live rank ... finished``)."""

CONFIRM_S = 60.0
"""``CommTimeouts.confirm``: how long a worker that saw a peer fail waits for the authority to
confirm the failure; how long the survivors of a pipeline wait for each other's progress in the
failover agreement; how long a node waits for a hand-over announced at a boundary to be
confirmed. When it fires: the original :class:`~bamboo.rc.PeerFailure` is raised (a slow peer is
not a dead peer, but an unconfirmed failure ends the worker), or a RuntimeError that names the
survivors that did not publish their progress, or the hand-over that was never confirmed."""

NOTICE_POLL_S = 0.02
"""``CommTimeouts.poll``: how often a worker blocked on a transfer or a collective checks for a
confirmed failure event (the gap between an event's publication and a blocked worker noticing
it)."""



@attrs.frozen
class CommTimeouts:
    """The timeouts a worker is given, in seconds (defaults above)."""

    group: float = attrs.field(default=GROUP_S, validator=attrs.validators.gt(0))
    """:data:`GROUP_S`"""
    build: float = attrs.field(default=BUILD_S, validator=attrs.validators.gt(0))
    """:data:`BUILD_S`"""
    confirm: float = attrs.field(default=CONFIRM_S, validator=attrs.validators.gt(0))
    """:data:`CONFIRM_S`"""
    poll: float = attrs.field(default=NOTICE_POLL_S, validator=attrs.validators.gt(0))
    """:data:`NOTICE_POLL_S`"""


# ---------------------------------------------------------------- poll intervals of store waits
STORE_POLL_S = 0.001
"""How often the failover agreement (survivors' progress) and the group barrier (members about
to build a group) read the store again while they wait. Bounded by ``CONFIRM_S`` and
``GROUP_S``."""

STRAGGLER_S = 0.5
"""How long the failover agreement and the group barrier wait for a survivor (a member) before they report it to
the failure authority as a suspect, once per wait: the authority probes it, so a node that died while no data
flowed to it (a survivor killed during another's failover, a member killed before it joined a new layout's
group) is confirmed at once instead of when its lease runs out (its TTL: 2 s by default, more in production), and
a slow one answers the probe and is left alone. Well above an agreement's usual wait (tens of milliseconds)."""

LEFT_POLL_S = 0.2
"""How often a worker blocked in a collective, while a failure event is pending, reads whether a live member left
for the barrier after a consecutive failure (``left/<rank>``, one store read per member). Slower than
``NOTICE_POLL_S``: the read goes to etcd under bamboo-launch, and every node waiting in a collective during a
failover elsewhere makes it; a member that left is rare, and this bounds how long it is waited for."""

EVENT_POLL_S = 0.005
"""How often :meth:`StoreFailureNotices.wait` reads the store again for the event it waits for.
Bounded by the ``timeout`` it is given (``CONFIRM_S`` in the runtime)."""

FINISH_POLL_S = 0.005
"""How often :meth:`StageExecutor.finish` checks whether every live rank finished. Bounded by
``BUILD_S``."""

COLLECTIVE_SPIN_S = 0.0005
"""How long a worker waiting for a collective whose work has no future sleeps between two ``is_completed()``
checks (a work with one wakes the waiter when it completes; either checks for failure events every
``NOTICE_POLL_S``). Bounded by ``GROUP_S`` (gloo)."""

# ---------------------------------------------------------------- the self-check
VERIFY_DEADLINE_S = 300.0
"""``bamboo-rc verify --timeout``: how long verify waits for its workers; when it fires, every
unfinished worker is SIGKILLed and the run fails."""

VERIFY_STORE_S = 60.0
"""The timeout of the TCPStore that verify's parent process hosts for its workers (how long a
``get`` on it may block)."""

VERIFY_BATCH_WINDOW_S = 0.005
"""Deaths that verify's parent sees within this window of each other are confirmed as one
failure event (the parent is the failure authority in verify)."""

VERIFY_HOLD_LIMIT_S = 10.0
"""The longest verify's parent holds back the confirmation of a death for
``KillPoint.hold_confirmation_until`` (the held node may itself be blocked on the victim; the
run then goes on unforced)."""

VERIFY_WAIT_POLL_S = 0.002
"""How often verify's parent polls ``waitpid`` and the store while it waits for its workers."""

NOTICE_LEAD_S = 60.0
"""``bamboo-rc verify --notice-lead`` (``NoticePoint.lead_s``): seconds from a preemption notice to
the preemption. A lead too short for the rest of the iteration turns the notice into an ordinary
failure at the deadline."""

CHAOS_GROUP_S = 30.0
"""``CommTimeouts.group`` of the runs of ``bamboo-rc soak`` and the chaos tests."""

CHAOS_BUILD_S = 30.0
"""``CommTimeouts.build`` of the runs of ``bamboo-rc soak`` and the chaos tests."""

CHAOS_CONFIRM_S = 15.0
"""``CommTimeouts.confirm`` of the runs of ``bamboo-rc soak`` and the chaos tests."""

CHAOS_DEADLINE_S = 120.0
"""The verify deadline (``VERIFY_DEADLINE_S``) of each run of ``bamboo-rc soak`` and the chaos
tests."""

ASSUMED_STEP_S = 1.0
"""The fault-free step `redundancy="auto"` assumes before one was measured (it sets how much a failure's
recomputation costs against the fault-free price of each mode)."""
DEFAULT_PREEMPTIONS_PER_NODE_HOUR = 0.1
"""The preemption rate `redundancy="auto"` assumes when none is given and before a job has history of its own:
the lowest of the rates the Bamboo paper measured on EC2 spot instances (10% to 33% of the nodes an hour)."""
