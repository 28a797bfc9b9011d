"""The worker's state machine in-process: every transition of its table, worked out by hand, the ones that
cannot happen, and whole lives walked as lists of outcomes.

No processes, no etcd, no engine: the outcomes are plain values (a layout, a role, an ending), and
:func:`next_phase` is a pure function of them.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import attrs
import pytest
from bamboo.launch import worker_phases
from bamboo.launch.generation import Ending
from bamboo.launch.prepare import Prepared
from bamboo.launch.roles import Role
from bamboo.launch.worker_phases import (
    TERMINAL,
    TRANSITIONS,
    JobEnded,
    JoinAbandoned,
    LayoutAbandoned,
    LayoutDecided,
    Outcome,
    Phase,
    RoleFound,
    StartDone,
    SwitchAbandoned,
    TrainingEnded,
    WentAhead,
    next_phase,
)
from bamboo.reconfig import JobLayout, LayerSpec, Layout

W, A, R, T, B, S = Phase.WARM, Phase.ATTEMPT, Phase.REDO, Phase.TRAINING, Phase.BARRIER, Phase.STANDBY
DONE, HANDED_OVER, ENDED = Phase.DONE, Phase.HANDED_OVER, Phase.ENDED
LAYERS = [LayerSpec(40, 80, 1.0) for _ in range(4)]


def _layout(generation: int, *, base: int | None = None, attempt: int = 0) -> JobLayout:
    plan = Layout(stages=2, layers=LAYERS, stage_layers=((0, 2), (2, 4)), owners=[["a", "b"]], microbatches=(2,))
    return JobLayout(generation=generation, plan=plan, start_step=generation, base_generation=base, attempt=attempt,
                     history=[(0, 1)] if generation == 0 else [(0, 1), (generation, 1)])


FIRST = _layout(0)
NEXT = _layout(2, base=1)
PREPARED = Prepared(attempt=0, layout=NEXT, epoch=1)
ROLE = RoleFound(Role(layout=FIRST))
JOIN = RoleFound(Role(prepared=PREPARED))
IN = StartDone(None, FIRST, member=True, prepared=False)
OUT = StartDone(None, FIRST, member=False, prepared=False)


def _trained(kind: str) -> TrainingEnded:
    return TrainingEnded(Ending(kind, reason="a node left"), IN)


# Every transition the worker makes, written out by hand: (phase, outcome, holds state, next phase).
HAND_TABLE: list[tuple[Phase, Outcome, bool, Phase]] = [
    (W, ROLE, False, A),
    (W, JOIN, False, A),
    (W, JobEnded(), False, ENDED),
    (A, IN, False, T),
    (A, IN, True, T),
    (A, OUT, False, S),
    (A, OUT, True, S),
    (A, JoinAbandoned(Role(prepared=PREPARED)), False, W),
    (A, LayoutAbandoned(FIRST), False, R),
    (A, LayoutAbandoned(NEXT), True, B),
    (A, SwitchAbandoned(Ending("switch", reason="new pipeline")), True, B),
    (R, LayoutDecided(NEXT, member=True), False, A),
    (R, LayoutDecided(NEXT, member=False), False, W),
    (R, JobEnded(), False, ENDED),
    (T, _trained("switch"), True, A),
    (T, _trained("barrier"), True, B),
    (T, _trained("done"), False, DONE),
    (T, _trained("handed-over"), False, HANDED_OVER),
    (B, LayoutDecided(NEXT, member=True), True, A),
    (B, LayoutDecided(NEXT, member=False), True, A),
    (B, WentAhead(3), False, W),
    (S, ROLE, False, A),
    (S, JOIN, False, A),
    (S, JobEnded(), False, ENDED),
]


@pytest.mark.parametrize(("phase", "outcome", "holds", "expected"), HAND_TABLE,
                         ids=[f"{p.name}-{o.case}-{'holds' if h else 'empty'}" for p, o, h, _ in HAND_TABLE])
def test_every_transition_of_the_table(phase: Phase, outcome: Outcome, holds: bool, expected: Phase) -> None:
    assert next_phase(phase, outcome, holds) is expected


def test_the_table_has_no_transition_the_hand_table_leaves_out() -> None:
    assert set(TRANSITIONS) == {(phase, outcome.case, holds) for phase, outcome, holds, _ in HAND_TABLE}


OUTCOMES: list[Outcome] = [ROLE, JobEnded(), IN, OUT, JoinAbandoned(Role(prepared=PREPARED)), LayoutAbandoned(FIRST),
                           SwitchAbandoned(Ending("switch")), LayoutDecided(NEXT, member=True),
                           LayoutDecided(NEXT, member=False), WentAhead(1)] + [
    _trained(kind) for kind in ("done", "handed-over", "switch", "barrier")]
ALLOWED = {(phase, outcome.case, holds) for phase, outcome, holds, _ in HAND_TABLE}
IMPOSSIBLE = [(phase, outcome, holds) for phase, outcome, holds in itertools.product(Phase, OUTCOMES, (False, True))
              if (phase, outcome.case, holds) not in ALLOWED]


@pytest.mark.parametrize(("phase", "outcome", "holds"), IMPOSSIBLE,
                         ids=[f"{p.name}-{o.case}-{'holds' if h else 'empty'}" for p, o, h in IMPOSSIBLE])
def test_a_transition_that_cannot_happen_raises_naming_it(phase: Phase, outcome: Outcome, holds: bool) -> None:
    with pytest.raises(ValueError, match=f"from phase {phase.name} on {type(outcome).__name__}") as raised:
        next_phase(phase, outcome, holds)
    assert repr(outcome.case) in str(raised.value)
    assert str(raised.value).endswith("holding state" if holds else "holding no state")


def test_the_impossible_transitions_include_the_ones_the_design_rules_out() -> None:
    ruled_out = {
        (A, "join abandoned", True),  # a holder never joins a prepared layout
        (A, "switch abandoned", False),  # a node that holds nothing never switches
        (R, "decided, in the layout", True),  # a holder decides again at the barrier, it never redoes a start
        (T, "trained, switch", False),  # a switch keeps the executor
        (T, "trained, done", True),  # the executor was let go when training began
        (B, "went ahead", True),  # it let its state go
        (W, "role found", True),
        (S, "role found", True),
    }
    assert ruled_out <= {(phase, outcome.case, holds) for phase, outcome, holds in IMPOSSIBLE}
    assert ruled_out.isdisjoint(TRANSITIONS)


@pytest.mark.parametrize("phase", sorted(TERMINAL, key=lambda p: p.name))
def test_nothing_follows_an_end(phase: Phase) -> None:
    for outcome, holds in itertools.product(OUTCOMES, (False, True)):
        with pytest.raises(ValueError, match=f"no transition from phase {phase.name}"):
            next_phase(phase, outcome, holds)


def test_an_ending_of_an_unknown_kind_has_no_transition() -> None:
    with pytest.raises(ValueError, match=r"TrainingEnded \('trained, paused'\) holding state"):
        next_phase(T, _trained("paused"), True)


def _walk(outcomes: list[tuple[Outcome, bool]]) -> list[Phase]:
    """The phases of a life that starts warm and meets ``outcomes`` (each with whether the node then holds
    state), in order."""
    phases = [W]
    for outcome, holds in outcomes:
        phases.append(next_phase(phases[-1], outcome, holds))
    return phases


def test_a_whole_life_through_a_switch_the_barrier_an_abandoned_start_and_standby_to_the_end() -> None:
    retried = _layout(3, base=1, attempt=1)
    life: list[tuple[Outcome, bool]] = [
        (ROLE, False),  # generation 0 places it
        (IN, False),  # every node is up: it trains generation 0
        (_trained("switch"), True),  # a layout was prepared meanwhile: it switches, holding its stages
        (StartDone(None, NEXT, member=True, prepared=True), True),
        (_trained("barrier"), True),  # a consecutive failure: the holders meet
        (LayoutDecided(retried, member=True), True),
        (LayoutAbandoned(retried), True),  # a node it needed died during the start: the barrier again
        (LayoutDecided(_layout(4, base=1, attempt=2), member=False), True),  # a source, left out of it
        (StartDone(None, _layout(4, base=1, attempt=2), member=False, prepared=False), True),  # sent its stages
        (JOIN, False),  # from standby it joins a layout being prepared
        (JoinAbandoned(Role(prepared=PREPARED)), False),
        (ROLE, False),
        (LayoutAbandoned(FIRST), False),  # holding nothing, it follows the next attempt's decision
        (LayoutDecided(_layout(6), member=True), False),
        (StartDone(None, _layout(6), member=True, prepared=False), False),
        (_trained("done"), False),
    ]
    assert _walk(life) == [W, A, T, A, T, B, A, B, A, S, A, W, A, R, A, T, DONE]


def test_lives_that_end_by_a_hand_over_by_a_layout_gone_ahead_and_by_the_job_s_end() -> None:
    handed = [(ROLE, False), (IN, False), (_trained("handed-over"), False)]
    assert _walk(handed) == [W, A, T, HANDED_OVER]
    gone = [(ROLE, False), (IN, False), (_trained("barrier"), True), (WentAhead(2), False), (JobEnded(), False)]
    assert _walk(gone) == [W, A, T, B, W, ENDED]
    redone = [(ROLE, False), (LayoutAbandoned(FIRST), False), (LayoutDecided(NEXT, member=False), False),
              (JobEnded(), False)]
    assert _walk(redone) == [W, A, R, W, ENDED]
    assert _walk([(JobEnded(), False)]) == [W, ENDED]


def test_what_the_outcomes_carry() -> None:
    assert JoinAbandoned(Role(prepared=PREPARED)).after == 1  # the prepared layout's base generation
    assert LayoutDecided(NEXT, member=False).after == 2
    assert WentAhead(5).after == 5
    assert [_trained(kind).holds for kind in ("done", "handed-over", "switch", "barrier")] == [False, False, True, True]
    with pytest.raises(ValueError, match="generation"):
        WentAhead(-1)
    with pytest.raises(TypeError, match="member"):
        StartDone(None, FIRST, member=1, prepared=False)  # type: ignore[arg-type]
    with pytest.raises(attrs.exceptions.FrozenInstanceError):
        ROLE.role = Role()  # type: ignore[misc]


def test_the_docstring_table_states_the_transitions() -> None:
    """Each row of the module docstring's table (``both`` counting twice) is a transition, and every
    transition is a row: same phases, same holds, same next phases."""
    rows = []
    for line in (worker_phases.__doc__ or "").splitlines():
        words = line.split()
        if len(words) > 3 and words[0] in Phase.__members__ and words[-1] != "phase":
            holds = next(word for word in words if word in ("no", "yes", "both"))
            after = line.split(f" {holds} ", 1)[1].split()[0]
            for held in {"no": [False], "yes": [True], "both": [False, True]}[holds]:
                rows.append((Phase[words[0]], held, Phase[after]))
    assert sorted(rows, key=str) == sorted(((p, h, n) for (p, _, h), n in TRANSITIONS.items()), key=str)


def test_the_module_imports_neither_torch_nor_etcd() -> None:
    """Its only imports outside ``if TYPE_CHECKING`` are the standard library's and attrs."""
    tree = ast.parse(Path(worker_phases.__file__).read_text())
    imported = set()
    for node in tree.body:
        if isinstance(node, ast.Import):
            imported |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            imported.add(node.module or "")
    assert imported == {"__future__", "enum", "collections.abc", "typing", "attrs"}


# What the observers of a worker's life see: each transition as a PhaseChange, with the generation its outcome
# concerns.
GENERATIONS: list[tuple[Outcome, int | None]] = [
    (ROLE, 0),
    (JOIN, 2),  # a joiner: the prepared layout it joins, not its base
    (JobEnded(), None),
    (IN, 0),
    (JoinAbandoned(Role(prepared=PREPARED)), 2),
    (LayoutAbandoned(NEXT), 2),
    (SwitchAbandoned(Ending("switch", reason="new pipeline")), None),  # no part in the prepared layout
    (LayoutDecided(NEXT, member=False), 2),
    (WentAhead(5), 5),
    (_trained("barrier"), 0),
]


@pytest.mark.parametrize(("outcome", "generation"), GENERATIONS, ids=lambda value: getattr(value, "case", value))
def test_each_outcome_names_the_generation_it_concerns(outcome: Outcome, generation: int | None) -> None:
    assert worker_phases.outcome_generation(outcome) == generation


def test_a_phase_change_carries_both_phases_the_cause_and_whether_the_node_now_holds_nothing() -> None:
    change = worker_phases.phase_change("n3", T, B, _trained("barrier"))
    assert (change.node, change.previous, change.phase, change.cause, change.generation) == (
        "n3", T, B, "trained, barrier", 0)
    assert not change.holds_nothing
    assert worker_phases.phase_change("n3", A, S, OUT).holds_nothing
    # The waiting phases hold nothing; the terminal ones are apart (the worker's end closes what it holds).
    assert {W, R, S} == worker_phases.HOLDS_NOTHING
    assert not worker_phases.HOLDS_NOTHING & TERMINAL
    with pytest.raises(ValueError, match="generation"):
        worker_phases.PhaseChange("n3", T, B, "trained, barrier", -1)
