"""The IR: compact string forms round-trip, constructors reject bad values with clear messages."""

from __future__ import annotations

import pytest
from bamboo.schedule import Instruction, Kind, RCMode, Schedule, one_f_one_b
from bamboo.schedule.ir import COMM_KINDS, PER_ITERATION, SENDS
from hypothesis import given, settings
from hypothesis import strategies as st


@st.composite
def instructions(draw: st.DrawFn) -> Instruction:
    kind = draw(st.sampled_from(list(Kind)))
    stage = 0 if kind is Kind.LOAD else draw(st.integers(0, 200))
    microbatch = None if kind in PER_ITERATION else draw(st.integers(0, 5000))
    peer = draw(st.integers(0, 200)) if kind in COMM_KINDS else None
    return Instruction(kind, stage, microbatch, peer)


@settings(max_examples=300, deadline=None)
@given(instructions())
def test_compact_form_round_trips(instr: Instruction) -> None:
    text = str(instr)
    assert Instruction.parse(text) == instr
    assert str(Instruction.parse(text)) == text


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2F5", Instruction(Kind.FORWARD, 2, 5)),
        ("12B31", Instruction(Kind.BACKWARD, 12, 31)),
        ("3FR5", Instruction(Kind.FRC, 3, 5)),
        ("3BR0", Instruction(Kind.BRC, 3, 0)),
        ("2SA5>3", Instruction(Kind.SEND_ACT, 2, 5, 3)),
        ("3RA5<2", Instruction(Kind.RECV_ACT, 3, 5, 2)),
        ("0L7", Instruction(Kind.LOAD, 0, 7)),
        ("4AR", Instruction(Kind.ALLREDUCE, 4)),
        ("4OPT", Instruction(Kind.OPTIMIZER, 4)),
        ("1SY>0", Instruction(Kind.SYNC_SEND, 1, None, 0)),
        ("1RY<2", Instruction(Kind.SYNC_RECV, 1, None, 2)),
    ],
)
def test_known_forms(text: str, expected: Instruction) -> None:
    assert Instruction.parse(text) == expected
    assert str(expected) == text


@pytest.mark.parametrize("text", ["", "F5", "2X5", "2SA5", "2SA5<3", "2RA5>3", "2F", "2AR5", "2F5>1", "-1F2"])
def test_bad_forms_are_rejected_with_the_text(text: str) -> None:
    with pytest.raises(ValueError, match="not an instruction"):
        Instruction.parse(text)


def test_constructor_messages_name_the_offending_value() -> None:
    with pytest.raises(ValueError, match="microbatch"):
        Instruction(Kind.FORWARD, 1)
    with pytest.raises(ValueError, match="peer"):
        Instruction(Kind.SEND_ACT, 1, 2)
    with pytest.raises(ValueError, match="'stage' must be >= 0: -3"):
        Instruction(Kind.FORWARD, -3, 0)
    with pytest.raises(ValueError, match="'peer' must be >= 0: -1"):
        Instruction(Kind.SEND_ACT, 1, 2, -1)
    with pytest.raises(ValueError, match="bool"):
        Instruction(Kind.FORWARD, 1, True)
    with pytest.raises(TypeError, match="'stage' must be <class 'int'>"):
        Instruction(Kind.FORWARD, None, 0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="no microbatch"):
        Instruction(Kind.ALLREDUCE, 1, 4)


def test_sends_and_receives_are_classified() -> None:
    for kind in Kind:
        instr = Instruction(kind, 0, None if kind in PER_ITERATION else 0, 1 if kind in COMM_KINDS else None)
        assert instr.is_send == (kind in SENDS)
        assert instr.is_comm == (kind in COMM_KINDS)
        assert instr.on_behalf_of == 0


def test_schedule_validates_its_placement_and_exposes_layout() -> None:
    with pytest.raises(ValueError, match=r"\(0, 5\)"):
        Schedule(2, 1, "1f1b", RCMode.NONE, (0, 5), {})
    schedule = one_f_one_b(4, 2, "eflb")
    assert schedule.nodes == (0, 1, 2, 3)
    assert schedule.stages_on(2) == (2,)
    assert schedule.shadow_of(0) == 3
    assert schedule.shadow_of(2) == 1
    assert one_f_one_b(4, 2).shadow_of(1) is None
    assert schedule.to_text()["1"][0] == "1RA0<0"
    assert len(schedule) == sum(len(s) for s in schedule.streams.values())


def test_schedule_rejects_bad_shadows() -> None:
    with pytest.raises(ValueError, match=r"shadows must give a node or None for each of 2 stages, got \(0,\)"):
        Schedule(2, 1, "1f1b", RCMode.EFLB, (0, 1), {}, (0,))
    assert Schedule(2, 1, "1f1b", RCMode.EFLB, (0, 1), {}).shadows == (1, 0)
