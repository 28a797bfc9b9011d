"""The communication layer: gloo groups built directly under versioned store prefixes.

Every group of a membership epoch lives under its own prefix `bamboo/e<epoch>/...` of the c10d
store (a TCPStore, or later the etcd-backed store from bamboo-membership), so a group is rebuilt
for a new epoch without restarting the world and no prefix is ever reused. Groups are
ProcessGroupGloo objects built directly (no `init_process_group`), and only their own
`send`/`recv`/`allreduce` methods are used.

P2P messages travel in chunks of at most :data:`CHUNK_BYTES` (1 MiB): gloo hangs until the group
timeout when a large, partly-transferred message loses its peer, and does not at 1 MiB. A failed
P2P operation raises :class:`PeerFailure`, which names the peer and the instruction.

Timeouts (all configurable through :class:`CommTimeouts`):
- `group`: the gloo timeout of every group, which bounds any send, receive or collective whose
  peer is alive but stuck (a dead peer is noticed within tens of milliseconds anyway);
- `build`: how long building a group may wait for its peers to join.
"""

from __future__ import annotations

import datetime
import socket
from collections.abc import Iterable, Sequence

import attrs
import torch
from torch.distributed import PrefixStore, Store
from torch.distributed.distributed_c10d import ProcessGroupGloo

__all__ = [
    "CHUNK_BYTES",
    "MAX_CHUNKS",
    "CommTimeouts",
    "EpochGroups",
    "PeerFailure",
    "PendingSends",
    "build_gloo_group",
    "chunk_views",
]

CHUNK_BYTES = 1 << 20
# gloo tags are 32-bit: a message tag is `base × MAX_CHUNKS + chunk`, so one message holds at most
# MAX_CHUNKS chunks (256 MiB of data). Callers split larger payloads into several messages.
MAX_CHUNKS = 256


class PeerFailure(RuntimeError):
    """A P2P send or receive (or a collective) failed: the peer's socket closed or it timed out.

    `peer` is the global rank of the peer (or -1 for a collective), `peer_name` its role (for
    example `stage 2 pipeline 0`), and `instruction` the instruction that was running.
    """

    def __init__(self, peer: int, peer_name: str, instruction: str, cause: BaseException | None = None) -> None:
        self.peer = peer
        self.peer_name = peer_name
        self.instruction = instruction
        self.cause = cause
        detail = f": {cause}" if cause is not None else ""
        super().__init__(f"peer {peer_name} (rank {peer}) failed during {instruction}{detail}")


@attrs.frozen
class CommTimeouts:
    """Timeouts of the communication layer, in seconds."""

    group: float = attrs.field(default=60.0, validator=attrs.validators.gt(0))
    build: float = attrs.field(default=120.0, validator=attrs.validators.gt(0))


def build_gloo_group(store: Store, prefix: str, rank: int, size: int, timeout: float) -> ProcessGroupGloo:
    """Build a gloo group of `size` ranks under `prefix` of `store` (blocks until all joined)."""
    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [ProcessGroupGloo.create_device(hostname=socket.gethostname())]
    options._threads = 1
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, options)


def chunk_views(flat: torch.Tensor) -> list[torch.Tensor]:
    """Split a 1-D contiguous tensor into views of at most :data:`CHUNK_BYTES` each."""
    per_chunk = max(1, CHUNK_BYTES // flat.element_size())
    return list(flat.split(per_chunk)) if flat.numel() else [flat]


def _chunk_tag(tag: int, index: int) -> int:
    if index >= MAX_CHUNKS:
        raise ValueError(f"message with tag {tag} needs more than {MAX_CHUNKS} chunks of {CHUNK_BYTES} bytes")
    return tag * MAX_CHUNKS + index


class PendingSends:
    """Sends in flight. Their tensors stay referenced until the send has completed."""

    def __init__(self) -> None:
        self._works: list[tuple[object, torch.Tensor, int, str, str]] = []

    def add(self, work: object, tensor: torch.Tensor, peer: int, peer_name: str, instruction: str) -> None:
        self._works.append((work, tensor, peer, peer_name, instruction))

    def wait_all(self) -> None:
        """Wait for every send; the first failure raises :class:`PeerFailure`."""
        works, self._works = self._works, []
        for index, (work, _tensor, peer, peer_name, instruction) in enumerate(works):
            try:
                work.wait()  # type: ignore[attr-defined]
            except RuntimeError as exc:
                self._works = works[index + 1 :]
                raise PeerFailure(peer, peer_name, instruction, exc) from exc

    def abandon(self) -> list[object]:
        """Forget the sends (after a failure); returns them so a caller can keep them referenced."""
        works, self._works = self._works, []
        return works

    def __len__(self) -> int:
        return len(self._works)


class EpochGroups:
    """All gloo groups of one process for one membership epoch.

    `members` maps a group name to the ordered global ranks in it. Every process builds the groups
    it belongs to in sorted name order, which cannot deadlock because all processes follow the
    same order. A group's prefix is `bamboo/<job>/e<epoch>/<name>`.
    """

    def __init__(
        self,
        store: Store,
        job: str,
        epoch: int,
        rank: int,
        members: dict[str, Sequence[int]],
        timeouts: CommTimeouts,
        names: dict[int, str] | None = None,
    ) -> None:
        self.epoch = epoch
        self.rank = rank
        self.timeouts = timeouts
        self.members = {name: tuple(ranks) for name, ranks in members.items()}
        self.names = names or {}
        self.groups: dict[str, ProcessGroupGloo] = {}
        for name in sorted(self.members):
            ranks = self.members[name]
            if rank in ranks and len(ranks) > 1:
                self.groups[name] = build_gloo_group(
                    store, f"bamboo/{job}/e{epoch}/{name}/", ranks.index(rank), len(ranks), timeouts.group
                )

    def name_of(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")

    def group_rank(self, group: str, rank: int) -> int:
        return self.members[group].index(rank)

    def send(
        self, group: str, tensor: torch.Tensor, peer: int, tag: int, instruction: str, pending: PendingSends
    ) -> None:
        """Start sending `tensor` to global rank `peer` in chunks; completion is awaited via `pending`."""
        pg = self.groups[group]
        flat = tensor.detach().contiguous().view(-1)
        dst = self.group_rank(group, peer)
        for index, chunk in enumerate(chunk_views(flat)):
            try:
                work = pg.send([chunk], dst, _chunk_tag(tag, index))
            except RuntimeError as exc:
                raise PeerFailure(peer, self.name_of(peer), instruction, exc) from exc
            pending.add(work, chunk, peer, self.name_of(peer), instruction)

    def post_recv(self, group: str, out: torch.Tensor, peer: int, tag: int, instruction: str) -> list[object]:
        """Post the receives of `out` (contiguous) from global rank `peer`; returns their works."""
        pg = self.groups[group]
        src = self.group_rank(group, peer)
        try:
            return [
                pg.recv([chunk], src, _chunk_tag(tag, index)) for index, chunk in enumerate(chunk_views(out.view(-1)))
            ]
        except RuntimeError as exc:
            raise PeerFailure(peer, self.name_of(peer), instruction, exc) from exc

    def wait_recv(self, works: list[object], peer: int, instruction: str) -> None:
        """Wait for posted receives; a failure raises PeerFailure."""
        try:
            for work in works:
                work.wait()  # type: ignore[attr-defined]
        except RuntimeError as exc:
            raise PeerFailure(peer, self.name_of(peer), instruction, exc) from exc

    def recv(self, group: str, out: torch.Tensor, peer: int, tag: int, instruction: str) -> torch.Tensor:
        """Receive into `out` (contiguous) from global rank `peer`; a failure raises PeerFailure."""
        self.wait_recv(self.post_recv(group, out, peer, tag, instruction), peer, instruction)
        return out

    def allreduce(self, group: str, tensors: Iterable[torch.Tensor], instruction: str) -> None:
        """Sum `tensors` in place over `group` (a one-member group is a no-op)."""
        if group not in self.groups:
            return
        pg = self.groups[group]
        for tensor in tensors:
            try:
                pg.allreduce([tensor]).wait()
            except RuntimeError as exc:
                raise PeerFailure(-1, f"a member of {group}", instruction, exc) from exc
