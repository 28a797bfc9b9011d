"""`execute_from`: resuming an execution at the first change gives exactly the times of a full `execute`."""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

import pytest
from bamboo.schedule import RCMode, engine, one_f_one_b
from bamboo.schedule.engine import BufferedEvent, Duration, Timeline, execute, execute_from
from bamboo.schedule.fill import _assemble, _items, _trial_duration
from bamboo.schedule.ir import Instruction, Schedule
from bamboo.schedule.simulate import Costs

Items = list[tuple[int, tuple[Instruction, ...]]]


def _random_positions(rng: random.Random, plain: Schedule, node: int, items: Items) -> list[int]:
    """Each item before a random instruction after its input (or at the tail), in item order."""
    tail = len(plain.streams[node])
    positions: list[int] = []
    for after, _instrs in items:
        low = max(after + 1, positions[-1] if positions else 0)
        positions.append(rng.randint(low, tail) if rng.random() < 0.7 else tail)
    return positions


@pytest.mark.parametrize("rc", [RCMode.LFLB, RCMode.EFLB])
@pytest.mark.parametrize(("stages", "microbatches"), [(2, 4), (3, 6), (4, 8), (5, 15)])
def test_resuming_at_the_first_change_gives_the_times_of_a_full_run(
    rc: RCMode, stages: int, microbatches: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    kept: list[int] = []  # how many instructions each resumed run starts with executed
    run = engine._run

    def counting_run(streams: Mapping[int, Sequence[Instruction]], duration: Duration, pos: dict[int, int],
                     free: dict[int, float], start: dict[int, list[float]], end: dict[int, list[float]],
                     arrivals: dict[tuple[int, int], float], buffered: list[BufferedEvent]) -> Timeline:
        kept.append(sum(pos.values()))
        return run(streams, duration, pos, free, start, end, arrivals, buffered)

    monkeypatch.setattr(engine, "_run", counting_run)
    rng = random.Random(stages * 100 + microbatches)
    costs = Costs.bert_like(stages)
    duration = _trial_duration(costs.linearizer_cost(), stages)
    plain = one_f_one_b(stages, microbatches)
    items = {n: _items(plain, n, rc) for n in range(stages)}
    positions = {n: _random_positions(rng, plain, n, items[n]) for n in range(stages)}
    streams = {n: _assemble(plain, n, items[n], positions[n]) for n in range(stages)}
    timeline = execute(streams, duration)
    for _ in range(60):
        changed = rng.sample(range(stages), rng.randint(1, 2))
        trial = dict(streams)
        for n in changed:
            trial[n] = _assemble(plain, n, items[n], _random_positions(rng, plain, n, items[n]))
        full = execute(trial, duration)
        resumed = execute_from(trial, duration, timeline, streams)
        assert resumed.start == full.start and resumed.end == full.end, changed
        if rng.random() < 0.5:  # the next trial starts from this one, as the local search's kept moves do
            streams, timeline = trial, resumed
    assert sum(count > 0 for count in kept) >= 10, kept  # the test exercised resumption, not only full runs


def test_unchanged_streams_keep_every_time_and_a_change_at_the_start_runs_everything_again() -> None:
    costs = Costs()
    duration = _trial_duration(costs.linearizer_cost(), 3)
    plain = one_f_one_b(3, 6)
    items = {n: _items(plain, n, RCMode.EFLB) for n in range(3)}
    tails = {n: [len(plain.streams[n])] * len(items[n]) for n in range(3)}
    streams = {n: _assemble(plain, n, items[n], tails[n]) for n in range(3)}
    timeline = execute(streams, duration)
    same = execute_from(dict(streams), duration, timeline, streams)
    assert same.start == timeline.start and same.end == timeline.end
    first = {**streams, 1: _assemble(plain, 1, items[1], [0] * len(items[1]))}
    assert execute_from(first, duration, timeline, streams).end == execute(first, duration).end
