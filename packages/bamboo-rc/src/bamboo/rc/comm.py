"""The communication layer: gloo groups built directly under versioned store prefixes.

Every group of a membership epoch lives under its own prefix `bamboo/e<epoch>/...` of the c10d
store (a TCPStore, or later the etcd-backed store from bamboo-membership), so a group is rebuilt
for a new epoch without restarting the world and no prefix is ever reused. Groups are
ProcessGroupGloo objects built directly (no `init_process_group`), and only their own
`send`/`recv`/`allreduce` methods are used.

P2P messages travel in chunks of at most :data:`CHUNK_BYTES` (1 MiB): gloo hangs until the group
timeout when a large, partly-transferred message loses its peer, and does not at 1 MiB. A failed
P2P operation raises :class:`PeerFailure`, which names the peer and the instruction; a failed
collective raises one that names every other member of the group (a collective does not say who
failed).

Timeouts (all configurable through :class:`CommTimeouts`; defaults and meaning in
:mod:`bamboo.rc.timeouts`): `group` (the gloo timeout of every group), `build`, `confirm`,
`poll`.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
import datetime
import os
import socket
import threading
import time
from collections.abc import Callable, Iterable, Sequence

import torch
from bamboo.rc.failures import PeerFailure
from bamboo.rc.ordered_sum import post_ordered_sum
from bamboo.rc.state import SpareBuffers
from bamboo.rc.timeouts import COLLECTIVE_SPIN_S, CommTimeouts
from bamboo.rc.two_phase_sum import SumDispatcher
from torch.distributed import PrefixStore, Store
from torch.distributed.distributed_c10d import ProcessGroupGloo

__all__ = [
    "CHUNK_BYTES",
    "GLOO_HOST_ENV",
    "MAX_CHUNKS",
    "CommTimeouts",
    "GroupTable",
    "PeerFailure",
    "build_gloo_group",
    "chunk_views",
    "gloo_device",
    "keep_until_settled",
    "kept_groups",
    "own_client",
    "release_settled",
    "wait_works",
]

CHUNK_BYTES = 1 << 20
# The gloo tags of one message: chunk i goes under `tag × MAX_CHUNKS + i mod MAX_CHUNKS` (tags are 32-bit, so
# a message cannot have one per chunk). A message of more chunks reuses its tags in turn, which is safe
# because gloo pairs the sends and receives of one tag between two ranks first in, first out: each side
# queues them per tag in the order they were posted, over one TCP stream, so chunk i + MAX_CHUNKS lands
# where it belongs, after chunk i. (Replica syncs still go in messages of at most MAX_CHUNKS chunks,
# 256 MiB, each of which a failover resumes on its own: StageInterpreter._receive_segments; a sync send is posted whole.)
MAX_CHUNKS = 256
# A group's list of posted operations is pruned of finished ones when it reaches this length.
_PRUNE_AT = 256


GLOO_HOST_ENV = "BAMBOO_GLOO_HOST"
"""The address this process's gloo groups listen on and advertise (default: the host name's address).
``GLOO_SOCKET_IFNAME`` (a network interface), as torch.distributed reads it, takes precedence."""


def gloo_device() -> object:
    """The gloo device of this process: ``GLOO_SOCKET_IFNAME``'s interface, else ``BAMBOO_GLOO_HOST``'s
    address, else the host name's (a machine whose host name does not resolve to an address its peers
    reach, such as a network namespace or a multi-homed host, sets one of them)."""
    interface = os.environ.get("GLOO_SOCKET_IFNAME")
    if interface:
        return ProcessGroupGloo.create_device(interface=interface)
    return ProcessGroupGloo.create_device(hostname=os.environ.get(GLOO_HOST_ENV) or socket.gethostname())


def build_gloo_group(store: Store, prefix: str, rank: int, size: int, timeout: float) -> ProcessGroupGloo:
    """Build a gloo group of `size` ranks under `prefix` of `store` (blocks until all joined)."""
    options = ProcessGroupGloo._Options()
    options._timeout = datetime.timedelta(seconds=timeout)
    options._devices = [gloo_device()]
    options._threads = 1
    return ProcessGroupGloo(PrefixStore(prefix, store), rank, size, options)


def own_client(store: Store) -> Store:
    """A client of `store` that a background thread can block in without holding up the others: a
    TCPStore client runs one request at a time, so a build waiting in it for a member's address would
    stall every other user of the client (the failover agreement among them) until the member came or
    the wait timed out. `store.clone()` where the store has one (TCPStore: a new connection); a store
    without one (ours in Python, whose waits poll and hold no lock) is shared as it is."""
    try:
        return store.clone()
    except (RuntimeError, AttributeError, NotImplementedError):
        return store


def _build_into(future: concurrent.futures.Future[ProcessGroupGloo], arguments: tuple[Store, str, int, int, float]) -> None:
    """Build a gloo group in a background thread (:meth:`GroupTable.start_builds`); the outcome goes to `future`."""
    try:
        future.set_result(build_gloo_group(*arguments))
    except BaseException as exc:  # the waiter gets it, without this frame (which would make a cycle with `future`)
        future.set_exception(exc.with_traceback(None))


class _Kept:
    """A group kept alive by :func:`keep_until_settled`, with the operations it may still be running."""

    __slots__ = ("group", "works")

    def __init__(self, group: object, works: list[object]) -> None:
        self.group = group
        self.works = works

    def settled(self) -> bool:
        self.works = [work for work in self.works if not work.is_completed()]  # type: ignore[attr-defined]
        return not self.works


_KEPT: list[_Kept] = []
_KEPT_LOCK = threading.Lock()  # a launcher may release an abandoned start's groups from its thread


def keep_until_settled(group: object, works: Iterable[object] = ()) -> None:
    """Keep `group` (a gloo group given up after a failure) alive until every one of `works`, the collectives
    posted on it, has finished.

    A failure can leave a collective pending on a group its survivors have given up (a peer that abandoned
    the step never sends its part). gloo's destructor waits for every queued collective, so freeing the
    group then would block until the group's timeout. The reference is leaked on purpose, through the
    interpreter's shutdown too; :func:`release_settled` gives it back once the works have all finished
    (by the group's timeout at the latest): freeing the group then returns at once, and closes its
    sockets and threads. (A pending P2P operation does not hold the destructor: its work holds the
    connection until the work's last reference goes.)"""
    ctypes.pythonapi.Py_IncRef(ctypes.py_object(group))
    with _KEPT_LOCK:
        _KEPT.append(_Kept(group, list(works)))


def release_settled() -> int:
    """Free the kept groups whose operations have all finished (see :func:`keep_until_settled`); returns
    how many groups stay kept. Cheap: it is called at every membership change."""
    global _KEPT
    settled: list[_Kept] = []
    unsettled: list[_Kept] = []
    with _KEPT_LOCK:
        for kept in _KEPT:
            (settled if kept.settled() else unsettled).append(kept)
        _KEPT = unsettled
        still = len(_KEPT)
    for kept in settled:  # outside the lock: a group's destructor joins its threads
        group, kept.group = kept.group, None
        ctypes.pythonapi.Py_DecRef(ctypes.py_object(group))
    return still


def kept_groups() -> int:
    """How many groups :func:`keep_until_settled` keeps now."""
    return len(_KEPT)


def chunk_views(flat: torch.Tensor) -> list[torch.Tensor]:
    """Split a 1-D contiguous tensor into views of at most :data:`CHUNK_BYTES` each."""
    per_chunk = max(1, CHUNK_BYTES // flat.element_size())
    return list(flat.split(per_chunk)) if flat.numel() else [flat]


def _chunk_tag(tag: int, index: int) -> int:
    """The gloo tag of chunk `index` of the message tagged `tag`: chunks past :data:`MAX_CHUNKS` reuse the
    message's tags in turn (see :data:`MAX_CHUNKS`)."""
    return tag * MAX_CHUNKS + index % MAX_CHUNKS


class GroupTable:
    """The gloo groups of one process, across membership epochs.

    `set_members(epoch, members)` maps group names to ordered global ranks. A group whose
    membership is unchanged keeps its gloo group (messages in flight on it stay deliverable); a
    group whose membership changed is retired (kept alive until the operations posted on it have finished,
    off the critical path: :func:`keep_until_settled`) and rebuilt
    on first use under the new prefix `bamboo/<job>/e<epoch>/<name>/`, so no prefix is ever reused.
    `build_all()` builds, in sorted name order, every group this rank belongs to: all processes
    follow the same order, so it cannot deadlock.

    `start_builds(epoch)` starts building, each in a thread of its own, every group of this rank whose
    membership changed in `epoch` (after a membership change: every member starts them when it applies the change,
    so no build waits for a member that is blocked somewhere else, whatever order the members use
    the groups in). A use of such a group waits for its build (:meth:`wait_built`, which polls an
    interrupt, so a member that died before it joined is noticed instead of waited for).
    """

    def __init__(self, store: Store, job: str, rank: int, timeouts: CommTimeouts, names: dict[int, str]) -> None:
        self.store = store
        self.job = job
        self.rank = rank
        self.timeouts = timeouts
        self.names = names
        self.members: dict[str, tuple[int, ...]] = {}
        self.versions: dict[str, int] = {}
        self.groups: dict[str, ProcessGroupGloo] = {}
        self.works: dict[str, list[object]] = {}  # per group: the operations posted on it (finished ones pruned)
        self._prune_at: dict[str, int] = {}
        self.building: dict[str, concurrent.futures.Future[ProcessGroupGloo]] = {}
        """The groups being built in the background (:meth:`start_builds`), by name."""
        self.failed_builds: dict[str, tuple[int, PeerFailure]] = {}
        """(the group's version, the failure) of each group whose eager first build failed
        (:meth:`build_eagerly`): raised at the group's next use in that version."""
        self._gathers = SpareBuffers()
        """The gather buffers of the ordered sums (:mod:`bamboo.rc.ordered_sum`, :mod:`bamboo.rc.two_phase_sum`),
        reused from step to step."""
        self._dispatchers: dict[str, SumDispatcher] = {}  # the posting thread of each group post_exact_sum used

    def set_members(self, epoch: int, members: dict[str, Sequence[int]]) -> None:
        for name in list(self.members):
            if name not in members:
                self._retire(name)
                del self.members[name]
        for name, ranks in members.items():
            ranks = tuple(ranks)
            if self.members.get(name) != ranks:
                self._retire(name)
                self.members[name] = ranks
                self.versions[name] = epoch
        release_settled()  # the groups retired earlier whose operations have finished since

    def _retire(self, name: str) -> None:
        self.failed_builds.pop(name, None)
        self.building.pop(name, None)  # a build in flight ends on its own (by the group timeout at the latest)
        group = self.groups.pop(name, None)
        dispatcher = self._dispatchers.pop(name, None)
        if dispatcher is not None:
            dispatcher.close()
        works = self.works.pop(name, [])
        self._prune_at.pop(name, None)
        if group is not None:
            keep_until_settled(group, works)  # a failure may have left an operation pending on it

    def release(self) -> None:
        """Give up every group of this table (an interrupted evaluation's, or a finished layout's): each is
        freed once the operations posted on it have finished (:func:`keep_until_settled`)."""
        for name in list(self.groups):
            self._retire(name)
        self.building.clear()
        release_settled()

    def _posted(self, name: str, works: list[object]) -> list[object]:
        """Note `works`, collectives just posted on group `name` (the table hands them over with the group
        when it is retired); returns them. P2P operations are not noted: gloo runs them outside the work
        queue its destructor waits for, and a pending one ends when the last reference to its work goes."""
        posted = self.works.setdefault(name, [])
        if len(posted) >= self._prune_at.get(name, _PRUNE_AT):
            posted[:] = [work for work in posted if not work.is_completed()]  # type: ignore[attr-defined]
            self._prune_at[name] = max(_PRUNE_AT, 2 * len(posted))  # many in flight: prune less often
        posted.extend(works)
        return works

    def build_all(self) -> None:
        for name in sorted(self.members):
            if self.rank in self.members[name] and len(self.members[name]) > 1:
                self.group(name)

    def _build_arguments(self, name: str, store: Store) -> tuple[Store, str, int, int, float]:
        """The arguments of :func:`build_gloo_group` for group `name` of the current membership, over `store`."""
        ranks = self.members[name]
        prefix = f"bamboo/{self.job}/e{self.versions[name]}/{name}/"
        return store, prefix, ranks.index(self.rank), len(ranks), self.timeouts.group

    def start_builds(self, changed_in: int | None = None) -> list[str]:
        """Start building, in the background, every group of this rank (with another member) that is
        neither built nor being built, or only those whose membership changed in epoch `changed_in`
        (one that never changed and was never used, such as a P2P pair of distant stages, is left to
        its first use); returns their names."""
        started = []
        for name in sorted(self.members):
            ranks = self.members[name]
            if self.rank not in ranks or len(ranks) < 2 or name in self.groups or name in self.building:
                continue
            if changed_in is not None and self.versions[name] != changed_in:
                continue
            self.start_build(name)
            started.append(name)
        return started

    def start_build(self, name: str) -> None:
        """Start building group `name` in a background thread, over a store client of its own, unless it
        is built or being built already (:meth:`wait_built` waits for it)."""
        if name in self.groups or name in self.building:
            return
        future: concurrent.futures.Future[ProcessGroupGloo] = concurrent.futures.Future()
        # The arguments are taken now: a later membership change must not alter what the thread builds.
        arguments = self._build_arguments(name, own_client(self.store))
        threading.Thread(target=_build_into, args=(future, arguments), name=f"bamboo-build-{name}", daemon=True).start()
        self.building[name] = future

    def build_after_barrier(self, name: str, instruction: str, barrier: Callable[[], None],
                            interrupt: Callable[[], None] | None = None) -> None:
        """Before group `name`'s first use in an epoch: unless it is built or being built already, call
        `barrier` (it returns once every member is about to build the group) and start the build in the
        background; then wait for the build, calling `interrupt` meanwhile (:meth:`wait_built`), so that a
        member that dies after the barrier and before it joins is noticed instead of waited for."""
        self.raise_failed_build(name)
        if name not in self.groups and name not in self.building:
            barrier()
            self.start_build(name)
        self.wait_built(name, instruction, interrupt)

    def ready(self, name: str) -> bool:
        """Whether group `name` can be used without waiting: built, or its build in the background ended well."""
        future = self.building.get(name)
        return name in self.groups or (future is not None and future.done() and future.exception() is None)

    def wait_built(self, name: str, instruction: str, interrupt: Callable[[], None] | None = None) -> None:
        """If group `name` is being built in the background, wait until it is, calling `interrupt` every
        `timeouts.poll` seconds (it may raise); a failed build raises a PeerFailure naming the other members."""
        future = self.building.get(name)
        if future is None:
            return
        while not future.done():
            concurrent.futures.wait([future], timeout=self.timeouts.poll)
            if interrupt is not None and not future.done():
                interrupt()
        del self.building[name]
        failure = future.exception()
        if failure is not None:
            raise self.collective_failure(name, instruction, failure) from failure
        self.groups[name] = future.result()

    def group(self, name: str) -> ProcessGroupGloo:
        """The gloo group `name` of the current membership, built on first use (or awaited, when its
        build was started in the background)."""
        group = self.groups.get(name)
        if group is None:
            self.raise_failed_build(name)
            if name in self.building:
                self.wait_built(name, f"the build of {name}")
                return self.groups[name]
            group = build_gloo_group(*self._build_arguments(name, self.store))
            self.groups[name] = group
        return group

    def build_eagerly(self, name: str) -> None:
        """Build group `name` now, before the first step. A member may build its side and die at once
        (a kill at its first instruction) while the others still connect: their build fails, and that
        failure is kept and raised, as a PeerFailure naming the other members, at the group's first use
        (inside a step, where a failure can be failed over) instead of here."""
        try:
            self.group(name)
        except RuntimeError as exc:
            self.failed_builds[name] = (self.versions[name], self.collective_failure(
                name, f"the first build of {name}", exc))

    def raise_failed_build(self, name: str) -> None:
        """Raise the failure of group `name`'s eager build, once, if it is of the group's current version."""
        failed = self.failed_builds.pop(name, None)
        if failed is not None and failed[0] == self.versions.get(name) and name not in self.groups:
            raise failed[1]

    def name_of(self, rank: int) -> str:
        return self.names.get(rank, f"rank {rank}")

    def group_rank(self, group: str, rank: int) -> int:
        return self.members[group].index(rank)

    def post_send(self, group: str, tensor: torch.Tensor, peer: int, tag: int, instruction: str) -> list[object]:
        """Post the chunked send of `tensor` to global rank `peer`; returns the works."""
        pg = self.group(group)
        flat = tensor.detach().contiguous().view(-1)
        dst = self.group_rank(group, peer)
        try:
            return [pg.send([chunk], dst, _chunk_tag(tag, index)) for index, chunk in enumerate(chunk_views(flat))]
        except RuntimeError as exc:
            raise PeerFailure(peer, self.name_of(peer), instruction, exc) from exc

    def post_recv(self, group: str, out: torch.Tensor, peer: int, tag: int, instruction: str) -> list[object]:
        """Post the chunked receive of `out` (contiguous) from global rank `peer`; returns the works."""
        pg = self.group(group)
        src = self.group_rank(group, peer)
        try:
            return [pg.recv([chunk], src, _chunk_tag(tag, index)) for index, chunk in enumerate(chunk_views(out.view(-1)))]
        except RuntimeError as exc:
            raise PeerFailure(peer, self.name_of(peer), instruction, exc) from exc

    def collective_failure(self, group: str, instruction: str, cause: BaseException) -> PeerFailure:
        """The failure of a collective on `group`: every other member is a suspect."""
        others = [rank for rank in self.members[group] if rank != self.rank]
        return PeerFailure(others, f"a member of {group}", instruction, cause)

    def post_allreduce(self, group: str, tensors: Sequence[torch.Tensor], instruction: str) -> list[object]:
        """Start summing `tensors` in place over `group`; returns the works (none for one member). Three members
        or more add in member order, the reference's (:mod:`bamboo.rc.ordered_sum`); two need no care."""
        size = len(self.members[group])
        if size < 2:
            return []
        pg = self.group(group)
        try:
            if size == 2:  # a + b == b + a: gloo's sum is the reference's
                return self._posted(group, [pg.allreduce([tensor]) for tensor in tensors])
            return self._posted(group, [post_ordered_sum(pg, tensor, size, self._gathers) for tensor in tensors])
        except RuntimeError as exc:
            raise self.collective_failure(group, instruction, exc) from exc

    def post_exact_sum(self, group: str, tensors: Sequence[torch.Tensor], instruction: str) -> list[object]:
        """:meth:`post_allreduce` at about a ring's cost: three members or more queue the sums on the group's
        :class:`~bamboo.rc.two_phase_sum.SumDispatcher`, which posts everything on the group from then on."""
        size = len(self.members[group])
        if size < 3:
            return self.post_allreduce(group, tensors, instruction)
        pg = self.group(group)
        dispatcher = self._dispatchers.get(group)
        if dispatcher is None or dispatcher.pg is not pg:
            rank = self.members[group].index(self.rank)
            dispatcher = self._dispatchers[group] = SumDispatcher(pg, size, rank, group, self._gathers)
        return self._posted(group, [dispatcher.post(tensor) for tensor in tensors])

    def post_all_to_all(self, group: str, out: torch.Tensor, data: torch.Tensor, out_sizes: Sequence[int],
                        in_sizes: Sequence[int], instruction: str) -> list[object]:
        """Start sending consecutive pieces of `data` (`in_sizes[i]` elements to the group's i-th member)
        and receiving into `out` (`out_sizes[i]` from the i-th); returns the works (none for one member)."""
        if len(self.members[group]) < 2:
            out.copy_(data)
            return []
        pg = self.group(group)
        try:
            return self._posted(group, [pg.alltoall_base(out, data, list(out_sizes), list(in_sizes))])
        except RuntimeError as exc:
            raise self.collective_failure(group, instruction, exc) from exc

    def post_broadcast(self, group: str, tensors: Sequence[torch.Tensor], root: int, instruction: str) -> list[object]:
        """Start broadcasting `tensors` in place from global rank `root` over `group`; returns the works."""
        pg = self.group(group)
        index = self.group_rank(group, root)
        try:
            return self._posted(group, [pg.broadcast(tensor, index) for tensor in tensors])
        except RuntimeError as exc:
            raise self.collective_failure(group, instruction, exc) from exc

    def wait_collective(
        self, group: str, works: Sequence[object], instruction: str, interrupt: Callable[[], None] | None = None
    ) -> None:
        """Wait for collective works, calling `interrupt` every `timeouts.poll` seconds (it may raise).

        The wait sleeps until the work completes (its future's callback wakes it) or the next `interrupt` is due,
        rather than spinning on ``is_completed()``: a worker waiting on a slower data-parallel peer used 10%+ of a
        core spinning. Where a work has no future, it checks every ``COLLECTIVE_SPIN_S``."""
        try:
            for work in works:
                if interrupt is not None:
                    done = _completion_event(work)
                    next_check = time.monotonic() + self.timeouts.poll
                    while not work.is_completed():  # type: ignore[attr-defined]
                        if done is None:
                            time.sleep(COLLECTIVE_SPIN_S)
                        elif done.wait(max(0.0, next_check - time.monotonic())):
                            # The future is done; the work is marked completed a moment later by the backend's
                            # thread. Block in wait() for that: looping here would spin on the core that thread
                            # needs (one core per worker: 10 ms of a 30 ms step).
                            break
                        if time.monotonic() >= next_check:
                            interrupt()
                            next_check = time.monotonic() + self.timeouts.poll
                work.wait()  # type: ignore[attr-defined]
        except RuntimeError as exc:
            raise self.collective_failure(group, instruction, exc) from exc

    def allreduce(
        self, group: str, tensors: Iterable[torch.Tensor], instruction: str,
        interrupt: Callable[[], None] | None = None,
    ) -> None:
        """Sum `tensors` in place over `group` (a one-member group is a no-op), one after the other.

        While it waits, `interrupt` is called every `timeouts.poll` seconds and may raise to give
        up (collectives, unlike P2P transfers, can be polled safely).
        """
        for tensor in tensors:
            self.wait_collective(group, self.post_allreduce(group, [tensor], instruction), instruction, interrupt)


def _completion_event(work: object) -> threading.Event | None:
    """An event set when `work` completes, successfully or not (from its future's done callback, which runs on
    the backend's thread); None when the work has no future."""
    done = threading.Event()
    try:
        work.get_future().add_done_callback(lambda _future: done.set())  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        return None
    return done


def wait_works(works: Sequence[object]) -> None:
    """Wait for every work of a transfer (raises RuntimeError when the peer failed)."""
    for work in works:
        work.wait()  # type: ignore[attr-defined]
