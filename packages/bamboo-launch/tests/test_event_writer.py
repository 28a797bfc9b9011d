"""The event logs of one etcd client share one writer thread (`bamboo.launch.event_writer`), each log's records
still in order; a log closes alone, and a client's writer thread ends with the client. Step records go out
together, in one value, and any other record takes the steps held before it along."""

from __future__ import annotations

import gc
import json
import threading
import time
from collections.abc import Callable
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
        puts = [(key, value) for key, value in kv.puts if f"/n{i}.agent.1/" in key]
        assert [key for key, _ in puts] == sorted(key for key, _ in puts)  # each log's sequence, in order
        lines = [json.loads(line) for _, value in puts for line in value.splitlines()]
        assert len(puts) == (3 if i == 0 else 1) and len(lines) == 3  # a join each; the three steps in one value
        assert i == 0 or [line["step"] for line in lines] == [0, 1, 2]
    logs[0].close()
    logs[1].write(Step(t=4.0, step=4, samples=1, loss=1.0, nodes_active=1, duration_s=0.0))  # the others go on
    assert logs[1].flush(10) and len(kv.puts) == 8


def _step(step: int) -> Step:
    return Step(t=float(step), step=step, samples=1, loss=1.0, nodes_active=1, duration_s=0.0)


def _wait_for(condition: Callable[[], bool]) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, "not within 10 s"
        time.sleep(0.005)


def test_steps_go_out_together_and_another_record_takes_them_along_in_order() -> None:
    kv = Recording()
    log = EtcdEventLog(kv, "job", "n0.worker.1", 0.0, batch_s=3600.0)  # type: ignore[arg-type]
    for step in range(4):
        log.write(_step(step))
    log.write(Join(t=5.0, node="n1", zone="a"))  # at once, after the steps held back
    _wait_for(lambda: len(kv.puts) == 1)
    assert [json.loads(line).get("step", "join") for line in kv.puts[0][1].splitlines()] == [0, 1, 2, 3, "join"]
    log.write(_step(4))
    log.close()  # sends what is held back
    assert len(kv.puts) == 2 and json.loads(kv.puts[1][1])["step"] == 4


def test_a_step_held_back_goes_out_after_the_batch_time_without_a_flush() -> None:
    kv = Recording()
    log = EtcdEventLog(kv, "job", "n0.worker.1", 0.0, batch_s=0.01)  # type: ignore[arg-type]
    log.write(_step(0))
    _wait_for(lambda: len(kv.puts) == 1)  # no other record, no flush: the writer's delayed task sent it
    unbatched = EtcdEventLog(kv, "job", "n1.worker.1", 0.0, batch_s=0)  # type: ignore[arg-type]
    unbatched.write(_step(0))
    unbatched.write(_step(1))
    assert unbatched.flush(10) and len(kv.puts) == 3  # one put per record
    log.close()
    unbatched.close()


def test_a_writer_runs_a_delayed_task_at_its_time_and_what_is_left_at_its_stop() -> None:
    writer = RecordWriter()
    ran: list[str] = []
    writer.submit_later(3600.0, lambda: ran.append("at the stop"))
    writer.submit_later(0.01, lambda: ran.append("soon"))
    writer.submit(lambda: ran.append("now"))
    _wait_for(lambda: ran == ["now", "soon"])
    done = threading.Event()
    writer.submit_later(3600.0, lambda: writer.submit(done.set))  # what a delayed task queues still runs
    writer.stop()
    assert done.wait(10) and ran == ["now", "soon", "at the stop"]


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
