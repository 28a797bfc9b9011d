"""bamboo.reconfig: reconfiguration planning for Bamboo, as pure functions every node runs alike.

- ``decide(view)``: reconfigure now (consecutive failure), at the next step boundary (a new pipeline can
  form, one more failure would be fatal, a shadow carries two stages while a replacement waits, or any
  failover, to rebuild redundancy), or carry on (every pipeline whole); each decision carries its reasons.
- ``plan_layout(view)``: the new layout: depth P kept first, ``D' = min(D, usable // P)`` whole pipelines,
  surplus nodes in standby, the minimum possible number of same-zone neighbours, a compute-balanced
  layer split within node memory, and microbatch shares that keep the global batch.
- ``JobLayout``: the versioned record of one generation of a job (placement, stage bounds, how it starts:
  first layout, transfer plan or checkpoint restore point), as every node reads it from etcd.
- ``plan_transfers(old, new, holders)``: each new owner fetches only the layers it lacks, from a surviving
  holder, in rounds where no node sends or receives two transfers at once; or "restore from checkpoint".
- ``cheapest_order(costs, slot_kinds)``: the least-cost matching of nodes to slots that ``plan_layout`` uses
  within each zone, exact and pure Python (nodes and slots come in few kinds).

Every value class is frozen, validated, and round-trips through JSON (``to_dict``/``from_dict``,
``to_json``/``from_json``). Outputs do not depend on input order.
"""

from bamboo.reconfig.assignment import cheapest_order
from bamboo.reconfig.decide import Decision, Reason, When, decide
from bamboo.reconfig.job_layout import (
    LAYOUT_VERSION,
    MODES,
    JobLayout,
    ModeChoice,
    RecordError,
    RestorePoint,
    StartMode,
)
from bamboo.reconfig.layout_plan import even_pipeline_counts, microbatch_shares, pipeline_count, plan_layout
from bamboo.reconfig.model import (
    ClusterView,
    LayerSpec,
    Layout,
    LayoutError,
    Node,
    NodeState,
    StageSlot,
    parse_nodes,
)
from bamboo.reconfig.partition import InfeasibleSplit, node_state_bytes, split_layers, stage_costs
from bamboo.reconfig.placement import minimum_same_zone_pairs, same_zone_pairs
from bamboo.reconfig.transfers import (
    Transfer,
    TransferPlan,
    holdings_from_layout,
    minimum_rounds,
    plan_transfers,
)

__all__ = [
    "LAYOUT_VERSION",
    "MODES",
    "ClusterView",
    "Decision",
    "InfeasibleSplit",
    "JobLayout",
    "LayerSpec",
    "Layout",
    "LayoutError",
    "ModeChoice",
    "Node",
    "NodeState",
    "Reason",
    "RecordError",
    "RestorePoint",
    "StageSlot",
    "StartMode",
    "Transfer",
    "TransferPlan",
    "When",
    "cheapest_order",
    "decide",
    "even_pipeline_counts",
    "holdings_from_layout",
    "microbatch_shares",
    "minimum_rounds",
    "minimum_same_zone_pairs",
    "node_state_bytes",
    "parse_nodes",
    "pipeline_count",
    "plan_layout",
    "plan_transfers",
    "same_zone_pairs",
    "split_layers",
    "stage_costs",
]
