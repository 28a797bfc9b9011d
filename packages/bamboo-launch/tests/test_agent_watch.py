"""A worker's watch of its agent: it ends with the agent named in its environment, not with its parent (on an
emulated cluster the fork server is the parent), and at once when the agent has already ended."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest
from bamboo.launch.agent_watch import AGENT_PID_ENV, watch_agent


def _agent() -> subprocess.Popen[bytes]:
    return subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])


def test_the_named_agent_s_death_ends_the_watch_even_before_it_is_reaped(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = _agent()
    monkeypatch.setenv(AGENT_PID_ENV, str(agent.pid))
    gone = threading.Event()
    try:
        watch_agent(gone.set)
        assert not gone.wait(0.2)  # alive: nothing happens (this process, its parent, never dies here)
        agent.kill()  # not reaped yet: a zombie is an ended agent
        assert gone.wait(30)
    finally:
        agent.kill()
        agent.wait()


def test_an_agent_that_ended_before_the_worker_started_ends_it_at_once(monkeypatch: pytest.MonkeyPatch) -> None:
    agent = _agent()
    agent.kill()
    agent.wait()  # reaped: the pid names no process any more
    monkeypatch.setenv(AGENT_PID_ENV, str(agent.pid))
    calls: list[str] = []
    watch_agent(lambda: calls.append(threading.current_thread().name))
    assert calls == [threading.current_thread().name]  # in the caller's thread, before it returned
