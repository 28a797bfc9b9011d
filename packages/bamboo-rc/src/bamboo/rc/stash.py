"""The FRC stash: what a replica forward pass saves for its backward, swapped off the device.

Eager FRC runs the successor's forward on the shadow in the bubbles. While it runs
(:meth:`FrcStash.recording`), every tensor autograd saves for the backward is registered under the
(stage, microbatch) of that FRC. The schedule's `SO` (:meth:`FrcStash.swap_out`) then moves those
tensors into the separate swap store, in host memory (:class:`bamboo.rc.device.HostSwap`):
- on a GPU, into pinned host memory, copied on a side stream; the device copies are released;
- on the CPU, where a tensor in host memory is its own swap: no copy.

`SI` (:meth:`FrcStash.swap_in`) brings them back to the device before BRC. The bytes in the store
are accounted, now and at the peak, and so are the bytes the stash holds on a GPU
(:attr:`FrcStash.device_peak_bytes`: recorded by an FRC and not swapped out yet, or swapped back in).
The replica's own weights are never stashed: they stay where they are. In `lflb` the stash is only the
replica's input (:meth:`FrcStash.put_input`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator

import torch
from bamboo.rc.device import HostSwap

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
        self.device_peak_bytes = 0
        """The most bytes of saved tensors the stash held on a GPU at once (0 on the CPU)."""
        self._swap = HostSwap()

    @property
    def bytes(self) -> int:
        """Bytes held in the swap store now."""
        return sum(self._bytes.values())

    @property
    def device_bytes(self) -> int:
        """Bytes of saved tensors the stash holds on a GPU now (live, not swapped out, or swapped back in)."""
        return sum(t.numel() * t.element_size() for live in self._live.values() for t in live if t.device.type == "cuda")

    def _note_device(self) -> None:
        if any(device.type == "cuda" for device in self._device.values()):
            self.device_peak_bytes = max(self.device_peak_bytes, self.device_bytes)

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
        self._note_device()

    def put_input(self, key: Key, tensor: torch.Tensor) -> None:
        """lflb: stash only the replica's input for a later FRC (in host memory: a pinned copy from a GPU, the
        tensor itself on the CPU; its user brings it back to the device)."""
        stored = self._swap.out(tensor.detach())
        self.inputs[key] = stored
        self._account(key, stored)

    def swap_out(self, key: Key) -> None:
        """Move the saved tensors of `key` into the swap store, in host memory (from a GPU, a copy on a side
        stream, and the device tensors are released; on the CPU, the tensors themselves)."""
        stored = [self._swap.out(tensor) for tensor in self._live.pop(key, [])]
        for tensor in stored:
            self._account(key, tensor)
        self._stored[key] = stored

    def swap_in(self, key: Key) -> None:
        """Bring the saved tensors of `key` back to their device (on the CPU they are used where they are)."""
        device = self._device.get(key)
        if key not in self._stored or device is None or device.type != "cuda":
            return
        self._live[key] = self._swap.back(self._stored[key], device)
        self._note_device()

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
