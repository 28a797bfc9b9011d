"""Device placement: which device a worker takes, and what each layer of the runtime puts where.

On the CPU every piece is exercised with ``device="cpu"``: the choice of the device (arguments, ``BAMBOO_DEVICE``,
``LOCAL_RANK``, a GPU count given to it), the staging and the stash's swap (no copy: a tensor in host memory is
its own swap), the slices, and a two-stage engine trained with ``device="cpu"`` against one with the default.
The GPU tests (marker ``cuda``) skip without a GPU; each runs in a fresh process, since a process that starts
CUDA cannot fork workers that use it.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import pytest
import torch
from bamboo.rc.config import load_config
from bamboo.rc.data import GlobalBatchSampler, pipeline_data_iter
from bamboo.rc.device import (
    DEVICE_ENV,
    HostSwap,
    RedundantStream,
    cuda_device_count,
    host_empty,
    resolve_device,
    to_device,
)
from bamboo.rc.engine import initialize
from bamboo.rc.model import GPTSize, gpt_layer_specs, lm_loss
from bamboo.rc.precision import autocast
from bamboo.rc.stash import FrcStash
from bamboo.rc.state import ReusedBuffers, SpareBuffers, TrainableSlice
from bamboo.rc.transport import HostStaging
from bamboo.rc.verify import DEFAULT_CONFIG

CPU = torch.device("cpu")
SIZE = GPTSize(layers=2, width=16, heads=2, sequence=8)

needs_gpu = pytest.mark.skipif(cuda_device_count() == 0, reason="needs a CUDA device (none visible)")


# ---------------------------------------------------------------------------------- which device
@pytest.mark.parametrize(("given", "environ", "gpus", "expected"), [
    ("cpu", {}, 2, "cpu"),
    (None, {}, 0, "cpu"),
    (None, {DEVICE_ENV: "cpu"}, 2, "cpu"),
    ("auto", {}, 0, "cpu"),
    (None, {}, 2, "cuda:0"),
    (None, {"LOCAL_RANK": "3"}, 2, "cuda:1"),  # four processes on two GPUs: two to a GPU
    (None, {DEVICE_ENV: "cuda", "LOCAL_RANK": "2"}, 4, "cuda:2"),
    ("cuda:1", {"LOCAL_RANK": "0"}, 2, "cuda:1"),
    (torch.device("cuda", 0), {}, 1, "cuda:0"),
])
def test_the_device_comes_from_the_argument_the_environment_or_the_gpus_present(
        given: str | torch.device | None, environ: dict[str, str], gpus: int, expected: str) -> None:
    assert resolve_device(given, environ=environ, cuda_count=gpus) == torch.device(expected)


def test_an_explicit_local_rank_picks_the_gpu() -> None:
    assert resolve_device("cuda", local_rank=5, environ={"LOCAL_RANK": "0"}, cuda_count=4) == torch.device("cuda", 1)


@pytest.mark.parametrize(("given", "environ", "gpus", "message"), [
    ("cuda", {}, 0, "CUDA is not available"),
    (None, {DEVICE_ENV: "cuda:0"}, 0, "CUDA is not available"),
    ("cuda:2", {}, 2, "sees 2 GPU(s), cuda:0 to cuda:1"),
    ("mps", {}, 0, "bamboo runs on cpu or cuda devices, not mps"),
    ("gpu0", {}, 0, "is not a device"),
    ("cuda", {"LOCAL_RANK": "x"}, 1, "LOCAL_RANK='x' is not an integer"),
])
def test_a_device_this_process_cannot_use_is_one_line(given: str | None, environ: dict[str, str], gpus: int,
                                                       message: str) -> None:
    with pytest.raises(ValueError, match=re.escape(message)) as raised:
        resolve_device(given, environ=environ, cuda_count=gpus)
    assert "\n" not in str(raised.value)


def test_initialize_refuses_a_gpu_this_process_does_not_have_before_it_builds_anything() -> None:
    if cuda_device_count():
        pytest.skip("this machine has a GPU")
    with pytest.raises(ValueError, match="CUDA is not available"):
        initialize(gpt_layer_specs(SIZE), dict(DEFAULT_CONFIG), "eflb", loss_fn=lm_loss, stages=2, rank=0,
                   world_size=2, store=object(), device="cuda")  # type: ignore[arg-type]  # never reached


def test_verify_names_a_bad_device_in_one_line() -> None:
    done = subprocess.run([sys.executable, "-m", "bamboo.rc.cli", "verify", "--device", "tpu"],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines()[-1] == ("bamboo-rc: error: device 'tpu' is not a device "
                                                    "(expected cpu, cuda, cuda:N or auto)")


# ---------------------------------------------------------------------------------- each piece on the CPU
def test_on_the_cpu_the_staging_and_the_swap_copy_nothing() -> None:
    tensor = torch.arange(6.0).reshape(2, 3)
    staging = HostStaging(CPU)
    sent = staging.outbound(tensor)
    assert sent.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr() and not staging.copies
    buffer = staging.inbound_buffer((2, 3), torch.float32)
    assert not buffer.is_pinned() and staging.inbound(buffer) is buffer
    assert staging.staged_bytes == 0
    swap = HostSwap()
    assert swap.out(tensor) is tensor
    assert swap.back([tensor], CPU)[0] is tensor
    assert to_device(tensor, CPU) is tensor
    assert not host_empty((4,), torch.float32, CPU).is_pinned()
    assert not ReusedBuffers(CPU).get("a", 4).is_pinned() and not SpareBuffers(CPU).take("a", 4).is_pinned()
    with RedundantStream(CPU).run():  # a plain block on the CPU
        assert torch.equal(tensor + 1, tensor.add(1))


def test_the_stash_keeps_the_saved_tensors_themselves_on_the_cpu_and_accounts_them() -> None:
    stash = FrcStash()
    weight = torch.randn(4, 4, requires_grad=True)
    x = torch.randn(3, 4, requires_grad=True)
    with stash.recording((1, 0), skip={weight.untyped_storage().data_ptr()}):
        y = (x @ weight).tanh().sum()
    live = [t.untyped_storage().data_ptr() for t in stash._live[(1, 0)]]
    stash.swap_out((1, 0))
    assert [t.untyped_storage().data_ptr() for t in stash._stored[(1, 0)]] == live  # no copy
    assert stash.bytes > 0 and stash.swapped_bytes_total == stash.bytes and stash.device_peak_bytes == 0
    stash.swap_in((1, 0))
    y.backward()
    expected = torch.autograd.grad((x @ weight).tanh().sum(), x)[0]
    assert torch.equal(x.grad, expected)
    stash.put_input((2, 0), x)  # lflb: the input itself
    assert stash.inputs[(2, 0)].untyped_storage().data_ptr() == x.untyped_storage().data_ptr()


def test_forward_precision_is_decided_in_one_place_on_the_device_type() -> None:
    fp32 = load_config(dict(DEFAULT_CONFIG))
    bf16 = load_config({**DEFAULT_CONFIG, "bf16": {"enabled": True}})
    with autocast(bf16, CPU):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.bfloat16
    with autocast(fp32, CPU):
        assert (torch.ones(2, 2) @ torch.ones(2, 2)).dtype is torch.float32


def test_a_slice_on_the_cpu_moves_its_gradients_through_host_buffers() -> None:
    config = load_config(dict(DEFAULT_CONFIG))
    piece = TrainableSlice(gpt_layer_specs(SIZE), range(0, 2), config, seed=1, device=CPU)
    assert all(p.device == CPU for p in piece.parameters)
    piece.zero_grads()
    for p in piece.parameters:
        p.grad.normal_()
    flat = piece.flat_grads(out=ReusedBuffers(CPU).get("g", piece.numel()))
    before = [p.grad.clone() for p in piece.parameters]
    piece.zero_grads()
    piece.load_flat_grads(flat)
    assert all(torch.equal(p.grad, b) for p, b in zip(piece.parameters, before, strict=True))


# ---------------------------------------------------------------------------------- a whole engine
def _train_rank(rank: int, store: Any, device: str | None, environ: dict[str, str]) -> dict[str, Any]:
    """One of two stages (eflb) for two steps: where its tensors were, its bytes swapped, its parameters."""
    os.environ.update(environ)
    torch.set_num_threads(1)
    engine = initialize(gpt_layer_specs(SIZE), dict(DEFAULT_CONFIG), "eflb", loss_fn=lm_loss, stages=2, rank=rank,
                        world_size=2, store=store, job="device", device=device)
    sampler = GlobalBatchSampler(2, SIZE.sequence, seed=3)
    data = pipeline_data_iter(sampler, 0, engine.executor.config.micro_batches)
    for _ in range(2):
        engine.train_batch(data)
    engine.finish()
    executor = engine.executor
    places = {str(executor.device)}
    for piece in executor.slices.values():
        places |= {str(p.device) for p in piece.parameters}
        places |= {str(t.device) for state in piece.optimizer.state.values()
                   for t in state.values() if isinstance(t, torch.Tensor) and t.dim() > 0}
    return {"places": places, "swapped": executor.stash.swapped_bytes_total,
            "parameters": {s: [p.detach().clone() for p in piece.parameters] for s, piece in executor.slices.items()}}


def _train(forked_ranks: Callable[..., Any], device: str | None, environ: dict[str, str]) -> dict[int, Any]:
    """Both stages in two forked processes (see `_train_rank`)."""
    with forked_ranks(2, lambda rank, store: _train_rank(rank, store, device, environ)) as ranks:
        pass
    return ranks.results


@pytest.mark.slow
def test_an_engine_on_the_cpu_device_trains_bit_equal_to_the_default_with_everything_in_host_memory(
    forked_ranks: Callable[..., Any],
) -> None:
    if cuda_device_count():
        pytest.skip("this machine has a GPU: the default device is not the CPU")
    named = _train(forked_ranks, "cpu", {})
    from_environment = _train(forked_ranks, None, {DEVICE_ENV: "cpu"})
    for rank in range(2):
        assert named[rank]["places"] == {"cpu"}
        assert named[rank]["swapped"] > 0  # eflb's FRC stash ran
        for stage, parameters in named[rank]["parameters"].items():
            for a, b in zip(parameters, from_environment[rank]["parameters"][stage], strict=True):
                assert torch.equal(a, b)


# ---------------------------------------------------------------------------------- on a GPU
def _on_gpu(code: str) -> None:
    """Run ``code`` in a fresh interpreter (CUDA started there, never in this process, which forks)."""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr


@pytest.mark.cuda
@needs_gpu
def test_on_a_gpu_the_staging_and_the_swap_round_trip_through_pinned_memory() -> None:
    _on_gpu("""
import torch
from bamboo.rc.device import HostSwap, RedundantStream
from bamboo.rc.transport import HostStaging
device = torch.device("cuda", 0)
tensor = torch.randn(1000, 33, device=device)
staging = HostStaging(device)
sent = staging.outbound(tensor * 2)
assert sent.is_pinned() and sent.device.type == "cpu" and torch.equal(sent, (tensor * 2).cpu())
back = staging.inbound(sent)
assert back.device == device and torch.equal(back, tensor * 2) and staging.staged_bytes == 2 * sent.numel() * 4
swap = HostSwap()
stored = swap.out(tensor * 3)
assert stored.is_pinned()
assert torch.equal(swap.back([stored], device)[0], tensor * 3)
with RedundantStream(device).run():
    y = tensor @ tensor.T
assert torch.equal(y, tensor @ tensor.T)
""")


@pytest.mark.cuda
@needs_gpu
def test_on_a_gpu_a_slice_moves_its_gradients_through_pinned_buffers_exactly() -> None:
    _on_gpu("""
import torch
from bamboo.rc.config import load_config
from bamboo.rc.model import GPTSize, gpt_layer_specs
from bamboo.rc.state import ReusedBuffers, TrainableSlice
from bamboo.rc.verify import DEFAULT_CONFIG
device = torch.device("cuda", 0)
piece = TrainableSlice(gpt_layer_specs(GPTSize(layers=2, width=16, heads=2, sequence=8)), range(0, 3),
                       load_config(dict(DEFAULT_CONFIG)), seed=1, device=device)
assert all(p.device == device for p in piece.parameters)
piece.zero_grads()
for p in piece.parameters:
    p.grad.normal_()
before = [p.grad.clone() for p in piece.parameters]
flat = piece.flat_grads(out=ReusedBuffers(device).get("g", piece.numel()))
assert flat.is_pinned()
piece.zero_grads()
piece.load_flat_grads(flat)
assert all(torch.equal(p.grad, b) for p, b in zip(piece.parameters, before))
piece.apply_step(1.0)
assert all(t.device == device for s in piece.optimizer.state.values() for t in s.values() if t.dim() > 0)
""")


@pytest.mark.cuda
@pytest.mark.slow
@needs_gpu
@pytest.mark.parametrize("redundancy", ["lflb", "eflb", "efeb"])
def test_on_a_gpu_a_kill_fails_over_exactly(redundancy: str) -> None:
    done = subprocess.run([sys.executable, "-m", "bamboo.rc.cli", "verify", "--device", "cuda", "--stages", "4",
                           "--pipelines", "1", "--steps", "3", "--redundancy", redundancy, "--kill", "1@1F2"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "max parameter difference: 0.000e+00 relative" in done.stdout
    assert "device=cuda" in done.stdout
