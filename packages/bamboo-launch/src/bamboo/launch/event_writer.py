"""One thread per etcd client that writes the records of every :class:`bamboo.launch.events.EtcdEventLog` on it.

An event log writes from the background so that training never waits for etcd. With a thread per log, each agent
and each worker started one more thread; a process that emulates many nodes on one client (bench_scale.py: a
hundred and twenty-five per process, two logs each) started hundreds, each start waiting for the interpreter lock
while the nodes registered. :func:`writer_for` hands every log of one client the same :class:`RecordWriter`: one
thread and one queue, so each log's records still go out in the order they were written (a log whose write waits
through an etcd outage holds up the others on that client, which wait for the same etcd). The thread ends when its
client is garbage-collected. A task may also be run later (:meth:`RecordWriter.submit_later`): a log that holds its
step records back to send them together asks to be woken then, without a thread of its own.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import queue
import threading
import time
import weakref
from collections.abc import Callable

__all__ = ["RecordWriter", "writer_for"]

log = logging.getLogger(__name__)

_Task = Callable[[], None]


class RecordWriter:
    """A queue of writes and the one thread that runs them, in order (see the module docstring)."""

    def __init__(self, name: str = "bamboo-events") -> None:
        self._tasks: queue.Queue[_Task | None] = queue.Queue()
        self._later: list[tuple[float, int, _Task]] = []  # (monotonic deadline, tie-break, task): a heap
        self._later_lock = threading.Lock()
        self._order = itertools.count()
        # The thread holds the queue and the heap, not this object: the writer may be collected while it runs.
        threading.Thread(target=_run, args=(self._tasks, self._later, self._later_lock), name=name,
                         daemon=True).start()

    def submit(self, task: _Task) -> None:
        """Run ``task`` on the writer's thread after every task submitted before it."""
        self._tasks.put(task)

    def submit_later(self, delay_s: float, task: _Task) -> None:
        """Run ``task`` on the writer's thread once ``delay_s`` seconds have passed (or at its stop, if sooner)."""
        with self._later_lock:
            heapq.heappush(self._later, (time.monotonic() + delay_s, next(self._order), task))
        self._tasks.put(_wake)  # the thread recomputes how long it may sleep

    def stop(self) -> None:
        """End the thread once the tasks before this call have run (the delayed ones too, at once)."""
        self._tasks.put(None)


def _wake() -> None:
    """A task that does nothing: it wakes the writer's thread to look at its delayed tasks."""


def _run(tasks: queue.Queue[_Task | None], later: list[tuple[float, int, _Task]], lock: threading.Lock) -> None:
    while True:
        with lock:
            wait = max(0.0, later[0][0] - time.monotonic()) if later else None
        try:
            task = tasks.get(timeout=wait)
        except queue.Empty:
            task = _wake
        stopping = task is None
        due = []
        with lock:
            while later and (stopping or later[0][0] <= time.monotonic()):
                due.append(heapq.heappop(later)[2])
        for job in (*due, *(() if task is None else (task,))):
            _run_one(job)
        if stopping:
            while not tasks.empty():  # what the delayed tasks submitted as they ran
                if (queued := tasks.get()) is not None:
                    _run_one(queued)
            return


def _run_one(task: _Task) -> None:
    try:
        task()
    except Exception:  # a task reports its own errors; one that raises must not stop the others' writes
        log.exception("an event log's write failed")


_LOCK = threading.Lock()
_WRITERS: weakref.WeakKeyDictionary[object, RecordWriter] = weakref.WeakKeyDictionary()


def writer_for(kv: object) -> RecordWriter | None:
    """The writer every event log on ``kv`` shares; its thread ends when ``kv`` is garbage-collected. None for a
    client that cannot be weakly referenced: the log then runs a writer of its own, and stops it when it closes."""
    with _LOCK:
        try:
            writer = _WRITERS.get(kv)
        except TypeError:
            return None
        if writer is None:
            writer = _WRITERS[kv] = RecordWriter()
            weakref.finalize(kv, writer.stop)
        return writer
