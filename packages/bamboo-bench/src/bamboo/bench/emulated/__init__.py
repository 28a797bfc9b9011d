"""bamboo.bench.emulated: the emulated spot cluster, a layer above bamboo-launch (``pip install bamboo-bench[emulated]``).

A whole job on one machine, each node a real process group that a replayed preemption trace SIGKILLs:

- :mod:`~bamboo.bench.emulated.run`: :func:`run_cluster` composes an embedded etcd (or an external one), the
  emulated spot market and one ``bamboo-launch agent`` process per node, plus the live view; its parts are
  :mod:`~bamboo.bench.emulated.run_options` (what a run takes and leaves: :class:`RunOptions`,
  :class:`RunResult`), :mod:`~bamboo.bench.emulated.run_agents` (the market's plan, the agents' command lines,
  the spec), :mod:`~bamboo.bench.emulated.run_watch` (following the job) and
  :mod:`~bamboo.bench.emulated.run_results` (reading back what it left; :func:`compare_with_reference`, the
  check of ``--verify`` against :mod:`~bamboo.bench.emulated.reference`);
- :mod:`~bamboo.bench.emulated.market`: the emulated spot market (a pure plan, a scheduler on an injectable
  clock); :mod:`~bamboo.bench.emulated.processes`: its nodes as real process groups (:class:`ProcessCluster`);
- :mod:`~bamboo.bench.emulated.forkserver`: the fork server that starts every node's agent and worker from one
  preloaded interpreter;
- :mod:`~bamboo.bench.emulated.cli`: ``bamboo-launch run`` and ``bamboo-launch market``, which bamboo-launch's
  command line finds through the ``bamboo.launch.commands`` entry-point group (bamboo-launch never imports
  this layer: an import contract in ``pyproject.toml`` says so).

The measured experiments (:mod:`bamboo.bench.measured`) run bamboo and on-demand through :func:`run_cluster`;
this layer never imports them. Importing it does not import torch.
"""

from bamboo.bench.emulated.forkserver import ForkServer, shared_fork_server
from bamboo.bench.emulated.market import (
    ActionKind,
    ExecutedAction,
    MarketAction,
    MonotonicClock,
    SpotMarket,
    StartedClock,
    market_rate,
    plan_market,
)
from bamboo.bench.emulated.processes import ProcessCluster, kill_process_group
from bamboo.bench.emulated.reference import compare_reports, compare_states, train_reference_history
from bamboo.bench.emulated.run import (
    RunError,
    RunHandles,
    RunOptions,
    RunResult,
    agent_command,
    compare_with_reference,
    initial_plan,
    run_cluster,
    run_spec_fields,
)

__all__ = [
    "ActionKind",
    "ExecutedAction",
    "ForkServer",
    "MarketAction",
    "MonotonicClock",
    "ProcessCluster",
    "RunError",
    "RunHandles",
    "RunOptions",
    "RunResult",
    "SpotMarket",
    "StartedClock",
    "agent_command",
    "compare_reports",
    "compare_states",
    "compare_with_reference",
    "initial_plan",
    "kill_process_group",
    "market_rate",
    "plan_market",
    "run_cluster",
    "run_spec_fields",
    "shared_fork_server",
    "train_reference_history",
]
