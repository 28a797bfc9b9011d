"""`bamboo-rc verify`: the P×D matrix, other modes, and the D-change test, all with real processes."""

from __future__ import annotations

import re

import attrs
import pytest
from bamboo.rc.cli import main
from bamboo.rc.verify import DEFAULT_CONFIG, run_verify

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("mode", ["none", "eflb"])
@pytest.mark.parametrize(("stages", "pipelines"), [(2, 1), (3, 1), (2, 2), (4, 1)])
def test_verify_cli_matrix(stages: int, pipelines: int, mode: str, capsys: pytest.CaptureFixture[str]) -> None:
    code = main(["verify", "--stages", str(stages), "--pipelines", str(pipelines), "--steps", "3",
                 "--redundancy", mode, "--timeout", "120"])
    out = capsys.readouterr().out
    assert code == 0, out
    assert "PASS" in out
    relative = float(re.search(r"max parameter difference: (\S+) relative", out).group(1))
    assert relative <= 1e-6
    assert "bit-equal" in out and "NOT bit-equal" not in out
    curve = re.findall(r"^\s+(\d+)\s+(\S+)\s+(\S+)$", out, flags=re.MULTILINE)
    assert [int(step) for step, _, _ in curve] == [0, 1, 2]


@pytest.mark.parametrize(("stages", "pipelines", "mode"), [(3, 1, "lflb"), (3, 2, "efeb"), (2, 1, "efeb")])
def test_verify_other_modes_are_exact(stages: int, pipelines: int, mode: str) -> None:
    result = run_verify(stages, pipelines, 3, mode, deadline_s=120)
    assert result.passed, result
    assert result.replicas_compared > 0
    if mode != "lflb":
        assert result.stash_peak_bytes > 0


def test_three_pipelines_are_exact_past_the_first_steps() -> None:
    """A data-parallel group of three adds its gradients in pipeline order, as the reference does: gloo's ring
    associated them otherwise, 2e-7 off after 3 steps (inside the tolerance) and 1e-4 after 6."""
    result = run_verify(2, 3, 6, "lflb", deadline_s=120)
    assert result.passed and result.max_relative_diff == 0.0, result


def test_bf16_and_sgd_configs_are_honoured_and_exact() -> None:
    bf16 = {**DEFAULT_CONFIG, "bf16": {"enabled": True}}
    sgd = {k: v for k, v in DEFAULT_CONFIG.items() if k != "scheduler"}
    sgd["optimizer"] = {"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}
    fp32 = run_verify(2, 1, 2, "eflb", config=DEFAULT_CONFIG, deadline_s=120)
    for config in (bf16, sgd):
        result = run_verify(2, 1, 2, "eflb", config=config, deadline_s=120)
        assert result.passed, result
        assert result.losses != fp32.losses  # the setting really changed the training


def test_changing_pipelines_keeps_the_global_batch_and_the_training() -> None:
    """D=1 with M=4 and D=2 with M=2 train on the same global batch: same losses, same reference."""
    one = run_verify(2, 1, 3, "eflb", config={**DEFAULT_CONFIG, "gradient_accumulation_steps": 4}, deadline_s=120)
    two = run_verify(2, 2, 3, "eflb", config={**DEFAULT_CONFIG, "gradient_accumulation_steps": 2}, deadline_s=120)
    assert one.passed and two.passed
    assert one.reference_losses[0] == two.reference_losses[0]  # step 0: same batch, same weights
    for a, b in zip(one.losses, two.losses, strict=True):
        assert a == pytest.approx(b, rel=1e-6)


def test_verify_cli_rejects_bad_input(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["verify", "--stages", "9"]) == 2
    assert "--stages 9 exceeds" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["verify", "--redundancy", "fast"])
    assert exit_info.value.code == 2
    assert "invalid choice: 'fast'" in capsys.readouterr().err


def test_a_shared_reference_cache_trains_each_reference_once() -> None:
    """Runs of one configuration share ``references``: the first trains the reference to the step it compares
    at and leaves it there; the next takes it from there instead of training it again."""
    references: dict = {}
    first = run_verify(2, 1, 2, "eflb", deadline_s=120, references=references)
    assert first.passed and list(references) == [2]
    assert references[2].losses == first.reference_losses
    marked = attrs.evolve(references[2], losses=[-1.0, -2.0])
    references[2] = marked
    second = run_verify(2, 1, 2, "lflb", deadline_s=120, references=references)
    assert second.reference_losses == [-1.0, -2.0]  # taken from the cache, not trained
