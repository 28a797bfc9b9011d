"""A worker that ends on a peer's failure, or whose transfer to or from a peer fails in gloo, tells its agent which
node it suspects (``bamboo.launch.generation._report_suspects``, ``bamboo.launch.starting._suspect``), in-process:
the session is a stand-in that records the reports.

Without the reports a killed node was found only when its lease expired (``--ttl``): in measured heavy-churn runs,
2 s of a restore's pause when that node was the elected coordinator (redundancy ``none``: no failover reports it),
and 2 s of a reconfiguration's pause when it was a joiner (in no training pipeline, so nobody else reports it).
"""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest
from bamboo.launch.attempt import AttemptAbandonedError
from bamboo.launch.generation import _report_suspects
from bamboo.launch.session import WorkerSession
from bamboo.launch.starting import _suspect
from bamboo.rc import PeerFailure


@attrs.define
class _Run:
    node: str = "a"
    suspects: list[tuple[str, str]] = attrs.field(factory=list)

    def report_suspect(self, node: str, reason: str) -> None:
        self.suspects.append((node, reason))


def _layout() -> SimpleNamespace:
    ranks = {"a": 0, "b": 1, "c": 2}
    return SimpleNamespace(ranks=ranks, node_of_rank={rank: node for node, rank in ranks.items()})


def test_each_suspect_of_a_peer_failure_is_reported_by_node_and_a_rank_outside_the_layout_skipped() -> None:
    run = _Run()
    _report_suspects(run, _layout(), PeerFailure((1, 2), "b or c", "0SA1>1", RuntimeError("reset")))  # type: ignore[arg-type]
    _report_suspects(run, _layout(), PeerFailure(7, "rank 7", "1RA0<7", RuntimeError("reset")))  # type: ignore[arg-type]
    assert run.suspects == [("b", "rank 0: 0SA1>1 failed"), ("c", "rank 0: 0SA1>1 failed")]


def test_a_failed_transfer_reports_its_peer_unless_the_attempt_was_abandoned() -> None:
    run = _Run()
    _suspect(run, "b", 4, RuntimeError("Connection closed by peer"))  # type: ignore[arg-type]
    _suspect(run, "c", 4, AttemptAbandonedError("this reconfiguration attempt was abandoned"))  # type: ignore[arg-type]
    _suspect(run, "a", 4, RuntimeError("reset"))  # type: ignore[arg-type]  # itself: nothing to report
    assert run.suspects == [("b", "a transfer of generation 4 failed: Connection closed by peer")]


def test_an_unreachable_agent_is_said_not_raised(capsys: pytest.CaptureFixture[str]) -> None:
    def refuse(node: str, reason: str) -> bool:
        raise ConnectionError("the agent is gone")

    stand_in = SimpleNamespace(node="a", agent=SimpleNamespace(report_peer_failure=refuse))
    WorkerSession.report_suspect(stand_in, "c", "0SA1>2 failed")  # type: ignore[arg-type]
    assert "node a: could not report c to the agent: the agent is gone" in capsys.readouterr().err
