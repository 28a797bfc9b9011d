"""Shared fixtures for the bamboo-launch tests: one embedded etcd per test module (``etcd``), and a membership
store on it under a job named after the test (``membership``), so that the tests of a module never see each
other's keys."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from bamboo.membership import EmbeddedEtcd, EtcdKV, EtcdOptions, MembershipStore


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.close()


@pytest.fixture
def membership(etcd: EmbeddedEtcd, request: pytest.FixtureRequest) -> Iterator[MembershipStore]:
    kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
    yield MembershipStore(kv, request.node.name.replace("[", "-").replace("]", "")[:60])
    kv.close()
