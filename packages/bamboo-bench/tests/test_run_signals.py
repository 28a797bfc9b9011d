"""``bamboo-launch run`` stopped by SIGTERM (``kill``, ``timeout``, a cancelled CI job) cleans up as Ctrl-C does: it
says it was interrupted, exits 130, and leaves no process of its cluster behind. Each node runs in a session of its
own, so a default SIGTERM used to end the launcher alone and leave its agents retrying their etcd. A stopped
``bamboo-bench compare`` stops its ``measure`` run the same way (SIGTERM) before it would kill it."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import pytest
from bamboo.bench import timeouts
from bamboo.bench.emulated.run_watch import wait_first_step
from bamboo.bench.emulated.stop_signals import pause, stop_signals_deferred, stopped_like_ctrl_c
from bamboo.bench.measured import compare


def _processes_naming(text: str) -> dict[int, str]:
    """pid -> command line of every process whose command line contains ``text``."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            line = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:  # gone meanwhile
            continue
        if text in line:
            found[int(entry.name)] = line
    return found


def test_the_first_stop_signal_raises_keyboard_interrupt_the_next_do_not_cut_the_clean_up_short() -> None:
    before = signal.getsignal(signal.SIGTERM)
    cleaned = False
    with pytest.raises(KeyboardInterrupt, match="SIGTERM"), stopped_like_ctrl_c():
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(5)  # the handler raises at once: the sleep is interrupted
        finally:  # the clean-up, as run_cluster's: a Ctrl-C or another SIGTERM meanwhile is ignored
            os.kill(os.getpid(), signal.SIGINT)
            os.kill(os.getpid(), signal.SIGTERM)
            time.sleep(0.05)
            cleaned = True
    assert cleaned
    assert signal.getsignal(signal.SIGTERM) is before


def test_a_stop_signal_in_a_deferred_block_waits_for_its_next_pause() -> None:
    steps: list[str] = []
    with stopped_like_ctrl_c(), pytest.raises(KeyboardInterrupt, match="SIGTERM"), stop_signals_deferred():
        os.kill(os.getpid(), signal.SIGTERM)  # as if it came during an etcd call of the loop
        steps.append("the call went on")
        time.sleep(0.01)  # a plain sleep, a call that returns: neither raises
        steps.append("and the next")
        pause(0)
        steps.append("not reached")
    assert steps == ["the call went on", "and the next"]


def test_a_stop_signal_during_a_pause_interrupts_its_sleep_and_one_before_the_block_ends_raises_there() -> None:
    timer = threading.Timer(0.05, os.kill, (os.getpid(), signal.SIGTERM))
    started = time.monotonic()
    with stopped_like_ctrl_c(), pytest.raises(KeyboardInterrupt, match="SIGTERM"), stop_signals_deferred():
        timer.start()
        pause(60)
    assert time.monotonic() - started < 30
    with stopped_like_ctrl_c(), pytest.raises(KeyboardInterrupt, match="SIGHUP"), stop_signals_deferred():
        os.kill(os.getpid(), signal.SIGHUP)
    pause(0)  # outside stopped_like_ctrl_c: only a sleep


def test_the_launchers_wait_for_the_first_step_is_not_interrupted_inside_its_etcd_reads() -> None:
    # The signal lands while the loop reads etcd (here, inside get_prefix); it surfaces at the loop's pause, after
    # the read returned: a gRPC call cut short by it could leave its channel unable to close (grpc/grpc#19973).
    reads: list[str] = []

    class _KV:
        def get_prefix(self, prefix: str) -> list[object]:
            reads.append("started")
            if len(reads) == 1:
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(0.01)
            reads.append("returned")
            return []

    membership = types.SimpleNamespace(kv=_KV(), keys=types.SimpleNamespace(decision=lambda name: name),
                                       get_decision=lambda name: None)
    recorder = types.SimpleNamespace(last_step=0)
    cluster = types.SimpleNamespace(snapshot=dict)
    with stopped_like_ctrl_c(), pytest.raises(KeyboardInterrupt, match="SIGTERM"):
        wait_first_step(recorder, cluster, membership, time.monotonic() + 60, Path("."),  # type: ignore[arg-type]
                        lambda line: None)
    assert reads == ["started", "returned"]


def test_sigterm_stops_the_run_and_every_node_it_started(tmp_path: Path) -> None:
    run_dir = tmp_path / "run"
    launcher = subprocess.Popen(
        [sys.executable, "-m", "bamboo.launch", "run", "--nodes", "2", "--stages", "2", "--pipelines", "1",
         "--steps", "100000", "--layers", "1", "--no-live", "--no-fork-server", "--timeout", "300",
         "--run-dir", str(run_dir)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env={**os.environ, "DS_ACCELERATOR": "cpu"})
    try:
        deadline = time.monotonic() + 120
        while len([line for line in _processes_naming(str(run_dir)).values() if " agent " in line]) < 2:
            assert launcher.poll() is None, launcher.communicate()
            assert time.monotonic() < deadline, "the run did not start its two agents"
            time.sleep(0.1)
        launcher.send_signal(signal.SIGTERM)
        _, err = launcher.communicate(timeout=60)
        assert launcher.returncode == 130, err[-2000:]
        assert "bamboo-launch: interrupted" in err
        deadline = time.monotonic() + 10  # the clean-up killed every node's process group before exiting
        while (left := _processes_naming(str(run_dir))) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert left == {}
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
        for pid in _processes_naming(str(run_dir)):  # what a failed assertion left behind
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


_CHILD = """
import signal, sys, time
if sys.argv[1] == "ignore":
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
print("ready", flush=True)
time.sleep(60)
"""


@pytest.mark.parametrize(("behaviour", "status"), [("default", -signal.SIGTERM), ("ignore", -signal.SIGKILL)])
def test_a_stopped_compare_terminates_its_measure_run_and_kills_it_only_if_it_lingers(
        behaviour: str, status: int, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(timeouts, "COMPARE_CHILD_STOP_S", 0.5)
    child = subprocess.Popen([sys.executable, "-c", _CHILD, behaviour], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    started = time.monotonic()
    compare._stop_child(child)
    assert child.returncode == status
    assert time.monotonic() - started < 30
    child.stdout.close()
