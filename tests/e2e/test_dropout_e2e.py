"""End to end: a model with dropout trains exactly through ``bamboo-launch run --verify``, a kill and a joiner.

The user script is the example residual MLP (``examples/train_mlp.py``) with ``--dropout 0.1`` in every
block. Five nodes start (P=2, D=2, one on standby, its worker warm). The trace kills node1 (stage 1 of
pipeline 0) 0.7 s into training: its shadow node0 takes the stage over, running the lost backward passes
from its forward redundant computation; then the reconfiguration that rebuilds redundancy brings the
standby node in (the stage state moved to it over gloo). Every forward on every node, the shadow's
redundant ones included, and the script's own single-process ``--verify`` reference draw their dropout masks
from generators seeded by (seed, step, global microbatch, layer) (``bamboo.rc.rng``), so the run must end
bit-equal to the fault-free reference: ``max relative diff 0.0``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from bamboo.launch.cli import main
from bamboo.launch.events import Failover, Reconfiguration, read_events

pytestmark = pytest.mark.timeout(240)

EXAMPLE = Path(__file__).resolve().parents[2] / "packages" / "bamboo-launch" / "examples" / "train_mlp.py"


def test_a_dropout_model_survives_a_kill_and_a_joiner_bit_exactly(
    tmp_path: Path, write_trace: Callable[[int, list[tuple[int, str, str]]], str],
    capsys: pytest.CaptureFixture[str],
    assert_preempted: Callable[..., None],
) -> None:
    trace = write_trace(5, [(700, "remove", "node2")])  # trace node2 is the launcher's node1
    run_dir = tmp_path / "run"
    code = main(["run", "--nodes", "5", "--stages", "2", "--pipelines", "2", "--steps", "60", "--zones", "a,b,c",
                 "--preemptions", trace, "--time-scale", "1", "--run-dir", str(run_dir), "--timeout", "200",
                 "--verify", "--json", "--no-live", "--redundancy", "lflb",  # the shadow's BRC, whatever auto would pick
                 "--", str(EXAMPLE), "--blocks", "3", "--dropout", "0.1"])
    report = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert code == 0, report
    assert report["verify"] == "PASSED" and report["compared_steps"] == 60, report
    assert report["max_relative_diff"] == 0.0, report

    events = read_events(run_dir / "events.jsonl")
    assert_preempted(events, {"node1"})
    assert [e.victim for e in events if isinstance(e, Failover)] == ["node1"]  # the shadow's BRC, not a restart
    reconfigurations = [e for e in events if isinstance(e, Reconfiguration)]
    assert reconfigurations and reconfigurations[-1].pipelines == 2 and reconfigurations[-1].bytes_moved > 0
    finishers = {torch.load(path, weights_only=False)["node"] for path in (run_dir / "out").glob("rank*.pt")}
    assert "node4" in finishers and "node1" not in finishers  # the joiner trained to the end
    logs = "".join(path.read_text() for path in (run_dir / "logs").glob("*.log"))
    assert "RandomnessWarning" not in logs
    assert (run_dir / "reference.log").exists()  # the script trained the --verify reference itself
