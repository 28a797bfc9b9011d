"""Fixtures of the multi-host tests: a fresh `HostNetwork` per test, etcd running inside a host.

Every fixture here skips its test, with the reason, where network namespaces cannot be made
(not root, no iproute2, an unprivileged container). Leftovers of crashed earlier runs are removed
once per session, before the first network is made.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from .host_etcd import HostEtcd
from .netns import HostNetwork, cleanup_leftovers, namespaces_unavailable_reason


@pytest.fixture(scope="session")
def network_namespaces() -> None:
    """Skip unless namespaces can be made here; remove what crashed earlier runs left behind."""
    reason = namespaces_unavailable_reason()
    if reason is not None:
        pytest.skip(f"network namespaces unavailable: {reason}")
    cleanup_leftovers()


@pytest.fixture
def host_network(network_namespaces: None) -> Iterator[HostNetwork]:
    """An empty `HostNetwork` (add hosts with ``add_host``/``add_hosts``), torn down after the test.

    Teardown kills every process left in its hosts and deletes the namespaces, the veth pairs and
    the bridge, also when the test failed; a teardown that leaves anything behind is an error.
    """
    network = HostNetwork()
    try:
        yield network
    finally:
        network.close()


@pytest.fixture
def host_etcd(host_network: HostNetwork, tmp_path: Path) -> Iterator[HostEtcd]:
    """A healthy etcd in its own host (label ``etcd``, the network's first host), data under `tmp_path`."""
    etcd = HostEtcd(host_network.add_host("etcd"), tmp_path / "etcd" / "data")
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.kill()
