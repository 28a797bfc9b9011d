"""Moving a stage's state (parameters, optimizer, scheduler, replica) between real processes."""

from __future__ import annotations

import datetime
import os
import tempfile
from pathlib import Path

import pytest
import torch
from bamboo.rc.comm import build_gloo_group
from bamboo.rc.config import load_config
from bamboo.rc.model import GPTSize, gpt_layer_specs, stage_bounds
from bamboo.rc.state import TrainableSlice
from bamboo.rc.transfer import export_stage_state, import_stage_state
from bamboo.rc.verify import DEFAULT_CONFIG
from bamboo.rc.worker import exact_mode
from torch.distributed import TCPStore

pytestmark = pytest.mark.slow


def _slices(seed: int) -> dict[int, TrainableSlice]:
    specs = gpt_layer_specs(GPTSize(layers=2, width=32, heads=2, sequence=8))
    bounds = stage_bounds(specs, 2)
    config = load_config(DEFAULT_CONFIG)
    return {stage: TrainableSlice(specs, range(*bounds[stage]), config, seed) for stage in (0, 1)}


def _train(slices: dict[int, TrainableSlice], steps: int) -> None:
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        for piece in slices.values():
            for p in piece.parameters:
                p.grad = torch.randn(p.shape, generator=generator)
            piece.apply_step(0.5)


def test_stage_state_moves_between_processes_bit_for_bit() -> None:
    # One intra-op thread, as every worker trains: a child forked while an earlier test's thread pool ran
    # would wait on the pool's threads, which it does not have (it hung in Adam.step after test_coordinator.py).
    exact_mode()
    with tempfile.TemporaryDirectory() as out:
        reader, writer = os.pipe()
        pid = os.fork()
        if pid == 0:  # the receiver: different initial weights, then the imported state
            code = 1
            try:
                os.close(writer)
                port = int.from_bytes(os.read(reader, 8), "little")
                store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
                group = build_gloo_group(store, "transfer/", 1, 2, 30.0)
                slices = _slices(seed=99)
                loaded = import_stage_state(slices, group, 0)
                _train(slices, 1)  # and it keeps training identically
                torch.save({"loaded": loaded, "states": {s: p.state_bytes() for s, p in slices.items()}},
                           Path(out) / "received.pt")
                code = 0
            finally:
                os._exit(code)
        os.close(reader)
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
        os.write(writer, store.port.to_bytes(8, "little"))
        group = build_gloo_group(store, "transfer/", 0, 2, 30.0)
        slices = _slices(seed=0)
        _train(slices, 3)
        sent = export_stage_state(slices, group, 1)
        _, status = os.waitpid(pid, 0)
        assert os.waitstatus_to_exitcode(status) == 0
        received = torch.load(Path(out) / "received.pt", weights_only=False)
    assert sent > 0 and received["loaded"] == [0, 1]
    _train(slices, 1)
    for stage, piece in slices.items():
        other = _slices(seed=5)[stage]
        other.load_state_bytes(received["states"][stage])
        assert other.steps == piece.steps == 4
        for mine, theirs in zip(piece.parameters, other.parameters, strict=True):
            assert torch.equal(mine, theirs)
        for mine, theirs in zip(piece.optimizer.state.values(), other.optimizer.state.values(), strict=True):
            assert all(torch.equal(mine[key], theirs[key]) for key in ("exp_avg", "exp_avg_sq", "step"))
        assert piece.optimizer.param_groups[0]["lr"] == other.optimizer.param_groups[0]["lr"]
