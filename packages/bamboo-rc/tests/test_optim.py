"""bamboo.rc.optim against torch.optim (Adam's fused path, SGD's single-tensor one): bit-equal parameters and state,
state dicts that load both ways, and Adam's bits independent of the thread count; and what a worker's training
never imports (torch._dynamo, sympy: CPU-seconds of every worker's start-up)."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import pytest
import torch
from bamboo.rc import load_config
from bamboo.rc.config import build_optimizer, build_scheduler
from bamboo.rc.optim import SGD, Adam, WarmupSchedule
from bamboo.rc.precision import backward_through

CASES: list[tuple[str, dict[str, Any]]] = [
    ("adam", {}),
    ("adam", {"lr": 3e-3, "betas": (0.8, 0.95), "eps": 1e-6, "weight_decay": 0.1}),
    ("adamw", {}),
    ("adamw", {"lr": 2e-2, "betas": (0.5, 0.9), "weight_decay": 0.3}),
    ("sgd", {"lr": 0.05}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "weight_decay": 1e-3}),
    ("sgd", {"lr": 0.05, "momentum": 0.9, "dampening": 0.2}),
    ("sgd", {"lr": 0.05, "momentum": 0.8, "nesterov": True, "weight_decay": 1e-2}),
]


def _pair(kind: str, params: dict[str, Any], seed: int) -> tuple[list[torch.nn.Parameter], Any,
                                                                    list[torch.nn.Parameter], Any]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(7, 5), (5,), (3, 2, 4)]
    start = [torch.randn(shape, generator=generator) for shape in shapes]
    ours = [torch.nn.Parameter(t.clone()) for t in start]
    theirs = [torch.nn.Parameter(t.clone()) for t in start]
    if kind == "sgd":
        return ours, SGD(ours, **params), theirs, torch.optim.SGD(theirs, foreach=False, **params)
    torch_cls = torch.optim.AdamW if kind == "adamw" else torch.optim.Adam
    defaults = {"weight_decay": 0.01} if kind == "adamw" else {}  # torch's AdamW default; Adam's is 0
    return (ours, Adam(ours, decoupled_weight_decay=kind == "adamw", **{**defaults, **params}),
            theirs, torch_cls(theirs, fused=True, **params))


def _step_both(ours: list[torch.nn.Parameter], mine: Any, theirs: list[torch.nn.Parameter], torch_opt: Any,
               generator: torch.Generator) -> None:
    for a, b in zip(ours, theirs, strict=True):
        grad = torch.randn(a.shape, generator=generator)
        a.grad, b.grad = grad.clone(), grad.clone()
    mine.step()
    torch_opt.step()


def _assert_bit_equal(ours: list[torch.nn.Parameter], mine: Any, theirs: list[torch.nn.Parameter],
                      torch_opt: Any) -> None:
    for a, b in zip(ours, theirs, strict=True):
        assert torch.equal(a, b), (a - b).abs().max()
        mine_state, torch_state = mine.state.get(a, {}), torch_opt.state.get(b, {})
        assert sorted(mine_state) == sorted(torch_state)
        for name, value in torch_state.items():
            assert value.dtype == mine_state[name].dtype, name
            assert torch.equal(mine_state[name], value), name


@pytest.mark.parametrize(("kind", "params"), CASES)
def test_every_step_is_bit_equal_to_torch_optim(kind: str, params: dict[str, Any]) -> None:
    ours, mine, theirs, torch_opt = _pair(kind, params, seed=1)
    generator = torch.Generator().manual_seed(2)
    for _ in range(25):
        _step_both(ours, mine, theirs, torch_opt, generator)
        _assert_bit_equal(ours, mine, theirs, torch_opt)


@pytest.mark.parametrize(("kind", "params"), CASES)
def test_state_dicts_load_both_ways_and_training_stays_bit_equal(kind: str, params: dict[str, Any]) -> None:
    ours, mine, theirs, torch_opt = _pair(kind, params, seed=3)
    generator = torch.Generator().manual_seed(4)
    for _ in range(4):
        _step_both(ours, mine, theirs, torch_opt, generator)
    # a fresh pair, each loading the other's state: ours from torch's, torch's from ours
    ours2, mine2, theirs2, torch_opt2 = _pair(kind, params, seed=3)
    with torch.no_grad():
        for a, b, src in zip(ours2, theirs2, ours, strict=True):
            a.copy_(src)
            b.copy_(src)
    mine2.load_state_dict(torch_opt.state_dict())
    torch_opt2.load_state_dict(mine.state_dict())
    _assert_bit_equal(ours2, mine2, ours, mine)
    for _ in range(4):
        _step_both(ours2, mine2, theirs2, torch_opt2, generator)
        _assert_bit_equal(ours2, mine2, theirs2, torch_opt2)


_THREADS_CODE = """
import sys, torch
from bamboo.rc.optim import Adam
torch.set_num_threads(int(sys.argv[1]))
generator = torch.Generator().manual_seed(0)
params = [torch.nn.Parameter(torch.randn(shape, generator=generator)) for shape in [(300_001,), (97, 33), (5,)]]
optimizer = Adam(params, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1, decoupled_weight_decay=True)
for _ in range(3):
    for p in params:
        p.grad = torch.randn(p.shape, generator=generator)
    optimizer.step()
print(torch.cat([p.detach().reshape(-1) for p in params]).view(torch.int32).sum(dtype=torch.int64).item())
"""


def test_adam_steps_bit_equal_on_one_thread_and_on_two() -> None:
    """Every node, replica and reference steps the same bits, whatever its torch thread count (the kernel splits
    its work on 64-byte boundaries); parameters of odd sizes exercise the kernel's scalar tail."""
    digests = [subprocess.run([sys.executable, "-c", _THREADS_CODE, str(threads)], capture_output=True, text=True,
                              timeout=120, check=True).stdout.strip() for threads in (1, 2)]
    assert digests[0] == digests[1]


def test_a_state_of_other_parameters_is_refused_with_the_counts() -> None:
    mine = Adam([torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(3))])
    other = Adam([torch.nn.Parameter(torch.zeros(2))])
    with pytest.raises(ValueError, match=r"\[1\] parameters, this optimizer's \[2\]"):
        mine.load_state_dict(other.state_dict())


@pytest.mark.parametrize(("make", "message"), [
    (lambda p: Adam(p, lr=-1.0), "lr must be >= 0.0, got -1.0"),
    (lambda p: Adam(p, betas=(0.9, 1.0)), r"betas\[1\] must be in \[0, 1\), got 1.0"),
    (lambda p: SGD(p, lr=0.1, nesterov=True), "nesterov needs a momentum > 0"),
    (lambda p: SGD(p, lr=0.1, momentum=-0.5), "momentum must be >= 0, got -0.5"),
])
def test_bad_hyper_parameters_are_refused_with_their_values(make: Any, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make([torch.nn.Parameter(torch.zeros(2))])


@pytest.mark.parametrize(("kind", "params", "torch_cls", "weight_decay"), [
    ("Adam", {"lr": 1e-3}, "AdamW", 0.01),  # DeepSpeed's Adam is AdamW by default
    ("Adam", {"lr": 1e-3, "adam_w_mode": False}, "Adam", 0.0),
    ("AdamW", {"lr": 1e-3}, "AdamW", 0.01),
    ("SGD", {"lr": 1e-3}, "SGD", 0.0),
])
def test_the_config_builds_the_optimizer_deepspeed_names(kind: str, params: dict[str, Any], torch_cls: str,
                                                          weight_decay: float) -> None:
    config = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": kind, "params": params}})
    optimizer = build_optimizer(config.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    assert optimizer.param_groups[0]["weight_decay"] == weight_decay
    if torch_cls != "SGD":
        assert optimizer.param_groups[0]["decoupled_weight_decay"] is (torch_cls == "AdamW")


def test_the_schedule_loads_a_torch_lambda_lr_state() -> None:
    config = load_config({"train_micro_batch_size_per_gpu": 1, "scheduler": {
        "type": "WarmupLR", "params": {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-2, "warmup_num_steps": 10}}})
    optimizer = build_optimizer(config.optimizer, [torch.nn.Parameter(torch.zeros(1))])
    schedule = build_scheduler(config.scheduler, optimizer)
    assert isinstance(schedule, WarmupSchedule)
    torch_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    lambda_lr = torch.optim.lr_scheduler.LambdaLR(torch_opt, schedule.lr_at)
    for _ in range(3):
        torch_opt.step()
        lambda_lr.step()
    schedule.load_state_dict(lambda_lr.state_dict())
    schedule.step()
    lambda_lr.step()
    assert schedule.last_epoch == 4 and schedule.get_last_lr() == lambda_lr.get_last_lr()


def test_training_a_slice_never_imports_torch_dynamo() -> None:
    """The point of bamboo.rc.optim and of exact_mode's eager flag: a fresh process that sets exact mode,
    builds a slice, steps it and serialises its state has not imported torch._dynamo (1.2 s of CPU)."""
    code = """
import sys, torch
from bamboo.rc import load_config
from bamboo.rc.worker import exact_mode
from bamboo.rc.model import GPTSize, gpt_layer_specs
from bamboo.rc.state import TrainableSlice
exact_mode()
assert torch.are_deterministic_algorithms_enabled()
config = load_config({"train_micro_batch_size_per_gpu": 1, "optimizer": {"type": "Adam", "params": {"lr": 1e-3}},
                      "scheduler": {"type": "WarmupLR", "params": {"warmup_num_steps": 5}}})
piece = TrainableSlice(gpt_layer_specs(GPTSize(layers=1, width=16, heads=2, sequence=8)), range(3), config, 0)
for p in piece.parameters:
    p.grad = torch.ones_like(p)
piece.apply_step(1.0)
piece.load_state_bytes(piece.state_bytes())
print(sorted(name for name in sys.modules if name.startswith("torch._dynamo")))
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[]", done.stdout


def test_a_backward_from_a_received_gradient_never_imports_sympy_and_gives_autograds_bits() -> None:
    """bamboo.rc.precision.backward_through: a stage's backward from its output's gradient, in a fresh process,
    leaves torch's symbolic shapes and sympy unimported (0.4 to 0.6 CPU-s of every worker's start-up), and gives
    the same gradient bits as ``torch.autograd.backward`` on a copy of the stage, which runs after the check."""
    code = """
import copy, sys, torch
from bamboo.rc.model import GPTSize, build_layers, gpt_layer_specs
from bamboo.rc.precision import backward_through
torch.manual_seed(0)
stage = build_layers(gpt_layer_specs(GPTSize(layers=2, width=16, heads=2, sequence=8)), range(1, 3), 0)
twin = copy.deepcopy(stage)
x = torch.randn(3, 8, 16)
grad = torch.randn(3, 8, 16)
backward_through(stage(x), grad)
imported = sorted(n for n in ("sympy", "torch.fx.experimental.symbolic_shapes") if n in sys.modules)
torch.autograd.backward(twin(x), grad)
same = all(torch.equal(a.grad, b.grad) for a, b in zip(stage.parameters(), twin.parameters()))
print(imported, same)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "[] True", done.stdout


def test_a_gradient_of_the_wrong_shape_gets_torchs_own_error() -> None:
    output = torch.nn.Linear(4, 4)(torch.randn(2, 4))
    with pytest.raises(RuntimeError, match="Mismatch in shape"):
        backward_through(output, torch.ones(3, 4))
