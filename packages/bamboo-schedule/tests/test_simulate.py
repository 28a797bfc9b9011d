"""The cost-model simulator: costs files, timings, metrics, and the paper's Figure 10 finding."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from bamboo.schedule import one_f_one_b
from bamboo.schedule.simulate import Costs, StageCost, simulate

FREE_LINKS = {"latency_ms": 0.0, "link_gb_per_s": 1e9, "swap_gb_per_s": 1e9}


def _free(**stage: float) -> Costs:
    return Costs.from_dict({**FREE_LINKS, "default": {"optimizer_ms": 0.0, "grad_mb": 0.0, **stage}})


def test_two_stage_single_microbatch_makespan_is_the_critical_path() -> None:
    costs = _free(forward_ms=1.0, backward_ms=2.0)
    result = simulate(one_f_one_b(2, 1), costs)
    assert result.makespan == pytest.approx(6.0)  # F0, F1, B1, B0
    assert result.bubble == pytest.approx({0: 3.0, 1: 3.0})
    assert result.bubble_pct == pytest.approx(50.0)
    assert result.overhead_pct == pytest.approx(0.0)


def test_link_latency_and_bandwidth_are_charged_per_message() -> None:
    costs = Costs.from_dict(
        {"latency_ms": 0.5, "link_gb_per_s": 2.0, "swap_gb_per_s": 1e9,
         "default": {"forward_ms": 1.0, "backward_ms": 2.0, "optimizer_ms": 0.0, "grad_mb": 0.0,
                     "activation_mb": 3.0}}
    )
    # two messages (activation, gradient), each 0.5 + 3 MB / 2 GB/s = 2.0 ms
    assert simulate(one_f_one_b(2, 1), costs).makespan == pytest.approx(6.0 + 4.0)


@pytest.mark.parametrize(("overlaps", "node_time"), [(False, 4 * 5.0 / 2.0), (True, 0.0)])
def test_swap_bandwidth_and_stash_sizes_feed_peak_stash(overlaps: bool, node_time: float) -> None:
    """A swap takes stash / bandwidth from its node, or nothing when the copy runs beside the computation."""
    costs = Costs.from_dict({**FREE_LINKS, "swap_gb_per_s": 2.0, "swap_overlaps": overlaps,
                             "default": {"optimizer_ms": 0.0, "grad_mb": 0.0, "stash_mb": 5.0}})
    result = simulate(one_f_one_b(3, 4, "eflb"), costs)
    assert result.peak_stash == pytest.approx({0: 20.0, 1: 20.0, 2: 20.0})
    swap_time = sum(result.timeline.end[0][i] - result.timeline.start[0][i]
                    for i, instr in enumerate(one_f_one_b(3, 4, "eflb").streams[0]) if instr.kind.value == "SO")
    assert swap_time == pytest.approx(node_time)


def test_a_background_replica_sync_costs_the_sender_latency_and_lands_after_the_transfer() -> None:
    """With sync_overlaps the sender of SY goes on after the latency; RY waits for the data's arrival."""
    costs = Costs.from_dict({"latency_ms": 0.5, "link_gb_per_s": 1.0, "swap_gb_per_s": 1e9,
                             "default": {"forward_ms": 1.0, "backward_ms": 2.0, "optimizer_ms": 0.0,
                                         "activation_mb": 0.0, "grad_mb": 4.0}})
    schedule = one_f_one_b(2, 1, "lflb")
    timeline = simulate(schedule, costs).timeline
    cells = {str(instr): (n, i) for n, stream in schedule.streams.items() for i, instr in enumerate(stream)}
    n, i = cells["1SY>0"]
    assert timeline.end[n][i] - timeline.start[n][i] == pytest.approx(0.5)
    m, j = cells["1RY<1"]
    assert timeline.start[m][j] >= timeline.start[n][i] + 0.5 + 4.0 - 1e-9
    assert timeline.end[m][j] - timeline.start[m][j] == pytest.approx(0.5)
    waited = simulate(schedule, attrs.evolve(costs, sync_overlaps=False)).timeline
    assert waited.end[n][i] - waited.start[n][i] == pytest.approx(0.5 + 4.0)


def test_overheads_order_as_in_the_paper() -> None:
    costs = Costs()
    overhead = {rc: simulate(one_f_one_b(4, 8, rc), costs).overhead_pct for rc in ("lflb", "eflb", "efeb")}
    assert 0.0 < overhead["lflb"] < overhead["eflb"] < overhead["efeb"]


def test_costs_json_round_trip_and_per_stage_overrides(tmp_path: Path) -> None:
    costs = Costs(stages=(StageCost(forward_ms=3.0), StageCost(forward_ms=4.0, frc_ms=5.0)), latency_ms=0.2)
    path = tmp_path / "costs.json"
    path.write_text(json.dumps(costs.to_dict()))
    loaded = Costs.from_json(path)
    assert loaded == costs
    assert loaded.stage(1).frc == 5.0 and loaded.stage(0).frc == 3.0 and loaded.stage(7) == loaded.default
    partial = Costs.from_dict({"default": {"forward_ms": 2.0}, "stages": [{"backward_ms": 9.0}]})
    assert partial.stage(0).forward_ms == 2.0 and partial.stage(0).backward_ms == 9.0


@pytest.mark.parametrize(
    ("content", "message"),
    [
        ("{", "cannot read costs file"),
        ('{"speed": 1}', "unknown cost keys \\['speed'\\]"),
        ('{"default": {"forward_ms": -1}}', "forward_ms must be a number >= 0, got -1"),
        ('{"default": {"fwd": 1}}', "unknown keys \\['fwd'\\] in default"),
        ('{"link_gb_per_s": 0}', "bandwidths must be > 0"),
    ],
)
def test_bad_costs_files_are_named(tmp_path: Path, content: str, message: str) -> None:
    path = tmp_path / "bad.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=message):
        Costs.from_json(path)


def test_figure_10_frc_hidden_on_first_stages_partly_on_the_last() -> None:
    """Paper, Figure 10: the bubble at stage i against the FRC for stage i+1 (BERT-like profile, 8 stages).

    Early stages wait on their slower successors, so their bubble swallows all the FRC they run for
    the next stage; the last stages have almost no bubble while the FRC they run is the most expensive.
    """
    costs = Costs.bert_like(8)
    M = 32
    result = simulate(one_f_one_b(8, M, "eflb", costs.linearizer_cost()), costs)
    assert result.baseline_bubble is not None
    hidden = [result.frc_hidden(n) for n in range(8)]
    for n in range(7):
        assert result.frc[n] == pytest.approx(M * costs.stage(n + 1).frc)  # FRC for stage n+1 runs on node n
    assert hidden[0] == hidden[1] == hidden[2] == 1.0  # fully hidden on the first stages
    assert hidden[6] is not None and hidden[6] < 1.0  # partly hidden on the last stage that runs a costly FRC
    bubbles = [result.baseline_bubble[n] for n in range(8)]
    assert bubbles == sorted(bubbles, reverse=True)  # the bubble shrinks along the pipeline
    assert 0.0 < result.overhead_pct < 50.0
