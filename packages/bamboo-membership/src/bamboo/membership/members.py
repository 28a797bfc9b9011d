"""The node records a detector follows, versioned: :class:`NodeTable` (the detector's own, mutable) and the
immutable :class:`MembershipView` it hands out, rebuilt only after the records changed.

A reader that runs often (bamboo-launch's elected coordinator, one round per failure notice, leader-key change or
layout change) gets the same view object, with the same ``version``, until a record is added, changed or removed:
it copies nothing, and can cache what it derives from the view (zones, placements) per version.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from types import MappingProxyType

import attrs
from bamboo.membership.records import NodeRecord

__all__ = ["EMPTY_VIEW", "MembershipView", "NodeTable"]


@attrs.frozen
class MembershipView:
    """The followed node records (node id -> record) at one ``version`` of them; ``nodes`` is read-only.

    ``version`` grows by one with each change of the records (a node added, its record changed, a node gone, every
    record forgotten), never goes back during a detector's life, and is 0 before the first record."""

    version: int = attrs.field(validator=attrs.validators.and_(attrs.validators.instance_of(int),
                                                               attrs.validators.ge(0)))
    nodes: Mapping[str, NodeRecord] = attrs.field(factory=lambda: MappingProxyType({}))


EMPTY_VIEW = MembershipView(0)
"""No node followed (a detector that follows none, or no detector at all)."""


class NodeTable:
    """Node id -> record, with a version counter and the :class:`MembershipView` of its current version, built on
    the first read after a change (so many changes between two reads cost one copy). Not locked: its owner
    (the detector) holds its own lock around every call."""

    def __init__(self) -> None:
        self._nodes: dict[str, NodeRecord] = {}
        self._version = 0
        self._view = EMPTY_VIEW

    @property
    def version(self) -> int:
        """How many changes the records have had."""
        return self._version

    def get(self, node: str) -> NodeRecord | None:
        return self._nodes.get(node)

    def put(self, record: NodeRecord) -> bool:
        """Add or replace ``record`` (under its id); True when that changed the records."""
        if self._nodes.get(record.id) == record:
            return False
        self._nodes[record.id] = record
        self._version += 1
        return True

    def update(self, records: Iterable[NodeRecord]) -> None:
        for record in records:
            self.put(record)

    def pop(self, node: str) -> NodeRecord | None:
        """Remove ``node``'s record; returns it (None: there was none, and nothing changed)."""
        record = self._nodes.pop(node, None)
        if record is not None:
            self._version += 1
        return record

    def clear(self) -> None:
        if self._nodes:
            self._nodes = {}
            self._version += 1

    def view(self) -> MembershipView:
        """The records at the current version: the same object until they change."""
        if self._view.version != self._version:
            self._view = MembershipView(self._version, MappingProxyType(dict(self._nodes)))
        return self._view
