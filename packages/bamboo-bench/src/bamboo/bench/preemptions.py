"""``--preemptions FILE|synthetic:RATE``: the one reader of a command's preemption trace, with its zones.

``bamboo-launch run``, ``bamboo-launch market``, ``bamboo-bench compare`` and ``bamboo-bench measure`` all take
the same flag: a trace file in any format :func:`bamboo.bench.loaders.load_trace` reads, or ``synthetic:RATE``,
the paper's model (:mod:`bamboo.bench.synthetic`) at per-hour preemption probability ``RATE`` on about
``nodes`` nodes. :func:`load_preemptions` reads it and applies ``--zones``:

- a synthetic trace starts with all ``nodes`` nodes (the job is launched on them; the paper's model would start
  with as many as the first hour's allocation draw allows, sometimes none) and the market then preempts and
  adds as the model says;
- a synthetic trace's zones are named by ``zones`` (its zone count is theirs; 3 without them);
- a file whose events carry one zone (the paper's EC2 CSV) is spread round-robin over ``zones``, in order of
  each node's first appearance (:func:`assign_zones`), so zone-aware placement and bulk losses have
  something to work with; a file that has zones of its own refuses ``zones``;
- a file is replayed as it is, whatever ``nodes``: every machine it holds runs as an emulated node, and
  ``bamboo-launch run`` and ``bamboo-bench compare`` say so in one line (:func:`size_notice`) when it holds more
  machines at once than ``--nodes``.

Every error is a :class:`PreemptionsError` (a ``ValueError``) whose one line names the flag and the value.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Protocol

import attrs
from bamboo.bench.loaders import load_trace
from bamboo.bench.synthetic import SyntheticSpec, generate_trace
from bamboo.bench.trace import Trace, TraceEvent

__all__ = ["DEFAULT_SYNTHETIC_ZONES", "SYNTHETIC_PREFIX", "PreemptionsError", "assign_zones", "load_preemptions",
           "size_notice", "synthetic_rate"]

SYNTHETIC_PREFIX = "synthetic:"
"""``synthetic:RATE`` names the paper's synthetic model instead of a file."""

DEFAULT_SYNTHETIC_ZONES = 3
"""The zones of a synthetic trace when no ``--zones`` names them."""


class PreemptionsError(ValueError):
    """A ``--preemptions`` (or ``--zones``) value that cannot be used; the message names it."""


class _Placed(Protocol):
    """What :func:`assign_zones` reads of an event: its node (a :class:`TraceEvent` has it)."""

    @property
    def node(self) -> str: ...


def assign_zones(events: Iterable[_Placed], zones: Sequence[str]) -> dict[str, str]:
    """Each node of ``events`` mapped to one of ``zones``, round-robin in order of first appearance."""
    if not zones or any(not zone for zone in zones):
        raise PreemptionsError(f"zones must be a non-empty list of non-empty names, got {list(zones)!r}")
    mapping: dict[str, str] = {}
    cycle = itertools.cycle(zones)
    for event in events:
        if event.node not in mapping:
            mapping[event.node] = next(cycle)
    return mapping


def synthetic_rate(text: str) -> float | None:
    """The RATE of ``synthetic:RATE`` (None for a file name); :class:`PreemptionsError` when RATE is not a
    number in [0, 1]."""
    if not text.startswith(SYNTHETIC_PREFIX):
        return None
    rate_text = text[len(SYNTHETIC_PREFIX):]
    try:
        rate = float(rate_text)
    except ValueError:
        raise PreemptionsError(f"--preemptions synthetic:RATE needs a number RATE in [0, 1], got {rate_text!r}") from None
    if not 0.0 <= rate <= 1.0:
        raise PreemptionsError(f"--preemptions synthetic:RATE needs RATE in [0, 1], got {rate_text!r}")
    return rate


def load_preemptions(text: str, *, nodes: int, zones: Sequence[str] | None = None, hours: float = 1.0,
                     seed: int = 0) -> Trace:
    """The trace named by ``--preemptions`` ``text``, zoned by ``zones`` (see the module docstring).

    ``nodes``, ``hours`` and ``seed`` are the synthetic model's cluster size, length and seed (a file ignores
    them). A malformed file raises :class:`bamboo.bench.loaders.TraceFormatError` naming the file and line.
    """
    rate = synthetic_rate(text)
    if rate is not None:
        try:
            spec = SyntheticSpec(preemption_probability=rate, desired_nodes=nodes,
                                 zones=len(zones) if zones else DEFAULT_SYNTHETIC_ZONES, start_full=True)
        except ValueError as error:
            raise PreemptionsError(f"--preemptions {text}: {error}") from None
        trace = generate_trace(spec, hours, seed)
        return attrs.evolve(trace, zone_names=tuple(zones)) if zones else trace
    if not Path(text).exists():
        raise PreemptionsError(f"--preemptions {text}: no such file (give a trace file or synthetic:RATE)")
    trace = load_trace(text)
    if not zones:
        return trace
    used = sorted({event.zone for event in trace.events()})
    if len(used) > 1:
        raise PreemptionsError(f"the trace {text} already has zones {used}; --zones is for traces without zones")
    zone_of = assign_zones(trace.events(), zones)
    events = [TraceEvent(e.time_s, e.kind, e.node, zone_of[e.node]) for e in trace.events()]
    return Trace.from_events(trace.name, events, duration_s=trace.duration_s)


def size_notice(text: str, peak: int, nodes: int) -> str | None:
    """One line for a trace file that holds more machines at once (``peak``) than ``--nodes``, which sizes only
    a synthetic trace: every machine of a file runs as an emulated node, and dozens of them on a few cores
    measure the cores more than the system. None when there is nothing to say."""
    if synthetic_rate(text) is not None or peak <= nodes:
        return None
    return (f"note: the trace {text} holds up to {peak} machines at once, more than --nodes {nodes} (which sizes "
            "a synthetic trace only); each of them runs as an emulated node")
