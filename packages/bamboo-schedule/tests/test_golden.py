"""Golden files pin the grids of a few small schedules. Set BAMBOO_UPDATE_GOLDEN=1 to rewrite them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from bamboo.schedule import Instruction, generate
from bamboo.schedule.export import text_grid
from bamboo.schedule.failover import failover_schedule, progress_at

CASES = [
    ("1f1b", 3, 4, "none"),
    ("1f1b", 3, 4, "eflb"),
    ("1f1b", 4, 4, "lflb"),
    ("gpipe", 2, 3, "efeb"),
]


def _check(golden: Path, text: str) -> None:
    if os.environ.get("BAMBOO_UPDATE_GOLDEN"):
        golden.write_text(text + "\n")
    assert golden.exists(), f"missing golden file {golden}; run with BAMBOO_UPDATE_GOLDEN=1"
    assert text + "\n" == golden.read_text()


@pytest.mark.parametrize(("policy", "stages", "microbatches", "rc"), CASES)
def test_schedule_grid_matches_golden(golden_dir: Path, policy: str, stages: int, microbatches: int, rc: str) -> None:
    schedule = generate(policy, stages, microbatches, rc)
    text = text_grid(schedule.streams)
    _check(golden_dir / f"{policy}_P{stages}_M{microbatches}_{rc}.txt", text)
    # the golden text parses back into the same streams
    rows = [line.split("|", 1)[1].split() for line in text.splitlines()[1:]]
    assert [[Instruction.parse(cell) for cell in row] for row in rows] == [list(s) for s in schedule.streams.values()]


def test_failover_grid_matches_golden(golden_dir: Path) -> None:
    schedule = generate("1f1b", 4, 4, "eflb")
    plan = failover_schedule(schedule, [1], progress_at(schedule, {1: 12}))
    split = {n: len(plan.executed[n]) for n in plan.survivors}
    text = text_grid(plan.iteration_streams(), (), split)
    text += "\nsteady:\n" + text_grid(plan.steady.streams)
    _check(golden_dir / "failover_1f1b_P4_M4_eflb_fail1at12.txt", text)
