"""A node posts every data-parallel all-reduce of its iteration before it waits for any of them.

The runtime waits for a stage's data-parallel reduction at that stage's replica sync (``SY``: the reduced
gradients go to the shadow), and the reduction completes only once the stage's host in every pipeline has posted
its ``AR``. A node that hosts one stage posts its one ``AR`` before its ``SY``. A node that hosts two (a shadow
after a hand-over or a failover) must post both before it waits for either: with ``1AR 1SY 2AR`` it sat in
``1SY`` while another pipeline's host of stage 2 waited for stage 2's reduction, which needed this node's
``2AR``, before it sent what that pipeline's host of stage 1 needed to post ``1AR``. Three pipelines, each waiting
on the next (found by ``bamboo-rc soak --stages 3 --pipelines 3 --notices``: a hand-over in one pipeline, a
failover in another; every worker timed out).

:func:`allreduces_before_syncs` is the lowering pass that the merged and failover schedules go through: each ``AR``
that follows one of its node's ``SY`` moves to just before the first such ``SY``, when the stage's backward work on
that node (``B``, ``BRC``) is all done by then. Where it is not (the host of the last stage and of stage 0, whose
backward comes last; a shadow that takes a stage over in a failover's remainder), the node waits for a reduction
before it posts the other stage's ``AR``. In a steady schedule that wait is for a later stage's reduction, and every
node waits in that order, so no cycle forms; a failover's remainder may invert it for its taken-over stage, which
can deadlock: under ``efeb`` every node sends eager gradient messages after its ``SY``, so another pipeline's nodes
wait, through them, for the redo. There :func:`syncs_after_allreduces` moves the ``SY`` after the ``AR`` instead, and
`bamboo.schedule.failover` keeps that only where blocking execution of the remainder still completes (a merge may
put a neighbour's ``RY`` of that sync before one of its own sends).
:func:`sync_problem` is the validator's check that no ``AR`` that could be posted before a ``SY`` comes after it.

The wait at a ``SY`` is a wait on the other pipelines, and what a node does after it, its own pipeline waits for. So
a remainder's first choice is :func:`syncs_last`: every ``SY`` after the node's other work (before its closing
``RY``), where blocking execution allows, else after its last ``AR``, else as it is. With ``P = 5``, ``D = 2`` under
``efeb`` and the last stage of pipeline 0 killed right after its ``AR``, the host of stage 1 sat in its ``1SY``
(for the stage's reduction) before it received the eager gradients that the shadow sends on its way to the redone
``4AR``, while pipeline 1's stage 1 could not post its ``1AR``: it was sending to its last stage, which waited in
``4SY`` for that redo (``bamboo-rc soak --stages 5 --pipelines 2 --redundancy efeb --second-failures --seed 220``,
2 of 60 runs; every worker timed out).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from bamboo.schedule.ir import Instruction, Kind

__all__ = ["allreduces_before_syncs", "sync_problem", "syncs_after_allreduces", "syncs_last"]


_BACKWARD = (Kind.BACKWARD, Kind.BRC)


def _ready_after(stream: Sequence[Instruction], at: int, stage: int) -> int:
    """The index of the last backward work of ``stage`` before ``at`` (-1: none): its ``AR`` may come after it."""
    return max((i for i in range(at) if stream[i].kind in _BACKWARD and stream[i].stage == stage), default=-1)


def _hoisted(stream: Sequence[Instruction]) -> list[Instruction]:
    out = list(stream)
    for instruction in [i for i in stream if i.kind is Kind.ALLREDUCE]:
        at = out.index(instruction)
        first_sync = next((i for i in range(at) if out[i].kind is Kind.SYNC_SEND), None)
        if first_sync is not None and _ready_after(out, at, instruction.stage) < first_sync:
            out.insert(first_sync, out.pop(at))
    return out


def allreduces_before_syncs(streams: Mapping[int, Sequence[Instruction]]) -> dict[int, tuple[Instruction, ...]]:
    """Each stream with every ``AR`` that follows a ``SY`` moved to just before the first one, where the stage's
    backward work on the node allows (see the module docstring)."""
    return {node: tuple(_hoisted(stream)) for node, stream in streams.items()}


def syncs_after_allreduces(streams: Mapping[int, Sequence[Instruction]]) -> dict[int, tuple[Instruction, ...]]:
    """Each stream with the replica syncs that precede its last all-reduce moved to just after it, in order: the
    remedy where an ``AR`` cannot move ahead of its node's ``SY``. Not always safe within a pipeline (see the module
    docstring): its caller keeps the result only where blocking execution still completes."""
    out: dict[int, tuple[Instruction, ...]] = {}
    for node, stream in streams.items():
        last = max((i for i, instruction in enumerate(stream) if instruction.kind is Kind.ALLREDUCE), default=0)
        early = {i for i, instruction in enumerate(stream[:last]) if instruction.kind is Kind.SYNC_SEND}
        kept = [instruction for i, instruction in enumerate(stream[: last + 1]) if i not in early]
        out[node] = (*kept, *(stream[i] for i in sorted(early)), *stream[last + 1:])
    return out


def syncs_last(streams: Mapping[int, Sequence[Instruction]]) -> dict[int, tuple[Instruction, ...]]:
    """Each stream with its replica syncs moved, in order, after its other work and before the replica receives
    (``RY``) that close it. Not always safe within a pipeline either: its caller keeps the result only where
    blocking execution still completes."""
    out: dict[int, tuple[Instruction, ...]] = {}
    for node, stream in streams.items():
        end = len(stream)
        while end and stream[end - 1].kind is Kind.SYNC_RECV:
            end -= 1
        body = stream[:end]
        syncs = [instruction for instruction in body if instruction.kind is Kind.SYNC_SEND]
        out[node] = (*(i for i in body if i.kind is not Kind.SYNC_SEND), *syncs, *stream[end:])
    return out


def sync_problem(streams: Mapping[int, Sequence[Instruction]]) -> tuple[str, list[tuple[int, int]]] | None:
    """The first replica sync that precedes an all-reduce of its node that could have been posted before it (the
    stage's backward work on the node all done by then: see the module docstring), with both cells; else None."""
    for node in sorted(streams):
        stream = streams[node]
        syncs = [i for i, instruction in enumerate(stream) if instruction.kind is Kind.SYNC_SEND]
        if not syncs:
            continue
        for at, instruction in enumerate(stream):
            if instruction.kind is not Kind.ALLREDUCE or at < syncs[0]:
                continue
            ready = _ready_after(stream, at, instruction.stage)
            waited = next((i for i in syncs if ready < i < at), None)
            if waited is not None:
                return (f"node {node} waits for a reduction at {stream[waited]} before it posts {instruction}, whose "
                        "gradients were ready: a node posts every all-reduce it can before it waits for one",
                        [(node, waited), (node, at)])
    return None
