"""One thread per etcd client that writes the records of every :class:`bamboo.launch.events.EtcdEventLog` on it.

An event log writes from the background so that training never waits for etcd. With a thread per log, each agent
and each worker started one more thread; a process that emulates many nodes on one client (bench_scale.py: a
hundred and twenty-five per process, two logs each) started hundreds, each start waiting for the interpreter lock
while the nodes registered. :func:`writer_for` hands every log of one client the same :class:`RecordWriter`: one
thread and one queue, so each log's records still go out in the order they were written (a log whose write waits
through an etcd outage holds up the others on that client, which wait for the same etcd). The thread ends when its
client is garbage-collected.
"""

from __future__ import annotations

import logging
import queue
import threading
import weakref
from collections.abc import Callable

__all__ = ["RecordWriter", "writer_for"]

log = logging.getLogger(__name__)

_Task = Callable[[], None]


class RecordWriter:
    """A queue of writes and the one thread that runs them, in order (see the module docstring)."""

    def __init__(self, name: str = "bamboo-events") -> None:
        self._tasks: queue.Queue[_Task | None] = queue.Queue()
        threading.Thread(target=_run, args=(self._tasks,), name=name, daemon=True).start()

    def submit(self, task: _Task) -> None:
        """Run ``task`` on the writer's thread after every task submitted before it."""
        self._tasks.put(task)

    def stop(self) -> None:
        """End the thread once the tasks before this call have run."""
        self._tasks.put(None)


def _run(tasks: queue.Queue[_Task | None]) -> None:
    while (task := tasks.get()) is not None:
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
