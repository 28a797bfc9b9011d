"""The front door as a DeepSpeed user meets it: ``bamboo.rc.PipelineModule`` without ``deepspeed.init_distributed``,
``BAMBOO_STAGES=2 torchrun --nproc_per_node 2 script.py`` (the README's launch), and the error a front-door script
gets under ``bamboo-launch run``."""

from __future__ import annotations

import datetime
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import bamboo.rc
import pytest
from bamboo.membership.embedded import free_port
from bamboo.rc.data import GlobalBatchSampler, pipeline_data_iter
from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss
from torch.distributed import TCPStore

SIZE = GPTSize(layers=2, width=16, heads=2, sequence=8)
CONFIG = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def _store() -> TCPStore:
    return TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))


def _losses(model: object, job: str, steps: int = 2) -> list[float]:
    sampler = GlobalBatchSampler(2, SIZE.sequence, seed=3)
    engine = bamboo.rc.initialize(model, CONFIG, "none", loss_fn=None if hasattr(model, "loss_fn") else lm_loss,
                                  rank=0, world_size=1, stages=1, store=_store(), job=job)

    batches = pipeline_data_iter(sampler, 0, 2, 0)
    losses = [float(engine.train_batch(batches)) for _ in range(steps)]
    engine.finish()
    return losses


def test_bamboos_pipeline_module_needs_no_process_group_and_trains_as_the_layer_specs() -> None:
    import deepspeed.comm
    from deepspeed.pipe import PipelineModule as DeepSpeedPipelineModule

    with pytest.raises(AssertionError, match="DeepSpeed backend not set"):  # why bamboo has its own
        DeepSpeedPipelineModule(layers=gpt_layer_specs(SIZE), num_stages=1, loss_fn=lm_loss)
    module = bamboo.rc.PipelineModule(layers=gpt_layer_specs(SIZE), num_stages=1, loss_fn=lm_loss)
    assert _losses(module, "module") == _losses(gpt_layer_specs(SIZE), "specs")
    assert not deepspeed.comm.is_initialized()  # nothing was initialised behind the user's back


def test_pipeline_module_refuses_what_bamboo_cannot_honour_by_name() -> None:
    specs = gpt_layer_specs(SIZE)
    with pytest.raises(ValueError, match=r"partition_method='uniform' is not supported.*stage_bounds"):
        bamboo.rc.PipelineModule(layers=specs, num_stages=2, partition_method="uniform")
    with pytest.raises(ValueError, match="topology= is not supported"):
        bamboo.rc.PipelineModule(layers=specs, topology=object())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="activation_checkpoint_interval=2"):
        bamboo.rc.PipelineModule(layers=specs, num_stages=2, activation_checkpoint_interval=2)
    with pytest.raises(ValueError, match="num_stages must be a positive integer, got 0"):
        bamboo.rc.PipelineModule(layers=specs, num_stages=0)
    with pytest.raises(TypeError, match="layer 1 must be a LayerSpec"):
        bamboo.rc.PipelineModule(layers=[specs[0], 3])


def test_initialize_under_bamboo_launch_run_names_train_worker(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("BAMBOO_SCRIPT_MODE", "describe")
    with pytest.raises(RuntimeError, match=r"under `bamboo-launch run`.*bamboo\.launch\.train_worker\(") as caught:
        bamboo.rc.initialize(gpt_layer_specs(SIZE), CONFIG, loss_fn=lm_loss)
    assert "\n" not in str(caught.value)


TORCHRUN_SCRIPT = '''
"""The README's torchrun launch: bamboo.rc.PipelineModule, no deepspeed.init_distributed."""
import os

import torch
from torch import nn
from torch.nn import functional
from deepspeed.pipe import LayerSpec

import bamboo.rc

config = {"train_micro_batch_size_per_gpu": 3, "gradient_accumulation_steps": 2,
          "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}


def mse(outputs, labels):
    return functional.mse_loss(outputs, labels)


def data():
    step = 0
    while True:
        for k in range(2):
            inputs = torch.randn(3, 5, generator=torch.Generator().manual_seed(1000 * step + k))
            yield inputs, inputs.sum(dim=1, keepdim=True)
        step += 1


module = bamboo.rc.PipelineModule(layers=[LayerSpec(nn.Linear, 5, 7), LayerSpec(nn.Tanh), LayerSpec(nn.Linear, 7, 1)],
                                  loss_fn=mse)  # num_stages: BAMBOO_STAGES
engine = bamboo.rc.initialize(model=module, config=config)
batches = data()
for _ in range(3):
    loss = engine.train_batch(batches)
engine.finish()
os.write(1, f"rank {os.environ['RANK']} loss {float(loss)!r}\\n".encode())  # one write: the ranks share stdout
os._exit(0)
'''


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_torchrun_launch_of_the_readme_trains_two_stages(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(textwrap.dedent(TORCHRUN_SCRIPT))
    port = free_port()  # for torchrun's store: below the ephemeral range, where no outgoing connection takes it
    env = {**os.environ, "BAMBOO_STAGES": "2", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    env.pop("BAMBOO_SCRIPT_MODE", None)
    process = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
         "--master_port", str(port), "--log-dir", str(tmp_path / "torchelastic"), str(script)],
        env=env, capture_output=True, text=True, timeout=150, check=False)
    assert process.returncode == 0, process.stdout[-3000:] + process.stderr[-3000:]
    reports = sorted(re.findall(r"rank (\d+) loss (\S+)", process.stdout))
    assert [rank for rank, _loss in reports] == ["0", "1"], process.stdout
    assert reports[0][1] == reports[1][1]  # both stages report the step's loss
