"""The worker's life as an explicit state machine: its phases, the outcomes it meets, and what comes next.

A worker (:mod:`bamboo.launch.worker`) is always in one :class:`Phase`. A phase does one thing with etcd,
torch and its peers, and ends in an outcome (the values below); :func:`next_phase` maps the phase, that
outcome and whether the node holds stage state (the executor of a layout it trained, kept for the next
layout) to the next phase. This module does nothing itself: it imports neither torch nor an etcd client,
and its transitions are tested in-process with plain values.

The phases:

- ``WARM``: the node holds nothing and waits for a role (:func:`bamboo.launch.roles.wait_role`);
- ``ATTEMPT``: it starts a layout as one attempt (:mod:`bamboo.launch.attempt`): a role found (a layout, or
  one being prepared that it joins), a switch to the layout prepared while it trained, or the layout decided
  at the barrier;
- ``REDO``: a start of a node that held nothing was abandoned: it follows the decision of the next attempt
  (:func:`bamboo.launch.barrier.next_attempt_layout`);
- ``TRAINING``: it trains the layout (:func:`bamboo.launch.generation.train_generation`);
- ``BARRIER``: it holds state and meets the other holders to decide the next layout
  (:mod:`bamboo.launch.barrier`); after an abandoned start of that layout it meets them again, as the next
  attempt;
- ``STANDBY``: a layout started without it (a source whose transfers are done): it lets its state go and
  waits for a role;
- ``DONE`` (it trained to the job's end: its report and the job's end record), ``HANDED_OVER`` (it left after
  its preemption notice), ``ENDED`` (the job ended while it had no role): the end of the worker's life.

The transitions (``holds``: whether the node holds state when the outcome comes; both: either way):

=========  ===========================================  =====  ==============================================
phase      outcome                                      holds  next phase
=========  ===========================================  =====  ==============================================
WARM       :class:`RoleFound`                           no     ATTEMPT
WARM       :class:`JobEnded`                            no     ENDED
ATTEMPT    :class:`StartDone`, the node in the layout   both   TRAINING
ATTEMPT    :class:`StartDone`, the node not in it       both   STANDBY
ATTEMPT    :class:`JoinAbandoned`                       no     WARM (a role after the prepared layout's base)
ATTEMPT    :class:`LayoutAbandoned`                     no     REDO
ATTEMPT    :class:`LayoutAbandoned`                     yes    BARRIER (again, as the next attempt)
ATTEMPT    :class:`SwitchAbandoned`                     yes    BARRIER
REDO       :class:`LayoutDecided`, the node in it       no     ATTEMPT
REDO       :class:`LayoutDecided`, the node not in it   no     WARM (a role after that layout)
REDO       :class:`JobEnded`                            no     ENDED
TRAINING   :class:`TrainingEnded` ``switch``            yes    ATTEMPT
TRAINING   :class:`TrainingEnded` ``barrier``           yes    BARRIER
TRAINING   :class:`TrainingEnded` ``done``              no     DONE
TRAINING   :class:`TrainingEnded` ``handed-over``       no     HANDED_OVER
BARRIER    :class:`LayoutDecided`, the node in it       yes    ATTEMPT
BARRIER    :class:`LayoutDecided`, the node not in it   yes    ATTEMPT (it sends its stages, then standby)
BARRIER    :class:`WentAhead`                           no     WARM (a role after the layout that went ahead)
STANDBY    :class:`RoleFound`                           no     ATTEMPT
STANDBY    :class:`JobEnded`                            no     ENDED
=========  ===========================================  =====  ==============================================

Any other triple cannot happen (a node that holds nothing never switches, a holder never joins a prepared
layout or redoes a start, nothing follows an end): :func:`next_phase` raises ``ValueError`` naming it.

Each transition is a :class:`PhaseChange` (:func:`phase_change`), which the worker hands to what observes its
life: the event log (a ``phase`` record), the script's ``on_phase`` hook, and its checkpoint writers, which
finish and close when the node enters a phase in :data:`HOLDS_NOTHING` (a node that let its stages go keeps no
writer thread competing with the nodes that train).
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TYPE_CHECKING, Final

import attrs

if TYPE_CHECKING:
    from bamboo.launch.prepare import Preparation
    from bamboo.launch.records import StopDecision
    from bamboo.launch.roles import Role
    from bamboo.rc import Engine
    from bamboo.reconfig import JobLayout

__all__ = [
    "HOLDS_NOTHING",
    "TERMINAL",
    "TRANSITIONS",
    "Ending",
    "JobEnded",
    "JoinAbandoned",
    "LayoutAbandoned",
    "LayoutDecided",
    "Outcome",
    "Phase",
    "PhaseChange",
    "RoleFound",
    "StartDone",
    "SwitchAbandoned",
    "TrainingEnded",
    "WentAhead",
    "next_phase",
    "outcome_generation",
    "phase_change",
]


class Phase(enum.Enum):
    """Where a worker is in its life (see the module docstring)."""

    WARM = "warm"
    ATTEMPT = "attempt"
    REDO = "redo"
    TRAINING = "training"
    BARRIER = "barrier"
    STANDBY = "standby"
    DONE = "done"
    HANDED_OVER = "handed-over"
    ENDED = "ended"


TERMINAL: Final = frozenset({Phase.DONE, Phase.HANDED_OVER, Phase.ENDED})
"""The phases that end the worker's life: nothing follows them."""

HOLDS_NOTHING: Final = frozenset({Phase.WARM, Phase.REDO, Phase.STANDBY})
"""The phases in which a node holds no stage state and waits (on standby it lets go what it held as it
enters); the terminal phases are apart: the worker's own end closes what it holds."""


@attrs.frozen
class Ending:
    """How a generation ended for this node: ``done`` (the job's last step, or a finish), ``handed-over``,
    ``barrier`` (with ``consecutive`` and the ``reason``) or ``switch`` (to the prepared layout ``stop`` names,
    with this node's ``preparation`` of it, if it has a part)."""

    kind: str
    reason: str = ""
    consecutive: bool = False
    stop: StopDecision | None = None
    preparation: Preparation | None = None


@attrs.frozen
class RoleFound:
    """A node that holds nothing found a role: a layout that places it, or one being prepared that does."""

    role: Role

    @property
    def case(self) -> str:
        return "role found"


@attrs.frozen
class JobEnded:
    """The job ended while this node looked for a role (or for the next attempt's layout)."""

    @property
    def case(self) -> str:
        return "job ended"


@attrs.frozen
class StartDone:
    """An attempt went ahead: this node's ``engine`` (None: it has no rank in ``layout``, a source going to
    standby), whether it is a ``member`` of the layout, and whether the layout was ``prepared`` while the
    previous one trained (a switch, or a joiner's start)."""

    engine: Engine | None
    layout: JobLayout
    member: bool = attrs.field(validator=attrs.validators.instance_of(bool))
    prepared: bool = attrs.field(validator=attrs.validators.instance_of(bool))

    @property
    def case(self) -> str:
        return "started, in the layout" if self.member else "started, not in the layout"


@attrs.frozen
class JoinAbandoned:
    """The start of a layout being prepared that this node, holding nothing, joined (``role``) was abandoned."""

    role: Role

    @property
    def case(self) -> str:
        return "join abandoned"

    @property
    def after(self) -> int:
        """The generation after which the node looks for a role again: the prepared layout's base."""
        assert self.role.prepared is not None
        return self.role.prepared.layout.base_generation


@attrs.frozen
class LayoutAbandoned:
    """The start of ``layout`` (a role found, the next attempt's layout, or one decided at the barrier) was
    abandoned."""

    layout: JobLayout

    @property
    def case(self) -> str:
        return "layout abandoned"


@attrs.frozen
class SwitchAbandoned:
    """A holder's switch to the layout prepared while it trained (``ending`` names it) was abandoned."""

    ending: Ending

    @property
    def case(self) -> str:
        return "switch abandoned"


@attrs.frozen
class LayoutDecided:
    """The next layout was decided (at the barrier, or the next attempt of an abandoned start); ``member``: this
    node has a rank in it."""

    layout: JobLayout
    member: bool = attrs.field(validator=attrs.validators.instance_of(bool))

    @property
    def case(self) -> str:
        return "decided, in the layout" if self.member else "decided, not in the layout"

    @property
    def after(self) -> int:
        """The generation after which a node left out of it looks for a role."""
        return self.layout.generation


@attrs.frozen
class WentAhead:
    """At the barrier, a layout prepared during this node's generation had gone ahead without it (generation
    ``generation``); the node let its state go."""

    generation: int = attrs.field(validator=attrs.validators.ge(0))

    @property
    def case(self) -> str:
        return "went ahead"

    @property
    def after(self) -> int:
        return self.generation


@attrs.frozen
class TrainingEnded:
    """A generation ended for this node (``ending``, of kind ``done``, ``handed-over``, ``barrier`` or
    ``switch``), trained as ``started`` went ahead."""

    ending: Ending
    started: StartDone

    @property
    def case(self) -> str:
        return f"trained, {self.ending.kind}"

    @property
    def holds(self) -> bool:
        """Whether the node keeps its executor for the next layout (a switch, or the barrier)."""
        return self.ending.kind in ("switch", "barrier")


Outcome = (RoleFound | JobEnded | StartDone | JoinAbandoned | LayoutAbandoned | SwitchAbandoned | LayoutDecided
           | WentAhead | TrainingEnded)
"""Every outcome a phase ends in."""

TRANSITIONS: Final[Mapping[tuple[Phase, str, bool], Phase]] = {
    (Phase.WARM, "role found", False): Phase.ATTEMPT,
    (Phase.WARM, "job ended", False): Phase.ENDED,
    (Phase.ATTEMPT, "started, in the layout", False): Phase.TRAINING,
    (Phase.ATTEMPT, "started, in the layout", True): Phase.TRAINING,
    (Phase.ATTEMPT, "started, not in the layout", False): Phase.STANDBY,
    (Phase.ATTEMPT, "started, not in the layout", True): Phase.STANDBY,
    (Phase.ATTEMPT, "join abandoned", False): Phase.WARM,
    (Phase.ATTEMPT, "layout abandoned", False): Phase.REDO,
    (Phase.ATTEMPT, "layout abandoned", True): Phase.BARRIER,
    (Phase.ATTEMPT, "switch abandoned", True): Phase.BARRIER,
    (Phase.REDO, "decided, in the layout", False): Phase.ATTEMPT,
    (Phase.REDO, "decided, not in the layout", False): Phase.WARM,
    (Phase.REDO, "job ended", False): Phase.ENDED,
    (Phase.TRAINING, "trained, switch", True): Phase.ATTEMPT,
    (Phase.TRAINING, "trained, barrier", True): Phase.BARRIER,
    (Phase.TRAINING, "trained, done", False): Phase.DONE,
    (Phase.TRAINING, "trained, handed-over", False): Phase.HANDED_OVER,
    (Phase.BARRIER, "decided, in the layout", True): Phase.ATTEMPT,
    (Phase.BARRIER, "decided, not in the layout", True): Phase.ATTEMPT,
    (Phase.BARRIER, "went ahead", False): Phase.WARM,
    (Phase.STANDBY, "role found", False): Phase.ATTEMPT,
    (Phase.STANDBY, "job ended", False): Phase.ENDED,
}
"""``(phase, outcome's case, holds state) -> next phase``: the table of the module docstring."""


def next_phase(phase: Phase, outcome: Outcome, holds_state: bool) -> Phase:
    """The phase after ``phase`` ended in ``outcome``, the node holding stage state or not (``holds_state``);
    raises ``ValueError`` for a transition that cannot happen (see the module docstring)."""
    found = TRANSITIONS.get((phase, outcome.case, holds_state))
    if found is None:
        holding = "holding state" if holds_state else "holding no state"
        raise ValueError(f"no transition from phase {phase.name} on {type(outcome).__name__} "
                         f"({outcome.case!r}) {holding}")
    return found


@attrs.frozen
class PhaseChange:
    """Node ``node`` entered ``phase`` from ``previous`` because that phase ended in ``cause`` (an outcome's
    case), about layout generation ``generation`` (None: the outcome concerns no layout)."""

    node: str = attrs.field(validator=attrs.validators.min_len(1))
    previous: Phase = attrs.field(validator=attrs.validators.instance_of(Phase))
    phase: Phase = attrs.field(validator=attrs.validators.instance_of(Phase))
    cause: str = attrs.field(validator=attrs.validators.min_len(1))
    generation: int | None = attrs.field(validator=attrs.validators.optional(attrs.validators.ge(0)))

    @property
    def holds_nothing(self) -> bool:
        """Whether the node holds no stage state in its new phase."""
        return self.phase in HOLDS_NOTHING


def outcome_generation(outcome: Outcome) -> int | None:
    """The layout generation ``outcome`` concerns: the layout found, started, decided, abandoned or trained,
    the one that went ahead, the prepared one a switch abandoned; None for an end while waiting (or a
    switch abandoned where this node had no part in the prepared layout)."""
    match outcome:
        case RoleFound(role=role) | JoinAbandoned(role=role):
            return role.layout.generation if role.prepared is None else role.prepared.layout.generation
        case StartDone(layout=layout) | LayoutAbandoned(layout=layout) | LayoutDecided(layout=layout):
            return layout.generation
        case TrainingEnded(started=started):
            return started.layout.generation
        case SwitchAbandoned(ending=ending):  # the prepared layout it switched to, when it had a part in it
            return None if ending.preparation is None else ending.preparation.layout.generation
        case WentAhead(generation=generation):
            return generation
    return None


def phase_change(node: str, previous: Phase, phase: Phase, outcome: Outcome) -> PhaseChange:
    """The transition from ``previous`` to ``phase`` on ``outcome``, as its observers see it."""
    return PhaseChange(node, previous, phase, outcome.case, outcome_generation(outcome))
