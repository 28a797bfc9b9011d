"""Seeded random kill points (single and non-adjacent double failures) through bamboo-rc verify."""

from __future__ import annotations

import pytest
from bamboo.rc.chaos import random_kill_points, run_chaos

pytestmark = pytest.mark.slow


def test_twenty_seeded_kill_points_all_match_the_reference() -> None:
    plans = random_kill_points(seed=2026, count=20, stages=4, steps=3)
    assert len({plan for plan in plans}) > 10  # really different kill points
    failures = [(plan, result) for plan, result in run_chaos(plans, 4, 3) if not result.passed]
    assert not failures, failures[:3]
