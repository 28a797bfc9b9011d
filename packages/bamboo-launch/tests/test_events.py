"""Tests of the JSON-lines event log: round trips through a file and through dicts, malformed records, several
writers sharing one file, and the job's log in etcd followed and read again (a real etcd for the reader)."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from bamboo.launch.events import (
    EtcdEventFollower,
    EtcdEventReader,
    EventLog,
    EventLogError,
    Join,
    Step,
    event_from_dict,
    event_to_dict,
    events_prefix,
    read_etcd_events,
    read_events,
)
from bamboo.membership import EventKind, KeyValue, MembershipStore, WatchEvent
from hypothesis import given, settings
from hypothesis import strategies as st


def test_round_trip_through_file(tmp_path: Path, fake_clock, sample_run: Callable[[], list]) -> None:
    clock = fake_clock
    path = tmp_path / "events.jsonl"
    with EventLog(path, clock=clock) as log:
        log.write_all(sample_run())
        clock.advance(5.0)
        emitted = log.emit(Join, node="late", zone="a")
    assert emitted.t == 5.0
    events = read_events(path)
    assert events == [*sample_run(), Join(t=5.0, node="late", zone="a")]
    first = json.loads(path.read_text().splitlines()[0])
    assert list(first)[:2] == ["kind", "t"] and first["kind"] == "run_start"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"kind":"join","t":1,"node":"n0"}', "missing keys ['zone']"),
        ('{"kind":"join","t":1,"node":"n0","zone":"a","colour":"red"}', "unknown keys ['colour']"),
        ('{"kind":"teleport","t":1}', "unknown kind 'teleport'"),
        ('{"kind":"step","t":-1,"step":0,"samples":1,"loss":1,"nodes_active":1,"duration_s":1}', "'t' must be >= 0: -1"),
        (
            '{"kind":"step","t":1,"step":0,"samples":0,"loss":1,"nodes_active":1,"duration_s":1}',
            "'samples' must be >= 1: 0",
        ),
        ('{"kind":"failover","t":1,"victim":"a","shadow":"b","stage":0,"pause_s":NaN}', "'pause_s' must be >= 0: nan"),
        ('{"kind":"join","t":1,"node":"n0","zo', "not valid JSON"),
        ("[1, 2]", "must be a JSON object"),
    ],
)
def test_malformed_record_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"kind":"join","t":0,"node":"n0","zone":"a"}\n\n' + line + "\n")
    with pytest.raises(EventLogError) as caught:
        read_events(path)
    assert f"{path}:3:" in str(caught.value)
    assert message in str(caught.value)


@settings(deadline=None, max_examples=50)
@given(
    st.lists(
        st.builds(
            Step,
            t=st.floats(0, 1e6),
            step=st.integers(0, 10**6),
            samples=st.integers(1, 10**4),
            loss=st.floats(-1e6, 1e6),
            nodes_active=st.integers(0, 100),
            duration_s=st.floats(0, 100),
        ),
        max_size=5,
    )
)
def test_dict_round_trip(steps: list[Step]) -> None:
    for step in steps:
        assert event_from_dict(json.loads(json.dumps(event_to_dict(step)))) == step


WRITER = """
import sys, time
from bamboo.launch.events import EventLog, Step
log = EventLog(sys.argv[1], start=float(sys.argv[2]))
for step in range(300):
    log.emit(Step, step=step, samples=int(sys.argv[3]), loss=1.0, nodes_active=1, duration_s=0.0)
log.close()
"""


def test_concurrent_writers_interleave_whole_records(tmp_path: Path) -> None:
    import subprocess
    import sys
    import time

    path = tmp_path / "shared.jsonl"
    start = time.monotonic()
    writers = [
        subprocess.Popen([sys.executable, "-c", WRITER, str(path), repr(start), str(samples)])
        for samples in (1, 2, 3)
    ]
    assert [w.wait(60) for w in writers] == [0, 0, 0]
    events = read_events(path)
    assert len(events) == 900
    for samples in (1, 2, 3):
        mine = [e for e in events if isinstance(e, Step) and e.samples == samples]
        assert [e.step for e in mine] == list(range(300))
        assert [e.t for e in mine] == sorted(e.t for e in mine)  # one shared clock origin


class _LaggingWatchKV:
    """A key-value store whose watch delivers a put only when the test calls :meth:`deliver`: etcd's watch lags
    behind its reads."""

    def __init__(self) -> None:
        self.items: dict[str, tuple[bytes, int]] = {}  # key -> its value and the revision that wrote it
        self.undelivered: list[WatchEvent] = []
        self.callback: Callable[[WatchEvent], None] | None = None
        self.written = 0

    def put(self, key: str, value: bytes) -> None:
        self.written += 1
        self.items[key] = (value, self.written)
        self.undelivered.append(WatchEvent(EventKind.PUT, key, value, revision=self.written))

    def deliver(self) -> None:
        assert self.callback is not None
        for event in self.undelivered:
            self.callback(event)
        self.undelivered.clear()

    def revision(self) -> int:
        return self.written

    def get_prefix(self, prefix: str) -> list[KeyValue]:
        return [KeyValue(key, value, revision, revision) for key, (value, revision) in sorted(self.items.items())
                if key.startswith(prefix)]

    def watch_prefix(self, prefix: str, callback: Callable[[WatchEvent], None], *,
                     start_revision: int | None = None, puts_only: bool = False) -> _LaggingWatchKV:
        self.undelivered.clear()  # what the first read returned
        self.callback = callback
        return self

    def cancel(self) -> None:
        self.callback = None


def _put_step(kv: _LaggingWatchKV, writer: str, step: int) -> None:
    record = Step(t=float(step), step=step, samples=1, loss=1.0, nodes_active=1, duration_s=0.1)
    kv.put(f"{events_prefix('job')}{writer}/{step:08d}", json.dumps(event_to_dict(record)).encode())


def test_the_final_poll_reads_the_records_the_watch_has_not_delivered_and_none_twice() -> None:
    kv = _LaggingWatchKV()
    _put_step(kv, "node0", 1)
    follower = EtcdEventFollower(kv, "job")  # type: ignore[arg-type]
    assert [e.step for e in follower.poll()] == [1]
    _put_step(kv, "node0", 2)
    _put_step(kv, "node1", 3)
    assert follower.poll() == []  # still in the watch
    assert [e.step for e in follower.poll(final=True)] == [2, 3]
    kv.deliver()  # the watch catches up late: nothing comes twice
    assert follower.poll(final=True) == []
    _put_step(kv, "node1", 4)
    kv.deliver()
    assert [e.step for e in follower.poll()] == [4]
    follower.close()


def test_a_final_read_while_the_watch_is_part_way_through_takes_the_rest_once_and_keeps_no_key() -> None:
    """The watch has delivered some of the records written since the first read when the final read comes: that read
    takes the others, the watch's late deliveries add nothing, and what the follower keeps to tell them apart is two
    revisions, not the keys it has seen (a run of days would grow that set by every record)."""
    kv = _LaggingWatchKV()
    follower = EtcdEventFollower(kv, "job")  # type: ignore[arg-type]
    assert follower.poll() == []
    for step in (1, 2, 3):
        _put_step(kv, "node0", step)
    assert kv.callback is not None
    first, *late = kv.undelivered
    kv.callback(first)  # the watch delivered step 1 only
    assert [e.step for e in follower.poll(final=True)] == [1, 2, 3]
    for event in late:
        kv.callback(event)
    assert follower.poll() == []
    assert not any(isinstance(value, (set, dict)) for value in vars(follower).values())
    follower.close()


def test_a_reader_told_of_each_record_takes_it_as_it_comes() -> None:
    """``on_arrival`` is called on the watch's thread once per record it queued (not for one a final read already
    delivered), so a reader needs no thread of its own to wait for records."""
    kv = _LaggingWatchKV()
    arrivals: list[list[int]] = []
    follower: EtcdEventFollower

    def on_arrival() -> None:
        arrivals.append([e.step for e in follower.poll()])

    follower = EtcdEventFollower(kv, "job", on_arrival=on_arrival)  # type: ignore[arg-type]
    assert follower.poll() == [] and arrivals == []
    _put_step(kv, "node0", 1)
    assert arrivals == []  # written, not yet delivered by the watch
    kv.deliver()
    assert arrivals == [[1]]
    _put_step(kv, "node0", 2)
    assert [e.step for e in follower.poll(final=True)] == [2]  # the final read takes it first
    kv.deliver()
    assert arrivals == [[1]]  # the late delivery is no new record
    follower.close()


class _CountingKV:
    """A store that passes every call to ``kv`` and counts the records its reads returned."""

    def __init__(self, kv: object) -> None:
        self.kv = kv
        self.returned = 0

    def __getattr__(self, name: str) -> object:
        return getattr(self.kv, name)

    def range_at(self, prefix: str, revision: int | None = None, *, changed_after: int = 0) -> object:
        items, at = self.kv.range_at(prefix, revision, changed_after=changed_after)  # type: ignore[attr-defined]
        self.returned += len(items)
        return items, at


def test_the_reader_takes_only_what_was_written_since_its_last_read_and_rereads_after_a_deletion(
    membership: MembershipStore,
) -> None:
    job = membership.keys.job
    prefix = events_prefix(job)
    kv = _CountingKV(membership.kv)

    def put(key: str, step: int) -> None:
        record = Step(t=float(step), step=step, samples=4, loss=1.0, nodes_active=2, duration_s=0.1)
        membership.kv.put(f"{prefix}{key}", json.dumps(event_to_dict(record)).encode())

    for step in range(1, 6):
        put(f"w/{step:04d}", step)
    reader = EtcdEventReader(kv, job)  # type: ignore[arg-type]
    assert [event.step for event in reader.read()] == [1, 2, 3, 4, 5]  # type: ignore[attr-defined]
    assert kv.returned == 5
    put("w/0006", 6)
    put("v/0001", 7)  # a new writer
    assert [event.step for event in reader.read()] == [1, 2, 3, 4, 5, 6, 7]  # type: ignore[attr-defined]
    assert kv.returned == 5 + 2  # only the two new records came from etcd
    assert reader.read(select=lambda records: lambda record: record["step"] > 5) == read_etcd_events(
        membership.kv, job, select=lambda records: lambda record: record["step"] > 5)
    membership.kv.delete(f"{prefix}w/0001")  # the oldest step record, deleted at the log's cap
    put("w/0008", 8)
    assert [event.step for event in reader.read()] == [2, 3, 4, 5, 6, 7, 8]  # type: ignore[attr-defined]
    assert kv.returned == 7 + 1 + 7  # the new record, then the whole log again
    put("w/0002", 9)  # a record written again under its key: read, and typed, again
    assert [event.step for event in reader.read()] == [3, 4, 5, 6, 7, 8, 9]  # type: ignore[attr-defined]


def test_the_reader_reads_a_store_without_revision_reads_whole_each_time() -> None:
    records = [KeyValue(key=f"{events_prefix('j')}w/{step:04d}", value=json.dumps(event_to_dict(
        Step(t=float(step), step=step, samples=4, loss=1.0, nodes_active=2, duration_s=0.1))).encode(),
        create_revision=step, mod_revision=step) for step in (2, 1)]

    class _PlainKV:
        def get_prefix(self, prefix: str) -> list[KeyValue]:
            return list(records)

    reader = EtcdEventReader(_PlainKV(), "j")  # type: ignore[arg-type]
    assert [event.step for event in reader.read()] == [1, 2]  # type: ignore[attr-defined]
    records.pop()
    assert [event.step for event in reader.read()] == [2]  # type: ignore[attr-defined]
