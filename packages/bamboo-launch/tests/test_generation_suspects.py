"""A worker whose engine ends with a peer's failure (no failover for it: redundancy ``none``) tells its agent
which nodes it suspects before it ends (``bamboo.launch.generation._report_suspects``), in-process: the session
and its agent are stand-ins that record the reports.

Without the report a killed node was found only when its lease expired: ``--ttl`` seconds of a restore's
pause when that node was the elected coordinator, in a measured heavy-churn run.
"""

from __future__ import annotations

from types import SimpleNamespace

import attrs
from bamboo.launch.generation import _report_suspects
from bamboo.rc import PeerFailure


@attrs.define
class _Agent:
    reports: list[tuple[str, str]] = attrs.field(factory=list)
    refuse: bool = False

    def report_peer_failure(self, node: str, reason: str) -> bool:
        if self.refuse:
            raise ConnectionError("the agent is gone")
        self.reports.append((node, reason))
        return True


def _layout() -> SimpleNamespace:
    ranks = {"a": 0, "b": 1, "c": 2}
    return SimpleNamespace(ranks=ranks, node_of_rank={rank: node for node, rank in ranks.items()})


def test_each_suspect_of_the_failure_is_reported_to_the_agent_by_node() -> None:
    agent = _Agent()
    run = SimpleNamespace(node="a", agent=agent)
    _report_suspects(run, _layout(), PeerFailure((1, 2), "b or c", "0SA1>1", RuntimeError("reset")))  # type: ignore[arg-type]
    assert agent.reports == [("b", "rank 0: 0SA1>1 failed"), ("c", "rank 0: 0SA1>1 failed")]


def test_a_rank_outside_the_layout_is_skipped_and_an_unreachable_agent_is_said_not_raised(capsys) -> None:
    run = SimpleNamespace(node="a", agent=_Agent())
    _report_suspects(run, _layout(), PeerFailure(7, "rank 7", "1RA0<7", RuntimeError("reset")))  # type: ignore[arg-type]
    assert run.agent.reports == []
    run.agent.refuse = True
    _report_suspects(run, _layout(), PeerFailure(2, "c", "0SA1>2", RuntimeError("reset")))  # type: ignore[arg-type]
    assert "could not report c to the agent: the agent is gone" in capsys.readouterr().err
