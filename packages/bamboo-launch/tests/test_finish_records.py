"""The records of a finish: the request, and the stop decision that carries it (older readers' form included)."""

from __future__ import annotations

import pytest
from bamboo.launch.records import FinishRequest, RecordError, StopDecision


def test_a_stop_decision_without_finish_is_a_reconfiguration_and_finish_round_trips() -> None:
    older = {"v": 1, "step": 12, "reason": "rebuild redundancy after a failover"}  # written before `finish`
    assert StopDecision.from_dict(older) == StopDecision(12, "rebuild redundancy after a failover", finish=False)
    finishing = StopDecision(40, "finish requested by alice", finish=True)
    assert StopDecision.from_dict(finishing.to_dict()) == finishing


@pytest.mark.parametrize(("data", "message"), [
    ({"v": 1, "step": 3, "reason": "x", "finish": "yes"}, "'finish' must be <class 'bool'>"),
    ({"v": 1, "by": "alice"}, "missing key 'unix'"),
    ({"v": 2, "by": "alice", "unix": 1.0}, "unknown version 2"),
    ({"v": 1, "by": "alice", "unix": float("nan")}, "key 'unix' must be a finite number"),
])
def test_malformed_finish_records_name_the_key(data: dict[str, object], message: str) -> None:
    cls = StopDecision if "step" in data else FinishRequest
    with pytest.raises(RecordError, match=message):
        cls.from_dict(data)


def test_a_finish_request_round_trips() -> None:
    request = FinishRequest(by="bamboo-launch run", unix=1_700_000_000.5)
    assert FinishRequest.from_dict(request.to_dict()) == request
