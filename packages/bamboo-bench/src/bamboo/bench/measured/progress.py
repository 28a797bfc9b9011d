"""Where a measured run's training stands when its window ends: the work it has to show, as the simulator counts it.

A ``step`` record says that a step finished, not that its work is kept. Checkpoint/restart loses the steps after
its last checkpoint at every interruption and trains them again once it has restarted; bamboo does the same
after a ``restore`` (every copy of a stage lost). The report counts each step number once
(:func:`bamboo.bench.value.compute_report`), which is right once the restart has caught up. A window that ends
before then, with the job down or still training the lost steps again, would be credited with steps the job no
longer has. The simulator rolls back at the interruption, so it counts where training stands. So does
:func:`progress_at_end`:

- the position is the step of the last step record (after a restore, steps are numbered on from the
  checkpoint, so a run training lost steps again stands at the step it trains, not the highest it reached);
- when the job was interrupted after the last step record began (no step started since), it stands at the
  newest checkpoint committed before that interruption, or at the step a later ``restore`` record loaded;
- its samples are those of steps 1 to the position (each step's newest record), and the steps after it are
  lost work (their time, ``discarded_s``, counts as lost).

What interrupts a job: a ``restore`` record for every system; for checkpoint/restart also every kill of a node
in its world and every node that entered the rendezvous later (:func:`interruptions`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import attrs
from bamboo.bench import timeouts
from bamboo.launch.events import Checkpoint, Event, Join, Preemption, Restore, RunStart, Step

__all__ = ["Progress", "interruptions", "progress_at_end"]


@attrs.frozen
class Progress:
    """Where training stood at the end: its ``step``, the ``samples`` of steps 1 to it, and the steps after it
    that were trained and lost (``discarded_steps``, ``discarded_s`` of step time)."""

    step: int
    samples: int
    discarded_steps: int = 0
    discarded_s: float = 0.0


def interruptions(ordered: Sequence[Event], start: RunStart,
                  registered_unix: Mapping[str, float]) -> list[tuple[float, str]]:
    """When checkpoint/restart's job was interrupted, as ``(unix time, "kill" | "join")``, in time order.

    With ``registered_unix`` (when each node's agent entered the rendezvous), a node added later interrupts when
    its agent entered, and a kill interrupts only if the node's agent had entered (a node killed before its
    entry was never part of the job); without it, at every later join and every kill."""
    added = [e for e in ordered if isinstance(e, Join) and e.t > timeouts.MEASURE_JOIN_AFTER_START_S]
    killed = [e for e in ordered if isinstance(e, Preemption)]
    if registered_unix:
        entered = [(registered_unix[e.node], "join") for e in added if e.node in registered_unix]
        killed = [e for e in killed if e.node in registered_unix]
    else:
        entered = [(start.unix_time + e.t, "join") for e in added]
    return sorted([(start.unix_time + e.t, "kill") for e in killed] + entered)


def progress_at_end(events: Sequence[Event], *, restarts_at_interruptions: bool,
                    registered_unix: Mapping[str, float] | None = None) -> Progress:
    """Where the run of ``events`` stood at its end (see the module docstring). ``restarts_at_interruptions``:
    every kill and join restarts the job from its last checkpoint (checkpoint/restart); ``registered_unix`` as
    for :func:`interruptions`."""
    ordered = sorted(events, key=lambda e: e.t)
    steps = [e for e in ordered if isinstance(e, Step)]
    if not steps:
        return Progress(step=0, samples=0)
    last = steps[-1]
    last_began = last.t - last.duration_s
    position = last.step
    restores = [e for e in ordered if isinstance(e, Restore) and e.t >= last_began]
    if restores:
        position = min(position, restores[0].step)
    start = next((e for e in ordered if isinstance(e, RunStart)), None)
    if restarts_at_interruptions and start is not None:
        later = [unix - start.unix_time for unix, _ in interruptions(ordered, start, registered_unix or {})
                 if unix - start.unix_time >= last_began]
        if later:
            committed = [e.step for e in ordered if isinstance(e, Checkpoint) and e.t <= later[0]]
            position = min(position, max(committed, default=0))
    newest = {record.step: record for record in steps}  # in time order: each step's newest record wins
    discarded = [record for step, record in newest.items() if step > position]
    return Progress(step=position, samples=sum(r.samples for s, r in newest.items() if s <= position),
                    discarded_steps=len(discarded), discarded_s=sum(r.duration_s for r in discarded))
