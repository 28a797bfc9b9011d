"""The trace-driven discrete-event simulator: throughput, cost and value of a training job on spot.

One run replays a stream of spot events (a `Trace`, or the endless synthetic stream) against one
strategy, and integrates the training progress between events: while the job runs with a given
configuration its throughput is constant, so no per-step events are needed. Strategies:

- ``bamboo``: the system's policy (``bamboo.bench.policy``, which is bamboo-reconfig's ``decide`` and
  ``plan_layout`` on integers). A preempted node's shadow (its predecessor in the pipeline) takes over
  after `failover_pause_s`; while any stage is taken over, steps are `fallback_slowdown` times slower.
  Losing a stage together with its shadow is a *fatal failure*: the job re-forms at once after a global
  rendezvous, and it rolls back to the last checkpoint only if some stage has no copy left in any
  pipeline. At the end of the step in progress it reconfigures (local rendezvous plus `reconfiguration_s`)
  after any failover, to rebuild redundancy (no sooner than `rebuild_delay_s` after the failover: the time
  a measured run took to prepare the next layout while it trained on), and when the waiting nodes let more
  pipelines run. Every
  layout is the planner's: depth P, ``min(D, usable // P)`` pipelines, the fewest same-zone neighbours,
  holders kept at their stages, the rest on standby.
- Pure data parallelism (a profile with P = 1): every node is one replica, and the replicas form one ring;
  a replica's shadow is its ring successor, which also computes its share (eager: overbatching). Losing a
  replica whose ring neighbours are alive is a failover like any other (the pause, then the rebuild at the
  step boundary); losing one next to a lost one is the consecutive failure (fatal): the job re-forms after a
  global rendezvous, and rolls back to the checkpoint only if no replica is left. The ring is placed by
  ``policy.plan_replica_ring`` (bamboo-reconfig plans P >= 2 only).
- ``checkpoint``: every preemption of a working node restarts the job (global rendezvous plus
  `restart_s`) from the last checkpoint; new nodes that allow another pipeline trigger a restart
  after a fresh checkpoint (no rollback). With a profile's ``checkpoint_restart_on_join`` of
  ``every-join`` (torchrun's elastic agents), every node that joins (also while a restart is under way, which
  then starts over) restarts the job from the last
  checkpoint instead, whether or not it allows another pipeline.
- ``sample-dropping``: a pipeline that loses a node drops out (its samples are dropped, the others
  go on) until a reconfiguration re-forms pipelines (placed by the same planner); when no pipeline is
  left it re-forms after a global rendezvous, rolling back only if some stage lost every copy.
- ``on-demand``: the profile's on-demand cluster, never preempted, at on-demand prices; it trains from
  ``on_demand_startup_s`` on (0 by default) and is billed from the start.

A profile's ``timing.startup_s`` (measured profiles set it) replaces the first start: the nodes present at
time 0 are ready at once and the first layout forms ``startup_s`` after the start, instead of after
`instance_creation_s` and the global rendezvous (which every later start still takes).

How many of a trace's instances a strategy holds: by default every one (the published simulator's replay,
and what the emulated cluster does). With ``desired_nodes`` (``simulate --trace --hold desired``), a
strategy asks the market for its own cluster only, as in the synthetic model: it takes a trace's new
instance only while it holds fewer than `desired_nodes`, and never the declined ones later (a replacement
is the trace's next new instance). This matters where the strategies want clusters of different sizes
(the pure data-parallel profiles): without it, a strategy that wants 20 nodes is billed for every node
of a 32-node trace.

Periodic checkpoints that stop training (``timing.checkpoint_s``) slow every spot strategy's progress by
the share of training time they take, ``checkpoint_s / checkpoint_interval_s``.

The strategies without redundancy (checkpoint, sample dropping) run on the profile's cluster without
redundancy (``ModelProfile.pipelines_for(redundancy=False)`` and its step times), Bamboo on the profile's own.

Outputs per run (`RunResult`) and averaged over seeds (`average_results`).

This module is the simulator's front: the strategies are `bamboo.bench.strategy`'s, the outputs
`bamboo.bench.results`', and one run is `bamboo.bench.sim_engine.SimulatedRun` (how each strategy reacts to
events) over `bamboo.bench.sim_state.RunState` (the state, clock and progress it keeps).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np
from bamboo.bench.profile import ModelProfile
from bamboo.bench.results import AveragedResult, RunResult, Timeline, average_results
from bamboo.bench.sim_engine import SimulatedRun
from bamboo.bench.strategy import Policy, PolicyMismatch, Strategy
from bamboo.bench.synthetic import SyntheticSpec, SyntheticTraceGenerator
from bamboo.bench.trace import Trace

__all__ = [
    "AveragedResult",
    "Policy",
    "PolicyMismatch",
    "RunResult",
    "Strategy",
    "Timeline",
    "average_results",
    "holding_at_most",
    "run_many",
    "simulate_run",
    "simulate_synthetic",
]


def _on_demand_result(profile: ModelProfile, target_samples: float, until_s: float, record: bool) -> RunResult:
    rate = profile.on_demand_samples_per_second
    startup = profile.on_demand_startup_s
    end = min(startup + target_samples / rate, until_s)
    samples = max(0.0, end - startup) * rate
    throughput = samples / end if end > 0 else 0.0
    cost = profile.on_demand_cost_per_hour
    timeline = None
    if record:
        nodes = profile.on_demand_nodes
        if startup > 0 and end > startup:
            timeline = Timeline(np.array([0.0, startup, end]), np.array([nodes, nodes, nodes]), np.array([0.0, rate, rate]))
        else:
            timeline = Timeline(np.array([0.0, end]), np.array([nodes, nodes]),
                                np.array([rate if startup == 0 else 0.0] * 2))
    return RunResult(
        strategy=Strategy.ON_DEMAND,
        completed=startup + target_samples / rate <= until_s,
        duration_h=end / 3600.0,
        samples=samples,
        preemptions=0,
        interval_h=math.nan,
        lifetime_h=end / 3600.0,
        fatal_failures=0,
        reconfigurations=0,
        nodes=float(profile.on_demand_nodes),
        throughput=throughput,
        cost_per_hour=cost,
        value=throughput / cost,
        progress_share=max(0.0, end - startup) / end if end > 0 else 0.0,
        timeline=timeline,
    )


def _trace_events(trace: Trace) -> Iterator[tuple[float, bool, int, int]]:
    return iter(zip(trace.time_s.tolist(), trace.is_add.tolist(), trace.node.tolist(), trace.zone.tolist(), strict=True))


def holding_at_most(
    events: Iterable[tuple[float, bool, int, int]], desired_nodes: int
) -> Iterator[tuple[float, bool, int, int]]:
    """The events of the instances a cluster that wants `desired_nodes` takes from `events`.

    A new instance is taken only while fewer than `desired_nodes` are held; a declined instance is never
    taken later, and its removal is dropped.
    """
    if desired_nodes < 1:
        raise ValueError(f"desired_nodes must be >= 1, got {desired_nodes!r}")
    held: set[int] = set()
    for event in events:
        _, is_add, node, _ = event
        if is_add:
            if len(held) < desired_nodes:
                held.add(node)
                yield event
        elif node in held:
            held.discard(node)
            yield event


def simulate_run(
    source: Trace | Iterable[tuple[float, bool, int, int]],
    profile: ModelProfile,
    strategy: Strategy,
    *,
    policy: Policy | None = None,
    target_samples: float | None = None,
    until_s: float | None = None,
    record: bool = False,
    check_policy: bool = False,
    desired_nodes: int | None = None,
) -> RunResult:
    """Simulate one run of `strategy` on `source` until `target_samples` are trained or `until_s` passes.

    `source` is a `Trace` or an iterable of (time_s, is_add, node id, zone index) in time order
    (e.g. `SyntheticTraceGenerator.events()`). `target_samples` defaults to the profile's
    `job_samples`; `until_s` defaults to no limit. With `record`, the result carries a `Timeline`.
    `desired_nodes` None: the strategy holds every instance of `source`; a number: at most that many
    (`holding_at_most`; e.g. ``profile.desired_nodes_for(redundancy=...)``, the cluster the strategy asks for).
    With `check_policy` (bamboo only; slow), every placement and decision is also computed by
    bamboo-reconfig's ``plan_layout`` and ``decide`` on the same state, and a difference raises
    `PolicyMismatch`.
    """
    target = profile.job_samples if target_samples is None else target_samples
    limit = math.inf if until_s is None else until_s
    if not target > 0:
        raise ValueError(f"target_samples must be > 0, got {target!r}")
    if not limit > 0:
        raise ValueError(f"until_s must be > 0, got {limit!r}")
    if strategy is Strategy.ON_DEMAND:
        return _on_demand_result(profile, target, limit, record)
    events = _trace_events(source) if isinstance(source, Trace) else iter(source)
    if desired_nodes is not None:
        events = holding_at_most(events, desired_nodes)
    return SimulatedRun(profile, strategy, policy or Policy(), target, limit, record, check_policy).run(events)


def simulate_synthetic(
    spec: SyntheticSpec,
    seed: int,
    profile: ModelProfile,
    strategy: Strategy,
    *,
    policy: Policy | None = None,
    target_samples: float | None = None,
    max_hours: float = 1000.0,
    record: bool = False,
    check_policy: bool = False,
) -> RunResult:
    """One run "until completion" on the synthetic stream for `seed` (given up after `max_hours`)."""
    events = SyntheticTraceGenerator(spec, seed).events(until_s=max_hours * 3600.0)
    return simulate_run(
        events, profile, strategy, policy=policy, target_samples=target_samples, until_s=max_hours * 3600.0,
        record=record, check_policy=check_policy,
    )


def run_many(
    spec: SyntheticSpec,
    seeds: Sequence[int],
    profile: ModelProfile,
    strategy: Strategy,
    policy: Policy | None = None,
    progress: Callable[[int], None] | None = None,
) -> list[RunResult]:
    """Run `simulate_synthetic` for each seed in this process, calling `progress(1)` after each."""
    results = []
    for seed in seeds:
        results.append(simulate_synthetic(spec, seed, profile, strategy, policy=policy))
        if progress is not None:
            progress(1)
    return results
