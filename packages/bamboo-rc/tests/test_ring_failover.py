"""P = 1 (pure data parallelism) with real SIGKILLs: D = 2, 3 and 4, a kill in the forward and in the
backward phase, lazy and eager; every run bit-equal (0.0) to the single-process reference."""

from __future__ import annotations

import pytest
from bamboo.rc.cli import main
from bamboo.rc.faults import KillPoint, NoticePoint
from bamboo.rc.ring import fault_free_ring_stream
from bamboo.rc.timeouts import CommTimeouts
from bamboo.rc.verify import DEFAULT_CONFIG, run_verify
from bamboo.schedule import Kind

pytestmark = pytest.mark.slow

TIMEOUTS = CommTimeouts(group=30.0, build=30.0, confirm=15.0)
M = DEFAULT_CONFIG["gradient_accumulation_steps"]


@pytest.mark.parametrize("mode", ["lflb", "eflb"])
@pytest.mark.parametrize("phase", [Kind.FORWARD, Kind.BACKWARD])
@pytest.mark.parametrize("pipelines", [2, 3, 4])
def test_a_killed_node_s_shadow_contributes_its_share_and_the_run_is_bit_equal(
    pipelines: int, phase: Kind, mode: str
) -> None:
    victim = pipelines - 1  # the last pipeline: its shadow is pipeline 0 (the ring closes)
    microbatch = victim * M + (2 if phase is Kind.FORWARD else 1)
    where = f"0{phase.value}{microbatch}"
    assert where in {str(i) for i in fault_free_ring_stream(victim, [M] * pipelines, mode)}
    result = run_verify(1, pipelines, 3, mode, timeouts=TIMEOUTS, deadline_s=120,
                        kills=(KillPoint(0, victim, where, step=1),))
    assert result.killed == (victim,)
    assert {(f.step, tuple(f.victims)) for f in result.failovers} == {(1, (victim,))}
    assert len(result.failovers) == pipelines - 1  # every survivor agreed on the one failover
    assert result.passed, result
    assert result.max_relative_diff == 0.0 and result.max_abs_diff == 0.0
    shadow = result.timings[0]["failovers"][0]
    recomputed = shadow.recovery_kinds or {}
    if mode == "lflb":  # the shadow computed the victim's microbatches after the failure
        assert recomputed.get("F", 0.0) > 0.0 and recomputed.get("B", 0.0) > 0.0
    else:  # eager: the victim's gradients were ready, nothing was recomputed
        assert recomputed.get("F", 0.0) == 0.0 and recomputed.get("B", 0.0) == 0.0


@pytest.mark.parametrize(
    ("pipelines", "kills", "steps"),
    [
        (4, [(1, "0F5", 1, False), (2, "0B9", 1, False)], 3),  # a node and its shadow: node 3 takes both shares
        (3, [(0, "-1", 1, False)], 3),  # the last instruction: the node dies with its all-reduce posted
        (4, [(1, "0AR", 1, False), (3, "0", 1, True)], 3),  # a second kill at the start of the recovery
        (4, [(1, "0B6", 0, False), (0, "0F2", 2, False)], 4),  # a second kill two steps later
        # D = 5, two non-adjacent victims: 3 survivors, two of them computing two shares, so the all-to-all's
        # pieces differ in size, and the 235,136 gradients split into 3 chunks of unequal size
        (5, [(1, "0F5", 1, False), (3, "0B13", 1, False)], 3),
    ],
)
def test_several_kills_in_the_ring_stay_exact(pipelines: int, kills: list[tuple[int, str, int, bool]], steps: int) -> None:
    points = tuple(KillPoint(0, d, where, step=step, in_recovery=recovery) for d, where, step, recovery in kills)
    for mode in ("lflb", "eflb"):
        result = run_verify(1, pipelines, steps, mode, timeouts=TIMEOUTS, deadline_s=120, kills=points)
        assert set(result.killed) == {d for d, _, _, _ in kills}, mode
        assert result.passed, (mode, result)
        assert result.max_relative_diff == 0.0, mode


def test_a_preemption_notice_hands_the_share_over_at_the_boundary() -> None:
    result = run_verify(1, 3, 4, "eflb", timeouts=TIMEOUTS, deadline_s=120,
                        notice_points=(NoticePoint(0, 1, 1, lead_s=60.0),))
    assert result.left == (1,) and not result.killed and not result.failovers
    assert result.passed, result
    assert result.max_relative_diff == 0.0


def test_verify_cli_runs_a_ring_with_a_kill_and_prints_the_pause(capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--stages", "1", "--pipelines", "3", "--redundancy", "lflb", "--kill", "0:1@0F5"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "max parameter difference: 0.000e+00 relative" in out
    assert "failover in step 1: victims {1: [0]}" in out and "ms from the kill until every survivor resumed" in out


def test_verify_cli_runs_uneven_shares_in_the_ring(capsys: pytest.CaptureFixture[str]) -> None:
    """Shares 3, 3 and 2 of 8 microbatches: the short last share's node dies, its shadow (node 0) computes it."""
    code = main(["verify", "--stages", "1", "--pipelines", "3", "--global-microbatches", "8", "--redundancy", "eflb",
                 "--kill", "0:2@0F7"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "max parameter difference: 0.000e+00 relative" in out and "failover in step 1: victims {2: [0]}" in out
    assert main(["verify", "--stages", "1", "--pipelines", "3", "--global-microbatches", "2"]) == 2
    assert capsys.readouterr().err.strip() == "bamboo-rc: error: a global batch of 2 microbatches cannot feed 3 pipelines"


@pytest.mark.parametrize(("mode", "pipelines", "global_microbatches", "kills"), [
    ("lflb", 4, 10, [(1, "0F4"), (3, "0B9")]),  # shares 3, 3, 2, 2: two nodes at once, a long and a short share
    ("efeb", 4, 10, [(0, "0FR9")]),  # node 0's eager copy of the short share it shadows
])
def test_uneven_shares_of_the_global_batch_fail_over_exactly_in_the_ring(
    mode: str, pipelines: int, global_microbatches: int, kills: list[tuple[int, str]],
) -> None:
    """D that does not divide the global batch (a loss left 3 nodes of a ring of 4 with 8 microbatches, say): the
    first ``G mod D`` shares are one microbatch longer; each node's stream, the ring's sum in share order and the
    takeover of a lost share follow the shares' own lengths, and the run is bit-equal to the reference that splits
    the global batch the same way."""
    shares = [global_microbatches // pipelines + (d < global_microbatches % pipelines) for d in range(pipelines)]
    for victim, where in kills:
        assert where in {str(i) for i in fault_free_ring_stream(victim, shares, mode)}
    result = run_verify(1, pipelines, 3, mode, timeouts=TIMEOUTS, deadline_s=120,
                        kills=tuple(KillPoint(0, victim, where, step=1) for victim, where in kills),
                        global_microbatches=global_microbatches)
    assert result.killed == tuple(sorted(victim for victim, _ in kills))
    assert result.passed and result.max_relative_diff == 0.0, result
