"""The prepared GPU check cannot rot: ``scripts/gpu-check.sh --dry-run`` runs its every step on the CPU with the
smallest sizes and prints its one table, with the exactness rows met (the time and memory goals are judged on
a GPU only)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
STEPS = ("environment", "verify", "pause", "overhead", "memory", "transport", "cuda tests", "transformers")

pytestmark = pytest.mark.slow


def test_the_dry_run_runs_every_step_of_the_gpu_check_on_the_cpu(tmp_path: Path) -> None:
    out = tmp_path / "gpu-check.json"
    done = subprocess.run(["bash", str(ROOT / "scripts" / "gpu-check.sh"), "--dry-run", "--json", str(out)],
                          capture_output=True, text=True, timeout=540, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["results"]
    assert [step for step in STEPS if not any(row["step"] == step for row in rows)] == []
    verified = [row for row in rows if row["step"] == "verify"]
    assert len(verified) == 2 and all(row["ok"] == "yes" for row in verified), verified
    assert any("kill -9" in row["what"] for row in verified)
    assert {row["what"].split()[1] for row in rows if row["step"] == "overhead"} >= {"none", "eflb", "deepspeed"}
    assert not any(row["ok"] == "NO" for row in rows), rows
    printed = done.stdout.splitlines()
    assert printed[0] == "| step | what | measured | goal | ok |"
    assert sum(line.startswith("| ") for line in printed) == len(rows) + 1
