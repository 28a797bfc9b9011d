"""What observes a worker's life (``bamboo.launch.worker._observe``), in-process: the event log gets a ``phase``
record per transition, the script's ``on_phase`` hook is called, and the node's checkpoint writers finish and
close when it enters a phase that holds nothing (and only then).

No etcd, no engine: the session is a stand-in with an in-memory log, the writers are stand-ins that record
their close.
"""

from __future__ import annotations

from types import SimpleNamespace

import attrs
import pytest
from bamboo.launch import worker
from bamboo.launch.event_records import WorkerPhase, event_from_dict, event_to_dict
from bamboo.launch.generation import WorkerState
from bamboo.launch.hooks import TrainingHooks
from bamboo.launch.worker_phases import Phase, PhaseChange


@attrs.define
class _Log:
    records: list[object] = attrs.field(factory=list)

    def now(self) -> float:
        return 12.5

    def write(self, event: object) -> None:
        self.records.append(event)


@attrs.define
class _Writer:
    closed: int = 0

    def close(self) -> None:
        self.closed += 1


def _life(hooks: TrainingHooks | None) -> tuple[worker._Life, _Log, dict[int, _Writer]]:
    log, writers = _Log(), {0: _Writer(), 1: _Writer()}
    state = WorkerState(startup=None)  # type: ignore[arg-type]
    state.checkpointers.update(writers)  # type: ignore[arg-type]
    return worker._Life(SimpleNamespace(log=log), state, hooks), log, writers  # type: ignore[arg-type]


def test_each_change_is_logged_and_handed_to_the_script_s_hook() -> None:
    seen: list[PhaseChange] = []
    life, log, writers = _life(TrainingHooks(on_phase=seen.append))
    change = PhaseChange("n1", Phase.ATTEMPT, Phase.TRAINING, "started, in the layout", 3)
    worker._observe(life, change)
    assert log.records == [WorkerPhase(t=12.5, node="n1", phase="training", previous="attempt",
                                       cause="started, in the layout", generation=3)]
    assert seen == [change]
    assert [w.closed for w in writers.values()] == [0, 0]  # training: the writers stay open
    assert len(life.state.checkpointers) == 2


@pytest.mark.parametrize("phase", [Phase.STANDBY, Phase.WARM, Phase.REDO])
def test_entering_a_phase_that_holds_nothing_closes_the_checkpoint_writers_once(phase: Phase) -> None:
    life, _, writers = _life(None)
    worker._observe(life, PhaseChange("n1", Phase.ATTEMPT, phase, "started, not in the layout", 4))
    assert [w.closed for w in writers.values()] == [1, 1]
    assert life.state.checkpointers == {}  # made again, per stage, when the node next trains
    worker._observe(life, PhaseChange("n1", phase, Phase.ATTEMPT, "role found", 5))
    assert [w.closed for w in writers.values()] == [1, 1]


def test_the_phase_record_round_trips_and_refuses_an_empty_phase() -> None:
    record = WorkerPhase(t=1.0, node="n1", phase="barrier", previous="training", cause="trained, barrier")
    assert event_from_dict(event_to_dict(record)) == record
    assert event_to_dict(record)["kind"] == "phase"
    with pytest.raises(ValueError, match="phase"):
        WorkerPhase(t=1.0, node="n1", phase="", previous="training", cause="trained, barrier")
