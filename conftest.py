"""Test-suite wide settings: the two lanes of ``make test``.

``make test`` runs pytest with two xdist workers (``-n 2 --dist loadgroup``). Every test that starts an
emulated cluster (``tests/e2e``, ``tests/hosts``) joins the ``clusters`` group, so those run one after
another on one worker: two clusters side by side on the 2-core machine would starve each other's lease
keep-alives (a 2 s TTL) and turn a slow machine into false failures. Every other test is spread over both
workers, filling the CPU that a cluster test leaves idle (its waits for leases, its single-process phases).
A plain ``pytest`` (no ``-n``) ignores the group and runs everything in one process, as before.
"""

from __future__ import annotations

from pathlib import Path

import pytest

CLUSTER_DIRECTORIES = ("tests/e2e", "tests/hosts")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Put the cluster tests in the ``clusters`` group, and first: xdist hands out work in collection order,
    so the long lane starts at once instead of after every short test."""
    root = Path(str(config.rootpath))
    clusters = []
    for item in items:
        path = Path(str(item.path)).resolve()
        if any(path.is_relative_to(root / directory) for directory in CLUSTER_DIRECTORIES):
            item.add_marker(pytest.mark.xdist_group("clusters"))
            clusters.append(item)
    grouped = set(clusters)
    items[:] = clusters + [item for item in items if item not in grouped]
