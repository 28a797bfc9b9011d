"""User scripts under ``bamboo-launch run -- SCRIPT``: the entry point's wiring, without a cluster.

The script modes run real ``python SCRIPT`` subprocesses (describe, reference); the worker mode is
covered end to end in ``test_script_e2e.py``.
"""

from __future__ import annotations

import importlib.util
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
from bamboo.bench.emulated.run import RunOptions
from bamboo.launch import cli
from bamboo.launch.agent import worker_command
from bamboo.launch.reference import train_reference_program
from bamboo.launch.script import (
    ENV_MODE,
    ENV_NODE,
    ScriptError,
    describe_script,
    reference_from_script,
    train_worker,
    worker_environment,
)
from bamboo.launch.spec import ENV_CONTEXT, JobSpec, ModuleFactory, Program, SpecError
from bamboo.launch.worker import pipeline_batches
from bamboo.rc.worker import exact_mode

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_mlp.py"

TINY_SCRIPT = '''
"""A tiny two-layer model for the tests."""
import os

import torch
from torch import nn
from torch.nn import functional

import bamboo.launch

CONFIG = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def microbatch(step, index):
    generator = torch.Generator().manual_seed(1000 * step + index)
    inputs = torch.randn(3, 5, generator=generator)
    return inputs, inputs.sum(dim=1, keepdim=True)


def mse(outputs, labels):
    return functional.mse_loss(outputs, labels)


LAYERS = [lambda: nn.Linear(5, 7), lambda: nn.Sequential(nn.Tanh(), nn.Linear(7, 1))]

if __name__ == "__main__":
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"], os.environ["LOCAL_RANK"]) == ("0", "1", "0")
if __name__ == "__main__":
    bamboo.launch.train_worker(layers=LAYERS, loss_fn=mse, microbatch=microbatch, config=CONFIG)
'''


def _write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(text))
    return path


def _import(path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location("tiny_script", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_worker_environment_is_torchrun_like_plus_the_bamboo_variables(tmp_path: Path) -> None:
    env = worker_environment(context_path=tmp_path / "node3.json", node="node3")
    assert env == {ENV_MODE: "worker", ENV_CONTEXT: str(tmp_path / "node3.json"), ENV_NODE: "node3",
                   "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1"}
    assert "RANK" not in env and "WORLD_SIZE" not in env  # a warm worker has no rank until a layout gives one


def _spec(script: tuple[str, ...] = (), **changes: object) -> JobSpec:
    fields: dict[str, object] = {
        "job": "j", "stages": 2, "pipelines": 3, "steps": 4, "micro_batches": 2, "created_unix": 1.0,
        "layers": [{"param_bytes": 4, "optimizer_bytes": 8, "compute_cost": 1.0}] * 3,
        "config": {"train_micro_batch_size_per_gpu": 2}, "script": script,
    }
    fields.update(changes)
    return JobSpec(**fields)  # type: ignore[arg-type]


def test_the_agent_spawns_the_builtin_worker_or_the_script(tmp_path: Path) -> None:
    context = tmp_path / "node0.json"
    command, env = worker_command(_spec(), context, "node0")
    assert command == [sys.executable, "-m", "bamboo.launch.worker"]
    assert env == {ENV_CONTEXT: str(context)}
    command, env = worker_command(_spec(("/x/train.py", "--lr", "3")), context, "node0")
    assert command == [sys.executable, "/x/train.py", "--lr", "3"]
    assert (env[ENV_MODE], env[ENV_CONTEXT], env[ENV_NODE]) == ("worker", str(context), "node0")


def test_job_spec_round_trips_and_names_conflicting_flags() -> None:
    spec = _spec(("/a/b.py", "--x", "1"), checkpoint_dir="/ckpt")
    assert JobSpec.from_json(spec.to_json()) == spec
    assert spec.script == ("/a/b.py", "--x", "1")
    assert spec.conflicts({"stages": 2, "steps": 4}) == []
    assert spec.conflicts({"stages": 4, "checkpoint_dir": None, "script": ["/a/b.py"]}) == [
        "--checkpoint-dir (none) conflicts with the job's stored checkpoint_dir /ckpt",
        "-- SCRIPT ARGS /a/b.py conflicts with the job's stored script /a/b.py --x 1",
        "--stages 4 conflicts with the job's stored stages 2",
    ]


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d.update(v=9), "job spec: unknown version 9"),
        (lambda d: d.pop("stages"), "job spec: missing key 'stages'"),
        (lambda d: d.update(colour="red"), "job spec: unknown key(s) 'colour'"),
        (lambda d: d.update(steps=0), "job spec: 'steps' must be >= 1: 0"),
        (lambda d: d.update(redundancy="eager"), "job spec: 'redundancy' must be in"),
    ],
)
def test_job_spec_reader_rejects_malformed_specs(change: object, message: str) -> None:
    import json

    data = json.loads(_spec().to_json())
    change(data)  # type: ignore[operator]
    with pytest.raises(SpecError) as error:
        JobSpec.from_dict(data)
    assert message in str(error.value)


def test_program_takes_layer_specs_or_module_factories_and_rejects_built_modules() -> None:
    program = Program(layers=[lambda: torch.nn.Linear(2, 2)], loss_fn=lambda o, y: o, microbatch=lambda s, i: (s, i))
    assert isinstance(program.layers[0], ModuleFactory)
    assert isinstance(program.layers[0].build(), torch.nn.Linear)
    with pytest.raises(TypeError, match=r"layer 1 is a Linear: give a DeepSpeed LayerSpec"):
        Program(layers=[lambda: torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], loss_fn=len, microbatch=len)
    with pytest.raises(ValueError, match="layers is empty"):
        Program(layers=[], loss_fn=len, microbatch=len)
    with pytest.raises(TypeError, match=r"'microbatch' must be callable \(got 3 that is a <class 'int'>\)"):
        Program(layers=[lambda: torch.nn.Linear(2, 2)], loss_fn=len, microbatch=3)


def test_train_worker_outside_the_launcher_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_MODE, raising=False)
    with pytest.raises(RuntimeError, match=r"runs under `bamboo-launch run \.\.\. -- SCRIPT` \(BAMBOO_SCRIPT_MODE"):
        train_worker(layers=[lambda: torch.nn.Linear(2, 2)], loss_fn=len, microbatch=len)


def test_pipeline_batches_take_their_share_of_each_global_batch() -> None:
    batches = pipeline_batches(lambda step, index: (step, index), first=3, count=3, first_step=5)
    assert [next(batches) for _ in range(6)] == [(5, 3), (5, 4), (5, 5), (6, 3), (6, 4), (6, 5)]
    uneven = pipeline_batches(lambda step, index: (step, index), first=6, count=5, first_step=0)  # 16 over 3: 6, 5, 5
    assert [next(uneven) for _ in range(6)] == [(0, 6), (0, 7), (0, 8), (0, 9), (0, 10), (1, 6)]


def test_describe_reads_the_example_model_and_config(tmp_path: Path) -> None:
    description = describe_script([str(EXAMPLE), "--blocks", "3", "--width", "32"], tmp_path / "describe.log",
                                  pipelines=2)
    assert len(description["layers"]) == 5  # input projection, 3 blocks, head
    block = 32 * 64 + 64 + 64 * 32 + 32 + 2 * 32  # up, down, layer norm
    assert description["layers"][1]["param_bytes"] == 4 * block
    assert description["layers"][1]["optimizer_bytes"] == 8 * block
    assert description["config"]["train_micro_batch_size_per_gpu"] == 16
    assert description["micro_batches"] == description["config"]["gradient_accumulation_steps"]


def test_describe_names_a_script_that_never_calls_the_entry_point(tmp_path: Path) -> None:
    script = _write(tmp_path, "forgot.py", "print('training... not really')\n")
    with pytest.raises(ScriptError, match=r"forgot\.py exited without calling bamboo\.launch\.train_worker.*log: "):
        describe_script([str(script)], tmp_path / "describe.log", pipelines=1)


def test_describe_reports_a_failing_script_with_its_status_last_line_and_log(tmp_path: Path) -> None:
    script = _write(tmp_path, "broken.py", "import sys\nraise SystemExit('no data under /nowhere')\n")
    log = tmp_path / "describe.log"
    with pytest.raises(ScriptError) as caught:
        describe_script([str(script)], log, pipelines=1)
    assert str(caught.value) == (f"{script} exited with status 1 while its model was read: "
                                 f"no data under /nowhere (log: {log})")


def test_reference_mode_replays_the_request_like_the_in_process_reference(tmp_path: Path) -> None:
    script = _write(tmp_path, "tiny.py", TINY_SCRIPT)
    history = [[0, 2], [3, 1]]  # two pipelines, then one from step 3
    states = reference_from_script([str(script)], config=_import(script).CONFIG, seed=7, history=history, steps=5,
                                   work_dir=tmp_path)
    tiny = _import(script)
    threads, deterministic = torch.get_num_threads(), torch.are_deterministic_algorithms_enabled()
    exact_mode()  # as the script's reference process runs
    try:
        expected = train_reference_program([ModuleFactory(f) for f in tiny.LAYERS], tiny.mse, tiny.microbatch,
                                           tiny.CONFIG, 7, history, 5)
    finally:
        torch.set_num_threads(threads)
        torch.use_deterministic_algorithms(deterministic)
    assert len(states) == len(expected) == 2
    for got, want in zip(states, expected, strict=True):
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), name
    untrained = train_reference_program([ModuleFactory(f) for f in tiny.LAYERS], tiny.mse, tiny.microbatch,
                                        tiny.CONFIG, 7, history, 0)
    assert not torch.equal(states[0]["weight"], untrained[0]["weight"])  # it did train


def test_the_reference_keeps_the_job_s_global_batch_when_its_first_kept_generation_had_fewer_pipelines(
    tmp_path: Path,
) -> None:
    """A job of 2 pipelines restarted from its initial state on one (its first kept generation has 1): every step
    still trains the job's global batch of 2 x M microbatches, so the reference must too. Configured from the
    history's first entry, it trained M and the comparison failed an exact run (0.59 in test_auto_redundancy_e2e).
    Given the job's pipelines, it differs from two pipelines throughout only in the grouping of the sums."""
    tiny = _import(_write(tmp_path, "tiny.py", TINY_SCRIPT))
    layers = [ModuleFactory(f) for f in tiny.LAYERS]

    def train(history: list[list[int]], pipelines: int | None) -> list[dict[str, torch.Tensor]]:
        return train_reference_program(layers, tiny.mse, tiny.microbatch, tiny.CONFIG, 7, history, 4,
                                       pipelines=pipelines)

    def distance(a: list[dict[str, torch.Tensor]], b: list[dict[str, torch.Tensor]]) -> float:
        return max(((x[k] - y[k]).abs().max() / y[k].abs().max()).item() for x, y in zip(a, b, strict=True) for k in y)

    two_throughout = train([[0, 2]], 2)
    assert distance(train([[0, 1], [2, 2]], 2), two_throughout) < 1e-5
    assert distance(train([[0, 1], [2, 2]], None), two_throughout) > 1e-3  # half the batch for two steps


def test_run_options_refuse_a_missing_script_or_a_directory(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"script '.*missing\.py' not found"):
        RunOptions(nodes=2, stages=2, pipelines=1, script=(str(tmp_path / "missing.py"),))
    with pytest.raises(ValueError, match=r"script '.*' is not a file"):
        RunOptions(nodes=2, stages=2, pipelines=1, script=(str(tmp_path),))


def test_cli_run_with_a_missing_script_is_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "train.py"
    status = cli.main(["run", "--nodes", "2", "--stages", "2", "--pipelines", "1", "--", str(missing), "--lr", "1"])
    assert status == 2
    assert capsys.readouterr().err == f"bamboo-launch: error: script '{missing}' not found\n"
