"""The least overhead of redundancy (`overhead_bound_pct`) and the placement that reaches for it (`fill_idle`)."""

from __future__ import annotations

import pytest
from bamboo.schedule import Kind, Schedule, one_f_one_b, simulate, validate
from bamboo.schedule._tasks import CostFn
from bamboo.schedule.bound import idle_intervals, packed_end
from bamboo.schedule.engine import execute
from bamboo.schedule.failover import failover_schedule, progress_at, validate_failover
from bamboo.schedule.simulate import Costs

FREE = {"latency_ms": 0.0, "link_gb_per_s": 1e9, "swap_gb_per_s": 1e9}


def _costs(top: dict[str, float] | None = None, **stage: float) -> Costs:
    return Costs.from_dict({**FREE, **(top or {}),
                            "default": {"optimizer_ms": 0.0, "grad_mb": 0.0, "activation_mb": 0.0, **stage}})


def test_packing_splits_items_over_idle_intervals_in_release_order() -> None:
    idle = idle_intervals([1.0, 5.0], [3.0, 6.0])
    assert idle == [(0.0, 1.0), (3.0, 5.0), (6.0, float("inf"))]
    assert packed_end([(0.0, 1.0)], idle) == 1.0  # fits before the first busy interval
    assert packed_end([(0.0, 2.0)], idle) == 4.0  # 1 before, 1 after the first busy interval
    assert packed_end([(0.0, 2.0), (2.0, 3.0)], idle) == 8.0  # 1 + 2 in the gaps, 2 after the last
    assert packed_end([(5.5, 1.0)], idle) == 7.0  # released inside a busy interval


def test_the_bound_of_an_frc_longer_than_the_bubble_by_hand() -> None:
    """P = 2, M = 1, F = 1, B = 2, FRC = 4, free links: T0 = 6 (F0, F1, B1, B0). Split packing: node 0's FRC of
    stage 1 is released when its forward ends (1) and fills its idle 1..4, 1 ms left after 6; node 1's FRC of
    stage 0 is released at once: idle 0..1, then from its backward's end (4): it ends at 7 (1 / 6). Whole FRCs,
    one node's chain at a time: node 1's FRC either runs before its receive of the activation (0..4, then F1, B1,
    B0: 9) or after its own work (4..8); node 0's either before its receive of the gradient (1..5, then B0: 7) or
    after its backward (10). The bound is 8 (2 / 6).

    No placement reaches it (README, "How far from reachable it is"): node 0's FRC either runs 1..5, before its
    receive of the gradient, which holds node 1's send until 5, so node 1's FRC ends at 9 at the earliest; or after
    node 0's backward, ending at 10. The placement finds 9 (first fit alone ran both FRCs last: 10)."""
    costs = _costs(forward_ms=1.0, backward_ms=2.0, frc_ms=4.0)
    result = simulate(one_f_one_b(2, 1, "eflb", costs.linearizer_cost(), refine=True), costs)
    assert result.baseline_makespan == pytest.approx(6.0)
    assert result.overhead_bound_pct == pytest.approx(200.0 / 6.0)
    assert result.makespan == pytest.approx(9.0)


def test_the_bound_of_the_last_replica_sync_by_hand() -> None:
    """P = 2, M = 1, F = 1, B = 2, 1 MB of gradients at 1 GB/s: each all-reduce takes 2 ms, a sync lands 1 ms
    after it is posted. T0 = 8 (node 0's all-reduce ends last). lflb's only cost is the sync of stage 0 to
    node 1, posted at 8 and received at 9: the bound is 1 / 8, and the placement reaches it."""
    costs = _costs({"link_gb_per_s": 1.0}, forward_ms=1.0, backward_ms=2.0, grad_mb=1.0)
    result = simulate(one_f_one_b(2, 1, "lflb", costs.linearizer_cost()), costs)
    assert result.baseline_makespan == pytest.approx(8.0)
    assert result.overhead_bound_pct == pytest.approx(12.5)
    assert result.overhead_pct == pytest.approx(12.5)


def test_no_redundancy_has_no_bound_above_zero() -> None:
    result = simulate(one_f_one_b(4, 8), Costs())
    assert result.overhead_bound_pct == 0.0


@pytest.mark.parametrize("refine", [False, True], ids=["first-fit", "refined"])
@pytest.mark.parametrize("rc", ["lflb", "eflb", "efeb"])
@pytest.mark.parametrize("costs", [Costs(), Costs.bert_like(5)], ids=["built-in", "bert_like"])
def test_no_placement_beats_the_bound(rc: str, costs: Costs, refine: bool) -> None:
    for stages in range(2, 6):
        for microbatches in (1, stages, 3 * stages):
            result = simulate(one_f_one_b(stages, microbatches, rc, costs.linearizer_cost(), refine=refine), costs)
            assert result.overhead_pct is not None and result.overhead_bound_pct is not None
            assert result.overhead_pct >= result.overhead_bound_pct - 1e-9, (stages, microbatches)


def _compute_starts(schedule: Schedule, cost: CostFn) -> dict[str, float]:
    """When each forward and backward starts when ``schedule`` runs with ``cost``."""
    timeline = execute(schedule.streams, lambda _node, instr: cost(instr))
    return {f"{i}@{n}": timeline.start[n][j] for n, stream in schedule.streams.items()
            for j, i in enumerate(stream) if i.kind in (Kind.FORWARD, Kind.BACKWARD)}


@pytest.mark.parametrize("rc", ["lflb", "eflb"])
@pytest.mark.parametrize("costs", [Costs(), Costs.bert_like(4)], ids=["built-in", "bert_like"])
def test_first_fit_delays_no_normal_work(rc: str, costs: Costs) -> None:
    """Without the local search (the default: ``refine`` is asked for), for the costs it was placed with, every
    forward and backward runs when it runs without redundancy: first fit only uses idle time, and puts what does
    not fit after the node's own work."""
    cost = costs.linearizer_cost()
    for stages, microbatches in ((2, 5), (3, 3), (4, 8), (4, 16)):
        filled = one_f_one_b(stages, microbatches, rc, cost)
        validate(filled)
        assert _compute_starts(filled, cost) == pytest.approx(
            _compute_starts(one_f_one_b(stages, microbatches, "none", cost), cost))


@pytest.mark.parametrize("costs", [Costs(), Costs.bert_like(4)], ids=["built-in", "bert_like"])
def test_the_local_search_never_ends_later_than_first_fit(costs: Costs) -> None:
    cost = costs.linearizer_cost()
    for stages, microbatches in ((2, 8), (3, 6), (4, 8), (4, 16)):
        refined = one_f_one_b(stages, microbatches, "eflb", cost, refine=True)
        validate(refined)
        first_fit = one_f_one_b(stages, microbatches, "eflb", cost)
        assert simulate(refined, costs).makespan <= simulate(first_fit, costs).makespan + 1e-9, (stages, microbatches)


def test_bert_like_eflb_overhead_after_the_local_search() -> None:
    """The placement's figures with the BERT-like costs (first fit alone: P=2 M=8 14.63%, P=4 M=8 9.61%, P=2 M=16
    21.17%, P=4 M=16 18.39%, P=8 M=16 10.29%, P=4 M=32 23.97%): within 2 points of the bound (now 12.20, 6.29,
    16.81, 13.76, 7.89, 18.51)."""
    expected = {(2, 8): 11.31, (4, 8): 6.21, (2, 16): 16.31, (4, 16): 11.78, (8, 16): 5.91, (4, 32): 17.43}
    for (stages, microbatches), bound in expected.items():
        costs = Costs.bert_like(stages)
        result = simulate(one_f_one_b(stages, microbatches, "eflb", costs.linearizer_cost(), refine=True), costs)
        assert result.overhead_pct is not None and result.overhead_bound_pct is not None
        assert result.overhead_bound_pct == pytest.approx(bound, abs=0.01)
        assert result.overhead_pct - result.overhead_bound_pct <= 2.0, (stages, microbatches, result.overhead_pct)


def test_the_built_in_costs_reach_the_bound_within_two_points() -> None:
    """The goal of the placement, in the simulator (deterministic): eflb within 2 points of the bound and lflb on
    it, for P in {2, 4, 8} and M in {P, 2P, 4P}, with the built-in costs."""
    costs = Costs()
    for stages in (2, 4, 8):
        for microbatches in (stages, 2 * stages, 4 * stages):
            for rc, allowed in (("lflb", 1e-6), ("eflb", 2.0)):
                result = simulate(one_f_one_b(stages, microbatches, rc, costs.linearizer_cost()), costs)
                assert result.overhead_pct is not None and result.overhead_bound_pct is not None
                assert result.overhead_pct - result.overhead_bound_pct <= allowed, (rc, stages, microbatches)


@pytest.mark.slow
def test_joint_pulls_bring_the_long_pipelines_within_two_points_of_the_bound() -> None:
    """bert_like P=16 M=128 and P=8 M=32 (before the joint pulls: 25.67 / 23.65, 2.02 points, and 16.84 / 15.24,
    1.60): several nodes' FRCs end the iteration, so a pull on one node alone delays the others; pulled into one
    microbatch's gradient waits together they end it sooner (now 25.36, 1.70 points, and 16.43, 1.18). The
    placements stay valid, and fail over (a victim at the middle of its stream)."""
    for (stages, microbatches), (bound, allowed) in {(16, 128): (23.65, 1.8), (8, 32): (15.24, 1.2)}.items():
        costs = Costs.bert_like(stages)
        schedule = one_f_one_b(stages, microbatches, "eflb", costs.linearizer_cost(), refine=True)
        validate(schedule)
        result = simulate(schedule, costs)
        assert result.overhead_pct is not None and result.overhead_bound_pct is not None
        assert result.overhead_bound_pct == pytest.approx(bound, abs=0.01)
        assert result.overhead_pct - result.overhead_bound_pct <= allowed, (stages, microbatches, result.overhead_pct)
        for victim in (stages // 2, stages - 2):
            cut = progress_at(schedule, {victim: len(schedule.streams[victim]) // 2})
            validate_failover(failover_schedule(schedule, [victim], cut))
