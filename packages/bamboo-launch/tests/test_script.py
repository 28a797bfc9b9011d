"""User scripts under ``bamboo-launch run -- SCRIPT``: the entry point's wiring, without a cluster.

The script modes run real ``python SCRIPT`` subprocesses (describe, reference); the worker mode is
covered end to end in ``test_script_e2e.py``.
"""

from __future__ import annotations

import importlib.util
import os
import sys
import textwrap
from pathlib import Path
from types import ModuleType

import pytest
import torch
from bamboo.launch import cli
from bamboo.launch.node import worker_command
from bamboo.launch.run import RunOptions, train_reference_program
from bamboo.launch.script import (
    ENV_AGENT,
    ENV_ENTRY_MARK,
    ENV_MODE,
    ENV_NODE,
    ENV_SPEC,
    ModuleFactory,
    Program,
    ScriptError,
    describe_script,
    reference_from_script,
    train_worker,
    worker_environment,
)
from bamboo.launch.worker import RunSpec, pipeline_batches
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
    env = worker_environment(spec_path=tmp_path / "RUN.json", node="node3", agent="127.0.0.1:5000", rank=5,
                             world_size=8, entry_mark=tmp_path / "node3.entered")
    assert env == {
        ENV_MODE: "worker", ENV_SPEC: str(tmp_path / "RUN.json"), ENV_NODE: "node3", ENV_AGENT: "127.0.0.1:5000",
        ENV_ENTRY_MARK: str(tmp_path / "node3.entered"), "RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "0",
        "LOCAL_WORLD_SIZE": "1",
    }


def _spec(tmp_path: Path, script: tuple[str, ...]) -> RunSpec:
    return RunSpec(job="j", etcd=("127.0.0.1:1",), stages=2, pipelines=3, steps=4, node_of_rank={},
                   out_dir=str(tmp_path / "out"), events=str(tmp_path / "events.jsonl"), run_start=0.0,
                   script=script)


def test_the_agent_spawns_the_builtin_worker_or_the_script_with_its_rank(tmp_path: Path) -> None:
    (tmp_path / "logs").mkdir()
    spec_path = tmp_path / "RUN.json"
    layout = {"generation": 2, "stages": 2, "pipelines": 3, "ranks": {"node0": 4, "node7": 1}}
    command, env, mark = worker_command(_spec(tmp_path, ()), spec_path, "node0", "h:1", layout)
    assert command == [sys.executable, "-m", "bamboo.launch.worker", "--spec", str(spec_path), "--node", "node0",
                       "--agent", "h:1"]
    assert env is None and mark is None

    stale = tmp_path / "logs" / "node0.entered"
    stale.touch()  # left by the worker of an earlier generation: must not count for this one
    command, env, mark = worker_command(_spec(tmp_path, ("/x/train.py", "--lr", "3")), spec_path, "node0", "h:1",
                                        layout)
    assert command == [sys.executable, "/x/train.py", "--lr", "3"]
    assert env is not None and mark == stale and not stale.exists()
    assert (env["RANK"], env["WORLD_SIZE"], env["LOCAL_RANK"]) == ("4", "6", "0")
    assert (env[ENV_MODE], env[ENV_SPEC], env[ENV_NODE], env[ENV_AGENT]) == ("worker", str(spec_path), "node0", "h:1")
    assert env["PATH"] == os.environ["PATH"]  # the node's own environment is kept


def test_run_spec_round_trips_the_script() -> None:
    spec = RunSpec(job="j", etcd=["e:1"], stages=2, pipelines=1, steps=3, node_of_rank={}, out_dir="o",
                   events="e", run_start=1.0, script=["/a/b.py", "--x", "1"])
    assert RunSpec.from_json(spec.to_json()) == spec
    assert spec.script == ("/a/b.py", "--x", "1")


def test_program_takes_layer_specs_or_module_factories_and_rejects_built_modules() -> None:
    program = Program(layers=[lambda: torch.nn.Linear(2, 2)], loss_fn=lambda o, y: o, microbatch=lambda s, i: (s, i))
    assert isinstance(program.layers[0], ModuleFactory)
    assert isinstance(program.layers[0].build(), torch.nn.Linear)
    with pytest.raises(TypeError, match=r"layer 1 is a Linear: give a DeepSpeed LayerSpec"):
        Program(layers=[lambda: torch.nn.Linear(2, 2), torch.nn.Linear(2, 2)], loss_fn=len, microbatch=len)
    with pytest.raises(ValueError, match="layers is empty"):
        Program(layers=[], loss_fn=len, microbatch=len)
    with pytest.raises(TypeError, match="microbatch must be callable, got int"):
        Program(layers=[lambda: torch.nn.Linear(2, 2)], loss_fn=len, microbatch=3)


def test_train_worker_outside_the_launcher_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_MODE, raising=False)
    with pytest.raises(RuntimeError, match=r"runs under `bamboo-launch run \.\.\. -- SCRIPT` \(BAMBOO_SCRIPT_MODE"):
        train_worker(layers=[lambda: torch.nn.Linear(2, 2)], loss_fn=len, microbatch=len)


def test_pipeline_batches_take_their_share_of_each_global_batch() -> None:
    batches = pipeline_batches(lambda step, index: (step, index), pipeline=1, micro_batches=3, first_step=5)
    assert [next(batches) for _ in range(6)] == [(5, 3), (5, 4), (5, 5), (6, 3), (6, 4), (6, 5)]


def test_describe_reads_the_example_model_and_config(tmp_path: Path) -> None:
    description = describe_script([str(EXAMPLE), "--blocks", "3", "--width", "32"], tmp_path / "describe.log")
    assert len(description.layers) == 5  # input projection, 3 blocks, head
    block = 32 * 64 + 64 + 64 * 32 + 32 + 2 * 32  # up, down, layer norm
    assert description.layers[1].param_bytes == 4 * block and description.layers[1].optimizer_bytes == 8 * block
    assert description.config is not None and description.config["train_micro_batch_size_per_gpu"] == 16


def test_describe_names_a_script_that_never_calls_the_entry_point(tmp_path: Path) -> None:
    script = _write(tmp_path, "forgot.py", "print('training... not really')\n")
    with pytest.raises(ScriptError, match=r"forgot\.py exited without calling bamboo\.launch\.train_worker.*log: "):
        describe_script([str(script)], tmp_path / "describe.log")


def test_describe_reports_a_failing_script_with_its_status_last_line_and_log(tmp_path: Path) -> None:
    script = _write(tmp_path, "broken.py", "import sys\nraise SystemExit('no data under /nowhere')\n")
    log = tmp_path / "describe.log"
    with pytest.raises(ScriptError) as caught:
        describe_script([str(script)], log)
    assert str(caught.value) == (f"{script} exited with status 1 while the launcher read its model: "
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
