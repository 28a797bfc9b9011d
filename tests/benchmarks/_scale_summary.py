"""The summary of ``bench_scale.py --repeat K``: per size, what K runs had in all (crashes, lost events, false
failures) and the spread of their p99s, so that "no crash and no lost event in 10 runs at 1,000 agents" is one
object to read.

Each summary object keeps the per-run keys of ``--json`` (``agents``, ``startup_p99_s``, ``failure_p99_s``,
``reconfigure_p99_s``, ``agent_cpu_pct``, ``lost_events``, ``crashes``) with the value that a goal is checked
against: a time or CPU figure is the worst run's (the largest), a count is the sum over the runs. Each measured
figure also has its spread over the runs, ``<key>_spread``: ``{"min", "median", "max"}``.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from typing import Any

__all__ = ["SPREAD_KEYS", "SUM_KEYS", "summarize", "summary_lines"]

SPREAD_KEYS = ("startup_p99_s", "failure_p99_s", "failure_1pct_p99_s", "reconfigure_p99_s", "agent_cpu_pct")
"""The figures whose worst run and spread the summary gives."""

SUM_KEYS = ("lost_events", "crashes", "false_failures")
"""The counts the summary adds up over the runs."""


def _measured(values: Sequence[Any]) -> list[float]:
    return [float(v) for v in values if isinstance(v, (int, float)) and not math.isnan(v)]


def summarize(results: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One summary object per number of agents in ``results`` (the runs' objects, in the order of the sizes)."""
    sizes = list(dict.fromkeys(r["agents"] for r in results))
    summaries = []
    for agents in sizes:
        runs = [r for r in results if r["agents"] == agents]
        summary: dict[str, Any] = {"summary": True, "agents": agents, "runs": len(runs),
                                   "runs_with_a_crash": sum(1 for r in runs if r.get("crashes")),
                                   "runs_with_a_lost_event": sum(1 for r in runs if r.get("lost_events"))}
        for key in SUM_KEYS:
            summary[key] = sum(int(r.get(key) or 0) for r in runs)
        for key in SPREAD_KEYS:
            values = _measured([r.get(key) for r in runs])
            summary[key] = max(values) if values else None
            summary[f"{key}_spread"] = ({"min": min(values), "median": statistics.median(values), "max": max(values)}
                                        if values else None)
        summaries.append(summary)
    return summaries


def summary_lines(summaries: Sequence[dict[str, Any]]) -> list[str]:
    """The summaries as text: per size, the counts and each figure's min / median / max over the runs."""
    def figure(key: str, spread: dict[str, float] | None) -> str:
        if spread is None:
            return f"{key} -"
        scale, unit = (1e3, " ms") if key.endswith("_s") else (1.0, "%")
        return f"{key} {spread['min'] * scale:.3g} / {spread['median'] * scale:.3g} / {spread['max'] * scale:.3g}{unit}"

    lines = []
    for s in summaries:
        lines.append(f"{s['agents']} agents, {s['runs']} runs: {s['crashes']} crashes ({s['runs_with_a_crash']} runs), "
                     f"{s['lost_events']} lost events ({s['runs_with_a_lost_event']} runs), {s['false_failures']} "
                     "false failures; min / median / max over the runs: "
                     + "; ".join(figure(key, s[f"{key}_spread"]) for key in SPREAD_KEYS))
    return lines
