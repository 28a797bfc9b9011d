"""Sweeps: many synthetic runs per preemption probability, averaged (the paper's Table 6).

Runs are split into chunks of seeds and spread over worker processes (`workers`, default: the
number of CPUs). Every probability uses the same seeds 0..runs-1, so rows differ only by the
probability. `progress(n)` is called as chunks finish (the CLI draws a rich progress bar).
"""

from __future__ import annotations

import math
import multiprocessing
import os
from collections.abc import Callable, Sequence

import attrs
from bamboo.bench.profile import ModelProfile
from bamboo.bench.simulator import AveragedResult, Policy, RunResult, Strategy, average_results, run_many
from bamboo.bench.synthetic import SyntheticSpec

__all__ = ["SweepRow", "sweep"]


@attrs.frozen
class SweepRow:
    """One row of a sweep: the preemption probability and the means over its runs."""

    probability: float
    result: AveragedResult

    def as_dict(self) -> dict[str, object]:
        """The JSON object printed by ``bamboo-bench sweep --json`` (the issue's keys, plus a few more)."""
        r = self.result

        def rounded(value: float, digits: int = 4) -> float | None:
            return None if math.isnan(value) else round(value, digits)

        return {
            "prob": self.probability,
            "strategy": r.strategy.value,
            "runs": r.runs,
            "completed_runs": r.completed_runs,
            "preemptions": rounded(r.preemptions, 2),
            "interval_h": rounded(r.interval_h, 3),
            "lifetime_h": rounded(r.lifetime_h, 2),
            "fatal_failures": rounded(r.fatal_failures, 3),
            "nodes": rounded(r.nodes, 2),
            "throughput": rounded(r.throughput, 2),
            "cost_per_hour": rounded(r.cost_per_hour, 2),
            "value": rounded(r.value, 3),
            "progress_share": rounded(r.progress_share, 3),
            "duration_h": rounded(r.duration_h, 2),
        }


def _chunk_job(args: tuple[SyntheticSpec, tuple[int, ...], ModelProfile, Strategy, Policy]) -> tuple[float, list[RunResult]]:
    spec, seeds, profile, strategy, policy = args
    return spec.preemption_probability, run_many(spec, seeds, profile, strategy, policy)


def sweep(
    profile: ModelProfile,
    probabilities: Sequence[float],
    runs: int,
    *,
    strategy: Strategy = Strategy.BAMBOO,
    zones: int = 3,
    bulk_mean: float = 2.0,
    policy: Policy | None = None,
    workers: int | None = None,
    chunk: int = 50,
    progress: Callable[[int], None] | None = None,
) -> list[SweepRow]:
    """Run `runs` seeds per probability on the synthetic model, until completion.

    The synthetic cluster's desired size is the strategy's: Bamboo's cluster for ``bamboo``, the profile's
    cluster without redundancy for the others (``ModelProfile.desired_nodes_for``).
    """
    if runs < 1:
        raise ValueError(f"runs must be >= 1, got {runs}")
    if not probabilities:
        raise ValueError("sweep needs at least one probability")
    policy = policy or Policy()
    desired = profile.desired_nodes_for(redundancy=strategy is Strategy.BAMBOO)
    specs = {
        p: SyntheticSpec(preemption_probability=p, desired_nodes=desired, zones=zones, bulk_mean=bulk_mean)
        for p in probabilities
    }
    jobs = []
    # Largest probabilities first: they take longest, so the pool stays busy to the end.
    for p in sorted(specs, reverse=True):
        for start in range(0, runs, chunk):
            seeds = tuple(range(start, min(start + chunk, runs)))
            jobs.append((specs[p], seeds, profile, strategy, policy))
    workers = workers or os.cpu_count() or 1
    collected: dict[float, list[RunResult]] = {p: [] for p in specs}
    if workers == 1:
        for job in jobs:
            p, results = _chunk_job(job)
            collected[p].extend(results)
            if progress is not None:
                progress(len(results))
    else:
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            for p, results in pool.imap_unordered(_chunk_job, jobs):
                collected[p].extend(results)
                if progress is not None:
                    progress(len(results))
    return [SweepRow(p, average_results(collected[p])) for p in probabilities]
