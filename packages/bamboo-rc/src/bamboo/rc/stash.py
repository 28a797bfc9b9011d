"""The FRC stash: tensors that a replica forward pass saves for its backward, kept off the device.

Eager FRC runs the successor's forward pass on the shadow during the bubbles. What autograd saves
for the backward (BRC, run only on failure) is packed by :meth:`FrcStash.saving` into a separate
store:
- on CUDA, into pinned host memory, copied on a side stream;
- on CPU, as a copy into the store (so the stash never aliases live activations).

The bytes are accounted per microbatch and at the peak. :meth:`FrcStash.drop` frees a
microbatch's entries (at the end of the iteration, or after its BRC ran).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["FrcStash"]


class FrcStash:
    """Saved tensors of replica forward passes, per microbatch, off the device."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device or torch.device("cpu")
        self._entries: dict[int, dict[int, torch.Tensor]] = {}
        self._bytes: dict[int, int] = {}
        self._next_key = 0
        self.peak_bytes = 0
        self._side_stream = torch.cuda.Stream() if self.device.type == "cuda" else None

    @property
    def bytes(self) -> int:
        """Bytes held now, over all microbatches."""
        return sum(self._bytes.values())

    def microbatches(self) -> list[int]:
        return sorted(self._entries)

    def _pack(
        self, microbatch: int, tensor: torch.Tensor, skip: frozenset[int]
    ) -> tuple[int, int, torch.device] | torch.Tensor:
        if tensor.untyped_storage().data_ptr() in skip:
            return tensor  # a replica weight: it stays where it is, only activations are stashed
        key = self._next_key
        self._next_key += 1
        if tensor.device.type == "cuda":
            assert self._side_stream is not None
            copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
            self._side_stream.wait_stream(torch.cuda.current_stream(tensor.device))
            with torch.cuda.stream(self._side_stream):
                copy.copy_(tensor, non_blocking=True)
                tensor.record_stream(self._side_stream)
        else:
            copy = tensor.detach().clone()
        self._entries.setdefault(microbatch, {})[key] = copy
        self._bytes[microbatch] = self._bytes.get(microbatch, 0) + copy.numel() * copy.element_size()
        self.peak_bytes = max(self.peak_bytes, self.bytes)
        return (microbatch, key, tensor.device)

    def _unpack(self, packed: tuple[int, int, torch.device] | torch.Tensor) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        microbatch, key, device = packed
        stored = self._entries[microbatch][key]
        if device.type == "cuda":
            assert self._side_stream is not None
            torch.cuda.current_stream(device).wait_stream(self._side_stream)
            return stored.to(device, non_blocking=True)
        return stored

    @contextlib.contextmanager
    def saving(self, microbatch: int, skip: Iterable[int] = ()) -> Iterator[None]:
        """Inside this block, tensors saved for backward are packed into the stash of `microbatch`.

        Tensors whose storage address is in `skip` (the replica's weights) are not copied.
        """
        skipped = frozenset(skip)
        with torch.autograd.graph.saved_tensors_hooks(
            lambda tensor: self._pack(microbatch, tensor, skipped), self._unpack
        ):
            yield

    def drop(self, microbatch: int) -> None:
        self._entries.pop(microbatch, None)
        self._bytes.pop(microbatch, None)

    def clear(self) -> None:
        self._entries.clear()
        self._bytes.clear()
