"""How a worker without a role finds one: a layout in etcd that places it, or a layout being prepared that does.

A warm worker (a joiner, or a node left out of the last layout) follows the job's layout by a watch
(:class:`bamboo.launch.role_watch.RoleWatch`), and looks for a layout being prepared during it
(:mod:`bamboo.launch.prepare`) each time the layout or a decision changes, and every ``ROLE_RESCAN_S``. A layout that places
it is a role: it starts it at once. A prepared layout that places it is a role too, before its switch: the
worker builds its part while the others train, so that the switch does not wait for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs
from bamboo.launch import timeouts
from bamboo.launch.prepare import Prepared, scan_prepared
from bamboo.launch.session import WorkerSession

if TYPE_CHECKING:
    from bamboo.reconfig import JobLayout

__all__ = ["Role", "wait_role"]


@attrs.frozen
class Role:
    """A role found: a layout to start now (``layout``), or one being prepared (``prepared``)."""

    layout: JobLayout | None = None
    prepared: Prepared | None = None


def wait_role(run: WorkerSession, after: int) -> Role | None:
    """The first role in a generation after ``after`` (see the module docstring); None once the job has ended."""
    cursor: dict[int, int] = {}  # generation -> prepared attempts before this index are known abandoned
    while True:
        seen = run.roles.changes()
        if run.ended() is not None:
            return None
        try:
            layout = run.layout()
            if layout is not None and layout.generation > after and run.node in layout.ranks:
                return Role(layout=layout)
            if layout is not None and layout.generation >= after:
                scan = scan_prepared(run.membership, layout.generation, cursor.get(layout.generation, 0))
                cursor[layout.generation] = scan.next_attempt
                if scan.open is not None and run.node in scan.open.layout.ranks:
                    return Role(prepared=scan.open)
        except Exception:  # etcd restarting (or a record being replaced): look again
            pass
        run.roles.wait_change(seen, timeouts.ROLE_RESCAN_S)
