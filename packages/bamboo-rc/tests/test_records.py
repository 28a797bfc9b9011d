"""The records bamboo-rc writes for other processes: versioned JSON, readers that name the bad key."""

from __future__ import annotations

import json

import pytest
from bamboo.rc.faults import KillRecord
from bamboo.rc.records import (
    CommitResult,
    FailoverRecord,
    FailureEvent,
    HandoverRecord,
    ProgressRecord,
    RecordError,
    ReducedRecord,
    SuspicionRecord,
)

FAILOVER = FailoverRecord(
    epoch=2, victims={0: [3, 1]}, step=4, cut={0: 19, 2: 12}, caught_at=10.0, confirmed_at=10.03,
    resumed_at=10.05, own_pipeline=True, kinds_before={"F": 0.5},
)
RECORDS = [
    FailureEvent(3, [5, 2], handover=True),
    SuspicionRecord(1, 0, 4, "0AR"),
    ProgressRecord(17, 2, remainder=True),
    ProgressRecord(0, 3, remainder=False, commit=CommitResult(2, 0.1 + 0.2, 1e-300)),
    CommitResult(4, 12.25, 3.0),
    HandoverRecord(5, 1, 2, 7),
    KillRecord(3, 1_700_000_000.25, "1:0@1F2/1"),
    FAILOVER,
    FAILOVER.ended(10.5, {"F": 0.75, "BR": 0.25}),
    ReducedRecord(7, {3: (6, 7), 0: (7,)}),
]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_every_record_round_trips_through_versioned_json(record: object) -> None:
    text = record.to_json()  # type: ignore[attr-defined]
    assert json.loads(text)["v"] == 1
    assert type(record).from_json(text) == record  # type: ignore[attr-defined]
    assert type(record).from_json(text.encode()) == record  # type: ignore[attr-defined]


@pytest.mark.parametrize("record", RECORDS, ids=lambda r: type(r).__name__)
def test_an_unknown_version_or_a_missing_key_is_rejected(record: object) -> None:
    data = json.loads(record.to_json())  # type: ignore[attr-defined]
    with pytest.raises(RecordError, match=r"unknown version 2 \(this reader knows version 1\)"):
        type(record).from_dict({**data, "v": 2})  # type: ignore[attr-defined]
    for key in data:  # every key, even one whose value may be null
        with pytest.raises(RecordError, match=f"missing key '{key}'"):
            type(record).from_dict({k: v for k, v in data.items() if k != key})  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("reader", "data", "message"),
    [
        (FailureEvent.from_dict, {"v": 1, "epoch": 1, "victims": "2", "handover": False},
         "failure event: key 'victims' must be a list of ranks (integers >= 0), got '2'"),
        (FailureEvent.from_dict, {"v": 1, "epoch": 0, "victims": [2], "handover": False},
         "failure event: key 'epoch' must be an integer >= 1, got 0"),
        (FailureEvent.from_dict, {"v": 1, "epoch": 1, "victims": [2], "handover": "no"},
         "failure event: key 'handover' must be true or false, got 'no'"),
        (ProgressRecord.from_dict, {"v": 1, "done": -1, "step": 0, "remainder": False, "commit": None},
         "progress: key 'done' must be an integer >= 0, got -1"),
        (ProgressRecord.from_dict, {"v": 1, "done": 0, "step": 1, "remainder": False, "commit": [0, 1.0, 2.0]},
         "progress: key 'commit': must be a JSON object, got list"),
        (ProgressRecord.from_dict,
         {"v": 1, "done": 0, "step": 1, "remainder": False, "commit": {"v": 1, "step": 0, "squared_norm": "big",
                                                                        "loss": 2.0}},
         "progress: key 'commit': key 'squared_norm' must be a number, got 'big'"),
        (FailoverRecord.from_dict, {**FAILOVER.to_dict(), "victims": {"zero": [1]}},
         "failover record: key 'victims' must be an object from pipelines to lists of nodes"),
        (FailoverRecord.from_dict, {**FAILOVER.to_dict(), "victims": {"0": 1}},
         "failover record: key 'victims' must map pipelines to lists of nodes, got 1 for pipeline 0"),
        (FailoverRecord.from_dict, {**FAILOVER.to_dict(), "kinds_before": {"F": "fast"}},
         "failover record: key 'kinds_before' must be an object from names to seconds"),
        (SuspicionRecord.from_dict, [1, 2], "suspicion: must be a JSON object, got list"),
        (ReducedRecord.from_dict, {"v": 1, "step": 7, "completed": {"0": [7, -1]}},
         "reduced: key 'completed' must map stages to lists of steps, got [7, -1] for stage 0"),
    ],
)
def test_a_malformed_value_is_named(reader, data, message: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(RecordError) as info:
        reader(data)
    assert str(info.value).startswith(message)


def test_text_that_is_not_json_is_a_record_error() -> None:
    with pytest.raises(RecordError, match="failure event: not JSON"):
        FailureEvent.from_json("{epoch: 1")


def test_a_failover_record_says_who_failed_and_how_long_the_pause_was() -> None:
    assert FAILOVER.victims == {0: (1, 3)}
    assert FAILOVER.pause_s == pytest.approx(0.05)
    ended = FAILOVER.ended(10.5, {"F": 0.75, "BR": 0.25})
    assert ended.iteration_end == 10.5 and ended.recovery_kinds == {"F": 0.25, "BR": 0.25}


def test_built_records_refuse_counts_that_are_not_ints_at_least_zero() -> None:
    with pytest.raises(ValueError, match="'done' must be >= 0: -1"):
        ProgressRecord(done=-1, step=0)
    with pytest.raises(ValueError, match="bool"):
        ProgressRecord(done=0, step=True)
    with pytest.raises(TypeError, match="'step' must be <class 'int'>"):
        ProgressRecord(done=0, step=1.0)


def test_a_witness_record_says_whether_an_all_reduce_had_completed() -> None:
    record = ReducedRecord(7, {3: (7, 6)})
    assert record.completed == {3: (6, 7)}
    assert record.has_completed(3, 6) and record.has_completed(3, 7)
    assert not record.has_completed(0, 7)  # never reduced here in step 7
    assert record.has_completed(0, 6)  # this node is past step 6: every all-reduce of it completed
