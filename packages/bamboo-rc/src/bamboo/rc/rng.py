"""Randomness that is a function of where it is used: every layer's forward under its own generator.

A layer's forward pass (dropout, say) draws its random numbers from a generator seeded with
:func:`layer_seed` of ``(run seed, step, global microbatch index, global layer index)``, inside
:func:`layer_rng`, and the generator state the caller had is restored afterwards. So the same
layer on the same microbatch of the same step draws the same numbers wherever it runs:

- the stage's original forward (``F``) and the shadow's forward redundant computation of it
  (``FR``, eager or, for lazy BRC, run just before the recomputed backward);
- a node that took a stage over, or joined after a reconfiguration, or restored a checkpoint (the
  generator has no state to move: only the step counter matters);
- the single-process references (:func:`bamboo.rc.reference.train_reference`,
  :func:`bamboo.launch.reference.train_reference_program`), which run the whole model layer by
  layer with the same indices.

:func:`run_layers` is the one function through which the runtime and the references run a layer's
forward; a new forward path must call it too.

**The global microbatch index** is the microbatch's position in the global batch of its step:
pipeline ``d`` of ``D``, running ``M`` microbatches per step, runs global microbatches
``d*M .. d*M+M-1`` (:func:`global_microbatch`), as its data iterator reads them
(:func:`bamboo.rc.data.pipeline_data_iter`, bamboo-launch's ``pipeline_batches``). The global batch
``D*M`` is the same in every layout, so a reconfiguration to a different D leaves the masks as they were.

**The seed** is the first 8 bytes of BLAKE2b over a domain tag and the four numbers as signed
64-bit integers, cut to 63 bits: two different tuples collide with probability about 2^-63, and
neighbouring tuples give unrelated seeds (unlike an affine mix such as ``seed*P + step``, whose
collisions are easy to hit). The same seed is given to the CPU generator and, when the layer's
input is on a CUDA device, that device's generator (forked and restored as well).

**What is covered, and what is not.** Anything a layer draws from torch's default generators
(``nn.Dropout``, ``torch.rand*``, ``torch.bernoulli``, ... on CPU or on the input's CUDA device)
is controlled. Not covered: Python's ``random``, NumPy's global generator, a ``torch.Generator``
that the layer keeps and advances itself, generators of other devices, randomness in the loss
function, and nondeterministic kernels. :func:`run_layers` detects these cheaply: the first time
it runs a layer object in training mode in a process, it runs it twice more first, on copies of
the input, under the same seed and without gradients (its buffers restored after each run), and
if the two outputs differ it emits a :class:`RandomnessWarning` naming the layer. That costs two
extra forwards per layer once per process, and nothing after. A layer whose first two calls agree
by chance (one that draws only sometimes) is not caught.
"""

from __future__ import annotations

import contextlib
import hashlib
import struct
import threading
import warnings
import weakref
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

__all__ = [
    "RNG_LOCK",
    "RandomnessWarning",
    "global_microbatch",
    "layer_rng",
    "layer_seed",
    "run_layers",
]

RNG_LOCK = threading.RLock()
"""Held while the process's default generators are seeded and drawn from (a layer's forward, a layer's
build): the launcher builds the next layout's engine in a background thread while this one trains, and
both seed the same global generators."""

_DOMAIN = b"bamboo.rc.layer-rng.v1"
_INT64 = (-(2**63), 2**63 - 1)
_SEED_MASK = 2**63 - 1


class RandomnessWarning(UserWarning):
    """A layer's forward gave different outputs for the same input under the same seed: it draws random
    numbers that bamboo cannot control (or runs nondeterministic kernels), so training is not exact."""


def layer_seed(run_seed: int, step: int, microbatch: int, layer: int) -> int:
    """The 63-bit seed of layer ``layer``'s forward on global microbatch ``microbatch`` of step ``step``.

    BLAKE2b of ``(run_seed, step, microbatch, layer)`` packed as signed 64-bit integers; ValueError
    for a negative step, microbatch or layer, or a number outside 64 bits.
    """
    for name, value in (("step", step), ("microbatch", microbatch), ("layer", layer)):
        if value < 0:
            raise ValueError(f"{name} must be >= 0, got {value}")
    values = (run_seed, step, microbatch, layer)
    if not all(_INT64[0] <= int(v) <= _INT64[1] for v in values):
        raise ValueError(f"layer seed inputs {values} do not fit in signed 64-bit integers")
    digest = hashlib.blake2b(_DOMAIN + struct.pack("<4q", *values), digest_size=8).digest()
    return int.from_bytes(digest, "little") & _SEED_MASK


def global_microbatch(first: int, count: int, k: int) -> int:
    """The position in the global batch of microbatch ``k`` of a pipeline whose share of it is the ``count``
    microbatches from ``first`` (:meth:`bamboo.rc.config.TrainingConfig.share`): ``first + k``."""
    if not 0 <= k < count or first < 0:
        raise ValueError(f"microbatch {k} of the share from {first} is outside 0..{count - 1}")
    return first + k


def _cuda_devices(device: torch.device | None) -> list[int]:
    """The CUDA device whose generator a forward on ``device`` draws from (none for a CPU input)."""
    if device is None or device.type != "cuda":
        return []
    return [device.index if device.index is not None else torch.cuda.current_device()]


@contextlib.contextmanager
def layer_rng(
    run_seed: int, step: int, microbatch: int, layer: int, device: torch.device | None = None
) -> Iterator[None]:
    """Run the body under generators seeded with :func:`layer_seed` (the CPU one, and ``device``'s when it
    is a CUDA device), restoring the generator states the caller had afterwards, even on an error."""
    seed = layer_seed(run_seed, step, microbatch, layer)
    cuda = _cuda_devices(device)
    with RNG_LOCK, torch.random.fork_rng(devices=cuda):
        torch.random.default_generator.manual_seed(seed)
        for index in cuda:
            torch.cuda.default_generators[index].manual_seed(seed)
        yield


def _device_of(value: Any) -> torch.device | None:
    if isinstance(value, torch.Tensor):
        return value.device
    if isinstance(value, (tuple, list)):
        for item in value:
            found = _device_of(item)
            if found is not None:
                return found
    return None


def _copy(value: Any) -> Any:
    """A copy of a layer's input (tensors cloned, so an in-place layer cannot change the real input)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (tuple, list)):
        return type(value)(_copy(item) for item in value)
    return value


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and bool(torch.equal(a, b) or (
            a.is_floating_point() and torch.allclose(a, b, rtol=0.0, atol=0.0, equal_nan=True)))
    if isinstance(a, (tuple, list)) and isinstance(b, (tuple, list)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return False
    try:
        return bool(a == b)
    except Exception:  # an output we cannot compare: nothing to report
        return True


_PROBED: weakref.WeakSet[nn.Module] = weakref.WeakSet()
"""The layer objects this process has already probed for uncontrolled randomness."""


def _probe(layer: nn.Module, index: int, x: Any, seed: int, step: int, microbatch: int) -> None:
    """Run ``layer`` twice on copies of ``x`` under the same seed, without gradients, its buffers restored
    after each run; warn (:class:`RandomnessWarning`) naming the layer when the outputs differ."""
    buffers = [(buffer, buffer.detach().clone()) for buffer in layer.buffers()]
    outputs = []
    for _ in range(2):
        with torch.no_grad(), layer_rng(seed, step, microbatch, index, _device_of(x)):
            outputs.append(layer(_copy(x)))
        with torch.no_grad():
            for buffer, saved in buffers:
                buffer.copy_(saved)
    if not _same(*outputs):
        warnings.warn(
            f"layer {index} ({type(layer).__name__}) gave different outputs for the same input under the same "
            f"seed: it draws random numbers outside torch's generators (Python's random, NumPy, a generator of "
            f"its own) or runs nondeterministic kernels, so runs with it are not exact",
            RandomnessWarning, stacklevel=3,
        )


def run_layers(
    layers: Sequence[nn.Module], indices: Sequence[int], x: Any, *, seed: int, step: int, microbatch: int
) -> Any:
    """Run ``layers`` (global indices ``indices``) in order on ``x``, each under :func:`layer_rng` of
    ``(seed, step, microbatch, its index)``; returns the last output.

    The first time a layer object is run in training mode in this process it is probed for randomness
    outside torch's generators (see the module docstring).
    """
    if len(layers) != len(indices):
        raise ValueError(f"{len(layers)} layers but {len(indices)} layer indices")
    for layer, index in zip(layers, indices, strict=True):
        if layer.training and layer not in _PROBED:
            _PROBED.add(layer)
            _probe(layer, index, x, seed, step, microbatch)
        with layer_rng(seed, step, microbatch, index, _device_of(x)):
            x = layer(x)
    return x
