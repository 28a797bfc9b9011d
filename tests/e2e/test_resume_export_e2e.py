"""End to end: a finished run resumed for more steps, and its model exported.

A 20-step run writes checkpoints (every 5 steps, and at its last step). Reusing its checkpoint directory
for a new run without ``--resume`` is refused (a run never overwrites another run's checkpoints). With
``--resume --steps 40`` the next run starts from step 20 of the checkpoint (the first layout restores
every stage from it, with the history it recorded) and must end exactly where a fault-free 40-step run
ends. ``bamboo-launch export`` then writes one state dict, from the run directory and from the newest
checkpoint, that loads into the model's layers in order.

Nothing fails in these runs, so their leases are long (10 s, as `make demo`'s): the test runs beside the
cluster tests, in the lane of short tests (the root conftest.py), where a starved agent must not lose its lease.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from bamboo.bench.emulated.run import RunError, RunOptions, compare_with_reference, run_cluster
from bamboo.launch.cli import main
from bamboo.launch.events import Restore, Step, read_events
from bamboo.rc.model import GPTSize, gpt_layer_specs

pytestmark = pytest.mark.timeout(600)  # three runs, in the lane of short tests at a low priority


def _options(tmp_path: Path, name: str, steps: int, resume: bool = False) -> RunOptions:
    return RunOptions(redundancy="eflb", nodes=4, stages=2, pipelines=2, steps=steps, zones=("a", "b", "c"),
                      checkpoint_dir=str(tmp_path / "checkpoints"), checkpoint_every=5, resume=resume,
                      run_dir=str(tmp_path / name), timeout_s=400.0, ttl=10, grace_s=10.0,
                      size={"layers": 2})


def test_a_finished_run_resumes_exactly_and_exports_its_model(tmp_path: Path) -> None:
    lines: list[str] = []
    first = run_cluster(_options(tmp_path, "first", 20), progress=lines.append)
    assert first.steps_done == 20 and not first.timed_out
    progress = [line for line in lines if line.startswith("step ")]  # --no-live's lines, every 10 steps
    assert progress and progress[-1].startswith("step 20  loss ") and " nodes 4 active" in progress[-1], lines
    with pytest.raises(RunError, match=r"holds the checkpoints of another run \(steps 20, 15, 10\): pass "
                                        r"--resume"):
        run_cluster(_options(tmp_path, "refused", 40))
    options = _options(tmp_path, "resumed", 40, resume=True)
    resumed = run_cluster(options)
    events = read_events(resumed.events)
    steps = sorted(e.step for e in events if isinstance(e, Step))
    assert steps == list(range(21, 41)), "the resumed run trains steps 21..40 only"
    assert not [e for e in events if isinstance(e, Restore)]  # a resume, not a restore after a loss
    comparison = compare_with_reference(resumed, options)
    assert comparison["steps"] == 40 and comparison["history"][0][0] == 0
    assert comparison["max_relative_diff"] == 0.0, comparison

    from_run, from_checkpoint = tmp_path / "run.pt", tmp_path / "checkpoint.pt"
    assert main(["export", str(tmp_path / "resumed"), "-o", str(from_run)]) == 0
    assert main(["export", "--checkpoint-dir", str(tmp_path / "checkpoints"), "-o", str(from_checkpoint)]) == 0
    model = torch.nn.Sequential(*[spec.build() for spec in gpt_layer_specs(GPTSize(layers=2))])
    model.load_state_dict(torch.load(from_run))  # strict: every key of every layer, and nothing else
    state, checkpointed = torch.load(from_run), torch.load(from_checkpoint)
    assert state.keys() == checkpointed.keys()
    assert all(torch.equal(state[key], checkpointed[key]) for key in state)  # the checkpoint of step 40
    report = next(iter(resumed.reports.values()))
    stage = report["hosted"][0]
    index = report["slice_layers"][stage][0]
    for name, tensor in report["slices"][stage][0].items():
        assert torch.equal(state[f"{index}.{name}"], tensor)
