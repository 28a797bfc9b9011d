"""The optimizers and the LR schedule that a DeepSpeed config names, in plain tensor ops.

Why not ``torch.optim``: building any ``torch.optim.Optimizer`` imports ``torch._dynamo`` (its
``add_param_group`` and ``step`` are wrapped to keep dynamo out), and so does a ``LambdaLR``. That import
is 1.2 s of CPU in every process that trains, about a third of a worker's start, and a worker's start is on
the path of every job start and of every replacement node's warm-up. Nothing here is compiled, so that
import buys nothing.

Adam's update is torch's fused kernel (``torch.optim.Adam``/``AdamW`` with ``fused=True``): one pass over
each parameter, its gradient and both moments, against the seven element-wise passes and two temporaries of the
single-tensor path (``foreach=False``, which bamboo used before). On one thread here it steps half of the
benchmark GPT's parameters in 2 ms instead of 10 ms, and the optimizer step ends every iteration on the critical
path. The kernel is element-wise and splits its work on 64-byte boundaries, so its bits depend neither on the
thread count nor on how parameters are grouped: every node, replica and single-process reference gets the same
parameters. They are bit-equal to ``torch.optim``'s fused path after any number of steps (``tests/test_optim.py``
holds that). SGD keeps torch's single-tensor path, op for op. ``state_dict()`` has torch's layout (``{"state":
{index: {...}}, "param_groups": [{..., "params": [index, ...]}]}``), so a checkpoint written before this module
existed loads, and a state written here loads into torch.optim.

Only what a DeepSpeed config can ask for is supported (:data:`bamboo.rc.config` checks the keys): Adam
with or without decoupled weight decay (AdamW), without amsgrad; SGD with momentum, dampening, nesterov
and weight decay.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch

__all__ = ["SGD", "Adam", "Optimizer", "WarmupSchedule"]


class Optimizer:
    """One parameter group, per-parameter state, and torch's ``state_dict`` layout."""

    def __init__(self, params: Iterable[torch.nn.Parameter], defaults: dict[str, Any]) -> None:
        params = list(params)
        if any(not isinstance(p, torch.Tensor) for p in params):
            raise TypeError(f"{type(self).__name__} takes tensors, got {sorted({type(p).__name__ for p in params})}")
        self.param_groups: list[dict[str, Any]] = [{"params": params, **defaults}]
        self.state: dict[torch.Tensor, dict[str, Any]] = {}

    def _parameters(self) -> list[torch.Tensor]:
        return [p for group in self.param_groups for p in group["params"]]

    def state_dict(self) -> dict[str, Any]:
        """``{"state": {index: state}, "param_groups": [group with "params" as indices]}``, as torch's."""
        index = {id(p): i for i, p in enumerate(self._parameters())}
        groups = [{**{k: v for k, v in group.items() if k != "params"},
                   "params": [index[id(p)] for p in group["params"]]} for group in self.param_groups]
        state = {index[id(p)]: dict(values) for p, values in self.state.items()}
        return {"state": state, "param_groups": groups}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Load a state of the same parameters (this class's or torch.optim's): floating-point state is cast to
        its parameter's dtype, Adam's ``step`` to a float32 counter, and each group's hyper-parameters replaced."""
        saved_groups = state_dict["param_groups"]
        if len(saved_groups) != len(self.param_groups):
            raise ValueError(f"the state has {len(saved_groups)} parameter groups, this optimizer "
                             f"{len(self.param_groups)}")
        sizes = [len(group["params"]) for group in self.param_groups]
        saved_sizes = [len(group["params"]) for group in saved_groups]
        if sizes != saved_sizes:
            raise ValueError(f"the state's parameter groups hold {saved_sizes} parameters, this optimizer's {sizes}")
        by_index = {}
        for group, saved in zip(self.param_groups, saved_groups, strict=True):
            by_index.update(zip(saved["params"], group["params"], strict=True))
        self.state = {}
        for key, values in state_dict["state"].items():
            param = by_index[key]
            self.state[param] = {name: _cast_state(name, value, param) for name, value in values.items()}
        self.param_groups = [{**{k: v for k, v in saved.items() if k != "params"}, "params": group["params"]}
                             for group, saved in zip(self.param_groups, saved_groups, strict=True)]

    def step(self) -> None:
        raise NotImplementedError


def _cast_state(name: str, value: Any, param: torch.Tensor) -> Any:
    if name == "step":  # the fused kernel reads a float32 counter on the parameter's device, as torch's fused path
        return torch.as_tensor(value, dtype=torch.float32).to(device=param.device)
    if not isinstance(value, torch.Tensor):
        return value
    return value.to(dtype=param.dtype if value.is_floating_point() else value.dtype, device=param.device)


class Adam(Optimizer):
    """Adam, or AdamW with ``decoupled_weight_decay``: ``torch.optim.Adam``/``AdamW`` with ``fused=True``."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 *, decoupled_weight_decay: bool = False) -> None:
        beta1, beta2 = (float(b) for b in betas)
        for name, value, low in (("lr", lr, 0.0), ("eps", eps, 0.0), ("weight_decay", weight_decay, 0.0)):
            if not value >= low:
                raise ValueError(f"Adam's {name} must be >= {low}, got {value!r}")
        for name, value in (("betas[0]", beta1), ("betas[1]", beta2)):
            if not 0.0 <= value < 1.0:
                raise ValueError(f"Adam's {name} must be in [0, 1), got {value!r}")
        super().__init__(params, {"lr": lr, "betas": (beta1, beta2), "eps": eps, "weight_decay": weight_decay,
                                  "amsgrad": False, "maximize": False, "foreach": None, "capturable": False,
                                  "differentiable": False, "fused": True,
                                  "decoupled_weight_decay": decoupled_weight_decay})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            batches: dict[tuple[torch.device, torch.dtype], _AdamBatch] = {}
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state.get(param)
                if not state:
                    state = self.state[param] = {
                        "step": torch.zeros((), dtype=torch.float32, device=param.device),
                        "exp_avg": torch.zeros_like(param, memory_format=torch.preserve_format),
                        "exp_avg_sq": torch.zeros_like(param, memory_format=torch.preserve_format),
                    }
                batch = batches.setdefault((param.device, param.dtype), _AdamBatch())
                batch.add(param, state)
            beta1, beta2 = group["betas"]
            fused = torch._fused_adamw_ if group["decoupled_weight_decay"] else torch._fused_adam_
            for batch in batches.values():
                torch._foreach_add_(batch.steps, 1)
                fused(batch.params, batch.grads, batch.exp_avgs, batch.exp_avg_sqs, [], batch.steps, lr=group["lr"],
                      beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"], eps=group["eps"],
                      amsgrad=False, maximize=False)


class _AdamBatch:
    """The parameters of one device and dtype that one fused call steps, with their state's tensors."""

    def __init__(self) -> None:
        self.params: list[torch.Tensor] = []
        self.grads: list[torch.Tensor] = []
        self.exp_avgs: list[torch.Tensor] = []
        self.exp_avg_sqs: list[torch.Tensor] = []
        self.steps: list[torch.Tensor] = []

    def add(self, param: torch.Tensor, state: dict[str, torch.Tensor]) -> None:
        self.params.append(param)
        self.grads.append(param.grad)
        self.exp_avgs.append(state["exp_avg"])
        self.exp_avg_sqs.append(state["exp_avg_sq"])
        self.steps.append(state["step"])


class SGD(Optimizer):
    """SGD with momentum, dampening, nesterov and weight decay: ``torch.optim.SGD`` with ``foreach=False``."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 1e-3, momentum: float = 0.0,
                 dampening: float = 0.0, weight_decay: float = 0.0, nesterov: bool = False) -> None:
        for name, value in (("lr", lr), ("momentum", momentum), ("weight_decay", weight_decay)):
            if not value >= 0.0:
                raise ValueError(f"SGD's {name} must be >= 0, got {value!r}")
        if nesterov and (momentum <= 0 or dampening != 0):
            raise ValueError(f"SGD's nesterov needs a momentum > 0 and no dampening, got momentum {momentum!r} "
                             f"and dampening {dampening!r}")
        super().__init__(params, {"lr": lr, "momentum": momentum, "dampening": dampening,
                                  "weight_decay": weight_decay, "nesterov": nesterov, "maximize": False,
                                  "foreach": False, "differentiable": False, "fused": None})

    @torch.no_grad()
    def step(self) -> None:
        for group in self.param_groups:
            lr, momentum, dampening = group["lr"], group["momentum"], group["dampening"]
            weight_decay, nesterov = group["weight_decay"], group["nesterov"]
            for param in group["params"]:
                grad = param.grad
                if grad is None:
                    continue
                if weight_decay != 0:
                    grad = grad.add(param, alpha=weight_decay)
                if momentum != 0:
                    state = self.state.setdefault(param, {})
                    buf = state.get("momentum_buffer")
                    if buf is None:
                        buf = state["momentum_buffer"] = grad.detach().clone()
                    else:
                        buf.mul_(momentum).add_(grad, alpha=1 - dampening)
                    grad = grad.add(buf, alpha=momentum) if nesterov else buf
                param.add_(grad, alpha=-lr)


class WarmupSchedule:
    """Sets every group's learning rate to ``lr_at(n)`` at optimizer step ``n``: ``lr_at(0)`` when built, and
    ``lr_at(n)`` after the n-th :meth:`step` (``torch.optim.lr_scheduler.LambdaLR`` with initial LRs of 1)."""

    def __init__(self, optimizer: Optimizer, lr_at: Callable[[int], float]) -> None:
        self.optimizer = optimizer
        self.lr_at = lr_at
        self.last_epoch = 0
        self._apply()

    def _apply(self) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = self.lr_at(self.last_epoch)

    def step(self) -> None:
        self.last_epoch += 1
        self._apply()

    def get_last_lr(self) -> list[float]:
        return [float(group["lr"]) for group in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_epoch": self.last_epoch, "_last_lr": self.get_last_lr()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Load ``last_epoch`` (from this class's state or a ``LambdaLR``'s); the LRs themselves come back with
        the optimizer's state."""
        self.last_epoch = int(state["last_epoch"])
