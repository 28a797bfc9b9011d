"""The emulated machines of the checkpoint/restart baseline: a node is a machine, its agent and every process below.

torchrun starts each worker in a session of its own, so the market's kill of a node (a SIGKILL of its agent's
process group) would leave the worker training. :class:`MachineCluster` kills the process groups of the agent
and of all its descendants, knows which machines the market took, and starts an agent again on a machine that
is still there (a job restarted by its controller).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

from bamboo.bench.emulated.processes import ProcessCluster, kill_process_group

__all__ = ["MachineCluster"]


def _descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (read from ``/proc``), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        parent = int(stat[stat.rindex(")") + 2:].split()[1])
        children.setdefault(parent, []).append(int(entry.name))
    found, frontier = [], [pid]
    while frontier:
        frontier = [child for parent in frontier for child in children.get(parent, [])]
        found += frontier
    return found


class MachineCluster(ProcessCluster):
    """A :class:`bamboo.bench.emulated.processes.ProcessCluster` whose kill takes a node's whole process tree, which knows
    which machines the market took (``taken``), and which can start a machine's agent again.

    torchrun starts each worker in a session of its own, so a SIGKILL of the agent's process group would
    leave the worker training. A lost machine loses both: :meth:`kill` SIGKILLs the process group of the
    agent and of every descendant (the worker also dies with its agent, ``PR_SET_PDEATHSIG``, for any other
    way the agent dies).
    """

    def __init__(self, command: Callable[[str, str], Sequence[str]], **kwargs: Any) -> None:
        super().__init__(command, **kwargs)
        self.taken: set[str] = set()

    def kill(self, node: str) -> None:
        with self._lock:
            self.taken.add(node)
        groups = set()
        for pid in _descendants(self.processes[node].pid):
            try:
                groups.add(os.getpgid(pid))
            except ProcessLookupError:
                continue
        super().kill(node)
        for group in groups:
            kill_process_group(group)

    def close(self) -> None:
        for node in self.alive():
            for pid in _descendants(self.processes[node].pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    continue
        super().close()

    def machines(self) -> dict[str, str]:
        """Node -> zone of every machine started and not taken by the market (its agent may have exited)."""
        with self._lock:
            return {node: zone for node, zone in self.zones.items() if node not in self.taken}

    def restart_agent(self, node: str) -> bool:
        """Start ``node``'s agent again on its machine (its log goes on); False if the machine was taken."""
        with self._lock:
            if self._closed or node in self.taken:
                return False
            if self.processes[node].poll() is None:
                raise RuntimeError(f"node {node}'s agent is still running")
            zone = self.zones[node]
            env = {**self._env, "BAMBOO_NODE_ID": node, "BAMBOO_ZONE": zone}
            output: IO[bytes] | int = subprocess.DEVNULL
            if self._log_dir is not None:
                old = self._logs.pop(node, None)
                if old is not None:
                    old.close()
                output = open(self._log_dir / f"{node}.log", "ab")  # noqa: SIM115
                self._logs[node] = output
            self.processes[node] = subprocess.Popen(
                list(self._command(node, zone)), env=env, stdin=subprocess.DEVNULL, stdout=output,
                stderr=subprocess.STDOUT, process_group=0)  # in the launcher's session, as ProcessCluster
        return True
