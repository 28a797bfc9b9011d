"""Which node reports the job's loss (writes the monitors, calls bamboo-launch's ``on_step``): exactly one."""

from __future__ import annotations

import attrs
import pytest
from bamboo.rc.engine import Engine
from bamboo.rc.layout import Layout


@attrs.define
class _Executor:
    """What ``Engine.reports`` reads of a StageExecutor."""

    layout: Layout
    rank: int
    dead: set[int]
    pipeline: int = 0
    hosted: tuple[int, ...] = ()


def _engine(executor: _Executor) -> Engine:
    engine = Engine.__new__(Engine)  # no groups, no monitors: reports() reads the executor only
    engine.executor = executor  # type: ignore[assignment]
    return engine


@pytest.mark.parametrize(("dead", "reporter"), [(set(), 0), ({0}, 1), ({0, 1}, 2)])
def test_with_one_stage_the_first_live_node_reports(dead: set[int], reporter: int) -> None:
    layout = Layout(1, 3)
    reporting = [r for r in range(3) if r not in dead and _engine(_Executor(layout, r, dead, pipeline=r,
                                                                            hosted=(0,))).reports()]
    assert reporting == [reporter]


def test_with_stages_the_host_of_pipeline_zeros_last_stage_reports() -> None:
    layout = Layout(2, 2)
    hosts = {0: (0,), 1: (1,), 2: (0,), 3: (1,)}
    reporting = [r for r in range(4) if _engine(_Executor(layout, r, set(), pipeline=r // 2, hosted=hosts[r])).reports()]
    assert reporting == [1]
    shadow = _Executor(layout, 0, {1}, pipeline=0, hosted=(0, 1))  # took stage 1 over after a failover
    assert _engine(shadow).reports()
