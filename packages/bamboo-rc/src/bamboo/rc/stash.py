"""The FRC stash: what a replica forward pass saves for its backward, swapped off the device.

Eager FRC runs the successor's forward on the shadow in the bubbles. While it runs
(:meth:`FrcStash.recording`), every tensor autograd saves for the backward is registered under the
(stage, microbatch) of that FRC. The schedule's `SO` (:meth:`FrcStash.swap_out`) then moves those
tensors into the separate swap store:
- on CUDA, into pinned host memory, copied on a side stream;
- on CPU, as the tensor itself: it is already in host memory, so the store keeps a reference and nothing is
  copied (autograd never changes a saved tensor in place).

`SI` (:meth:`FrcStash.swap_in`) brings them back to the device before BRC. The bytes in the store
are accounted, now and at the peak. The replica's own weights are never stashed: they stay
where they are. In `lflb` the stash is only the replica's input (:meth:`FrcStash.put_input`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch

__all__ = ["FrcStash"]

Key = tuple[int, int]


class _Handle:
    """What autograd keeps in place of a saved tensor: a key into the stash."""

    __slots__ = ("index", "key")

    def __init__(self, key: Key, index: int) -> None:
        self.key = key
        self.index = index


class FrcStash:
    """Saved tensors of replica forward passes, keyed by (stage, microbatch)."""

    def __init__(self) -> None:
        self._live: dict[Key, list[torch.Tensor]] = {}
        self._stored: dict[Key, list[torch.Tensor]] = {}
        self._device: dict[Key, torch.device] = {}
        self._bytes: dict[Key, int] = {}
        self.inputs: dict[Key, torch.Tensor] = {}
        self.peak_bytes = 0
        self.swapped_bytes_total = 0
        self._side_stream: object | None = None

    @property
    def bytes(self) -> int:
        """Bytes held in the swap store now."""
        return sum(self._bytes.values())

    def _account(self, key: Key, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        self._bytes[key] = self._bytes.get(key, 0) + size
        self.swapped_bytes_total += size
        self.peak_bytes = max(self.peak_bytes, self.bytes)

    def _pack(self, key: Key, tensor: torch.Tensor, skip: frozenset[int]) -> _Handle | torch.Tensor:
        if tensor.untyped_storage().data_ptr() in skip:
            return tensor  # a replica weight: it stays where it is
        tensors = self._live.setdefault(key, [])
        tensors.append(tensor)
        self._device[key] = tensor.device
        return _Handle(key, len(tensors) - 1)

    def _unpack(self, packed: _Handle | torch.Tensor) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        if packed.key in self._live:
            return self._live[packed.key][packed.index]
        return self._stored[packed.key][packed.index]

    @contextlib.contextmanager
    def recording(self, key: Key, skip: Iterable[int] = ()) -> Iterator[None]:
        """Register the tensors saved for backward inside this block under `key`.

        Tensors whose storage address is in `skip` (the replica's weights) are left alone.
        """
        skipped = frozenset(skip)
        with torch.autograd.graph.saved_tensors_hooks(lambda t: self._pack(key, t, skipped), self._unpack):
            yield

    def put_input(self, key: Key, tensor: torch.Tensor) -> None:
        """lflb: stash only the replica's input for a later FRC (a host copy of a device tensor; a host tensor as
        it is, since nothing writes into a forward's output)."""
        kept = tensor.detach()
        if kept.device.type != "cpu":
            kept = kept.to("cpu", copy=True)
        self.inputs[key] = kept
        self._account(key, kept)

    def swap_out(self, key: Key) -> None:
        """Move the saved tensors of `key` into the swap store (a copy of a device tensor, released on the device;
        a host tensor as it is)."""
        live = self._live.pop(key, [])
        stored = []
        for tensor in live:
            if tensor.device.type == "cuda":
                if self._side_stream is None:
                    self._side_stream = torch.cuda.Stream()
                stream = self._side_stream
                copy = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
                stream.wait_stream(torch.cuda.current_stream(tensor.device))  # type: ignore[attr-defined]
                with torch.cuda.stream(stream):  # type: ignore[arg-type]
                    copy.copy_(tensor, non_blocking=True)
                    tensor.record_stream(stream)  # type: ignore[arg-type]
            else:
                copy = tensor.detach()
            stored.append(copy)
            self._account(key, copy)
        self._stored[key] = stored

    def swap_in(self, key: Key) -> None:
        """Bring the saved tensors of `key` back to their device (on CPU they are used in place)."""
        device = self._device.get(key)
        if key not in self._stored or device is None or device.type != "cuda":
            return
        if self._side_stream is not None:
            torch.cuda.current_stream(device).wait_stream(self._side_stream)  # type: ignore[arg-type]
        self._live[key] = [t.to(device, non_blocking=True) for t in self._stored[key]]

    def drop(self, key: Key) -> None:
        self._live.pop(key, None)
        self._stored.pop(key, None)
        self._device.pop(key, None)
        self._bytes.pop(key, None)
        self.inputs.pop(key, None)

    def clear(self) -> None:
        self._live.clear()
        self._stored.clear()
        self._device.clear()
        self._bytes.clear()
        self.inputs.clear()
