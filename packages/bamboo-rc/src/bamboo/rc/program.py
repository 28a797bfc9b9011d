"""From schedules to executor ops: what one node runs in one iteration.

`iteration_ops(layout_stages, micro_batches, stage, redundancy)` gives node `stage`'s ops for a
fault-free iteration: 1F1B for its own stage; with redundancy, an FRC op right after each forward
send (the replica's forward pass runs while the node would otherwise wait for its successor);
with `efeb`, a BRC op right after each backward, once the replica's output gradient exists.
"""

from __future__ import annotations

from bamboo.rc.executor import Op, OpKind

__all__ = ["iteration_ops"]


def iteration_ops(stages: int, micro_batches: int, stage: int, redundancy: str) -> list[Op]:
    """Node `stage`'s ops for one fault-free 1F1B iteration of `micro_batches` microbatches."""
    last = stages - 1
    replica = (stage + 1) % stages if redundancy != "none" and stages > 1 else None

    def forward(k: int) -> list[Op]:
        ops = []
        if stage > 0:
            ops.append(Op(OpKind.RECV_ACT, stage, k))
        ops.append(Op(OpKind.FORWARD, stage, k))
        if stage < last:
            ops.append(Op(OpKind.SEND_ACT, stage, k))
        if replica is not None:
            ops.append(Op(OpKind.FRC, replica, k))
        return ops

    def backward(k: int) -> list[Op]:
        ops = []
        if stage < last:
            ops.append(Op(OpKind.RECV_GRAD, stage, k))
        ops.append(Op(OpKind.BACKWARD, stage, k))
        if stage > 0:
            ops.append(Op(OpKind.SEND_GRAD, stage, k))
        if replica is not None and redundancy == "efeb":
            ops.append(Op(OpKind.BRC, replica, k))
        return ops

    warmup = min(stages - stage - 1, micro_batches)
    ops: list[Op] = []
    for k in range(warmup):
        ops += forward(k)
    for k in range(micro_batches - warmup):
        ops += forward(warmup + k)
        ops += backward(k)
    for k in range(micro_batches - warmup, micro_batches):
        ops += backward(k)
    return ops
