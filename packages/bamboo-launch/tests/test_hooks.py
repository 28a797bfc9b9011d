"""A script's hooks (``train_worker(on_step=..., evaluate=(fn, N), on_phase=...)``) and the front-door script's
error.

The dispatch is tested on a stand-in engine (fast); one short real run (2 nodes) checks that the hooks are
called in the workers, that the evaluation goes through the pipeline and changes nothing the training
sees (the run still matches its fault-free reference), that each worker's ``on_phase`` and the event log see
its life (warm, attempt, training, done), and that the config's TensorBoard monitor writes an event file.
"""

from __future__ import annotations

import json
import math
import textwrap
from pathlib import Path
from typing import Any

import attrs
import pytest
from bamboo.bench.emulated.run import RunOptions, compare_with_reference, run_cluster
from bamboo.launch.events import WorkerPhase, read_events
from bamboo.launch.hooks import Evaluation, TrainingHooks, evaluation_batches, run_step_hooks
from bamboo.launch.script import ScriptError, describe_script
from bamboo.rc import StepInfo


@attrs.define
class _Executor:
    pipeline: int


@attrs.define
class _Engine:
    """What :func:`run_step_hooks` uses of a bamboo-rc Engine."""

    last_step: StepInfo | None
    reporting: bool
    executor: _Executor = attrs.field(factory=lambda: _Executor(1))
    evaluated: list[list[Any]] = attrs.field(factory=list)
    by_index: list[Any] = attrs.field(factory=list)
    last_eval_loss: float | None = None

    def gradient_accumulation_steps(self) -> int:
        return 2

    def microbatch_share(self) -> tuple[int, int]:
        return self.executor.pipeline * 2, 2

    def reports(self) -> bool:
        return self.reporting

    def eval_batch(self, data_iter: Any, *, microbatch: Any) -> None:
        self.evaluated.append(list(data_iter))
        self.by_index.append(microbatch(5))  # what a P = 1 node that took over share 2 (M = 2) would ask
        self.last_eval_loss = 0.25


def test_evaluation_runs_every_n_steps_on_the_pipelines_share_and_on_step_gets_its_loss() -> None:
    called: list[StepInfo] = []
    hooks = TrainingHooks(on_step=called.append, evaluate=(lambda step, index: (step, index), 2))
    for step in (1, 2):
        engine = _Engine(StepInfo(step=step, loss=1.5, lr=0.1, samples_per_second=40.0, samples=12 * step), True)
        info = run_step_hooks(engine, hooks)
        assert info == called[-1]
    assert [info.eval_loss for info in called] == [None, 0.25]
    assert engine.evaluated == [[(2, 2), (2, 3)]]  # pipeline 1 of M=2: global microbatches 2 and 3 of step 2
    assert engine.by_index == [(2, 5)]  # a taken-over share's data: the same function, by global index
    assert called[-1] == StepInfo(step=2, loss=1.5, lr=0.1, samples_per_second=40.0, samples=24, eval_loss=0.25)


def test_only_the_reporting_node_calls_on_step_but_every_node_evaluates() -> None:
    called: list[StepInfo] = []
    engine = _Engine(StepInfo(step=3, loss=1.0, lr=0.1, samples_per_second=1.0), reporting=False)
    run_step_hooks(engine, TrainingHooks(on_step=called.append, evaluate=(lambda step, index: index, 3)))
    assert called == [] and engine.evaluated == [[2, 3]]


def test_hooks_are_checked_with_the_offending_value() -> None:
    with pytest.raises(ValueError, match="'every_n_steps' must be >= 1: 0"):
        TrainingHooks(evaluate=(lambda step, index: None, 0))
    with pytest.raises(TypeError, match="evaluate must be a pair"):
        TrainingHooks(evaluate=print)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match=r"'on_step' must be callable \(got 3 that is a <class 'int'>\)"):
        TrainingHooks(on_step=3)  # type: ignore[arg-type]
    assert list(evaluation_batches(Evaluation(lambda step, index: (step, index), 1), 7, 0, 2)) == [(7, 0), (7, 1)]
    assert list(evaluation_batches(Evaluation(lambda step, index: (step, index), 1), 7, 6, 5))[-1] == (7, 10)


def test_a_front_door_script_under_the_launcher_is_told_to_call_train_worker(tmp_path: Path) -> None:
    script = tmp_path / "front_door.py"
    script.write_text(textwrap.dedent('''
        from torch import nn
        import bamboo.rc

        engine = bamboo.rc.initialize(model=[lambda: nn.Linear(2, 2)], config={}, loss_fn=lambda out, y: out.sum())
    '''))
    with pytest.raises(ScriptError) as caught:
        describe_script([str(script)], tmp_path / "describe.log", pipelines=1)
    message = str(caught.value)
    assert "bamboo.rc.initialize cannot run under `bamboo-launch run`" in message, message
    assert "bamboo.launch.train_worker(layers=..., loss_fn=..., microbatch=..., config=...)" in message
    assert "needs BAMBOO_STAGES" not in message


HOOKED_SCRIPT = '''
"""A tiny two-stage model with on_step, evaluate, on_phase and a TensorBoard monitor."""
import json
import sys

import torch
from torch import nn
from torch.nn import functional

import bamboo.launch

OUT = sys.argv[1]
CONFIG = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
          "tensorboard": {"enabled": True, "output_path": OUT, "job_name": "hooked"}}


def microbatch(step, index):
    inputs = torch.randn(3, 5, generator=torch.Generator().manual_seed(1000 * step + index))
    return inputs, inputs.sum(dim=1, keepdim=True)


def validation(step, index):  # a fixed validation set: the step is ignored
    return microbatch(10_000, index)


def mse(outputs, labels):
    return functional.mse_loss(outputs, labels)


def on_step(info):
    with open(f"{OUT}/steps.jsonl", "a") as sink:
        sink.write(json.dumps({"step": info.step, "loss": info.loss, "lr": info.lr,
                               "samples_per_second": info.samples_per_second, "eval_loss": info.eval_loss}) + "\\n")


def on_phase(change):
    with open(f"{OUT}/phases-{change.node}.jsonl", "a") as sink:
        sink.write(json.dumps({"previous": change.previous.value, "phase": change.phase.value,
                               "cause": change.cause, "generation": change.generation}) + "\\n")


if __name__ == "__main__":
    bamboo.launch.train_worker(layers=[lambda: nn.Linear(5, 7), lambda: nn.Sequential(nn.Tanh(), nn.Linear(7, 1))],
                               loss_fn=mse, microbatch=microbatch, config=CONFIG, on_step=on_step,
                               evaluate=(validation, 2), on_phase=on_phase)
'''


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_hooks_are_called_in_a_real_run_and_tensorboard_gets_an_event_file(tmp_path: Path) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    script = tmp_path / "hooked.py"
    script.write_text(textwrap.dedent(HOOKED_SCRIPT))
    out = tmp_path / "out"
    out.mkdir()
    # Nothing fails here: 10 s leases, so that the run is safe beside the cluster tests (the root conftest.py).
    options = RunOptions(redundancy="eflb", nodes=2, stages=2, pipelines=1, steps=4, run_dir=str(tmp_path / "run"), time_scale=1.0,
                         timeout_s=180.0, ttl=10, grace_s=10.0, script=(str(script), str(out)))
    result = run_cluster(options)
    assert result.steps_done == 4
    steps = [json.loads(line) for line in (out / "steps.jsonl").read_text().splitlines()]
    assert [s["step"] for s in steps] == [1, 2, 3, 4]  # once per step: only the reporting node calls it
    assert all(s["lr"] == 0.1 and s["samples_per_second"] > 0 and math.isfinite(s["loss"]) for s in steps)
    assert [s["eval_loss"] is not None for s in steps] == [False, True, False, True]
    events = list((out / "hooked").glob("events.out.tfevents.*"))
    assert events, sorted(p.name for p in out.rglob("*"))
    accumulator = EventAccumulator(str(out / "hooked"))
    accumulator.Reload()
    evaluations = [event.value for event in accumulator.Scalars("Train/Samples/eval_loss")]
    assert evaluations == pytest.approx([s["eval_loss"] for s in steps if s["eval_loss"] is not None])
    assert len(accumulator.Scalars("Train/Samples/train_loss")) == 4
    assert compare_with_reference(result, options)["max_relative_diff"] == 0.0  # evaluation changed nothing
    # Each worker's life, as its on_phase hook and the event log saw it: found its role, started, trained, done.
    lives = {path.stem.removeprefix("phases-"): [json.loads(line) for line in path.read_text().splitlines()]
             for path in sorted(out.glob("phases-*.jsonl"))}
    assert len(lives) == 2, lives
    for life in lives.values():
        assert [(c["previous"], c["phase"]) for c in life] == [("warm", "attempt"), ("attempt", "training"),
                                                               ("training", "done")], life
        assert [c["cause"] for c in life] == ["role found", "started, in the layout", "trained, done"]
        assert {c["generation"] for c in life} == {0}
    logged = [e for e in read_events(result.events) if isinstance(e, WorkerPhase)]
    assert sorted((e.node, e.phase) for e in logged) == sorted((node, c["phase"]) for node, life in lives.items()
                                                              for c in life)
