"""Generators and the redundancy pass: valid, deadlock-free, and shaped as the modes promise."""

from __future__ import annotations

import pytest
from bamboo.schedule import Kind, RCMode, add_redundancy, generate, gpipe, one_f_one_b
from bamboo.schedule.validate import validate
from hypothesis import given, settings
from hypothesis import strategies as st

MODES = ["none", "lflb", "eflb", "efeb"]


@settings(max_examples=80, deadline=None)
@given(
    policy=st.sampled_from(["1f1b", "gpipe"]),
    stages=st.integers(2, 12),
    microbatches=st.integers(1, 32),
    rc=st.sampled_from(MODES),
)
def test_every_generated_schedule_validates(policy: str, stages: int, microbatches: int, rc: str) -> None:
    schedule = generate(policy, stages, microbatches, rc)
    validate(schedule)
    assert schedule.rc is RCMode(rc)


@pytest.mark.parametrize("policy", ["1f1b", "gpipe"])
@pytest.mark.parametrize("rc", ["lflb", "eflb", "efeb"])
def test_redundancy_pass_equals_generating_with_redundancy(policy: str, rc: str) -> None:
    for stages, microbatches in [(2, 1), (3, 5), (5, 3), (6, 8)]:
        plain = generate(policy, stages, microbatches)
        assert add_redundancy(plain, rc) == generate(policy, stages, microbatches, rc)


def _compute(schedule, node):  # type: ignore[no-untyped-def]
    return [i for i in schedule.streams[node] if i.kind in (Kind.FORWARD, Kind.BACKWARD)]


def test_one_f_one_b_warms_up_then_alternates() -> None:
    P, M = 5, 9
    schedule = one_f_one_b(P, M)
    for s in range(P):
        kinds = [i.kind for i in _compute(schedule, s)]
        warmup = min(P - 1 - s, M)
        assert kinds[: warmup + 1] == [Kind.FORWARD] * (warmup + 1)
        steady = kinds[warmup : warmup + 2 * (M - warmup)]
        assert steady == [Kind.FORWARD, Kind.BACKWARD] * (M - warmup)


def test_gpipe_runs_all_forwards_first() -> None:
    schedule = gpipe(3, 4)
    for s in range(3):
        kinds = [i.kind for i in _compute(schedule, s)]
        assert kinds == [Kind.FORWARD] * 4 + [Kind.BACKWARD] * 4


def test_eflb_runs_frc_for_the_successor_and_swaps_it_out_right_after() -> None:
    P, M = 4, 6
    schedule = one_f_one_b(P, M, "eflb")
    for n in range(P):
        stream = schedule.streams[n]
        frcs = [j for j, i in enumerate(stream) if i.kind is Kind.FRC]
        assert len(frcs) == M
        for j in frcs:
            assert stream[j].stage == (n + 1) % P
            assert stream[j + 1].kind is Kind.SWAP_OUT and stream[j + 1].stage == stream[j].stage
            assert stream[j + 1].microbatch == stream[j].microbatch
        assert not any(i.kind is Kind.BRC for i in stream)
    last = schedule.streams[P - 1]
    loads = [j for j, i in enumerate(last) if i.kind is Kind.LOAD]
    assert len(loads) == M
    assert all(last[j + 1].kind is Kind.FRC and last[j + 1].stage == 0 for j in loads)


def test_eflb_fills_the_first_stage_bubble_before_its_first_backward() -> None:
    schedule = one_f_one_b(4, 8, "eflb")
    stream = schedule.streams[0]
    first_backward = next(j for j, i in enumerate(stream) if i.kind is Kind.BACKWARD)
    assert any(i.kind is Kind.FRC for i in stream[:first_backward])


def test_efeb_runs_brc_and_needs_the_extra_gradient() -> None:
    schedule = one_f_one_b(4, 3, "efeb")
    node0 = schedule.streams[0]
    assert sum(i.kind is Kind.BRC for i in node0) == 3
    # BRC of stage 1 on node 0 needs the gradient w.r.t. stage 1's output, sent by node 2
    assert any(i.kind is Kind.RECV_GRAD and i.stage == 1 and i.peer == 2 for i in node0)


def test_lflb_stashes_the_replica_input_only() -> None:
    schedule = one_f_one_b(3, 4, "lflb")
    for n in range(3):
        kinds = [i.kind for i in schedule.streams[n]]
        assert Kind.FRC not in kinds and Kind.BRC not in kinds
        assert kinds.count(Kind.SWAP_OUT) == (4 if n != 2 else 0)  # stage 0's input is re-loaded


@pytest.mark.parametrize("rc", ["lflb", "eflb", "efeb"])
def test_replica_sync_goes_to_the_shadow_after_the_all_reduce(rc: str) -> None:
    schedule = one_f_one_b(4, 3, rc)
    for n in range(4):
        stream = [str(i) for i in schedule.streams[n]]
        assert f"{n}SY>{(n - 1) % 4}" in stream
        assert stream.index(f"{n}SY>{(n - 1) % 4}") > stream.index(f"{n}AR")
        assert f"{(n + 1) % 4}RY<{(n + 1) % 4}" in stream


def test_no_redundancy_means_no_sync() -> None:
    schedule = one_f_one_b(3, 2)
    assert not any(i.kind in (Kind.SYNC_SEND, Kind.SYNC_RECV) for s in schedule.streams.values() for i in s)


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: one_f_one_b(0, 4), "stages must be an int >= 1, got 0"),
        (lambda: one_f_one_b(4, 0), "microbatches must be an int >= 1, got 0"),
        (lambda: one_f_one_b(1, 4, "eflb"), "at least 2 stages, got 1"),
        (lambda: one_f_one_b(4, 4, "fast"), "unknown redundancy mode 'fast'"),
        (lambda: generate("zb", 4, 4), "unknown policy 'zb'"),
        (lambda: add_redundancy(one_f_one_b(3, 2, "eflb"), "efeb"), "needs a plain schedule"),
    ],
)
def test_bad_arguments_are_named(call, message) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ValueError, match=message):
        call()


def test_single_stage_plain_pipeline() -> None:
    schedule = one_f_one_b(1, 3)
    validate(schedule)
    assert [str(i) for i in schedule.streams[0]] == ["0L0", "0F0", "0B0", "0L1", "0F1", "0B1", "0L2", "0F2", "0B2",
                                                      "0AR", "0OPT"]
