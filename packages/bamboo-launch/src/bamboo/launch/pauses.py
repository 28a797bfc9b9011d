"""A reconfiguration's pause, broken down: what stopped training, and for how long.

The pause runs from the first node that stopped training the old layout (``t0``: the first holder at the
barrier, or at the switch of a layout prepared while the old one trained; when every holder was lost, the end
of the last step trained, by the old layout or the one before it, since no holder lived to say when it stopped)
to the new layout's ``go``
(every node of it up), plus what the new layout's first step took beyond a usual step. Every node of the
new layout says in its ``up`` record (:class:`bamboo.launch.records.NodeUp`) when each part of its start
ended; the part of the node that came up last (the *critical* node) is the pause's path:

- ``nodes_s``: the wait for machines to arrive and start, which no decision can shorten. When no holder lived
  (every one was lost), from ``t0`` to the last node of the new layout becoming warm (its worker started and
  its model built). When holders lived but were fewer than one pipeline's ``stages``, the barrier could not plan
  until enough new nodes were warm (it waits, holding the state): from the last holder stopping to the moment
  the holders and the new layout's warm nodes first numbered ``stages``. Zero when the holders alone could form
  a pipeline: such a barrier never waits for a node that is still starting;
- ``decide_s``: from the end of that wait (or from the last holder stopping) to the critical node having the
  layout (the barrier's planning, and the time to notice it). Zero when the layout was decided while the old
  one trained;
- ``group_builds_s``: its engine (its stages' layers) and gloo groups, as far as they were built after
  it had the layout and every holder had stopped. Zero when they were built while the old layout trained;
- ``transfers_s``: its stages' state put in place after that (local copies, transfers from peers, a
  restore from a peer's memory or from disk);
- ``first_step_s``: the new layout's first step beyond a usual step (groups still built on first use,
  cold caches);
- ``barrier_s``: the rest: waiting for every holder to stop, for the critical node, and for ``go``.

Every part is clipped to ``[t0, go]``, so the parts add up to the pause.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

import attrs
from bamboo.launch.records import NodeUp

__all__ = ["PauseBreakdown", "first_step_excess", "pause_breakdown"]


@attrs.frozen
class PauseBreakdown:
    """One reconfiguration's pause and its parts, in seconds (see the module docstring)."""

    total_s: float = attrs.field(validator=attrs.validators.ge(0.0))
    nodes_s: float = attrs.field(validator=attrs.validators.ge(0.0))
    decide_s: float = attrs.field(validator=attrs.validators.ge(0.0))
    barrier_s: float = attrs.field(validator=attrs.validators.ge(0.0))
    transfers_s: float = attrs.field(validator=attrs.validators.ge(0.0))
    group_builds_s: float = attrs.field(validator=attrs.validators.ge(0.0))
    first_step_s: float = attrs.field(validator=attrs.validators.ge(0.0))

    def line(self) -> str:
        """``0.52 s (nodes 0.00, decide 0.01, barrier 0.10, transfers 0.20, group builds 0.00, first step
        0.21)``."""
        return (f"{self.total_s:.2f} s (nodes {self.nodes_s:.2f}, decide {self.decide_s:.2f}, barrier "
                f"{self.barrier_s:.2f}, transfers {self.transfers_s:.2f}, group builds {self.group_builds_s:.2f}, "
                f"first step {self.first_step_s:.2f})")


def pause_breakdown(t0: float, go: float, ups: Sequence[NodeUp], first_step_s: float = 0.0, *,
                    stages: int) -> PauseBreakdown:
    """The pause from ``t0`` (the first node that stopped) to ``go``, broken down by the ``up`` records of the
    new layout's nodes (of ``stages`` stages a pipeline), plus ``first_step_s``, the first step's excess
    (:func:`first_step_excess`)."""
    go = max(go, t0)
    window = go - t0

    def span(start: float | None, end: float | None) -> float:
        if start is None or end is None:
            return 0.0
        return max(0.0, min(end, go) - max(start, t0))

    stopped = [up.stopped for up in ups if up.stopped is not None]
    last_stopped = max(stopped, default=t0)
    last_warm = _enough_nodes_at(ups, stopped, last_stopped, stages)
    critical = max(ups, key=lambda up: up.at if up.at is not None else t0, default=None)
    nodes = decide = builds = transfers = 0.0
    if critical is not None:
        planned = critical.planned if critical.planned is not None else last_stopped
        nodes = span(last_stopped, min(last_warm, planned))
        decide = span(max(last_stopped, min(last_warm, planned)), planned)
        ready = max(planned, last_stopped)
        built = critical.built if critical.built is not None else ready
        builds = span(ready, built)
        transfers = span(max(ready, built), critical.state)
    barrier = max(0.0, window - nodes - decide - builds - transfers)
    first = max(0.0, first_step_s)
    return PauseBreakdown(total_s=window + first, nodes_s=nodes, decide_s=decide, barrier_s=barrier,
                          transfers_s=transfers, group_builds_s=builds, first_step_s=first)


def _enough_nodes_at(ups: Sequence[NodeUp], stopped: Sequence[float], last_stopped: float, stages: int) -> float:
    """When the new layout's nodes first sufficed to plan it (see ``nodes_s`` in the module docstring): with no
    holder, when its last node was warm; with holders, when they and the new nodes warm by then first numbered
    one pipeline (``last_stopped`` when the holders alone did)."""
    warm = sorted(up.warm for up in ups if up.warm is not None and up.stopped is None)
    if not stopped:
        return warm[-1] if warm else last_stopped
    missing = stages - len(stopped)
    if missing <= 0 or not warm:
        return last_stopped
    return max(last_stopped, warm[min(missing, len(warm)) - 1])


def first_step_excess(first: float, usual: Sequence[float]) -> float:
    """What a first step of ``first`` seconds took beyond the median of ``usual`` steps (0 without any)."""
    if not usual:
        return 0.0
    return max(0.0, first - statistics.median(usual))
