"""The emulated cluster's nodes as real processes: :class:`ProcessCluster`, the :class:`MarketActions` that
:class:`bamboo.bench.emulated.market.SpotMarket` drives (one process group per node, SIGKILLed whole)."""

from __future__ import annotations

import itertools
import logging
import os
import signal
import subprocess
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import IO

from bamboo.bench.emulated import timeouts as emulated_timeouts
from bamboo.bench.emulated.forkserver import ForkServer
from bamboo.launch.forkserver import FORK_SERVER_ENV, ForkedProcess

__all__ = ["ProcessCluster", "kill_process_group"]

logger = logging.getLogger(__name__)


def kill_process_group(pgid: int) -> bool:
    """SIGKILL every process of group ``pgid``; False if the group no longer exists."""
    try:
        os.killpg(pgid, signal.SIGKILL)
    except ProcessLookupError:
        return False
    return True


class ProcessCluster:
    """:class:`MarketActions` on real processes: one per node, each leading its own process group.

    ``command(node, zone)`` gives the argv of a node (for the launcher: ``bamboo-launch agent ...``).
    Each process gets ``BAMBOO_NODE_ID`` and ``BAMBOO_ZONE`` in its environment, leads a new process
    group (``process_group=0``: everything it spawns shares the group unless it opts out), and writes
    stdout and stderr to ``log_dir/<node>.log`` if ``log_dir`` is given. The nodes stay in the
    launcher's session: with the kernel's autogroup scheduling, a new session per node would give each
    node as much CPU as the launcher and everything else it shares a machine with, whatever their
    priorities; in one session a lower-priority launcher (``nice``) runs lower-priority nodes.

    With a ``fork_server`` (:mod:`bamboo.bench.emulated.forkserver`), each node is forked from its preloaded
    interpreter instead of exec'd, and its agent starts its worker the same way (same groups, same files).

    - ``kill`` sends SIGKILL to the whole group, then reaps the leader;
    - ``notify`` sends ``notice_signal`` (SIGTERM) to the leader only: the agent turns it into a
      preemption notice, as a cloud's shutdown signal would arrive;
    - ``close`` kills every node still running.

    ``notice_signal`` (SIGTERM) is the signal a notice sends. ``reap_timeout_s`` (10 s) bounds how
    long ``kill`` and ``close`` wait for a killed leader to be reaped; a SIGKILLed process that is
    not gone by then is reported (``kill`` raises ``subprocess.TimeoutExpired``, which the market
    records as a failed action).
    """

    def __init__(
        self,
        command: Callable[[str, str], Sequence[str]],
        *,
        env: Mapping[str, str] | None = None,
        log_dir: str | os.PathLike[str] | None = None,
        notice_signal: signal.Signals = signal.SIGTERM,
        name_prefix: str = "node",
        reap_timeout_s: float = emulated_timeouts.REAP_TIMEOUT_S,
        fork_server: ForkServer | None = None,
    ) -> None:
        self._command = command
        self._env = dict(os.environ if env is None else env)
        self._fork_server = fork_server
        if fork_server is not None:  # each node's agent starts its worker through it too
            self._env[FORK_SERVER_ENV] = fork_server.address
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._notice_signal = notice_signal
        self._prefix = name_prefix
        self._reap_timeout_s = reap_timeout_s
        self._counter = itertools.count()
        self._lock = threading.Lock()
        self.processes: dict[str, subprocess.Popen[bytes] | ForkedProcess] = {}
        self.zones: dict[str, str] = {}
        self.notices: list[tuple[str, float]] = []
        self._logs: dict[str, IO[bytes]] = {}
        self._closed = False

    def add(self, zone: str) -> str:
        # Under the lock, so that close() cannot miss a node started concurrently.
        with self._lock:
            if self._closed:
                raise RuntimeError(f"cluster is closed; not starting a node in {zone}")
            node = f"{self._prefix}{next(self._counter)}"
            env = {**self._env, "BAMBOO_NODE_ID": node, "BAMBOO_ZONE": zone}
            output: IO[bytes] | int = subprocess.DEVNULL
            if self._log_dir is not None:
                self._log_dir.mkdir(parents=True, exist_ok=True)
                output = open(self._log_dir / f"{node}.log", "wb")  # noqa: SIM115
                self._logs[node] = output
            if self._fork_server is not None:
                self.processes[node] = self._fork_server.start(list(self._command(node, zone)), env=env,
                                                               stdout=output, stderr=subprocess.STDOUT,
                                                               process_group=0)
            else:
                self.processes[node] = subprocess.Popen(list(self._command(node, zone)), env=env,
                                                        stdin=subprocess.DEVNULL, stdout=output,
                                                        stderr=subprocess.STDOUT, process_group=0)
            self.zones[node] = zone
        return node

    def kill(self, node: str) -> None:
        process = self.processes[node]
        # The leader's pid is the group id (process_group=0); it stays reserved until reaped.
        kill_process_group(process.pid)
        process.wait(self._reap_timeout_s)
        log = self._logs.pop(node, None)
        if log is not None:
            log.close()

    def notify(self, node: str, deadline: float) -> None:
        process = self.processes[node]
        self.notices.append((node, deadline))
        if process.poll() is None:
            process.send_signal(self._notice_signal)

    def snapshot(self) -> dict[str, subprocess.Popen[bytes] | ForkedProcess]:
        """Every node started so far and its leader process, copied under the lock: the market's thread adds
        nodes while the launcher reads them."""
        with self._lock:
            return dict(self.processes)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called: no node starts any more."""
        return self._closed

    def alive(self) -> list[str]:
        """Nodes whose leader process is still running."""
        return [node for node, process in self.snapshot().items() if process.poll() is None]

    def close(self) -> None:
        """Kill every node that is still running and close the log files; later adds raise."""
        with self._lock:
            self._closed = True
        for node, process in list(self.processes.items()):
            if process.poll() is None:
                kill_process_group(process.pid)
            try:
                process.wait(self._reap_timeout_s)
            except subprocess.TimeoutExpired:
                logger.error("node %s (pid %d) did not die after SIGKILL", node, process.pid)
        for log in self._logs.values():
            log.close()
        self._logs.clear()

    def __enter__(self) -> ProcessCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
