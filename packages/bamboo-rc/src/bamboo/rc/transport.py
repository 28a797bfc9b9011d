"""The transport: how a worker's tensors reach other workers, on a GPU as on the CPU, and what a dead peer does.

**The decision: gloo over host memory, GPU tensors staged through pinned host buffers.** Every message
(activations and gradients point to point, the data-parallel all-reduce, the replica sync, the commit's
all-reduce) goes over the gloo groups of :mod:`bamboo.rc.comm`, which only ever see host tensors. On a GPU
:class:`HostStaging` copies a device tensor into a pinned host buffer before it is sent, and a message is
received into a pinned host buffer and copied to the device once it has arrived. Gradients that are
all-reduced are gathered into pinned host buffers already (:class:`bamboo.rc.state.ReusedBuffers`), so the
all-reduce needs no staging of its own. On the CPU the staging is the identity: no copy.

Why not NCCL, whose collectives run on the GPU:

- **A dead peer.** gloo reports a killed peer within milliseconds (its sockets close), and a peer that is
  stopped, not dead, leaves the wait to the failure notices, which the runtime polls every ``NOTICE_POLL_S``
  (``CommTimeouts.poll``) in every blocking wait: the same failure path as on the CPU, tested there. An NCCL
  collective with a dead peer hangs on the GPU until NCCL's own timeout, and the only way out is
  ``ncclCommAbort`` of every affected communicator and a rebuild, which is where torchft and PyTorch see
  their hangs.
- **Several processes on one GPU.** NCCL refuses two ranks of a communicator on one device; a one-GPU machine
  tests a pipeline with its stages as processes sharing the GPU, which gloo over host memory allows.
- **The cost.** Staging adds a device-to-host and a host-to-device copy per message (tens of GB/s from
  pinned memory), against gloo's TCP transfer of the same bytes. ``scripts/gpu-check.sh`` prints the staging
  share of the transfers on the GPU it runs on.

A staged copy waits on the local GPU only, never on a peer, so the transport adds no timeout: the survivor
of a dead peer waits at most until the failure is confirmed (then ``poll``), and a live but stuck peer is
bounded by the group timeout (``GROUP_S``), as on the CPU (``docs/failure-model.md``, "GPUs").
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from bamboo.rc.device import host_empty, to_device

__all__ = ["HostStaging"]


class HostStaging:
    """One worker's staging between its device and the host buffers gloo sends and receives.

    :attr:`staged_bytes` counts the bytes copied either way (0 on the CPU: nothing is copied)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.staged_bytes = 0

    @property
    def copies(self) -> bool:
        """Whether messages are copied between the device and host buffers (the device is a GPU)."""
        return self.device.type == "cuda"

    def outbound(self, tensor: torch.Tensor) -> torch.Tensor:
        """What to send for ``tensor``: the tensor itself when it is in host memory; for a GPU tensor, a pinned
        host copy, complete when this returns (gloo reads it as soon as the send is posted)."""
        tensor = tensor.detach()
        if tensor.device.type != "cuda":
            return tensor
        host = host_empty(tensor.shape, tensor.dtype, tensor.device)
        host.copy_(tensor)  # synchronous: after the kernels that produced the tensor
        self.staged_bytes += host.numel() * host.element_size()
        return host

    def inbound_buffer(self, shape: Sequence[int] | torch.Size, dtype: torch.dtype) -> torch.Tensor:
        """A host buffer to receive a message of ``shape`` and ``dtype`` into (pinned on a GPU)."""
        return host_empty(shape, dtype, self.device)

    def inbound(self, buffer: torch.Tensor) -> torch.Tensor:
        """The received ``buffer`` on the device: itself on the CPU, else a copy queued on the current stream."""
        if not self.copies:
            return buffer
        self.staged_bytes += buffer.numel() * buffer.element_size()
        return to_device(buffer, self.device)
