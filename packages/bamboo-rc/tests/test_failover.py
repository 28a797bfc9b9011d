"""Failover with real SIGKILLs: single and non-adjacent victims, consecutive victims, detection."""

from __future__ import annotations

import attrs
import pytest
from bamboo.rc.cli import main
from bamboo.rc.faults import KillPoint, NoticePoint
from bamboo.rc.timeouts import CommTimeouts
from bamboo.rc.verify import DEFAULT_CONFIG, run_verify
from bamboo.schedule import Costs, one_f_one_b

pytestmark = pytest.mark.slow

TIMEOUTS = CommTimeouts(group=30.0, build=30.0, confirm=15.0)


@pytest.mark.parametrize(
    ("stages", "kills"),
    [
        (4, [(1, "1F2")]),  # forward phase, middle stage
        (4, [(2, "2B1")]),  # backward phase
        (4, [(0, "0")]),  # first instruction, first stage
        (4, [(3, "-1")]),  # last instruction, last stage
        (4, [(3, "3F0")]),  # last stage, first forward
        (4, [(1, "1F2"), (3, "3B0")]),  # two non-adjacent victims in one iteration
        (3, [(1, "1B0")]),
        (3, [(2, "0FR1")]),  # the last node dies while it runs the first stage's FRC
    ],
)
def test_eflb_survives_kills_and_matches_the_reference(stages: int, kills: list[tuple[int, str]]) -> None:
    _fails_over_exactly(stages, kills, "eflb")


def _fails_over_exactly(stages: int, kills: list[tuple[int, str]], mode: str, costs: Costs | None = None) -> None:
    """One pipeline of ``stages``, each of ``kills`` (stage, instruction) in step 1: killed, failed over, exact
    (with ``costs``, on the placement searched for them)."""
    points = tuple(KillPoint(stage, 0, where, step=1) for stage, where in kills)
    result = run_verify(stages, 1, 3, mode, timeouts=TIMEOUTS, deadline_s=120, kills=points, schedule_costs=costs)
    assert set(result.killed) == {stage for stage, _ in kills}
    assert result.failovers, "no survivor failed over"
    assert result.passed, result
    assert result.max_relative_diff <= 1e-6


@pytest.mark.parametrize(
    ("stages", "pipelines", "mode", "kills"),
    [
        # (stage, instruction, step, only during a failover's remainder)
        (4, 1, "eflb", [(1, "1F2", 1, False), (3, "3B2", 1, True)]),  # second kill during the merged remainder
        (4, 1, "eflb", [(1, "1F2", 1, False), (3, "3B2", 2, False)]),  # in a later iteration (merged schedule)
        (6, 1, "efeb", [(2, "2F1", 1, False), (4, "4B2", 1, True)]),
        (6, 1, "lflb", [(2, "2F1", 1, False), (4, "4B2", 2, False)]),
        (4, 2, "eflb", [(1, "1F2", 1, False), (3, "3B2", 1, True)]),  # the data-parallel groups follow
        # the first victim dies after its all-reduce and before it posts its replica sync (its data-parallel peer
        # joins the shadow's redo); the others finish their streams meanwhile (their replica syncs are posted, not
        # waited for), so the second dies in the next iteration, on the merged schedule
        (4, 2, "eflb", [(3, "3SY>2", 1, False), (1, "1F2", 2, False)]),
    ],
)
def test_a_second_non_adjacent_failure_after_a_failover_matches_the_reference(
    stages: int, pipelines: int, mode: str, kills: list[tuple[int, str, int, bool]]
) -> None:
    points = tuple(KillPoint(stage, 0, where, step=step, in_recovery=recovery) for stage, where, step, recovery in kills)
    steps = max(step for _, _, step, _ in kills) + 2  # a whole iteration runs with both stages taken over
    result = run_verify(stages, pipelines, steps, mode, timeouts=TIMEOUTS, deadline_s=120, kills=points)
    assert set(result.killed) == {stage for stage, _, _, _ in kills}
    own = {(f.step, repr(f.victims)) for f in result.failovers if f.cut is not None}
    assert own == {(step, repr({0: (stage,)})) for stage, _, step, _ in kills}, "not two separate failovers"
    assert result.passed, result
    assert result.max_relative_diff <= 1e-6


@pytest.mark.parametrize(
    ("kill", "steps", "lost", "copies", "after"),
    [
        # node 2 dies while node 1's stage runs on node 0: stage 2's only replica was on node 1
        ("1@1F2,2@2B2/1/recovery", 3, "[2]", "stage 2: none", 1),
        # node 0 dies in the next iteration while it runs stages 0 and 1: stage 1 has no replica left
        ("1@1F2,0@0B1/2", 4, "[0, 1]", "stage 0: shadow rank 3; stage 1: none", 2),
    ],
)
def test_a_second_victim_next_to_a_taken_over_stage_is_a_consecutive_failure(
    kill: str, steps: int, lost: str, copies: str, after: int, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(["verify", "--stages", "4", "--steps", str(steps), "--kill", kill])
    out = capsys.readouterr().out
    assert code != 0
    assert f"ConsecutiveFailure: consecutive failure in pipeline 0: lost stages {lost}" in out
    assert copies in out
    assert f"after {after} steps" in out
    relative = float(out.split("max parameter difference: ")[1].split(" relative")[0])
    assert relative <= 1e-6  # every survivor (and replica) at the state before the failed iteration


@pytest.mark.parametrize(
    ("stage", "pipeline", "where"),
    [
        (1, 0, "1F1"),  # forward phase
        (1, 0, "1B2"),  # backward phase
        (0, 1, "0"),  # first instruction, first stage
        (2, 1, "-1"),  # last instruction, last stage
        (2, 0, "2OPT"),  # after its all-reduce: the data-parallel peer joins the shadow's redo
    ],
)
def test_two_pipelines_fail_over_exactly(stage: int, pipeline: int, where: str) -> None:
    kill = KillPoint(stage, pipeline, where, step=1)
    result = run_verify(3, 2, 3, "eflb", timeouts=TIMEOUTS, deadline_s=120, kills=(kill,))
    assert result.killed == (pipeline * 3 + stage,)
    assert result.passed, result


def test_data_parallel_peer_that_ran_ahead_redoes_the_failed_step_before_its_next_all_reduce() -> None:
    """Issue 8 regression: the victim (stage 2 of pipeline 0) dies right after its all-reduce of
    step 1 completed, and the failure is confirmed only once its data-parallel peer (stage 2 of
    pipeline 1) has finished step 1 and posted its all-reduce of step 2. The peer must join the
    shadow's redo of step 1 before it posts step 2's all-reduce again on the rebuilt group (gloo
    matches collectives in posting order); the other order silently summed different steps."""
    kill = KillPoint(2, 0, "2OPT", step=1, settle=True, hold_confirmation_until=(2, 1, "2AR", 2))
    result = run_verify(3, 2, 3, "eflb", timeouts=TIMEOUTS, deadline_s=120, kills=(kill,))
    assert result.killed == (2,)
    peer_failovers = result.timings[5]["failovers"]
    assert [f.step for f in peer_failovers] == [2], "the peer did not run ahead into step 2 as forced"
    assert result.passed, result
    assert result.max_relative_diff == 0.0


def test_two_pipelines_two_non_adjacent_victims() -> None:
    kills = (KillPoint(1, 0, "1B0", step=1), KillPoint(0, 1, "0F2", step=1))
    result = run_verify(3, 2, 3, "eflb", timeouts=TIMEOUTS, deadline_s=120, kills=kills)
    assert result.killed == (1, 3)  # both victims were killed
    assert not result.unfired_kills
    assert result.passed, result


def test_a_kill_point_that_never_fires_is_named_and_fails_the_run(capsys: pytest.CaptureFixture[str]) -> None:
    """Node 1 dies at its instruction 4 (1F1) before it sends 1SA1, so node 2 never reaches its
    instruction 4 (2F1, which needs that activation) outside the failover's remainder."""
    code = main(["verify", "--stages", "4", "--pipelines", "1", "--steps", "3", "--redundancy", "eflb",
                 "--kill", "1@4,2@4"])
    out = capsys.readouterr().out
    assert code == 1
    assert "killed with SIGKILL: ranks [1]" in out
    assert "kill point 2:0@4/1 never fired" in out
    assert "max parameter difference: 0.000e+00 relative" in out  # the run itself is exact
    assert out.rstrip().endswith("FAIL")


@pytest.mark.parametrize("mode", ["lflb", "efeb"])
def test_other_modes_fail_over_exactly(mode: str) -> None:
    result = run_verify(4, 1, 3, mode, timeouts=TIMEOUTS, deadline_s=120, kills=(KillPoint(2, 0, "2B1"),))
    assert result.killed == (2,)
    assert result.passed, result


@pytest.mark.parametrize(
    ("stages", "kills"),
    [
        (3, [(1, "1OPT")]),  # the owner of the sync that node 0 posted ahead ("1RY<1"), after its "1SY>0"
        (3, [(0, "0AR")]),  # the owner of the sync that node 2 posted ahead ("0RY<0"), before its "0SY>2"
        (4, [(2, "2AR")]),  # before its "2SY>1": node 1 drops the "2RY<2" it posted ahead, node 0 keeps "1RY<1"
    ],
)
def test_lflb_fails_over_exactly_with_a_replica_sync_received_ahead(stages: int, kills: list[tuple[int, str]]) -> None:
    """A shadow posts the receive of its replica's sync after its last gradient receive (`post_sync_ahead`); a
    failure after that drops it (its owner died) or leaves it to be received (another node died)."""
    _fails_over_exactly(stages, kills, "lflb")


@pytest.mark.parametrize(("mode", "kills"), [("eflb", [(1, "1B1")]), ("eflb", [(2, "-1")]), ("lflb", [(1, "1OPT")])])
def test_a_placement_searched_for_costs_fails_over_exactly(mode: str, kills: list[tuple[int, str]]) -> None:
    """`schedule_costs`: the runtime runs the placement `bamboo.schedule` searched for the costs (here another
    order than the unit-cost one on every node), and a failure on it fails over exactly."""
    costs, microbatches = Costs.bert_like(3), DEFAULT_CONFIG["gradient_accumulation_steps"]
    searched = one_f_one_b(3, microbatches, mode, costs.linearizer_cost(), refine=True)
    unit = one_f_one_b(3, microbatches, mode)
    assert all(searched.streams[n] != unit.streams[n] for n in searched.streams)
    _fails_over_exactly(3, kills, mode, costs)


def test_adjacent_victims_raise_consecutive_failure_at_the_start_of_the_iteration(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code = main(["verify", "--stages", "4", "--steps", "3", "--kill", "1@0,2@0", "--kill-step", "1"])
    out = capsys.readouterr().out
    assert code != 0
    assert "ConsecutiveFailure: consecutive failure in pipeline 0: lost stages [1, 2]" in out
    assert "stage 1: shadow rank 0" in out and "stage 2: none" in out
    assert "after 1 steps" in out
    # Every survivor's parameters (and replicas) equal the reference after 1 step, i.e. the state
    # before the failed iteration: no partial gradient was applied, no optimizer stepped.
    relative = float(out.split("max parameter difference: ")[1].split(" relative")[0])
    assert relative <= 1e-6


def test_a_consecutive_failure_in_one_pipeline_ends_the_other_pipelines_commit_without_waiting() -> None:
    """P = 4, D = 2: pipeline 1 loses stage 3 before its all-reduce and stage 2 after its own (a consecutive pair).
    Pipeline 0's stage 3 never completes its all-reduce and leaves for the barrier; its stages 0 to 2 complete
    theirs and wait in the commit for it. Every survivor keeps its groups until all have left (as in
    bamboo-launch), so they learn that it left from the store: not after the group timeout, and not from a
    connection closed after the build timeout, both of which outlast the run's deadline here. Stage 3's death is
    confirmed only once stage 2 has run on to the instruction before its own kill point: confirmed sooner, stage 2
    would take stage 3 over instead (a loaded machine did that once)."""
    kills = (KillPoint(3, 1, "3AR", step=1, hold_confirmation_until=(2, 1, "2SY>1", 1)),
             KillPoint(2, 1, "2OPT", step=1))
    timeouts = CommTimeouts(group=120.0, build=120.0, confirm=15.0)
    result = run_verify(4, 2, 3, "eflb", timeouts=timeouts, deadline_s=45, kills=kills)
    assert set(result.killed) == {6, 7} and not result.unfired_kills
    assert result.consecutive is not None and "consecutive failure in pipeline 1: lost stages [2, 3]" in result.consecutive
    assert {rank: code for rank, code in result.worker_exit_codes.items() if rank not in result.killed} == dict.fromkeys(
        range(6), 3)  # every survivor left the failed iteration
    assert result.compared_at_step == 1 and result.max_relative_diff <= 1e-6
    assert result.refused_exactly and not result.passed  # what soak counts apart from wrong results and hangs
    assert not attrs.evolve(result, max_relative_diff=1.0).refused_exactly
    assert not attrs.evolve(result, consecutive=None, max_relative_diff=1.0).refused_exactly


def test_without_redundancy_a_kill_is_a_typed_peer_failure(capfd: pytest.CaptureFixture[str]) -> None:
    result = run_verify(3, 1, 2, "none", timeouts=TIMEOUTS, deadline_s=120, kills=(KillPoint(1, 0, "1F1", 0),))
    assert not result.passed
    err = capfd.readouterr().err
    assert "PeerFailure: peer stage 1 pipeline 0 (rank 1) failed during" in err


@pytest.mark.parametrize(("stages", "pipelines", "stage", "pipeline"), [(4, 1, 2, 0), (3, 2, 1, 1)])
def test_preemption_notice_hands_over_at_the_boundary(stages: int, pipelines: int, stage: int, pipeline: int) -> None:
    notice = NoticePoint(stage, pipeline, step=1, lead_s=60.0)
    result = run_verify(stages, pipelines, 4, "eflb", timeouts=TIMEOUTS, deadline_s=120, notice_points=(notice,))
    assert result.left == (pipeline * stages + stage,)
    assert not result.killed and not result.failovers  # no failure, no BRC: a planned hand-over
    assert result.passed, result


def test_a_hand_over_in_one_pipeline_and_a_failover_in_another_post_every_ready_all_reduce_before_waiting() -> None:
    """Pipeline 1's last stage hands over after step 1, so its shadow hosts stages 1 and 2; in step 2 pipeline 2's
    stage 0 dies late in its stream, and pipeline 2's last node takes it over. The merged node used to wait for
    stage 1's reduction (at ``1SY``) before it posted ``2AR``, which pipeline 2's last node waited for before it
    received the gradients pipeline 2's stage 1 had to send before it posted ``1AR``: every worker timed out
    (found by ``bamboo-rc soak --stages 3 --pipelines 3 --notices``). Now ``2AR`` comes before ``1SY``
    (`bamboo.schedule.reduction_order`); exact, with even shares and uneven ones."""
    for micro_batches, global_microbatches in ((3, None), (4, 10)):
        config = {**DEFAULT_CONFIG, "gradient_accumulation_steps": micro_batches}
        result = run_verify(3, 3, 3, "lflb", config=config, timeouts=CommTimeouts(group=20.0, build=30.0, confirm=15.0),
                            deadline_s=120, kills=(KillPoint(0, 2, "14", step=2),),
                            notice_points=(NoticePoint(2, 1, step=1, lead_s=60.0),),
                            global_microbatches=global_microbatches)
        assert result.left == (5,) and result.killed == (6,), result
        assert result.passed and result.max_relative_diff == 0.0, result


def test_efeb_last_stage_killed_after_its_all_reduce_with_two_pipelines_is_exact() -> None:
    """Pipeline 0's last stage dies right after posting its all-reduce (``3OPT``): its shadow redoes it. The redo came
    after the shadow's own ``2SY``, where it waited for stage 2's reduction, while pipeline 1's stage 2 waited to
    send to its stage 1, which waited for the eager gradient that pipeline 1's last stage sends after its ``3SY``,
    which waited for the redo: every worker timed out (found by ``bamboo-rc soak --stages 4 --pipelines 3
    --redundancy efeb --second-failures``, 2 of 60 runs). Now the remainder's syncs follow its all-reduces where
    blocking execution allows (`bamboo.schedule.failover`)."""
    result = run_verify(4, 2, 3, "efeb", timeouts=CommTimeouts(group=20.0, build=30.0, confirm=15.0), deadline_s=120,
                        kills=(KillPoint(3, 0, "28", step=1),))
    assert result.killed == (3,), result
    assert result.passed and result.max_relative_diff == 0.0, result


def test_efeb_last_of_five_stages_killed_after_its_all_reduce_with_two_pipelines_is_exact() -> None:
    """P = 5: pipeline 0's last stage dies right after its ``4AR``. Its shadow sends its eager gradients to stage 1's
    host on its way to the redone ``4AR``; that host waited at its ``1SY`` for stage 1's reduction before it took
    them, while pipeline 1's stage 1 was sending to its last stage, which waited at ``4SY`` for the redo: every
    worker timed out (``bamboo-rc soak --stages 5 --pipelines 2 --redundancy efeb --second-failures --seed 220``, 2
    of 60 runs; 5 of 7 runs of this kill alone). Now a remainder's syncs come after the node's other work where
    blocking execution allows (`bamboo.schedule.reduction_order.syncs_last`)."""
    result = run_verify(5, 2, 3, "efeb", timeouts=CommTimeouts(group=20.0, build=30.0, confirm=15.0), deadline_s=120,
                        kills=(KillPoint(4, 0, "31", step=1),))
    assert result.killed == (4,), result
    assert result.passed and result.max_relative_diff == 0.0, result


def test_preemption_notice_too_close_to_the_deadline_is_an_ordinary_failure() -> None:
    notice = NoticePoint(2, 0, step=1, lead_s=0.0)
    result = run_verify(4, 1, 4, "eflb", timeouts=TIMEOUTS, deadline_s=120, notice_points=(notice,))
    assert result.killed == (2,) and not result.left
    assert result.failovers
    assert result.passed, result
