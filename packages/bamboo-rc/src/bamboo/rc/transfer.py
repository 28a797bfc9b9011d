"""Moving a stage's state between processes over torch.distributed.

After a consecutive failure the launcher rebuilds the lost stages from the copies that survive
(data-parallel peers, shadows). :func:`export_stage_state` sends everything a stage needs to
continue exactly (parameters, optimizer state, LR-scheduler state, step counter, and the replica
of the successor when there is one) to another process over a gloo group;
:func:`import_stage_state` receives it and loads it into that process's slices. The payload is
`torch.save` bytes in a uint8 tensor, sent in 1 MiB chunks behind an 8-byte length.
"""

from __future__ import annotations

import io

import torch
from bamboo.rc.comm import chunk_views
from bamboo.rc.state import TrainableSlice
from torch.distributed.distributed_c10d import ProcessGroupGloo

__all__ = ["export_stage_state", "import_stage_state"]

_TAG_LENGTH, _TAG_DATA = 7001, 7002


def export_stage_state(slices: dict[int, TrainableSlice], group: ProcessGroupGloo, dst: int) -> int:
    """Send the state of every slice in `slices` (stage -> slice) to group rank `dst`.

    Returns the number of bytes sent.
    """
    buffer = io.BytesIO()
    torch.save({stage: piece.state_bytes() for stage, piece in slices.items()}, buffer)
    data = torch.frombuffer(bytearray(buffer.getvalue()), dtype=torch.uint8)
    group.send([torch.tensor([data.numel()], dtype=torch.int64)], dst, _TAG_LENGTH).wait()
    for index, chunk in enumerate(chunk_views(data)):
        group.send([chunk], dst, _TAG_DATA * 1024 + index).wait()
    return data.numel()


def import_stage_state(slices: dict[int, TrainableSlice], group: ProcessGroupGloo, src: int) -> list[int]:
    """Receive states from group rank `src` and load them into `slices`; returns the stages loaded.

    Every received stage must have a slice here (built from the same layer specs and config).
    """
    length = torch.zeros(1, dtype=torch.int64)
    group.recv([length], src, _TAG_LENGTH).wait()
    data = torch.empty(int(length[0]), dtype=torch.uint8)
    for index, chunk in enumerate(chunk_views(data)):
        group.recv([chunk], src, _TAG_DATA * 1024 + index).wait()
    states = torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=False)
    missing = sorted(set(states) - set(slices))
    if missing:
        raise ValueError(f"received state for stages {missing}, which have no slice here")
    for stage, state in states.items():
        slices[stage].load_state_bytes(state)
    return sorted(states)
