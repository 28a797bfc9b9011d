"""The job's ``step`` records: one per step, and none lost with the node that writes them.

The host of the last stage of pipeline 0 writes each step's record (P = 1: the first live node). Records go out
from a background thread (:mod:`bamboo.launch.event_writer`), so a writer killed right after a step can take the
record of that step with it: the report then sees a step that trained but was never recorded (its loss and time
lost). Every node that may become the writer (pipeline 0's nodes; P = 1: every node) therefore builds the record
of each step, and holds the last one it did not write. A node that writes the first record of its own
(:meth:`StepRecords.settle`) while holding the record of the step just before, in the same layout, took the
writing over from a node that left, and that node may have died with that record queued: the record is written
again unless the nodes that died (their workers' records in etcd) have it. The check reads those nodes' records
once, on the event writer's thread, not on the training loop's; a node confirmed dead is fenced, so nothing it
queued can land after the check.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Sequence

import attrs
from bamboo.launch.event_records import Step
from bamboo.launch.event_writer import writer_for
from bamboo.launch.events import EventWriter, events_prefix
from bamboo.membership import KeyValueStore, StoreError

__all__ = ["StepRecords", "recorded", "worker_records_prefix", "worker_writer"]

def worker_writer(node: str, pid: int) -> str:
    """The event-log writer name of node ``node``'s worker process ``pid``."""
    return f"{node}.worker.{pid}"


def worker_records_prefix(job: str, node: str) -> str:
    """The etcd prefix of every record that any worker of ``node`` wrote in job ``job``."""
    return f"{events_prefix(job)}{node}.worker."


def recorded(kv: KeyValueStore, prefixes: Sequence[str], record: Step) -> bool:
    """Whether a ``step`` record of ``record``'s step and generation is under any of ``prefixes``."""
    for prefix in prefixes:
        for item in kv.get_prefix(prefix):
            try:
                found = json.loads(item.value)
            except ValueError:
                continue  # the report names a bad record; here it is only not this step's
            if (isinstance(found, dict) and found.get("kind") == Step.KIND and found.get("step") == record.step
                    and found.get("generation") == record.generation):
                return True
    return False


@attrs.define
class StepRecords:
    """The step records of one worker (see the module docstring): what it writes, and the one it holds."""

    held: Step | None = None
    """The record of the last step this node built and did not write."""

    def settle(self, record: Step, *, writes: bool) -> Step | None:
        """After a step: hold ``record`` if this node does not write it; when it does, return the held record of
        the step just before (same generation), which the writer before this node may have died with."""
        if not writes:
            self.held = record
            return None
        before, self.held = self.held, None
        if before is not None and before.generation == record.generation and before.step == record.step - 1:
            return before
        return None

    def after_step(self, record: Step, *, writes: bool, events: EventWriter, kv: KeyValueStore,
                   departed: Callable[[], Sequence[str]]) -> None:
        """Settle ``record`` (:meth:`settle`); write it when this node writes, after the one it may recover, which
        goes out unless the records under ``departed()`` (the etcd prefixes of the nodes that left) have it."""
        recover = self.settle(record, writes=writes)
        if recover is not None:
            prefixes = departed()
            _on_writer_thread(kv, lambda: _write_unless_recorded(kv, events, prefixes, recover))
        if writes:
            events.write(record)


def _write_unless_recorded(kv: KeyValueStore, events: EventWriter, prefixes: Sequence[str], record: Step) -> None:
    try:
        if recorded(kv, prefixes, record):
            return
    except StoreError as error:  # the report counts a step whose record is missing; a duplicate would count twice
        print(f"step {record.step}: cannot read the records of the nodes that left ({error}); its record is not "
              "written again", file=sys.stderr, flush=True)
        return
    events.write(record)
    print(f"step {record.step}: its record was not in etcd (its writer left with it queued); written again",
          file=sys.stderr, flush=True)


def _on_writer_thread(kv: KeyValueStore, task: Callable[[], None]) -> None:
    writer = writer_for(kv)
    if writer is None:
        task()
    else:
        writer.submit(task)
