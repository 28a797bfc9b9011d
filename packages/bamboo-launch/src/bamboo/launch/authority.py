"""Wiring the runtime's failure interface to bamboo-membership: worker side and launcher side.

`bamboo.rc` learns of failures through :class:`bamboo.rc.FailureNotices`: a worker *suspects* a
peer, and an authority *confirms* failures by publishing a :class:`bamboo.rc.FailureEvent` (the
next runtime epoch and the global ranks that died) in the c10d store the workers share. Here:

- :class:`MembershipFailureNotices` (in each worker) is :class:`bamboo.rc.StoreFailureNotices`
  over the etcd-backed c10d store, whose ``suspect`` is also forwarded to the node's agent over
  gRPC (``AgentClient.report_peer_failure``), so that the agent's ``FailureDetector`` probes the
  suspect. A poll that cannot reach etcd (etcd restarting) answers "nothing confirmed yet"
  instead of crashing the worker; the transfer it guards keeps waiting.
- :class:`FailureAuthority` (in the launcher) runs a ``FailureDetector`` of its own, which sees
  every ``NodeFailed`` (probe-confirmed neighbour reports written by any agent, and lease
  expiries). It maps each failed node to its global rank in the current layout (``roles()``:
  the generation and node -> rank) and publishes the ranks that failed within
  ``batch_window_s`` (default 2.5 s: the probe and lease paths confirm kills of one instant up to about the 2 s lease TTL apart, and bamboo-rc handles failures of one event together) of each other as one event of that generation's job
  (``<job>-g<generation>``, epochs counted from 1 in each generation), so a consecutive pair
  killed together is one event.

Nobody acts on a suspicion alone: only what the membership detector confirmed is published.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from bamboo.membership import (
    AgentClient,
    DetectorConfig,
    FailureDetector,
    GrpcProber,
    MembershipStore,
    NodeFailed,
)
from bamboo.membership.kv import StoreError, StoreUnavailableError
from bamboo.rc import FailureEvent, StoreFailureNotices
from torch.distributed import Store

__all__ = ["FailureAuthority", "MembershipFailureNotices", "PatientKV"]

log = logging.getLogger(__name__)


class PatientKV:
    """A key-value store (``EtcdKV``) whose calls ride out an etcd outage of up to ``outage_s`` seconds.

    Each call that fails with ``StoreUnavailableError`` (etcd down or restarting) is retried every
    ``retry_s`` (0.1 s) until ``outage_s`` (30 s) has passed, then the error is raised. The runtime
    reads the c10d store at every step, so the workers' store sits on this: a restarted etcd only
    pauses them. Other errors are raised at once.
    """

    def __init__(self, kv: object, outage_s: float = 30.0, retry_s: float = 0.1) -> None:
        self._kv = kv
        self.outage_s = outage_s
        self.retry_s = retry_s

    def __getattr__(self, name: str) -> object:
        attribute = getattr(self._kv, name)
        if not callable(attribute):
            return attribute

        def patient(*args: object, **kwargs: object) -> object:
            deadline = time.monotonic() + self.outage_s
            while True:
                try:
                    return attribute(*args, **kwargs)
                except StoreUnavailableError:
                    if time.monotonic() > deadline:
                        raise
                    time.sleep(self.retry_s)

        return patient


class MembershipFailureNotices(StoreFailureNotices):
    """The worker's :class:`bamboo.rc.FailureNotices`: events from the store, suspicions to the agent.

    ``node_of_rank`` names the node that runs each global rank (for the agent's detector).
    """

    def __init__(
        self, store: Store, job: str, agent: AgentClient | None, node_of_rank: dict[int, str]
    ) -> None:
        super().__init__(store, job)
        self.agent = agent
        self.node_of_rank = dict(node_of_rank)

    def suspect(self, epoch: int, reporter: int, peer: int, instruction: str) -> None:
        node = self.node_of_rank.get(peer)
        if self.agent is not None and node is not None:
            try:
                self.agent.report_peer_failure(node, f"rank {reporter}: {instruction} failed in epoch {epoch}")
            except Exception as error:  # the agent being unreachable must not hide the suspicion
                log.error("could not report %s to the agent: %s", node, error)
        try:
            super().suspect(epoch, reporter, peer, instruction)
        except (StoreError, RuntimeError) as error:
            log.error("could not record the suspicion of rank %d: %s", peer, error)

    def poll(self, epoch: int) -> FailureEvent | None:
        try:
            return super().poll(epoch)
        except (StoreError, RuntimeError) as error:  # etcd unreachable: nothing confirmed that we can see
            log.warning("failure notices unreadable (epoch %d): %s", epoch, error)
            return None


class FailureAuthority:
    """Turns membership's ``NodeFailed`` into the runtime's numbered ``FailureEvent``.

    ``roles()`` gives the current generation and its node -> global rank map; failures of other
    nodes (standby) are recorded in :attr:`failed_nodes` but publish nothing. ``store`` is the c10d
    store the workers share; events go under job ``<job>-g<generation>``. ``on_event(event,
    nodes)`` is called after each publication (the launcher logs it).
    """

    def __init__(
        self,
        membership: MembershipStore,
        store: Store,
        job: str,
        roles: Callable[[], tuple[int, dict[str, int]]],
        *,
        detector_config: DetectorConfig | None = None,
        batch_window_s: float = 2.5,
        on_event: Callable[[FailureEvent, list[str]], None] | None = None,
    ) -> None:
        self.store = store
        self.job = job
        self.roles = roles
        self.batch_window_s = batch_window_s
        self.on_event = on_event
        self.detector = FailureDetector(membership, "launcher", GrpcProber("launcher"), detector_config)
        self.epochs: dict[int, int] = {}
        self.failed_nodes: dict[str, float] = {}
        self.published: list[tuple[int, FailureEvent]] = []
        self._pending: list[str] = []
        self._lock = threading.Condition()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._publisher, name="bamboo-failure-authority", daemon=True)

    def start(self) -> FailureAuthority:
        self.detector.subscribe(self._on_failed)
        self.detector.start()
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            self._lock.notify_all()
        self.detector.stop()
        self._thread.join(5)

    def failed_ranks(self) -> set[int]:
        """Global ranks confirmed failed so far."""
        return {rank for _, event in self.published for rank in event.victims}

    def _on_failed(self, event: NodeFailed) -> None:
        with self._lock:
            if event.node in self.failed_nodes:
                return
            self.failed_nodes[event.node] = time.monotonic()
            self._pending.append(event.node)
            self._lock.notify_all()

    def _roles(self) -> tuple[int, dict[str, int]]:
        for attempt in range(100):
            try:
                return self.roles()
            except (StoreError, RuntimeError) as error:
                log.error("reading the layout failed (attempt %d): %s", attempt + 1, error)
                time.sleep(0.2)
        raise RuntimeError("the layout could not be read from etcd")

    def _publisher(self) -> None:
        while not self._stop.is_set():
            with self._lock:
                while not self._pending and not self._stop.is_set():
                    self._lock.wait(0.5)
                if self._stop.is_set():
                    return
            time.sleep(self.batch_window_s)  # gather the failures that come together
            with self._lock:
                nodes, self._pending = self._pending, []
            generation, ranks = self._roles()
            nodes = [node for node in nodes if node in ranks]
            if not nodes:
                continue  # standby nodes: nothing for the runtime to do
            self.epochs[generation] = self.epochs.get(generation, 0) + 1
            event = FailureEvent(self.epochs[generation], [ranks[node] for node in nodes])
            notices = StoreFailureNotices(self.store, f"{self.job}-g{generation}")
            for attempt in range(100):  # etcd may be restarting: keep trying, a confirmed failure must get out
                try:
                    notices.publish(event)
                    break
                except (StoreError, RuntimeError) as error:
                    log.error("publishing %s failed (attempt %d): %s", event, attempt + 1, error)
                    time.sleep(0.2)
            self.published.append((generation, event))
            if self.on_event is not None:
                self.on_event(event, nodes)
