"""``bamboo-bench compare --seeds N``: one comparison per seed, summarised as the median and range of each figure.

One run of a comparison is one draw: a synthetic trace is one sample of the preemption model, and even a trace
file replayed again lands its kills on other steps of a noisy machine. ``--seeds N`` runs the whole comparison
N times, with the trace seeds ``seed, seed + 1, ..., seed + N - 1`` (a synthetic trace is drawn anew for each;
a trace file is replayed as it is, so its spread is the run-to-run noise), each in its own folder ``OUT/seed-S``,
and reports each system's median and range over them: throughput, value, and the ratios against
checkpoint/restart and on-demand, each ratio taken within one seed (both systems on the same trace) before the
median is taken.

A seed whose comparison fails (a run that did not start, a baseline that never stepped) does not end the others:
with ``on_failure`` the failure is reported and the next seed runs, so a long multi-seed run keeps the table of
the seeds that finished (the command then exits non-zero and names the failed seeds).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import attrs
from bamboo.bench.measured.compare import Comparison, run_compare
from bamboo.bench.measured.options import CompareError, CompareOptions

__all__ = ["Spread", "SystemSpread", "run_seeds", "spread_records", "summarise"]


@attrs.frozen
class Spread:
    """The median and range of one figure over the seeds (the figures themselves kept, in seed order)."""

    median: float
    low: float
    high: float
    values: tuple[float, ...]

    @classmethod
    def of(cls, values: Sequence[float]) -> Spread:
        if not values:
            raise ValueError("a spread needs at least one value")
        return cls(statistics.median(values), min(values), max(values), tuple(values))

    def as_dict(self) -> dict[str, Any]:
        return {"median": self.median, "min": self.low, "max": self.high, "values": list(self.values)}


@attrs.frozen
class SystemSpread:
    """One system's figures over the seeds; a ratio is None where the other system did not run."""

    system: str
    throughput: Spread
    value: Spread
    vs_checkpoint_throughput: Spread | None
    vs_checkpoint_value: Spread | None
    vs_on_demand_throughput: Spread | None
    vs_on_demand_value: Spread | None


def run_seeds(options: CompareOptions, seeds: int, status: Callable[[str], None] | None = None,
              on_failure: Callable[[int, CompareError], None] | None = None) -> list[Comparison]:
    """Run the comparison of ``options`` once per seed (``options.seed`` onwards), each in ``OUT/seed-S``; returns
    the comparisons that finished, in seed order. A seed that fails raises its :class:`CompareError`, or, with
    ``on_failure``, is passed to it (with its seed) and the next seed runs."""
    if seeds < 1:
        raise CompareError(f"--seeds must be >= 1, got {seeds}")
    say = status or (lambda line: None)
    comparisons = []
    for offset in range(seeds):
        seed = options.seed + offset
        run = attrs.evolve(options, seed=seed, out=options.out / f"seed-{seed}")
        try:
            comparisons.append(run_compare(run, status=lambda line, seed=seed: say(f"seed {seed}: {line}")))
        except CompareError as error:
            if on_failure is None:
                raise
            on_failure(seed, error)
    return comparisons


def _ratio_spread(comparisons: Sequence[Comparison], system: str, against: str, key: str) -> Spread | None:
    if system == against:
        return None
    ratios = [c.ratio(system, against, key) for c in comparisons]
    known = [r for r in ratios if r is not None]
    return Spread.of(known) if known else None


def summarise(comparisons: Sequence[Comparison]) -> list[SystemSpread]:
    """Each system's median and range over ``comparisons`` (one per seed, the same systems in each)."""
    if not comparisons:
        raise ValueError("nothing to summarise: no comparison ran")
    out = []
    for system in comparisons[0].results:
        results = [c.results[system] for c in comparisons]
        out.append(SystemSpread(
            system=system,
            throughput=Spread.of([r.throughput for r in results]), value=Spread.of([r.value for r in results]),
            vs_checkpoint_throughput=_ratio_spread(comparisons, system, "checkpoint", "throughput"),
            vs_checkpoint_value=_ratio_spread(comparisons, system, "checkpoint", "value"),
            vs_on_demand_throughput=_ratio_spread(comparisons, system, "on-demand", "throughput"),
            vs_on_demand_value=_ratio_spread(comparisons, system, "on-demand", "value")))
    return out


def _spread_dict(spread: Spread | None) -> dict[str, Any] | None:
    return None if spread is None else spread.as_dict()


def _medians(throughput: Spread | None, value: Spread | None) -> dict[str, float | None] | None:
    """A ratio's ``{"throughput", "value"}`` medians (None where the other system did not run)."""
    if throughput is None and value is None:
        return None
    return {"throughput": None if throughput is None else throughput.median,
            "value": None if value is None else value.median}


def spread_records(comparisons: Sequence[Comparison],
                   failed: Mapping[int, str] | None = None) -> list[dict[str, Any]]:
    """``--json`` with ``--seeds``: one object per system with the medians under the keys a single comparison
    uses (``system``, ``throughput``, ``value``, ``vs_checkpoint``, ``vs_on_demand``), each figure's spread
    (``spread``: median, min, max and the values in seed order), the ``seeds`` that finished, each seed's own
    record (``runs``), and the seeds that failed with why (``failed_seeds``, seed as a string -> message)."""
    seeds = [c.options.seed for c in comparisons]
    per_seed = [{r["system"]: r for r in c.records()} for c in comparisons]
    out = []
    for summary in summarise(comparisons):
        out.append({
            "system": summary.system, "throughput": summary.throughput.median, "value": summary.value.median,
            "vs_checkpoint": _medians(summary.vs_checkpoint_throughput, summary.vs_checkpoint_value),
            "vs_on_demand": _medians(summary.vs_on_demand_throughput, summary.vs_on_demand_value),
            "spread": {"throughput": summary.throughput.as_dict(), "value": summary.value.as_dict(),
                       "vs_checkpoint_throughput": _spread_dict(summary.vs_checkpoint_throughput),
                       "vs_checkpoint_value": _spread_dict(summary.vs_checkpoint_value),
                       "vs_on_demand_throughput": _spread_dict(summary.vs_on_demand_throughput),
                       "vs_on_demand_value": _spread_dict(summary.vs_on_demand_value)},
            "seeds": seeds,
            "runs": [records[summary.system] for records in per_seed],
            "failed_seeds": {str(seed): message for seed, message in (failed or {}).items()},
        })
    return out
