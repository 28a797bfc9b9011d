"""The emulated spot market: replay a preemption trace, compressed in time, against real processes.

Two halves, kept apart so that the timing logic is tested without sleeping:

1. :func:`plan_market` is a pure function from trace events to a time-ordered tuple of
   :class:`MarketAction` (``notify``, ``kill``, ``add``) at wall-clock offsets:

   - a trace ``remove`` at ``t`` becomes ``kill`` at ``t / time_scale``;
   - with ``notice_s > 0`` it is preceded by ``notify`` at ``t / time_scale - notice_s`` (not before
     the node exists), whose deadline is the kill's offset;
   - a trace ``add`` at ``t > 0`` becomes ``add`` at ``t / time_scale + allocation_delay_s`` (the
     time a new instance takes to boot and start its agent, in wall seconds, not compressed).
     Adds at ``t == 0`` are the initial cluster and start at once;
   - a node removed before (or at the instant) its ``add`` would have run never starts: its add,
     notice and kill are all dropped (it never existed for the cluster).

2. :class:`SpotMarket` executes a plan on an injectable :class:`Clock` through pluggable
   :class:`MarketActions` callbacks: ``add(zone) -> node`` starts a node and names it,
   ``kill(node)`` and ``notify(node, deadline)``. The market maps each trace node to the node
   that ``add`` returned. :class:`bamboo.bench.emulated.processes.ProcessCluster` is the real implementation: one process per node,
   each in its own session (so its own process group), killed with ``SIGKILL`` to the whole group,
   notified with ``SIGTERM`` to its leader.

Compact string form of an action: ``kill node3@us-east-1a@12.5s``.
"""

from __future__ import annotations

import enum
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Protocol

import attrs

__all__ = [
    "ActionKind",
    "Clock",
    "ExecutedAction",
    "MarketAction",
    "MarketActions",
    "MonotonicClock",
    "SpotMarket",
    "StartedClock",
    "TraceEventLike",
    "market_rate",
    "plan_market",
]

logger = logging.getLogger(__name__)


class ActionKind(enum.Enum):
    """What the market does to a node. At equal times adds go first, then notices, then kills."""

    NOTIFY = "notify"
    KILL = "kill"
    ADD = "add"

    @property
    def order(self) -> int:
        """Tie-break rank at equal times."""
        return {ActionKind.ADD: 0, ActionKind.NOTIFY: 1, ActionKind.KILL: 2}[self]


class TraceEventLike(Protocol):
    """The shape of one trace event the market reads (``bamboo.bench.trace.TraceEvent`` has it)."""

    @property
    def time_s(self) -> float: ...

    @property
    def kind(self) -> object: ...  # an enum whose .value is "add"/"remove", or the string itself

    @property
    def node(self) -> str: ...

    @property
    def zone(self) -> str: ...


def _kind_name(kind: object) -> str:
    name = getattr(kind, "value", kind)
    if name not in ("add", "remove"):
        raise ValueError(f"trace event kind must be 'add' or 'remove', got {kind!r}")
    return str(name)


@attrs.frozen
class MarketAction:
    """One scheduled action: at ``at_s`` wall seconds after the market starts, do ``kind`` to ``node``.

    ``node`` is the trace's node name; ``deadline_s`` (notices only) is the offset of its kill.
    """

    at_s: float = attrs.field(validator=attrs.validators.ge(0.0))
    kind: ActionKind = attrs.field(validator=attrs.validators.instance_of(ActionKind))
    node: str = attrs.field(validator=attrs.validators.min_len(1))
    zone: str = attrs.field(validator=attrs.validators.min_len(1))
    deadline_s: float | None = None

    def __str__(self) -> str:
        return f"{self.kind.value} {self.node}@{self.zone}@{self.at_s:g}s"


def plan_market(
    events: Iterable[TraceEventLike],
    *,
    time_scale: float = 1.0,
    allocation_delay_s: float = 0.0,
    notice_s: float = 0.0,
    zone_of: Mapping[str, str] | None = None,
) -> tuple[MarketAction, ...]:
    """The actions that replay ``events`` compressed by ``time_scale``, in execution order.

    ``zone_of`` (say :func:`bamboo.bench.preemptions.assign_zones`) overrides the trace's zones. Raises ``ValueError``
    naming the event if the trace removes a node that is not alive or adds one twice.
    """
    if not time_scale > 0:
        raise ValueError(f"time_scale must be > 0, got {time_scale!r}")
    if not allocation_delay_s >= 0:
        raise ValueError(f"allocation_delay_s must be >= 0, got {allocation_delay_s!r}")
    if not notice_s >= 0:
        raise ValueError(f"notice_s must be >= 0, got {notice_s!r}")
    added_at: dict[str, tuple[float, str, int]] = {}
    actions: list[tuple[float, int, int, MarketAction]] = []
    sequence = itertools.count()
    for event in events:
        kind = _kind_name(event.kind)
        zone = zone_of[event.node] if zone_of is not None else event.zone
        at = event.time_s / time_scale
        if kind == "add":
            if event.node in added_at:
                raise ValueError(
                    f"trace adds node {event.node!r} at {event.time_s:g}s but it is already alive"
                )
            start = at if event.time_s == 0 else at + allocation_delay_s
            added_at[event.node] = (start, zone, next(sequence))  # adds keep their trace order
            continue
        if event.node not in added_at:
            raise ValueError(f"trace removes node {event.node!r} at {event.time_s:g}s but it is not alive")
        start, zone, add_sequence = added_at.pop(event.node)
        if start >= at:
            logger.info(
                "node %s is removed at %.3fs before its delayed start at %.3fs: never started",
                event.node,
                at,
                start,
            )
            continue
        actions.append(
            (
                start,
                ActionKind.ADD.order,
                add_sequence,
                MarketAction(start, ActionKind.ADD, event.node, zone),
            )
        )
        if notice_s > 0:
            notify_at = max(start, at - notice_s)
            if notify_at < at:
                notify = MarketAction(notify_at, ActionKind.NOTIFY, event.node, zone, deadline_s=at)
                actions.append((notify_at, ActionKind.NOTIFY.order, next(sequence), notify))
        actions.append(
            (at, ActionKind.KILL.order, next(sequence), MarketAction(at, ActionKind.KILL, event.node, zone))
        )
    for node, (start, zone, add_sequence) in added_at.items():  # alive at the end of the trace
        actions.append(
            (start, ActionKind.ADD.order, add_sequence, MarketAction(start, ActionKind.ADD, node, zone))
        )
    actions.sort(key=lambda item: item[:3])
    return tuple(action for *_, action in actions)


class Clock(Protocol):
    """Time for the market: ``now()`` in seconds, and ``sleep(seconds, stop)`` that ends early on ``stop``."""

    def now(self) -> float: ...

    def sleep(self, seconds: float, stop: threading.Event) -> None: ...


class MonotonicClock:
    """The real clock: ``time.monotonic`` and an interruptible wait."""

    def now(self) -> float:
        return time.monotonic()

    def sleep(self, seconds: float, stop: threading.Event) -> None:
        stop.wait(max(0.0, seconds))


class StartedClock(MonotonicClock):
    """The market's clock of an emulated run: frozen until :meth:`start_now`, then monotonic from that instant.

    The initial nodes start at once (offset 0); every later action of the trace is timed from the first
    training step, so the workers' start-up (imports, group building) is not compressed trace time and no
    kill lands before training begins.
    """

    def __init__(self) -> None:
        self._frozen_at: float | None = time.monotonic()
        self._shift = 0.0

    def now(self) -> float:
        return self._frozen_at if self._frozen_at is not None else time.monotonic() - self._shift

    def start_now(self) -> None:
        """Start the clock (once; later calls change nothing)."""
        if self._frozen_at is not None:
            self._shift = time.monotonic() - self._frozen_at
            self._frozen_at = None


class MarketActions(Protocol):
    """What the market does to the cluster.

    ``add(zone)`` starts a node in ``zone`` and returns its name; ``kill(node)`` kills it at once;
    ``notify(node, deadline)`` warns it that it will be killed at ``deadline`` (the market clock's
    time, seconds).
    """

    def add(self, zone: str) -> str: ...

    def kill(self, node: str) -> None: ...

    def notify(self, node: str, deadline: float) -> None: ...


@attrs.frozen
class ExecutedAction:
    """An action that ran: when (market clock, seconds since start), and on which live node."""

    action: MarketAction
    executed_at_s: float
    live_node: str


class SpotMarket:
    """Executes a plan from :func:`plan_market` on a clock, through ``actions``.

    Use :meth:`run_due` to run what is due now (deterministic tests drive a fake clock), or
    :meth:`run` / :meth:`start` to replay the whole plan. ``on_action`` is called after each
    action with its :class:`ExecutedAction` (the CLI writes the event log there). A failing action
    is logged and recorded in ``failures``; the replay goes on.
    """

    def __init__(
        self,
        plan: Sequence[MarketAction],
        actions: MarketActions,
        *,
        clock: Clock | None = None,
        on_action: Callable[[ExecutedAction], None] | None = None,
    ) -> None:
        self.plan = tuple(plan)
        self._actions = actions
        self._clock = clock or MonotonicClock()
        self._on_action = on_action
        self._next = 0
        self._started_at: float | None = None
        self._live: dict[str, str] = {}
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.executed: list[ExecutedAction] = []
        self.failures: list[tuple[MarketAction, BaseException]] = []

    @property
    def live_nodes(self) -> dict[str, str]:
        """Trace node -> live node, for nodes started and not killed."""
        return dict(self._live)

    @property
    def done(self) -> bool:
        """Whether every action of the plan has run."""
        return self._next >= len(self.plan)

    @property
    def adds_pending(self) -> bool:
        """Whether the plan still has a node to start (an ``add`` not yet run)."""
        return any(action.kind is ActionKind.ADD for action in self.plan[self._next:])

    def elapsed(self) -> float:
        """Seconds since the market started (0 before)."""
        if self._started_at is None:
            return 0.0
        return self._clock.now() - self._started_at

    def run_due(self) -> float | None:
        """Run every action due by now; return the offset of the next one, or None when done."""
        if self._started_at is None:
            self._started_at = self._clock.now()
        now = self.elapsed()
        while self._next < len(self.plan) and self.plan[self._next].at_s <= now:
            action = self.plan[self._next]
            self._next += 1
            self._execute(action, now)
        return None if self.done else self.plan[self._next].at_s

    def _execute(self, action: MarketAction, now: float) -> None:
        live = self._live.get(action.node, "")
        try:
            if action.kind is ActionKind.ADD:
                live = self._actions.add(action.zone)
                self._live[action.node] = live
            elif action.kind is ActionKind.NOTIFY:
                if not live:
                    raise RuntimeError(f"notice for {action.node}, which is not running")
                assert action.deadline_s is not None and self._started_at is not None
                self._actions.notify(live, self._started_at + action.deadline_s)
            else:
                if not live:
                    raise RuntimeError(f"kill of {action.node}, which is not running")
                del self._live[action.node]
                self._actions.kill(live)
        except Exception as error:
            logger.error("market action %s failed: %s", action, error)
            self.failures.append((action, error))
            return
        executed = ExecutedAction(action=action, executed_at_s=now, live_node=live)
        self.executed.append(executed)
        if self._on_action is not None:
            self._on_action(executed)

    def run(self) -> None:
        """Replay the whole plan (or until :meth:`stop`), sleeping on the clock between actions."""
        while not self._stop.is_set():
            next_at = self.run_due()
            if next_at is None:
                return
            self._clock.sleep(next_at - self.elapsed(), self._stop)

    def start(self) -> None:
        """Replay in a background thread."""
        if self._thread is not None:
            raise RuntimeError("market already started")
        self._thread = threading.Thread(target=self.run, name="bamboo-spot-market", daemon=True)
        self._thread.start()

    def stop(self, timeout: float | None = None) -> None:
        """Stop replaying (actions already run stay done) and join the thread."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)

    def join(self, timeout: float | None = None) -> bool:
        """Wait for a :meth:`start`-ed replay to finish; True if it did."""
        if self._thread is None:
            return self.done
        self._thread.join(timeout)
        return not self._thread.is_alive()


def market_rate(plan: Sequence[MarketAction], duration_s: float) -> float:
    """The preemptions per node-hour of wall time that ``plan`` carries out over its first ``duration_s``
    seconds: its kills over the time integral of its live nodes (0.0 when it kills none)."""
    if duration_s <= 0:
        raise ValueError(f"duration_s must be > 0, got {duration_s!r}")
    alive, node_seconds, kills, last = 0, 0.0, 0, 0.0
    for action in sorted(plan, key=lambda a: (a.at_s, a.kind.order)):
        at = min(action.at_s, duration_s)
        node_seconds += alive * (at - last)
        last = at
        if action.at_s > duration_s:
            break
        if action.kind is ActionKind.ADD:
            alive += 1
        elif action.kind is ActionKind.KILL:
            alive, kills = alive - 1, kills + 1
    node_seconds += alive * (duration_s - last)
    return kills / (node_seconds / 3600.0) if kills and node_seconds > 0 else 0.0
