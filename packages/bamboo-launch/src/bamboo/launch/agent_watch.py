"""A worker never outlives the agent that fences it: it watches its agent's process and ends with it.

The agent names itself in its worker's environment (``BAMBOO_AGENT_PID``, :data:`AGENT_PID_ENV`). On an
emulated cluster the fork server (:mod:`bamboo.bench.emulated.forkserver`) forks the worker, so the worker's parent is
that server, not its agent, and watching the parent would miss the agent's death. The watch holds a pidfd of
the agent, which becomes readable once the agent has ended, reaped or not, and which no reuse of the pid can
fool. A worker started after its agent had already ended (a node killed while its worker was being forked:
the fork joined the dead agent's process group after the kill) ends at once instead of training unfenced.
Where pidfds are not available, or no agent is named (a worker started by hand), it polls every
``AGENT_POLL_S`` as before: the named pid's existence, or a change of its parent.
"""

from __future__ import annotations

import os
import select
import threading
import time
from collections.abc import Callable

from bamboo.launch.timeouts import AGENT_POLL_S

__all__ = ["AGENT_PID_ENV", "watch_agent"]

AGENT_PID_ENV = "BAMBOO_AGENT_PID"
"""Set by the agent when it spawns its worker: the agent's own pid."""


def _exists(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def watch_agent(on_gone: Callable[[], None]) -> None:
    """Call ``on_gone`` (in a daemon thread; at once, in this thread, if the agent has already ended) when this
    worker's agent ends: the process named by ``BAMBOO_AGENT_PID``, or this process's parent when none is."""
    named = os.environ.get(AGENT_PID_ENV, "")
    agent = int(named) if named.isdigit() else os.getppid()
    pidfd_open = getattr(os, "pidfd_open", None)
    handle = None
    if pidfd_open is not None:
        try:
            handle = pidfd_open(agent)
        except ProcessLookupError:
            on_gone()
            return
        except OSError:
            handle = None

    def still_there() -> bool:
        return _exists(agent) if named.isdigit() else os.getppid() == agent

    def wait() -> None:
        if handle is not None:
            select.select([handle], [], [])
        else:
            while still_there():
                time.sleep(AGENT_POLL_S)
        on_gone()

    threading.Thread(target=wait, name="bamboo-agent-watch", daemon=True).start()
