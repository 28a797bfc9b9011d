"""Failover from cuts where receives were posted ahead: a send completed, its receive had not run yet.

A runtime that posts each node's next activation or gradient receive before its turn (bamboo-rc's
``StageInterpreter.post_ahead``) lets a blocking send complete while its receiver still computes. The cut then
holds messages in flight; the failover plan runs their receives without a partner, and must stay valid.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest
from bamboo.schedule import Kind, generate, one_f_one_b
from bamboo.schedule.cut import cut_problem
from bamboo.schedule.engine import Deadlock, check_execution, counterpart, received_ahead
from bamboo.schedule.failover import ConsecutiveFailure, failover_schedule, validate_failover
from bamboo.schedule.ir import Instruction
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

_AHEAD = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD})


def _first_receive(stream: Sequence[Instruction], index: int) -> Instruction | None:
    """The receive a node at `index` has posted ahead: its first activation or gradient receive from there on."""
    for instr in stream[index:]:
        if instr.kind in _AHEAD:
            return instr
    return None


def cut_with_receives_ahead(
    streams: Mapping[int, Sequence[Instruction]],
    seed: int,
    start: Mapping[int, int] | None = None,
    delivered: set[tuple[int, Instruction]] | None = None,
) -> tuple[dict[int, int], set[tuple[int, Instruction]]]:
    """Progress after a random run that stopped at a random moment, where a send may also complete into the
    receive its receiver posted ahead; returns the progress and the receives whose data came ahead."""
    rng = random.Random(seed)
    pos = dict(start) if start is not None else dict.fromkeys(streams, 0)
    came = set(delivered or ())
    total = sum(len(s) for s in streams.values())
    for _ in range(rng.randint(0, total)):
        options: list[tuple[int, int | None, bool]] = []
        for n, stream in streams.items():
            if pos[n] >= len(stream):
                continue
            instr = stream[pos[n]]
            m = instr.peer
            if m is None or (n, instr) in came:
                options.append((n, None, False))
            elif m in streams and pos[m] < len(streams[m]):
                other = counterpart(instr, n)
                if streams[m][pos[m]] == other:
                    options.append((n, m, False))
                if instr.is_send and instr.kind is not Kind.SYNC_SEND and _first_receive(streams[m], pos[m]) == other:
                    options.append((n, m, True))
        if not options:
            break
        n, m, ahead = rng.choice(options)
        instr = streams[n][pos[n]]
        came.discard((n, instr))
        pos[n] += 1
        if m is None:
            continue
        if ahead:
            came.add((m, counterpart(instr, n)))
        else:
            pos[m] += 1
    return pos, came


def test_a_send_into_a_receive_posted_ahead_is_in_flight_not_an_inconsistent_cut() -> None:
    schedule = one_f_one_b(3, 2, "lflb")
    streams = schedule.streams
    sa = next(i for i in streams[0] if i.kind is Kind.SEND_ACT)
    executed = {0: streams[0][: streams[0].index(sa) + 1], 1: (), 2: ()}
    assert received_ahead(executed) == {(1, counterpart(sa, 0))}
    assert cut_problem(executed) is None
    assert "waits at 0SA0>1" in (cut_problem(executed, receives_ahead=False) or "")  # efeb: no receive posted ahead
    # received but never sent stays inconsistent
    ra = counterpart(sa, 0)
    bad = {0: (), 1: streams[1][: streams[1].index(ra) + 1], 2: ()}
    assert cut_problem(bad) is not None
    # a receive whose data came ahead runs alone; without it, it waits forever
    rest = {1: streams[1][streams[1].index(ra):streams[1].index(ra) + 1]}
    check_execution(rest, ahead={(1, ra)})
    with pytest.raises(Deadlock):
        check_execution(rest)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["1f1b", "gpipe"]),
    stages=st.integers(2, 8),
    microbatches=st.integers(1, 12),
    rc=st.sampled_from(["lflb", "eflb"]),
    data=st.data(),
)
def test_failover_from_a_cut_with_receives_posted_ahead_validates(  # type: ignore[no-untyped-def]
    policy, stages, microbatches, rc, data
) -> None:
    victims = data.draw(st.sets(st.integers(0, stages - 1), min_size=1, max_size=max(1, stages // 2)), "victims")
    assume(all((v + 1) % stages not in victims for v in victims))
    schedule = generate(policy, stages, microbatches, rc)
    progress, came = cut_with_receives_ahead(schedule.streams, data.draw(st.integers(0, 2**31), "seed"))
    plan = failover_schedule(schedule, victims, progress)
    validate_failover(plan)
    for m, receive in came:  # a survivor's receive whose data came ahead stays in its remainder, and runs alone
        if m not in victims and receive.peer not in victims:
            assert receive in plan.remainder.streams[m]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    stages=st.integers(4, 8),
    microbatches=st.integers(1, 6),
    rc=st.sampled_from(["lflb", "eflb"]),
    first=st.integers(0, 7),
    gap=st.integers(2, 6),
    seed=st.integers(0, 2**31),
)
def test_a_second_failure_during_a_remainder_with_receives_ahead_validates(  # type: ignore[no-untyped-def]
    stages, microbatches, rc, first, gap, seed
) -> None:
    first %= stages
    second = (first + gap) % stages
    assume(second != first)
    schedule = one_f_one_b(stages, microbatches, rc)
    progress, came = cut_with_receives_ahead(schedule.streams, seed)
    plan = failover_schedule(schedule, [first], progress)
    full = plan.iteration_streams()
    start = {n: len(plan.executed[n]) for n in plan.survivors}
    survivors_came = {(m, r) for m, r in came if m in full and r.peer in full}
    position, _ = cut_with_receives_ahead(full, seed + 1, start, survivors_came)
    cut = {n: position[n] - start[n] for n in plan.survivors}
    try:
        again = failover_schedule(plan, [second], cut)
    except ConsecutiveFailure:
        return
    validate_failover(again)
