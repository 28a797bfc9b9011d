"""How ``bamboo-launch run``, ``bamboo-bench compare`` and ``bamboo-bench measure`` stop on Ctrl-C, ``kill``,
``timeout``, a cancelled CI job or a closed terminal: as Ctrl-C does, by a KeyboardInterrupt in the main thread, so
that the run's clean-up kills its nodes and its etcd; but raised only where that is safe.

The failure model. An exception that a signal handler raises lands wherever the main thread happens to be. Inside
a gRPC call it can leave the call's channel unable to close: the close then waits forever (grpc/grpc#19973, still
so in grpcio 1.85: an interrupt in the call's ``condition.__exit__`` hung two closes out of three on this machine),
and a launcher stopped while it read etcd never exited. Between a lock's ``acquire`` and its ``try`` (``Popen.poll``
has one) it leaves the lock held, and inside ``Popen()`` it loses a node that has already started. The launcher
spends nearly all its life in its watch loops, which read etcd and poll the nodes' processes several times a
second: there (:func:`stop_signals_deferred`) a stop signal is only noted, and the loop's next :func:`pause` raises
it, at a point that holds nothing. A loop's pause is at most ``PROGRESS_POLL_S`` (0.25 s), so a stop still takes
effect within a poll, plus the etcd read under way (bounded by its own timeout).

Outside :func:`stopped_like_ctrl_c`, nothing here changes how a signal is handled: :func:`pause` only sleeps.
"""

from __future__ import annotations

import contextlib
import signal
import threading
import time
from collections.abc import Iterator

__all__ = ["STOP_SIGNALS", "pause", "stop_signals_deferred", "stopped_like_ctrl_c"]

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
"""The signals that stop ``bamboo-launch run``, ``bamboo-bench compare`` and ``bamboo-bench measure``: Ctrl-C,
``kill``, ``timeout``, a CI job cancelled, the terminal closed."""


class _StopState:
    """What the handler and the main thread share. Python runs signal handlers in the main thread, between two of
    its bytecodes, so no lock guards it (a lock taken by the handler could be the one the main thread holds)."""

    def __init__(self) -> None:
        self.signal: int | None = None  # the first stop signal received, if any
        self.raised = False  # its KeyboardInterrupt was raised: the signals that follow are ignored
        self.deferring = 0  # how many stop_signals_deferred blocks the main thread is in
        self.sleeping = False  # in pause's sleep, where raising is safe


_state = _StopState()


def _interrupt(number: int) -> KeyboardInterrupt:
    _state.raised = True
    return KeyboardInterrupt(signal.Signals(number).name)


@contextlib.contextmanager
def stopped_like_ctrl_c(signals: tuple[signal.Signals, ...] = STOP_SIGNALS) -> Iterator[None]:
    """Within it, the first of ``signals`` raises KeyboardInterrupt in the main thread, as Ctrl-C does, so that a
    run's clean-up kills its nodes and its etcd (at once, or at the next :func:`pause` inside a
    :func:`stop_signals_deferred` block); the signals that follow are ignored, so that they do not cut that
    clean-up short (a terminal's Ctrl-C reaches ``compare`` and its ``measure`` run together, and ``compare`` then
    sends that run SIGTERM). Each node runs in a process group of its own: with the default action, a run stopped
    by ``timeout`` left its agents running, still retrying their etcd, long after it ended. Main thread only."""
    saved = (_state.signal, _state.raised)
    _state.signal, _state.raised = None, False

    def on_signal(number: int, _frame: object) -> None:
        if _state.signal is not None:
            return
        _state.signal = number
        if not _state.deferring or _state.sleeping:
            raise _interrupt(number)

    previous = {number: signal.signal(number, on_signal) for number in signals}
    try:
        yield
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        _state.signal, _state.raised = saved


def _raise_if_stopped() -> None:
    if _state.signal is not None and not _state.raised:
        raise _interrupt(_state.signal)


@contextlib.contextmanager
def stop_signals_deferred() -> Iterator[None]:
    """Within it, a stop signal is noted and raised by the next :func:`pause`, or when the block ends, instead of
    wherever the main thread is (a gRPC call, a lock just taken). A block that ends by an exception lets that
    exception go on: the run ends either way. In another thread than the main one, it changes nothing."""
    if threading.current_thread() is not threading.main_thread():  # signals reach the main thread alone
        yield
        return
    _state.deferring += 1
    try:
        yield
    finally:
        _state.deferring -= 1
    _raise_if_stopped()


def pause(seconds: float) -> None:
    """Sleep ``seconds``; KeyboardInterrupt, before or during the sleep, once a stop signal came (the wait of a
    watch loop in a :func:`stop_signals_deferred` block). In another thread than the main one, it only sleeps."""
    if threading.current_thread() is not threading.main_thread():
        time.sleep(seconds)
        return
    _raise_if_stopped()
    _state.sleeping = True
    try:
        time.sleep(seconds)
    finally:
        _state.sleeping = False
    _raise_if_stopped()
