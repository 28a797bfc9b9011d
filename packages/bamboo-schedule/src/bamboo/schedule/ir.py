"""The schedule IR: instruction kinds, the immutable `Instruction`, and per-node `Schedule` streams.

A *node* is the process that owns stage ``n`` of a pipeline of depth ``P`` (node ``n`` runs stage ``n``
in the fault-free layout). Node ``n`` also holds the replica of stage ``(n + 1) % P``; it is that
stage's *shadow*. After a failover the shadow runs both its own stage and the victim's, so streams
are keyed by the executing node, and every instruction names the stage whose layers it uses.

Every instruction has a compact string form that round-trips through `Instruction.parse`::

    2F5      node runs stage 2's forward on microbatch 5
    3FR5     forward redundant computation (FRC) of stage 3, microbatch 5
    2SA5>3   send stage 2's output activation of microbatch 5 to node 3
    3RA5<2   receive stage 3's input activation of microbatch 5 from node 2
    0AR      data-parallel all-reduce of stage 0's gradients
    1SY>0    replica sync: send stage 1's reduced gradients to node 0 (its shadow)

The layout is ``<stage><code>[<microbatch>][>peer | <peer]``: ``>`` marks a send, ``<`` a receive.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Mapping

import attrs

__all__ = ["BUFFERED_SENDS", "COMM_KINDS", "COMPUTE_KINDS", "Instruction", "Kind", "RCMode", "Schedule"]


class Kind(enum.Enum):
    """What an instruction does. The value is its code in the compact string form."""

    LOAD = "L"
    """Load the input samples of microbatch ``k`` for stage 0 (run by node 0, or by stage 0's shadow)."""
    FORWARD = "F"
    """Normal forward pass of ``stage`` on microbatch ``k``; the last stage also computes the loss."""
    BACKWARD = "B"
    """Normal backward pass of ``stage`` on microbatch ``k``; accumulates ``stage``'s weight gradients."""
    FRC = "FR"
    """Forward redundant computation: the shadow runs ``stage``'s forward with its replica layers."""
    BRC = "BR"
    """Backward redundant computation: the shadow runs ``stage``'s backward from the FRC state."""
    SEND_ACT = "SA"
    """Send ``stage``'s output activation of microbatch ``k`` to node ``peer`` (which runs stage+1)."""
    RECV_ACT = "RA"
    """Receive ``stage``'s input activation of microbatch ``k`` from node ``peer`` (stage-1's output)."""
    SEND_GRAD = "SG"
    """Send the gradient w.r.t. ``stage``'s input of microbatch ``k`` to node ``peer``."""
    RECV_GRAD = "RG"
    """Receive the gradient w.r.t. ``stage``'s output of microbatch ``k`` from node ``peer``."""
    SWAP_OUT = "SO"
    """Move the FRC stash of (``stage``, ``k``) from device memory to the swap store."""
    SWAP_IN = "SI"
    """Bring the FRC stash of (``stage``, ``k``) back from the swap store into device memory."""
    ALLREDUCE = "AR"
    """Data-parallel all-reduce of ``stage``'s accumulated gradients (collective, no peer)."""
    OPTIMIZER = "OPT"
    """Optimizer step on ``stage``'s layers with the reduced gradients."""
    SYNC_SEND = "SY"
    """Replica sync: send ``stage``'s reduced gradients (and step state) to its shadow node ``peer``."""
    SYNC_RECV = "RY"
    """Replica sync: receive ``stage``'s reduced gradients from node ``peer`` and apply the identical
    optimizer step to the local replica of ``stage``."""

    # Members are singletons and compare by identity, so identity hashing is consistent and much
    # cheaper than Enum's name hashing; the schedules hash tens of thousands of kinds.
    __hash__ = object.__hash__


SENDS = frozenset({Kind.SEND_ACT, Kind.SEND_GRAD, Kind.SYNC_SEND})
RECVS = frozenset({Kind.RECV_ACT, Kind.RECV_GRAD, Kind.SYNC_RECV})
COMM_KINDS = SENDS | RECVS
BUFFERED_SENDS = frozenset({Kind.SYNC_SEND})
"""Sends that are posted and not waited for: the replica sync. Its node goes on at once; the receive waits for the
data. The runtime completes such a send before the step commits."""
"""Point-to-point kinds: they carry a ``peer`` node and pair up with one instruction on that node."""
COMPUTE_KINDS = frozenset({Kind.FORWARD, Kind.BACKWARD, Kind.FRC, Kind.BRC})
PER_ITERATION = frozenset({Kind.ALLREDUCE, Kind.OPTIMIZER, Kind.SYNC_SEND, Kind.SYNC_RECV})
"""Kinds that run once per stage and iteration, without a microbatch."""


class RCMode(enum.Enum):
    """Redundant-computation mode (the paper's names)."""

    NONE = "none"
    """No redundancy: a plain pipeline."""
    LFLB = "lflb"
    """Lazy FRC, lazy BRC: the shadow only stashes the replica's input; FRC and BRC run on failure."""
    EFLB = "eflb"
    """Eager FRC, lazy BRC (Bamboo's default): FRC in the bubbles every iteration, BRC on failure."""
    EFEB = "efeb"
    """Eager FRC, eager BRC: the shadow runs both redundant passes every iteration."""

    @property
    def receives_ahead(self) -> bool:
        """Whether a node may post its next activation or gradient receive before its turn, so that a send into it
        completes while the receiver still works (a failover's cut then holds messages in flight:
        `bamboo.schedule.engine.received_ahead`). Not in efeb: a failover drops the shadow's copies of the
        successor's gradients for the rest of the iteration, and one posted ahead would stay posted."""
        return self is not RCMode.EFEB


_CODES = {kind.value: kind for kind in Kind}
_FORM = re.compile(r"^(\d+)([A-Z]+)(\d+)?(?:([<>])(\d+))?$")


_INDEX = attrs.validators.and_(attrs.validators.instance_of(int), attrs.validators.not_(attrs.validators.instance_of(bool)),
                               attrs.validators.ge(0))
"""A stage, micro-batch or node index: an int (not a bool) >= 0."""


@attrs.frozen(order=False)
class Instruction:
    """One step of one node's stream.

    ``stage`` is the stage whose layers (or tensors) the instruction uses. The executing node is the
    key of the stream that holds the instruction. Redundant work (FRC, BRC, swaps, sync receive) is
    done on behalf of the node that owns ``stage`` in the fault-free layout, i.e. node ``stage``.
    ``microbatch`` is None exactly for the per-iteration kinds (all-reduce, optimizer, sync).
    ``peer`` is the other node of a send or receive, and None for every other kind.
    """

    kind: Kind = attrs.field(validator=attrs.validators.instance_of(Kind))
    stage: int = attrs.field(validator=_INDEX)
    microbatch: int | None = attrs.field(default=None, validator=attrs.validators.optional(_INDEX))
    peer: int | None = attrs.field(default=None, validator=attrs.validators.optional(_INDEX))

    def __attrs_post_init__(self) -> None:
        if (self.microbatch is None) != (self.kind in PER_ITERATION):
            need = "no microbatch" if self.kind in PER_ITERATION else "a microbatch"
            raise ValueError(f"{self.kind.name} takes {need}, got microbatch={self.microbatch!r}")
        if (self.peer is None) == (self.kind in COMM_KINDS):
            need = "a peer node" if self.kind in COMM_KINDS else "no peer"
            raise ValueError(f"{self.kind.name} takes {need}, got peer={self.peer!r}")

    @property
    def on_behalf_of(self) -> int:
        """The node whose work this is in the fault-free layout: the owner of ``stage``."""
        return self.stage

    @property
    def is_send(self) -> bool:
        return self.kind in SENDS

    @property
    def is_recv(self) -> bool:
        return self.kind in RECVS

    @property
    def is_comm(self) -> bool:
        return self.kind in COMM_KINDS

    def __str__(self) -> str:
        text = f"{self.stage}{self.kind.value}"
        if self.microbatch is not None:
            text += str(self.microbatch)
        if self.peer is not None:
            text += (">" if self.is_send else "<") + str(self.peer)
        return text

    def __repr__(self) -> str:
        return f"Instruction({self})"

    @classmethod
    def parse(cls, text: str) -> Instruction:
        """Inverse of ``str()``: ``Instruction.parse("2SA5>3")``. Raises ValueError naming the text."""
        match = _FORM.match(text.strip())
        if match is None or match.group(2) not in _CODES:
            raise ValueError(f"not an instruction: {text!r}")
        stage, code, microbatch, arrow, peer = match.groups()
        kind = _CODES[code]
        if arrow is not None and (arrow == ">") != (kind in SENDS):
            raise ValueError(f"not an instruction: {text!r} ('>' marks sends, '<' receives)")
        try:
            return cls(
                kind,
                int(stage),
                None if microbatch is None else int(microbatch),
                None if peer is None else int(peer),
            )
        except ValueError as error:
            raise ValueError(f"not an instruction: {text!r}: {error}") from None

    def sent_to(self, dst: int) -> Instruction:
        """This instruction with another peer (used when a failover re-routes a message)."""
        return make(self.kind, self.stage, self.microbatch, dst)


_INTERNED: dict[tuple[Kind, int, int | None, int | None], Instruction] = {}
_INTERN_LIMIT = 1 << 20
# The slots' own setters: they skip the frozen class's __setattr__ and the attribute-name lookup.
_SET_KIND = Instruction.__dict__["kind"].__set__
_SET_STAGE = Instruction.__dict__["stage"].__set__
_SET_MICROBATCH = Instruction.__dict__["microbatch"].__set__
_SET_PEER = Instruction.__dict__["peer"].__set__
_NEW = object.__new__


def make(kind: Kind, stage: int, microbatch: int | None = None, peer: int | None = None) -> Instruction:
    """Fast, interned constructor for trusted callers inside this package (skips validation).

    The generators build tens of thousands of instructions; the public constructor validates.
    Instructions are immutable, so equal ones are shared.
    """
    key = (kind, stage, microbatch, peer)
    instr = _INTERNED.get(key)
    if instr is None:
        if len(_INTERNED) >= _INTERN_LIMIT:
            _INTERNED.clear()
        instr = _NEW(Instruction)
        _SET_KIND(instr, kind)
        _SET_STAGE(instr, stage)
        _SET_MICROBATCH(instr, microbatch)
        _SET_PEER(instr, peer)
        _INTERNED[key] = instr
    return instr


_ROWS: dict[tuple[Kind, int, int | None], tuple[Instruction, ...]] = {}


def make_row(kind: Kind, stage: int, peer: int | None, count: int) -> tuple[Instruction, ...]:
    """``make(kind, stage, k, peer)`` for k in 0..count-1, interned as a whole (the generators' unit)."""
    key = (kind, stage, peer)
    row = _ROWS.get(key)
    if row is None or len(row) < count:
        if len(_ROWS) >= _INTERN_LIMIT:
            _ROWS.clear()
        row = _ROWS[key] = tuple([make(kind, stage, k, peer) for k in range(count)])
    return row


def clear_caches() -> None:
    """Forget the interned instructions and rows (benchmarks call this to time a cold start)."""
    _INTERNED.clear()
    _ROWS.clear()


def _streams(value: Mapping[int, object]) -> dict[int, tuple[Instruction, ...]]:
    return {int(node): tuple(stream) for node, stream in sorted(value.items())}  # type: ignore[call-overload]


@attrs.frozen
class Schedule:
    """One iteration of one pipeline: an instruction stream per executing node.

    ``placement[s]`` is the node that runs stage ``s`` (``s`` in the fault-free layout, the shadow for
    a failed-over stage). ``streams[n]`` is node ``n``'s instructions in execution order. Streams are
    directly executable by a blocking interpreter (see the package README, "Executing a schedule").
    """

    stages: int = attrs.field(validator=attrs.validators.ge(1))
    microbatches: int = attrs.field(validator=attrs.validators.ge(1))
    policy: str = attrs.field(validator=attrs.validators.in_(("1f1b", "gpipe")))
    rc: RCMode = attrs.field(validator=attrs.validators.instance_of(RCMode))
    placement: tuple[int, ...] = attrs.field(converter=tuple)
    streams: dict[int, tuple[Instruction, ...]] = attrs.field(converter=_streams)
    shadows: tuple[int | None, ...] = attrs.field(
        default=attrs.Factory(lambda self: self.default_shadows(), takes_self=True), converter=tuple
    )
    """``shadows[s]``: the node holding a live replica of stage s, or None when s is unprotected
    (no redundancy, or after a failover until reconfiguration)."""

    def default_shadows(self) -> tuple[int | None, ...]:
        """Node (s-1) % P for every stage when there is redundancy, else None."""
        if self.rc is RCMode.NONE or self.stages < 2:
            return (None,) * self.stages
        return tuple((s - 1) % self.stages for s in range(self.stages))

    @placement.validator
    def _check_placement(self, _attribute: attrs.Attribute, value: tuple[int, ...]) -> None:
        if len(value) != self.stages or any(not 0 <= node < self.stages for node in value):
            raise ValueError(f"placement must map each of {self.stages} stages to a node, got {value}")

    @shadows.validator
    def _check_shadows(self, _attribute: attrs.Attribute, value: tuple[int | None, ...]) -> None:
        if len(value) != self.stages or any(n is not None and not 0 <= n < self.stages for n in value):
            raise ValueError(f"shadows must give a node or None for each of {self.stages} stages, got {value}")

    @property
    def nodes(self) -> tuple[int, ...]:
        """The executing nodes, in order."""
        return tuple(self.streams)

    def stages_on(self, node: int) -> tuple[int, ...]:
        """The stages whose primary copy node ``node`` runs."""
        return tuple(s for s, n in enumerate(self.placement) if n == node)

    def shadow_of(self, stage: int) -> int | None:
        """The node holding ``stage``'s live replica (``(stage - 1) % P`` when fault-free), or None."""
        return self.shadows[stage]

    def __len__(self) -> int:
        return sum(len(stream) for stream in self.streams.values())

    def to_text(self) -> dict[str, list[str]]:
        """The streams in compact string form, keyed by node (as strings, for JSON)."""
        return {str(node): [str(i) for i in stream] for node, stream in self.streams.items()}
