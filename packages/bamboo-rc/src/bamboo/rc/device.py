"""Where a worker's tensors live: its device, the host memory that faces the network and the stash, its streams.

A worker computes on one device (:func:`resolve_device`): the one named by ``initialize(..., device=)``, else by
``BAMBOO_DEVICE`` (``bamboo-launch --device`` sets it for its workers), else ``cuda:LOCAL_RANK`` (modulo the
GPUs present, so that several processes of a one-GPU machine share it) when CUDA is present, else the CPU.
The layers, the replica, the optimizer state, the activations, the received tensors and the FRC stash's live
tensors are on that device. What crosses the network or waits in the stash is in host memory, pinned when the
device is a GPU:

- the transport (:mod:`bamboo.rc.transport`) stages device tensors through pinned host buffers over gloo;
- the FRC stash swaps saved tensors to pinned host memory on a side stream and back before BRC
  (:class:`HostSwap`); on the CPU a tensor already in host memory is its own swap, with no copy;
- redundant work (FRC, BRC) may run on a second stream beside the normal work (:class:`RedundantStream`).

On the CPU every one of these is the identity: no copy, no stream, no pinned memory.

**Precision** is :mod:`bamboo.rc.precision`'s: its ``autocast(config, device)`` applies bf16 or fp16 on the
device's type.

**Fork safety.** Nothing here initializes CUDA until a tensor is put on a GPU: :func:`resolve_device` counts
GPUs through NVML (``torch.cuda.device_count``), so ``verify``'s parent can resolve a device and still fork its
workers.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping, Sequence

import torch

__all__ = [
    "CUBLAS_WORKSPACE",
    "DEVICE_ENV",
    "HostSwap",
    "RedundantStream",
    "cuda_device_count",
    "exact_kernels",
    "host_empty",
    "peak_memory_bytes",
    "resolve_device",
    "to_device",
]

DEVICE_ENV = "BAMBOO_DEVICE"
"""The environment variable a worker reads its device from when ``initialize`` is given none (``cpu``,
``cuda``, ``cuda:N``, ``auto``); ``bamboo-launch agent --device`` and ``bamboo-launch run --device`` set it."""

LOCAL_RANK_ENV = "LOCAL_RANK"
"""torchrun's (and bamboo-launch's) local rank: which GPU of the machine a worker takes by default."""

CUBLAS_WORKSPACE = ":4096:8"
"""cuBLAS's workspace setting for deterministic results (``CUBLAS_WORKSPACE_CONFIG``), set by
:func:`exact_kernels` before CUDA starts."""


def cuda_device_count() -> int:
    """GPUs this process may use, counted without initializing CUDA where NVML answers (so a process that
    counts can still fork workers that use them); 0 with a CPU-only torch."""
    return torch.cuda.device_count()


def _local_rank(local_rank: int | None, environ: Mapping[str, str]) -> int:
    if local_rank is not None:
        return local_rank
    text = environ.get(LOCAL_RANK_ENV, "0") or "0"
    try:
        value = int(text)
    except ValueError:
        raise ValueError(f"environment variable {LOCAL_RANK_ENV}={text!r} is not an integer") from None
    if value < 0:
        raise ValueError(f"environment variable {LOCAL_RANK_ENV}={value} is negative")
    return value


def resolve_device(
    device: str | torch.device | None = None,
    *,
    local_rank: int | None = None,
    environ: Mapping[str, str] | None = None,
    cuda_count: int | None = None,
) -> torch.device:
    """The device a worker computes on.

    ``device`` (``"cpu"``, ``"cuda"``, ``"cuda:N"``, ``"auto"`` or a ``torch.device``) wins; None reads
    :data:`DEVICE_ENV`; absent or ``auto``, a GPU when CUDA is present, else the CPU. ``cuda`` without an index
    is ``cuda:(local rank mod GPUs)`` (``local_rank``, else ``LOCAL_RANK``, else 0): one process per GPU on a
    machine with enough of them, several processes sharing a GPU otherwise. A device this process cannot use
    is a one-line ValueError. ``environ`` and ``cuda_count`` replace ``os.environ`` and
    :func:`cuda_device_count` (tests)."""
    environ = os.environ if environ is None else environ
    if device is None:
        device = environ.get(DEVICE_ENV) or "auto"
    text = str(device).strip()
    count = cuda_device_count() if cuda_count is None else cuda_count
    if text == "auto":
        text = "cuda" if count > 0 else "cpu"
    try:
        parsed = torch.device(text)
    except (RuntimeError, ValueError):
        raise ValueError(f"device {text!r} is not a device (expected cpu, cuda, cuda:N or auto)") from None
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type != "cuda":
        raise ValueError(f"device {text!r}: bamboo runs on cpu or cuda devices, not {parsed.type}")
    if count == 0:
        raise ValueError(f"device {text!r}: CUDA is not available to this process (torch {torch.__version__}, "
                         f"CUDA build {torch.version.cuda or 'none'}, {count} GPUs visible)")
    index = _local_rank(local_rank, environ) % count if parsed.index is None else parsed.index
    if index >= count:
        raise ValueError(f"device {text!r}: this process sees {count} GPU(s), cuda:0 to cuda:{count - 1}")
    return torch.device("cuda", index)


def exact_kernels() -> None:
    """What deterministic GPU kernels need before CUDA starts: cuBLAS's fixed workspace
    (``CUBLAS_WORKSPACE_CONFIG``, kept when set). Deterministic algorithms themselves are
    :func:`bamboo.rc.worker.exact_mode`'s flag; on the CPU this changes nothing."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)


# ---------------------------------------------------------------------------------- memory
def to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``tensor`` on ``device``: itself when it is there already (no copy), else a copy queued on the current
    stream (asynchronous from pinned memory)."""
    if tensor.device == device:
        return tensor
    return tensor.to(device, non_blocking=True)


def host_empty(shape: Sequence[int] | torch.Size, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """An uninitialized host tensor that faces ``device``: pinned when it is a GPU (copies to and from it can
    be asynchronous), plain memory on the CPU."""
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=device.type == "cuda")


def peak_memory_bytes(device: torch.device) -> int | None:
    """The most bytes this process had allocated on ``device`` so far (a GPU), None on the CPU."""
    if device.type != "cuda":
        return None
    return int(torch.cuda.max_memory_allocated(device))


# ---------------------------------------------------------------------------------- streams
class RedundantStream:
    """A second stream for redundant work (FRC, BRC) on a GPU, as a fork and a join around each piece of it.

    :meth:`run` makes the second stream wait for what the current stream queued (the inputs are ready), runs
    the block on it, and makes the current stream wait for it afterwards. So the redundant kernels overlap the
    normal work queued before them, and everything later sees their results; no tensor crosses streams without
    one of those waits, so none needs ``record_stream`` (a block freed by one stream is reused by the other only
    after a wait). On the CPU :meth:`run` is a plain block."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._stream: torch.cuda.Stream | None = None

    @contextlib.contextmanager
    def run(self) -> Iterator[None]:
        if self.device.type != "cuda":
            yield
            return
        if self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        main = torch.cuda.current_stream(self.device)
        self._stream.wait_stream(main)
        try:
            with torch.cuda.stream(self._stream):
                yield
        finally:
            main.wait_stream(self._stream)


class HostSwap:
    """The FRC stash's way to host memory and back.

    :meth:`out` copies a GPU tensor into pinned host memory on a side stream (after the current stream's
    work that produced it) and records the side stream on the source, so its memory is reused only once the
    copy is done; a tensor in host memory already is returned as it is (no copy). :meth:`back` copies stored
    tensors to their device on the current stream, after the side stream's copies."""

    def __init__(self) -> None:
        self._streams: dict[torch.device, torch.cuda.Stream] = {}

    def _stream(self, device: torch.device) -> torch.cuda.Stream:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)
        return stream

    def out(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` in host memory: a pinned copy made on the side stream (GPU), or ``tensor`` itself."""
        if tensor.device.type != "cuda":
            return tensor
        stream = self._stream(tensor.device)
        copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        stream.wait_stream(torch.cuda.current_stream(tensor.device))
        with torch.cuda.stream(stream):
            copy.copy_(tensor, non_blocking=True)
        tensor.record_stream(stream)
        return copy

    def back(self, stored: Sequence[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
        """``stored`` on ``device`` (queued on the current stream after the swap-outs); the very tensors when
        ``device`` is the CPU."""
        if device.type != "cuda":
            return list(stored)
        stream = self._streams.get(device)
        if stream is not None:
            torch.cuda.current_stream(device).wait_stream(stream)
        return [tensor.to(device, non_blocking=True) for tensor in stored]
