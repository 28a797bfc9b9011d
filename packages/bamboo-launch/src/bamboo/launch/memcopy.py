"""In-memory copies of the job's state: a copy of every stage, at recent steps, in the memory of live nodes.

Disk is the last resort of a restore. Before it, the planner of a restore looks for the newest step at which
every stage has a copy in the memory of a live node (:func:`memory_restore`):

- every node that holds a stage keeps its own copy of it (a snapshot, taken at the step boundary every
  ``memory_copy_every`` steps: the tensors cloned, serialised later off the training thread);
- the host of each stage in pipeline 0 (the node that writes the stage's disk checkpoints) also sends its
  copy to :data:`KEEPERS` *keepers* (:func:`plan_keepers`): live nodes that do not hold the stage, in zones
  where it has no copy yet where there are such, standby nodes first, the stages spread evenly over them
  (Gemini's idea: a checkpoint in a peer's RAM, refreshed asynchronously, here by a background thread).

Every worker serves the copies it keeps (:class:`CopyServer`: a TCP server on the worker's host, behind
the job's agent token when there is one) and publishes what it keeps under ``/bamboo/<job>/copies/<node>``
(a :class:`CopyIndex`, attached to its agent's lease: it goes when the node is declared dead). A node keeps
the copies of its :data:`KEEP_STEPS` newest steps of each stage. Each copy carries its *lineage*
(:func:`lineage`: the pipelines of every generation that trained the steps before it): after a restore the
steps after it are trained again, maybe grouped otherwise, so a copy of such a step from the abandoned
timeline is no copy of the step the job has now, and a restore only takes copies of the job's own lineage
(a newer copy of the same stage and step replaces an older one). A restore from memory names, for each stage,
the nodes that keep it at the chosen step (:class:`bamboo.reconfig.RestorePoint`'s ``memory``); every node
of the new layout loads each of its stages from its own memory when it keeps it, or fetches it from the
first of them that answers (:func:`fetch_copy`), checking its SHA-256 (a keeper stores a copy as sent; the
bytes are checked where they are used, :func:`verified`).

A stage survives in memory as long as one of its holders or keepers lives; the job restores from memory as
long as every stage does at one common step (see ``docs/failure-model.md``). The keepers of different stages
fall behind by different amounts (each host's background thread sends only the newest copy it has when it
gets to it), so their newest steps need not meet, and each node's own copies move on: a restore that lost a
host could find no step at which every stage is kept. So each host also *pins* the newest step at which every
stage has a copy on a keeper (:func:`kept_elsewhere_step`, from the indexes it reads to send), keeps its own
copy of that step, and tells its keepers with each copy it sends, which keep it too (:meth:`CopyStore.pin`):
that step stays common until a newer one is. And a host that fell behind sends the newest step the other
stages' keepers share, while it still keeps it, rather than its newest (:func:`catch_up_step`): that makes a
newer step common at once. This module never imports torch
at import time: the agents' coordinator plans restores with it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import socket
import socketserver
import struct
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING

import attrs
from bamboo.launch import timeouts

if TYPE_CHECKING:
    from bamboo.launch.json_types import JSON, JSONObject
    from bamboo.membership import KeyValueStore

__all__ = [
    "KEEPERS",
    "KEEP_STEPS",
    "Copy",
    "CopyIndex",
    "CopyServer",
    "CopyStore",
    "Holding",
    "catch_up_step",
    "copies_prefix",
    "fetch_copy",
    "kept_elsewhere_step",
    "lineage",
    "memory_restore",
    "plan_keepers",
    "read_indexes",
    "send_copy",
    "verified",
]

KEEPERS = 2
"""How many keepers the host of a stage in pipeline 0 sends each copy to (besides its own)."""
KEEP_STEPS = 3
"""How many of its newest steps of each stage a node keeps in memory."""
_HEADER = struct.Struct("!I")
_MAX_HEADER = 1 << 16


def lineage(history: Iterable[Sequence[int]], step: int) -> str:
    """What the state at ``step`` descends from: a digest of the ``(first step, pipelines)`` of every generation
    of ``history`` (a ``JobLayout``'s) that trained steps before it. Two copies of one stage at one step with the
    same lineage hold the same bits (training is exact)."""
    before = [[int(first), int(pipelines)] for first, pipelines in history if int(first) < step]
    return hashlib.sha256(json.dumps(before).encode()).hexdigest()[:16]


def copies_prefix(job: str) -> str:
    """The etcd prefix of the nodes' :class:`CopyIndex` records."""
    return f"/bamboo/{job}/copies/"


@attrs.frozen
class CopyIndex:
    """What one node keeps in memory: ``copies`` (stage -> step -> lineage, each at the layer range
    ``layers[stage]``), where it serves them (``address``, ``host:port``) and its zone."""

    node: str
    zone: str
    address: str
    copies: dict[int, dict[int, str]] = attrs.field(factory=dict)
    layers: dict[int, tuple[int, int]] = attrs.field(factory=dict)

    def to_json(self) -> bytes:
        copies = {str(s): {str(k): line for k, line in sorted(steps.items())} for s, steps in sorted(self.copies.items())}
        return json.dumps({"v": 1, "node": self.node, "zone": self.zone, "address": self.address, "copies": copies,
                           "layers": {str(s): list(r) for s, r in sorted(self.layers.items())}}).encode()

    @classmethod
    def from_json(cls, value: bytes) -> CopyIndex:
        data = json.loads(value)
        if data.get("v") != 1:
            raise ValueError(f"copy index: unknown version {data.get('v')!r}")
        return cls(node=str(data["node"]), zone=str(data["zone"]), address=str(data["address"]),
                   copies={int(s): {int(k): str(line) for k, line in steps.items()} for s, steps in data["copies"].items()},
                   layers={int(s): (int(r[0]), int(r[1])) for s, r in data["layers"].items()})


@attrs.frozen
class Copy:
    """One stage's state at one step (of :func:`lineage` ``lineage``), as bytes, with their SHA-256 and the
    stage's layer range."""

    stage: int
    step: int
    layers: tuple[int, int]
    data: bytes | bytearray = attrs.field(repr=False)
    """The stage's bytes (as received: a bytearray, which reads wherever bytes do)."""
    sha256: str
    lineage: str


class CopyStore:
    """The copies a node keeps: the :data:`KEEP_STEPS` newest steps of each stage, and each stage's pinned step
    (thread-safe).

    A stage's pin is the step its host wants kept: the newest one every stage's keepers hold
    (:func:`kept_elsewhere_step`); the host sets it in its own store and in its keepers' with each copy it sends,
    and a later host of the stage replaces it."""

    def __init__(self, keep: int = KEEP_STEPS, on_change: Callable[[], None] = lambda: None) -> None:
        self.keep = keep
        self.on_change = on_change
        self._copies: dict[tuple[int, int], Copy] = {}
        self._pins: dict[int, int] = {}
        self._lock = threading.Lock()

    def put(self, copy: Copy) -> None:
        with self._lock:
            self._copies[(copy.stage, copy.step)] = copy
            self._evict(copy.stage)
        self.on_change()

    def pin(self, stage: int, step: int | None) -> None:
        """Keep ``stage``'s copy of ``step`` (None: no step) besides its newest ones, in place of its last pin."""
        with self._lock:
            if self._pins.get(stage) == step:
                return
            if step is None:
                del self._pins[stage]
            else:
                self._pins[stage] = step
            before = len(self._copies)
            self._evict(stage)
            changed = len(self._copies) != before
        if changed:
            self.on_change()

    def steps(self, stage: int) -> list[int]:
        """The steps of ``stage`` kept here, oldest first."""
        with self._lock:
            return sorted(step for s, step in self._copies if s == stage)

    def pinned(self) -> dict[int, int]:
        """Stage -> its pinned step."""
        with self._lock:
            return dict(self._pins)

    def _evict(self, stage: int) -> None:
        """Drop ``stage``'s copies beyond its newest :attr:`keep` steps, but its pinned one (the lock held)."""
        steps = sorted((step for s, step in self._copies if s == stage), reverse=True)
        for old in steps[self.keep:]:
            if old != self._pins.get(stage):
                del self._copies[(stage, old)]

    def get(self, stage: int, step: int) -> Copy | None:
        with self._lock:
            return self._copies.get((stage, step))

    def discard(self, copy: Copy) -> None:
        """Forget ``copy`` (found damaged): the node's index stops offering it."""
        with self._lock:
            if self._copies.get((copy.stage, copy.step)) is not copy:
                return
            del self._copies[(copy.stage, copy.step)]
        self.on_change()

    def index(self) -> tuple[dict[int, dict[int, str]], dict[int, tuple[int, int]]]:
        """``(stage -> step -> lineage of the copies kept, stage -> layer range)``."""
        with self._lock:
            copies: dict[int, dict[int, str]] = {}
            layers: dict[int, tuple[int, int]] = {}
            for (stage, step), copy in sorted(self._copies.items()):
                copies.setdefault(stage, {})[step] = copy.lineage
                layers[stage] = copy.layers
        return copies, layers


def _send_message(sock: socket.socket, header: Mapping[str, JSON], data: bytes = b"") -> None:
    encoded = json.dumps(dict(header)).encode()
    sock.sendall(_HEADER.pack(len(encoded)) + encoded)
    if data:
        sock.sendall(data)


def _receive_exactly(sock: socket.socket, size: int) -> bytearray:
    """``size`` bytes from ``sock``, read straight into one buffer (a copy's megabytes are not joined from chunks)."""
    buffer, got = bytearray(size), 0
    view = memoryview(buffer)
    while got < size:
        read = sock.recv_into(view[got:], min(size - got, 1 << 20))
        if not read:
            raise ConnectionError(f"the connection closed after {got} of {size} bytes")
        got += read
    return buffer


def _receive_message(sock: socket.socket) -> tuple[JSONObject, bytearray]:
    (size,) = _HEADER.unpack(_receive_exactly(sock, _HEADER.size))
    if size > _MAX_HEADER:
        raise ConnectionError(f"a header of {size} bytes is too long")
    header = json.loads(_receive_exactly(sock, size))
    return header, _receive_exactly(sock, int(header.get("bytes", 0)))


class CopyServer:
    """Serves a :class:`CopyStore` over TCP on ``host`` (port chosen by the system): ``put`` stores a copy a
    peer sends, ``get`` answers one. Every request carries the job's ``token`` (empty: none is checked)."""

    def __init__(self, store: CopyStore, host: str, token: str = "") -> None:
        self.store = store
        self.token = token
        server = self

        class Handler(socketserver.BaseRequestHandler):
            def handle(self) -> None:
                server._handle(self.request)

        self._server = socketserver.ThreadingTCPServer((host, 0), Handler, bind_and_activate=True)
        self._server.daemon_threads = True
        self.address = f"{host}:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, name="bamboo-copy-server", daemon=True)
        self._thread.start()

    def _handle(self, sock: socket.socket) -> None:
        sock.settimeout(timeouts.COPY_TRANSFER_S)
        try:
            header, data = _receive_message(sock)
            if not hmac.compare_digest(str(header.get("token", "")), self.token):
                _send_message(sock, {"error": "bad token"})
                return
            if header.get("op") == "put":  # kept as sent: whoever uses the copy checks its SHA-256 (verified)
                pin = header.get("pin")
                self.store.pin(int(header["stage"]), None if pin is None else int(pin))
                self.store.put(Copy(int(header["stage"]), int(header["step"]), tuple(header["layers"]), data,
                                    str(header["sha256"]), str(header["lineage"])))
                _send_message(sock, {"ok": True})
                return
            copy = self.store.get(int(header["stage"]), int(header["step"]))
            if copy is None:
                _send_message(sock, {"error": f"no copy of stage {header['stage']} at step {header['step']}"})
                return
            try:
                verified(copy, "this keeper")  # checked when used: a damaged copy leaves the index
            except RuntimeError as error:
                self.store.discard(copy)
                _send_message(sock, {"error": str(error)})
                return
            _send_message(sock, {"ok": True, "bytes": len(copy.data), "sha256": copy.sha256,
                                 "layers": list(copy.layers), "lineage": copy.lineage}, copy.data)
        except (OSError, ValueError, KeyError, ConnectionError):
            return  # a peer that died mid-request: nothing to answer

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _connect(address: str) -> socket.socket:
    host, port = address.rsplit(":", 1)
    sock = socket.create_connection((host, int(port)), timeout=timeouts.COPY_TRANSFER_S)
    sock.settimeout(timeouts.COPY_TRANSFER_S)
    return sock


def send_copy(address: str, copy: Copy, token: str = "", pin: int | None = None) -> None:
    """Send ``copy`` to the keeper at ``address``, with the step of its stage the keeper is to keep besides the
    newest (``pin``, :meth:`CopyStore.pin`); raises OSError or RuntimeError when it is not kept."""
    with _connect(address) as sock:
        _send_message(sock, {"op": "put", "token": token, "stage": copy.stage, "step": copy.step,
                             "layers": list(copy.layers), "bytes": len(copy.data), "sha256": copy.sha256,
                             "lineage": copy.lineage, "pin": pin}, copy.data)
        answer, _ = _receive_message(sock)
    if not answer.get("ok"):
        raise RuntimeError(f"{address} did not keep stage {copy.stage} at step {copy.step}: {answer.get('error')}")


def fetch_copy(address: str, stage: int, step: int, token: str = "") -> Copy:
    """The copy of ``stage`` at ``step`` kept at ``address`` (RuntimeError or OSError when it cannot be had)."""
    with _connect(address) as sock:
        _send_message(sock, {"op": "get", "token": token, "stage": stage, "step": step})
        answer, data = _receive_message(sock)
    if not answer.get("ok"):
        raise RuntimeError(f"{address}: {answer.get('error')}")
    return verified(Copy(stage, step, tuple(answer["layers"]), data, str(answer["sha256"]), str(answer["lineage"])),
                    address)


def verified(copy: Copy, where: str) -> Copy:
    """``copy`` once its bytes match its SHA-256; RuntimeError naming ``where`` it was kept otherwise.

    A keeper stores what it is sent without hashing it (a copy's hash costs as much CPU as receiving it, and
    most copies are never used): the bytes are checked where they are used, by the keeper before it serves
    them, by :func:`fetch_copy` and by a node that restores from its own memory. A copy damaged on its way or
    in a keeper's memory is refused then and leaves that node's index (the next restore plan does not count
    on it), and the restore tries the next node that keeps it."""
    if hashlib.sha256(copy.data).hexdigest() != copy.sha256:
        raise RuntimeError(f"{where}: the copy of stage {copy.stage} at step {copy.step} does not match its SHA-256")
    return copy


def read_indexes(kv: KeyValueStore, job: str) -> dict[str, CopyIndex]:
    """Every live node's :class:`CopyIndex` (a malformed one is skipped)."""
    found = {}
    for item in kv.get_prefix(copies_prefix(job)):
        try:
            index = CopyIndex.from_json(item.value)
        except (ValueError, KeyError, TypeError):
            continue
        found[index.node] = index
    return found


@attrs.frozen
class Holding:
    """Who holds each stage of a layout, alive: ``owners[s]`` train stage ``s`` and keep its copies in their own
    memory, and the owners of stage ``s - 1`` (its shadows) hold its replica; ``placed`` are every node of the
    layout (the others wait on standby)."""

    owners: tuple[tuple[str, ...], ...]
    placed: tuple[str, ...]


def plan_keepers(indexes: Mapping[str, CopyIndex], holding: Holding, count: int = KEEPERS) -> list[list[str]]:
    """The keepers of every stage's copies (list index: the stage), the same on every sender.

    A stage's keepers are live nodes (``indexes``) that hold no part of it: first in zones where no copy of it
    is yet (its owners' zones), one per zone; then nodes on standby before placed ones; among those, the nodes
    that keep the fewest other stages' copies, then by name. Stages are planned in order, each counting the
    keepers planned before it, so a node receives a second stage's copies only when it is the only one in a zone
    without a copy, or every other candidate keeps as many (measured, 8 nodes: the busiest standby worker kept
    both stages while another kept none)."""
    kept: dict[str, int] = dict.fromkeys(indexes, 0)
    plan: list[list[str]] = []
    placed = set(holding.placed)
    for stage, owners in enumerate(holding.owners):
        held = set(owners) | set(holding.owners[stage - 1])  # its owners and its shadows
        covered = {indexes[node].zone for node in owners if node in indexes}
        candidates = sorted((node for node in indexes if node not in held),
                            key=lambda node: (indexes[node].zone in covered, node in placed, kept[node], node))
        chosen: list[str] = []
        zones = set(covered)
        for pass_ in (0, 1):
            for node in candidates:
                if len(chosen) < count and node not in chosen and (pass_ == 1 or indexes[node].zone not in zones):
                    chosen.append(node)
                    zones.add(indexes[node].zone)
        for node in chosen:
            kept[node] += 1
        plan.append(chosen)
    return plan


def kept_elsewhere_step(indexes: Mapping[str, CopyIndex], holding: Holding) -> int | None:
    """The newest step at which every stage of ``holding`` has a copy in the memory of a node that does not train
    it (a keeper: it outlives the stage's owners), by ``indexes``; None when there is none. Copies of any lineage
    count: a pin only keeps a copy, the restore checks the lineage."""
    kept: list[set[int]] = []
    for stage, owners in enumerate(holding.owners):
        kept.append({step for node, index in indexes.items() if node not in owners
                     for step in index.copies.get(stage, {})})
    common = set.intersection(*kept) if kept else set()
    return max(common, default=None)


def catch_up_step(indexes: Mapping[str, CopyIndex], holding: Holding, stage: int, kept: Iterable[int]) -> int | None:
    """The step whose copy of ``stage`` its host should send next, when it is not the newest: the newest step that
    every other stage's keepers hold and ``stage``'s keepers do not, newer than any they hold, among the steps the
    host still ``kept``; None when there is none (send the newest). A host that fell behind thus sends the step the
    others' keepers already share, which makes it restorable at once, rather than one nobody else has
    (``test_memcopy.py``'s replay: step 7 of 12 restorable after losing every host, against step 1 with pins
    alone)."""
    elsewhere = [{step for node, index in indexes.items() if node not in owners for step in index.copies.get(s, {})}
                 for s, owners in enumerate(holding.owners)]
    mine = elsewhere.pop(stage)
    if not elsewhere:
        return None
    candidates = set.intersection(*elsewhere) & set(kept)
    return max((step for step in candidates if step > max(mine, default=-1)), default=None)


def memory_restore(indexes: Mapping[str, CopyIndex], bounds: Sequence[Sequence[int]], alive: Iterable[str],
                   history: Sequence[Sequence[int]]) -> tuple[int, dict[int, tuple[str, ...]]] | None:
    """The newest step at which every stage (of layer ranges ``bounds``) has a copy of the job's lineage
    (``history``: the ``JobLayout`` history of the generation that restores) in the memory of an ``alive``
    node, and for each stage the nodes that keep it then; None when there is none."""
    live = set(alive)
    keepers: dict[tuple[int, int], list[str]] = {}
    for node, index in sorted(indexes.items()):
        if node not in live:
            continue
        for stage, steps in index.copies.items():
            if stage < len(bounds) and tuple(index.layers.get(stage, ())) == tuple(bounds[stage]):
                for step, line in steps.items():
                    if line == lineage(history, step):
                        keepers.setdefault((stage, step), []).append(node)
    steps = sorted({step for _stage, step in keepers}, reverse=True)
    for step in steps:
        if all((stage, step) in keepers for stage in range(len(bounds))):
            return step, {stage: tuple(keepers[(stage, step)]) for stage in range(len(bounds))}
    return None
