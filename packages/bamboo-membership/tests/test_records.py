"""Record encoding: protobuf JSON round trips, and any bytes at all decode or raise MalformedValueError."""

from __future__ import annotations

import json

from bamboo.membership.records import (
    FailureReport,
    MalformedValueError,
    NodeFailed,
    NodeRecord,
    NodeState,
    decode_json,
    decode_message,
    encode_message,
)
from hypothesis import given, settings
from hypothesis import strategies as st

node_ids = st.text(st.characters(blacklist_characters="/", blacklist_categories=("Cs",)), min_size=1, max_size=20)


@settings(deadline=None, max_examples=60)
@given(
    node_id=node_ids,
    zone=st.text(max_size=10),
    port=st.integers(0, 65535),
    incarnation=st.integers(0, 2**64 - 1),
    state=st.sampled_from(list(NodeState.values())),
)
def test_node_record_round_trips(node_id: str, zone: str, port: int, incarnation: int, state: int) -> None:
    record = NodeRecord(id=node_id, zone=zone, address="10.0.0.1", agent_port=port, incarnation=incarnation,
                        state=state)
    assert decode_message("/k", encode_message(record), NodeRecord) == record


@settings(deadline=None, max_examples=150)
@given(raw=st.one_of(st.binary(max_size=64), st.text(max_size=64).map(str.encode),
                     st.dictionaries(st.sampled_from(["id", "agent_port", "state", "x"]),
                                     st.one_of(st.integers(), st.text(max_size=5), st.none(), st.booleans()))
                     .map(lambda d: json.dumps(d).encode())))
def test_any_bytes_decode_or_raise_a_clear_malformed_value_error(raw: bytes) -> None:
    try:
        record = decode_message("/bamboo/j/nodes/x", raw, NodeRecord)
    except MalformedValueError as exc:
        assert "/bamboo/j/nodes/x" in str(exc) and "NodeRecord" in str(exc) and exc.raw == raw
    else:
        assert record.id  # the one required field
    try:
        decode_json("/bamboo/j/layout", raw, "layout")
    except MalformedValueError as exc:
        assert "layout" in str(exc)


def test_node_failed_from_report() -> None:
    report = FailureReport(node="n", epoch=4, incarnation=2, detected_by="d", path=2, reason="lease expired",
                           detected_at=5.5)
    assert NodeFailed.from_report(report) == NodeFailed("n", 4, "d", "lease expired", 2, "lease_expiry", 5.5)
