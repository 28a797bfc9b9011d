"""The event logs of one etcd client share one writer thread (`bamboo.launch.event_writer`), each log's records
still in order; a log closes alone, and a client's writer thread ends with the client."""

from __future__ import annotations

import gc
import threading
from typing import Any

from bamboo.launch.event_writer import RecordWriter, writer_for
from bamboo.launch.events import EtcdEventLog, Join, Step


class Recording:
    """A client that records its puts (key, value), and the thread each came from."""

    def __init__(self) -> None:
        self.puts: list[tuple[str, bytes]] = []
        self.threads: set[str] = set()
        self.release = threading.Event()
        self.release.set()

    def put(self, key: str, value: bytes, **_: Any) -> int:
        self.release.wait(10)
        self.puts.append((key, value))
        self.threads.add(threading.current_thread().name)
        return len(self.puts)


def test_the_logs_of_one_client_share_one_thread_and_keep_their_order() -> None:
    kv = Recording()
    before = set(threading.enumerate())  # (other tests' threads come and go in this process: only new writers count)
    logs = [EtcdEventLog(kv, "job", f"n{i}.agent.1", 0.0) for i in range(5)]  # type: ignore[arg-type]
    writers = [t for t in threading.enumerate() if t not in before and t.name == "bamboo-events"]
    assert len(writers) <= 1  # one writer for the five
    kv.release.clear()  # the writer waits in the first put while every log queues its records
    for step in range(3):
        for i, log in enumerate(logs):
            log.write(Step(t=float(step), step=step, samples=1, loss=1.0, nodes_active=1, duration_s=0.0) if i else Join(t=0.0, node="n0", zone="a"))
    assert not logs[0].flush(0.05)  # the first put is still waiting
    kv.release.set()
    assert all(log.flush(10) for log in logs)
    assert len(kv.threads) == 1
    for i in range(5):
        keys = [key for key, _ in kv.puts if f"/n{i}.agent.1/" in key]
        assert keys == sorted(keys) and len(keys) == 3  # each log's sequence, in order
    logs[0].close()
    logs[1].write(Step(t=4.0, step=4, samples=1, loss=1.0, nodes_active=1, duration_s=0.0))  # the others go on
    assert logs[1].flush(10) and len(kv.puts) == 16


def test_a_clients_writer_thread_ends_with_the_client() -> None:
    kv = Recording()
    writer = writer_for(kv)
    assert writer is not None and writer_for(kv) is writer
    done = threading.Event()
    ran_on: list[threading.Thread] = []
    writer.submit(lambda: (ran_on.append(threading.current_thread()), done.set()))
    assert done.wait(10)
    (thread,) = ran_on  # this client's writer thread (other tests' writers may come and go meanwhile)
    assert thread.is_alive()
    del kv, writer
    gc.collect()
    thread.join(10)
    assert not thread.is_alive()


def test_a_task_that_raises_does_not_stop_the_writer() -> None:
    writer = RecordWriter()
    done = threading.Event()

    def fail() -> None:
        raise RuntimeError("one write failed")

    writer.submit(fail)
    writer.submit(done.set)
    assert done.wait(10)
    writer.stop()
