"""The validator catches each kind of broken schedule and prints the grid with the bad cell marked."""

from __future__ import annotations

import attrs
import pytest
from bamboo.schedule import Instruction, Schedule, one_f_one_b
from bamboo.schedule.engine import Deadlock, Mismatch, execute
from bamboo.schedule.validate import ScheduleError, validate


def _edit(schedule: Schedule, node: int, stream: list[str]) -> Schedule:
    streams = dict(schedule.streams)
    streams[node] = tuple(Instruction.parse(t) for t in stream)
    return attrs.evolve(schedule, streams=streams)


def _texts(schedule: Schedule, node: int) -> list[str]:
    return [str(i) for i in schedule.streams[node]]


def test_valid_schedule_passes() -> None:
    validate(one_f_one_b(3, 4, "eflb"))


def test_send_send_cycle_is_a_deadlock_and_both_heads_are_marked() -> None:
    schedule = one_f_one_b(2, 2)
    # node 0 sends activation 1 before receiving gradient 0, node 1 sends gradient 0 before receiving
    # activation 1: with blocking send/recv both wait forever
    node0 = ["0L0", "0F0", "0SA0>1", "0L1", "0F1", "0SA1>1", "0RG0<1", "0B0", "0RG1<1", "0B1", "0AR", "0OPT"]
    node1 = ["1RA0<0", "1F0", "1B0", "1SG0>0", "1RA1<0", "1F1", "1B1", "1SG1>0", "1AR", "1OPT"]
    with pytest.raises(ScheduleError) as info:
        validate(_edit(_edit(schedule, 0, node0), 1, node1))
    assert "deadlock" in info.value.problem
    assert ">>0SA1>1<<" in info.value.grid and ">>1SG0>0<<" in info.value.grid
    assert str(info.value).count("node ") >= 2  # the whole grid is printed
    # receiving first on one side fixes it
    node1_fixed = ["1RA0<0", "1F0", "1B0", "1RA1<0", "1SG0>0", "1F1", "1B1", "1SG1>0", "1AR", "1OPT"]
    validate(_edit(_edit(schedule, 0, node0), 1, node1_fixed))


def test_messages_in_the_wrong_order_are_a_mismatch() -> None:
    schedule = one_f_one_b(2, 2)
    node1 = _texts(schedule, 1)
    i, j = node1.index("1RA0<0"), node1.index("1RA1<0")
    node1[i], node1[j] = node1[j], node1[i]
    with pytest.raises(ScheduleError, match=r"pairs with|before its input"):
        validate(_edit(schedule, 1, node1))
    with pytest.raises(Mismatch):
        execute(_edit(schedule, 1, node1).streams)


def test_a_missing_backward_is_reported_with_its_count() -> None:
    schedule = one_f_one_b(3, 3)
    node2 = [t for t in _texts(schedule, 2) if t != "2B1"]
    with pytest.raises(ScheduleError, match=r"runs before its input|runs 0 times"):
        validate(_edit(schedule, 2, node2))


def test_a_duplicated_forward_is_reported() -> None:
    schedule = one_f_one_b(2, 2)
    node0 = _texts(schedule, 0)
    node0.insert(node0.index("0F0") + 1, "0F0")
    with pytest.raises(ScheduleError, match="FORWARD of stage 0 microbatch 0 runs 2 times, expected 1"):
        validate(_edit(schedule, 0, node0))


def test_backward_before_its_forward_is_a_dependency_error() -> None:
    schedule = one_f_one_b(1, 2)
    with pytest.raises(ScheduleError, match="0B0 runs before its input the forward state of stage 0") as info:
        validate(_edit(schedule, 0, ["0B0", "0L0", "0F0", "0L1", "0F1", "0B1", "0AR", "0OPT"]))
    assert ">>0B0<<" in info.value.grid


def test_frc_on_the_wrong_node_is_reported() -> None:
    schedule = one_f_one_b(3, 1, "eflb")
    node0 = _texts(schedule, 0)
    node1 = _texts(schedule, 1)
    # move stage 2's FRC (and its swap-out) from node 1 to node 0, which does not hold that replica
    node1 = [t for t in node1 if t not in ("2FR0", "2SO0")]
    node0 = [*node0[: node0.index("0SA0>1") + 1], "0L0"]
    with pytest.raises(ScheduleError):
        validate(_edit(_edit(schedule, 1, node1), 0, node0))


def test_replica_used_after_its_sync_is_reported() -> None:
    schedule = one_f_one_b(2, 1, "eflb")
    node0 = [t for t in _texts(schedule, 0) if t not in ("1FR0", "1SO0")] + ["1FR0", "1SO0"]
    node0 = [t for t in node0 if t != "1RY<1"]
    node0.insert(node0.index("1FR0"), "1RY<1")
    with pytest.raises(ScheduleError, match="after its sync step"):
        validate(_edit(schedule, 0, node0))


def test_out_of_range_and_self_messages() -> None:
    schedule = one_f_one_b(2, 1)
    with pytest.raises(ScheduleError, match="stage 5 out of range"):
        validate(_edit(schedule, 0, [*_texts(schedule, 0), "5F0"]))
    with pytest.raises(ScheduleError, match="cannot send to or receive from itself"):
        validate(_edit(schedule, 0, [*_texts(schedule, 0), "0SA0>0"]))


def test_engine_reports_deadlock_cells() -> None:
    streams = {0: (Instruction.parse("0RA0<1"),), 1: (Instruction.parse("1RG0<0"),)}
    with pytest.raises(Deadlock) as info:
        execute(streams)
    assert set(info.value.cells) == {(0, 0), (1, 0)}
