"""``decide(view)``: whether to reconfigure now, at the next step boundary, or carry on.

The triggers (paper §5; docs/architecture.md, "A reconfiguration"), most urgent first; a decision lists every one that
holds, in this order (``Decision.reasons``; ``Decision.reason`` is the first):

- ``consecutive-failure`` (now): a pipeline lost a node and its shadow (two consecutive stages, last to
  first included). The shadow of the lost stage is gone too, so that pipeline cannot go on; training
  reconfigures from the start of the current iteration.
- ``one-more-failure-fatal`` (next step boundary): a pipeline runs with failed stages, and the loss of
  *any* of its surviving nodes would now be fatal. A surviving node's loss is fatal when its own shadow
  is gone (the previous stage failed) or when it is already carrying the next stage for a failed node.
- ``shadow-carrying-two-stages`` (next step boundary): a shadow runs a failed node's stage besides its
  own, and a standby or joining node is waiting to take that stage over.
- ``new-pipeline`` (next step boundary): the waiting (standby and joining) nodes, with the survivors,
  can form more pipelines than run now, up to the target D; or, when the layout runs shallower than the
  target P (too few nodes were left), they can form pipelines of a greater depth again.
- ``rebuild redundancy after a failover`` (next step boundary): some owner of the current layout is
  preempted, so its stage runs on its shadow. That taken-over stage and its successor have no shadow any
  more, so one more failure next to them would be consecutive; the next step boundary re-forms the
  pipelines with full redundancy, even when no replacement waits (the surplus goes to standby, and fewer
  pipelines may run until nodes join). It holds whenever the layout has a preempted owner, so it follows
  ``consecutive-failure`` too, and it alone turns a failover that nothing else calls for into a
  reconfiguration.

With one stage (P = 1) a pipeline is one node and its shadow is the next pipeline's node, which holds
the same parameters: a lost node is a failover (``rebuild redundancy after a failover``, the next step
boundary drops its pipeline and keeps the global batch) as long as one node survives; only the loss of
every node is a ``consecutive-failure``.

Otherwise ``all-pipelines-whole``: carry on. With no layout yet, the decision is to configure now
(``no-layout``).
"""

from __future__ import annotations

import enum
import json
from collections.abc import Mapping
from typing import Any

import attrs
from bamboo.reconfig.layout_plan import choose_depth, pipeline_count
from bamboo.reconfig.model import ClusterView, NodeState
from bamboo.reconfig.partition import InfeasibleSplit


class When(enum.Enum):
    """When to reconfigure."""

    NOW = "now"
    NEXT_STEP_BOUNDARY = "next-step-boundary"
    CARRY_ON = "carry-on"


class Reason(enum.Enum):
    """Why; the machine-readable half of a decision (``Decision.detail`` is the readable half)."""

    NO_LAYOUT = "no-layout"
    CONSECUTIVE_FAILURE = "consecutive-failure"
    ONE_MORE_FAILURE_FATAL = "one-more-failure-fatal"
    SHADOW_CARRYING_TWO_STAGES = "shadow-carrying-two-stages"
    NEW_PIPELINE = "new-pipeline"
    REBUILD_REDUNDANCY = "rebuild redundancy after a failover"
    ALL_PIPELINES_WHOLE = "all-pipelines-whole"


def _to_reasons(value: object) -> tuple[Reason, ...]:
    return tuple(Reason(item) for item in value)  # type: ignore[union-attr]


def _to_ints(value: object) -> tuple[int, ...]:
    return tuple(int(item) for item in value)  # type: ignore[union-attr]


@attrs.frozen
class Decision:
    """What ``decide`` says: when, the triggering reasons (most urgent first), the pipelines concerned."""

    when: When = attrs.field(converter=When)
    reasons: tuple[Reason, ...] = attrs.field(converter=_to_reasons)
    detail: str = attrs.field(validator=attrs.validators.instance_of(str))
    pipelines: tuple[int, ...] = attrs.field(converter=_to_ints, default=())

    @reasons.validator
    def _check_reasons(self, _attribute: attrs.Attribute, value: tuple[Reason, ...]) -> None:
        if not value:
            raise ValueError(f"a decision ({self.when.value}) must carry at least one reason")

    @property
    def reason(self) -> Reason:
        """The most urgent reason."""
        return self.reasons[0]

    @property
    def reconfigure(self) -> bool:
        return self.when is not When.CARRY_ON

    def to_dict(self) -> dict[str, Any]:
        return {
            "when": self.when.value,
            "reasons": [reason.value for reason in self.reasons],
            "detail": self.detail,
            "pipelines": list(self.pipelines),
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Decision:
        return cls(when=data["when"], reasons=data["reasons"], detail=data["detail"],
                   pipelines=data.get("pipelines", ()))

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> Decision:
        return cls.from_dict(json.loads(text))


def decide(view: ClusterView) -> Decision:
    """The reconfiguration decision for ``view`` (deterministic, independent of input order)."""
    layout = view.layout
    usable = len(view.usable_nodes)
    waiting = sum(1 for node in view.nodes if node.state in (NodeState.STANDBY, NodeState.JOINING))
    if layout is None:
        return Decision(When.NOW, [Reason.NO_LAYOUT],
                        f"no layout yet; {usable} usable node(s) to place", ())
    states = {node.id: node.state for node in view.nodes}
    stages = layout.stages
    fatal: dict[int, list[int]] = {}
    degraded: dict[int, list[int]] = {}
    lost_in: dict[int, list[int]] = {}
    fragile: list[int] = []
    for pipeline, row in enumerate(layout.owners):
        dead = [states[node] is NodeState.PREEMPTED for node in row]
        lost = [stage for stage in range(stages) if dead[stage]]
        if not lost:
            continue
        lost_in[pipeline] = lost
        if stages == 1:  # the shadow ring over the pipelines: fatal only when no node is left
            every_node_lost = all(states[owners[0]] is NodeState.PREEMPTED for owners in layout.owners)
            pairs = [0] if every_node_lost else []
        else:
            pairs = [stage for stage in lost if dead[(stage - 1) % stages]]
        if pairs:
            fatal[pipeline] = pairs
            continue
        degraded[pipeline] = lost
        survivors = [stage for stage in range(stages) if not dead[stage]]
        if stages > 1 and all(dead[(stage - 1) % stages] or dead[(stage + 1) % stages] for stage in survivors):
            fragile.append(pipeline)

    # Every pipeline with a preempted owner failed over (its shadows took over what they could).
    rebuild = ""
    if lost_in:
        rebuild = "rebuild redundancy after a failover: " + "; ".join(
            f"pipeline {p}: stage(s) {_join(lost)} lost" for p, lost in lost_in.items()
        ) + " (a taken-over stage and its successor have no shadow)"

    if fatal and stages == 1:
        return Decision(When.NOW, [Reason.CONSECUTIVE_FAILURE, Reason.REBUILD_REDUNDANCY],
                        f"consecutive failure: every node of the {layout.num_pipelines} data-parallel pipelines lost; "
                        + rebuild, sorted(lost_in))
    if fatal:
        parts = [
            f"pipeline {p}: " + ", ".join(f"stage {s} and its shadow stage {(s - 1) % stages}" for s in stages_lost)
            for p, stages_lost in sorted(fatal.items())
        ]
        return Decision(When.NOW, [Reason.CONSECUTIVE_FAILURE, Reason.REBUILD_REDUNDANCY],
                        "consecutive failure: " + "; ".join(parts) + " lost; " + rebuild, sorted(lost_in))

    reasons: list[Reason] = []
    details: list[str] = []
    concerned: set[int] = set()
    if fragile:
        reasons.append(Reason.ONE_MORE_FAILURE_FATAL)
        details.append(f"pipeline(s) {_join(fragile)}: the loss of any surviving node would be fatal")
        concerned.update(fragile)
    if degraded and waiting:
        reasons.append(Reason.SHADOW_CARRYING_TWO_STAGES)
        carried = "; ".join(
            f"pipeline {p}: stage(s) {_join(lost)} carried by their shadows" for p, lost in sorted(degraded.items())
        )
        details.append(f"{carried}; {waiting} replacement(s) waiting")
        concerned.update(degraded)
    possible = pipeline_count(usable, stages, view.target_pipelines, view.global_batch, view.even_shares)
    deeper = _deeper_stages(view, usable) if waiting and stages < view.target_stages else None
    if deeper is not None:
        reasons.append(Reason.NEW_PIPELINE)
        details.append(
            f"{waiting} waiting node(s) with the survivors can run "
            f"{pipeline_count(usable, deeper, view.target_pipelines, view.global_batch, view.even_shares)} pipeline(s) "
            f"of {deeper} "
            f"stages, back towards the target depth, instead of {layout.num_pipelines} of {stages}"
        )
    elif waiting and possible > layout.num_pipelines:
        reasons.append(Reason.NEW_PIPELINE)
        details.append(
            f"{waiting} waiting node(s) with the survivors can run {possible} pipeline(s) of {stages} stages "
            f"instead of {layout.num_pipelines}"
        )
    if degraded:
        reasons.append(Reason.REBUILD_REDUNDANCY)
        details.append(rebuild)
        concerned.update(degraded)
    if reasons:
        return Decision(When.NEXT_STEP_BOUNDARY, reasons, "; ".join(details), sorted(concerned))
    return Decision(When.CARRY_ON, [Reason.ALL_PIPELINES_WHOLE],
                    f"all {layout.num_pipelines} pipeline(s) are whole; {waiting} node(s) waiting", ())


def _deeper_stages(view: ClusterView, usable: int) -> int | None:
    """The depth ``plan_layout`` would now choose, when it is deeper than the current layout's."""
    assert view.layout is not None
    try:
        stages, _bounds = choose_depth(view, usable)
    except InfeasibleSplit:
        return None
    return stages if stages > view.layout.stages and usable >= stages else None


def _join(values: list[int]) -> str:
    return ", ".join(str(value) for value in values)
