"""How the runtime learns of failures: typed errors and the failure-notice interface.

`bamboo.rc` knows nothing of etcd. A worker that sees a P2P operation fail reports a *suspicion*
through :class:`FailureNotices`; an authority outside the workers (the launcher over
bamboo-membership, or `verify`'s parent process, which sees its children die through `waitpid`)
*confirms* failures by publishing a :class:`FailureEvent`: the next membership epoch and the global
ranks that failed. Nobody acts on a suspicion alone (a slow peer is not a dead peer), and every
survivor acts on the same published event, so all derive the same failover.

:class:`StoreFailureNotices` implements the interface over any c10d store, under
`bamboo/<job>/epoch/<e>` (the event that starts epoch e) and `bamboo/<job>/suspect/<e>/<rank>`.
Values are JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from typing import Protocol

import attrs
from torch.distributed import Store

__all__ = [
    "ConsecutiveFailure",
    "FailureEvent",
    "FailureNoticed",
    "FailureNotices",
    "HandedOver",
    "StoreFailureNotices",
]


@attrs.frozen
class FailureEvent:
    """Confirmed failures that start membership epoch `epoch`: the global ranks that died."""

    epoch: int = attrs.field(validator=attrs.validators.ge(1))
    victims: tuple[int, ...] = attrs.field(converter=lambda v: tuple(sorted(v)))
    handover: bool = False
    """True when the ranks left after a preemption notice, at an iteration boundary."""

    def to_json(self) -> str:
        return json.dumps({"epoch": self.epoch, "victims": list(self.victims), "handover": self.handover})

    @classmethod
    def from_json(cls, text: str | bytes) -> FailureEvent:
        data = json.loads(text)
        return cls(int(data["epoch"]), data["victims"], bool(data.get("handover", False)))


class FailureNotices(Protocol):
    """The runtime's window on failure detection (the launcher implements it over membership)."""

    def suspect(self, epoch: int, reporter: int, peer: int, instruction: str) -> None:
        """Report that `reporter` saw `peer` fail during `instruction` in epoch `epoch`."""

    def poll(self, epoch: int) -> FailureEvent | None:
        """The event that starts epoch `epoch`, if it was published (must not block)."""

    def wait(self, epoch: int, timeout: float) -> FailureEvent | None:
        """Block up to `timeout` seconds for the event that starts epoch `epoch`."""


class FailureNoticed(Exception):
    """Raised inside the executor when a confirmed failure is noticed while waiting."""

    def __init__(self, event: FailureEvent) -> None:
        self.event = event
        super().__init__(f"failure confirmed for epoch {event.epoch}: ranks {list(event.victims)}")


class HandedOver(Exception):
    """Raised by the executor of a node that handed its role to its shadow after a preemption
    notice: the process should now exit (cleanly) before its deadline."""


class ConsecutiveFailure(RuntimeError):
    """Adjacent stages of one pipeline failed (a node and its shadow): no failover is possible.

    Every survivor is left at the consistent start-of-iteration state: partial gradients
    discarded, the optimizer not stepped. `lost_stages` are the stages of `pipeline` whose node
    died; `surviving_copies[s]` lists where copies of each lost stage survive, as
    `("data-parallel", rank)` for the same stage in another pipeline and `("shadow", rank)` for a
    live shadow's replica.
    """

    def __init__(
        self, pipeline: int, lost_stages: Sequence[int], surviving_copies: dict[int, list[tuple[str, int]]]
    ) -> None:
        self.pipeline = pipeline
        self.lost_stages = tuple(sorted(lost_stages))
        self.surviving_copies = surviving_copies
        copies = "; ".join(
            f"stage {s}: " + (", ".join(f"{kind} rank {rank}" for kind, rank in surviving_copies.get(s, [])) or "none")
            for s in self.lost_stages
        )
        super().__init__(
            f"consecutive failure in pipeline {pipeline}: lost stages {list(self.lost_stages)} "
            f"(a node and its shadow); surviving copies: {copies}; every survivor is at the start of the iteration"
        )


class StoreFailureNotices:
    """:class:`FailureNotices` over a c10d store (TCPStore, or the etcd-backed store).

    `job` scopes the keys. Polls use `store.check`, which does not block.
    """

    def __init__(self, store: Store, job: str) -> None:
        self.store = store
        self.job = job

    def _event_key(self, epoch: int) -> str:
        return f"bamboo/{self.job}/epoch/{epoch}"

    def suspect(self, epoch: int, reporter: int, peer: int, instruction: str) -> None:
        value = json.dumps({"reporter": reporter, "peer": peer, "instruction": instruction})
        self.store.set(f"bamboo/{self.job}/suspect/{epoch}/{reporter}", value)

    def poll(self, epoch: int) -> FailureEvent | None:
        key = self._event_key(epoch)
        if not self.store.check([key]):
            return None
        return FailureEvent.from_json(self.store.get(key))

    def wait(self, epoch: int, timeout: float) -> FailureEvent | None:
        deadline = time.monotonic() + timeout
        while True:
            event = self.poll(epoch)
            if event is not None or time.monotonic() >= deadline:
                return event
            time.sleep(0.005)

    def publish(self, event: FailureEvent) -> None:
        """Publish a confirmed event (the authority's side)."""
        self.store.set(self._event_key(event.epoch), event.to_json())
