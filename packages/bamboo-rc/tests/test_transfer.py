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


def test_the_wire_format_gives_back_every_tensor_bit_for_bit_and_every_other_value_as_it_was() -> None:
    from bamboo.rc.transfer import pack_states, unpack_states

    wide = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    states = {0: {"layers": {"w": torch.randn(3, 5), "half": torch.randn(7).half(), "bf": torch.randn(5).bfloat16(),
                             "strided": wide.t(), "empty": torch.empty(0, 4)},
                  "optimizer": {"state": {0: {"step": torch.tensor(3.0), "exp_avg": torch.randn(3, 5)}},
                                "param_groups": [{"lr": 0.1, "params": [0], "betas": (0.9, 0.999)}]},
                  "scheduler": None, "steps": 3, "loss_scale": {"scale": 2.0 ** 15}},
              2: {"flags": torch.tensor([True, False, True]), "ids": torch.tensor([1, -2, 3], dtype=torch.int64)}}
    buffer = pack_states(states)
    assert buffer.dtype == torch.uint8 and buffer.dim() == 1
    back = unpack_states(buffer)

    def same(a: object, b: object) -> None:
        if isinstance(a, torch.Tensor):
            assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
            assert torch.equal(a.contiguous().view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(
                torch.uint8) if b.numel() else b)
            assert b.untyped_storage().nbytes() == b.numel() * b.element_size()  # its own copy, not the buffer
        elif isinstance(a, dict):
            assert isinstance(b, dict) and a.keys() == b.keys()
            for key in a:
                same(a[key], b[key])
        elif isinstance(a, (list, tuple)):
            assert type(a) is type(b) and len(a) == len(b)
            for x, y in zip(a, b, strict=True):
                same(x, y)
        else:
            assert a == b

    same(states, back)
