"""When each torchrun agent of the checkpoint/restart baseline entered the rendezvous, read from the launcher's
store.

A node the market adds interrupts a torchrun job only once its agent has started (a new Python process that
imports torch) and entered the rendezvous: from then on the running agents see it waiting and restart their
workers. A node killed before that never interrupts anything. :class:`RendezvousWatch` measures that delay:
it polls the state that torchrun's ``c10d`` rendezvous keeps on the launcher's ``TCPStore`` (key
``torch.rendezvous.<rendezvous id>``, a base64 pickle of the rendezvous state whose node descriptors carry
each agent's process id) and notes the first time each node's agent appears in it, as a participant, on the
wait list or with a heartbeat. :mod:`bamboo.bench.measured.measure` makes the delays the profile's
``instance_creation_s`` and counts a join's restart from the moment its agent entered.

It also notes a live agent that torchrun **dropped** from the rendezvous: one seen in the state before, whose
process still runs, absent from it for ``dropped_after_s``. torchrun drops a node whose heartbeat is late
(``keep_alive_interval`` x ``keep_alive_max_attempt``) and never lets it beat again; when every running agent is
dropped, the next node to arrive starts a second job of its own instead of restarting the running one, and the
measured restarts are no longer torchrun's usual ones. The baseline reports such a run
(:data:`bamboo.bench.timeouts.BASELINE_RDZV_KEEP_ALIVE_ATTEMPTS` is sized so that it does not happen).

The state's layout is torch's (``torch.distributed.elastic.rendezvous.dynamic_rendezvous``, torch 2.13); a
state this module cannot read is skipped, and the run then measures no such delays (the profile says so).
"""

from __future__ import annotations

import base64
import binascii
import pickle
import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING

from bamboo.bench import timeouts

if TYPE_CHECKING:
    import torch.distributed as dist

__all__ = ["RendezvousWatch", "agent_pids", "state_key"]


def state_key(rendezvous_id: str) -> str:
    """The store key under which torchrun's ``c10d`` rendezvous keeps the state of ``rendezvous_id``."""
    return f"torch.rendezvous.{rendezvous_id}"


def agent_pids(raw: bytes) -> set[int]:
    """The process ids of the agents in a rendezvous state as stored (base64 of a pickle); empty when the
    value is torchrun's placeholder or cannot be read."""
    try:
        state = pickle.loads(base64.b64decode(raw, validate=True))  # our own agents wrote it
    except (binascii.Error, pickle.UnpicklingError, EOFError, AttributeError, ImportError, ValueError):
        return set()
    nodes: set[object] = set()
    for field in ("participants", "wait_list", "redundancy_list", "last_heartbeats"):
        nodes.update(getattr(state, field, None) or ())
    return {pid for pid in (getattr(node, "pid", None) for node in nodes) if isinstance(pid, int)}


class RendezvousWatch:
    """Polls ``store`` every ``poll_s`` seconds for the state of the rendezvous ``rendezvous()`` names, and
    notes, per node, the first wall time its agent (process id ``pids()[node]``, the live agents) was in it
    (``registered``), and when a live agent seen before left it for good (``dropped``, see the module docstring)."""

    def __init__(self, store: dist.Store, rendezvous: Callable[[], str], pids: Callable[[], Mapping[str, int]],
                 poll_s: float = timeouts.BASELINE_RDZV_POLL_S, clock: Callable[[], float] = time.time,
                 dropped_after_s: float = timeouts.BASELINE_DROPPED_AGENT_S) -> None:
        self._store = store
        self._rendezvous = rendezvous
        self._pids = pids
        self._poll_s = poll_s
        self._clock = clock
        self._dropped_after_s = dropped_after_s
        self._registered: dict[str, float] = {}
        self._seen_pids: set[int] = set()
        self._absent_since: dict[int, float] = {}
        self._dropped: dict[str, float] = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="baseline-rendezvous-watch", daemon=True)

    def poll(self) -> None:
        """Read the state once and note the nodes seen for the first time."""
        key = state_key(self._rendezvous())
        try:
            if not self._store.check([key]):
                return
            raw = self._store.get(key)
        except (RuntimeError, ValueError, TimeoutError):  # the store is closing at the run's end
            return
        now = self._clock()
        seen = agent_pids(raw)
        live = self._pids()
        with self._lock:
            for node, pid in live.items():
                if pid in seen:
                    self._registered.setdefault(node, now)
                    self._seen_pids.add(pid)
                    self._absent_since.pop(pid, None)
                elif pid in self._seen_pids and node not in self._dropped:  # an agent restarted later has a new pid
                    since = self._absent_since.setdefault(pid, now)
                    if now - since >= self._dropped_after_s:
                        self._dropped[node] = since

    def dropped(self) -> dict[str, float]:
        """Node -> the wall time its live agent went missing from the rendezvous, for each one still missing
        ``dropped_after_s`` later (a node is reported once)."""
        with self._lock:
            return dict(self._dropped)

    def registered(self) -> dict[str, float]:
        """Node -> the wall time its agent was first seen in the rendezvous."""
        with self._lock:
            return dict(self._registered)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5.0)

    def _loop(self) -> None:
        while not self._stop.wait(self._poll_s):
            self.poll()
