"""Fixtures for bamboo.membership tests: a real etcd on free loopback ports, clients, per-test job names.

The etcd fixture is a thin wrapper around the library's `EmbeddedEtcd` (started once per session, stopped
by PID). Tests that restart or kill etcd start their own instance with `etcd_factory`.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator

import pytest
from bamboo.membership.embedded import EmbeddedEtcd
from bamboo.membership.kv import EtcdKV, EtcdOptions
from bamboo.membership.store import MembershipStore

_jobs = itertools.count()

WaitUntil = Callable[..., None]


@pytest.fixture(scope="session")
def etcd() -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd().start()
    try:
        yield server
    finally:
        server.close()
    assert not server.running


@pytest.fixture
def etcd_factory() -> Iterator[Callable[[], EmbeddedEtcd]]:
    servers: list[EmbeddedEtcd] = []

    def make() -> EmbeddedEtcd:
        server = EmbeddedEtcd().start()
        servers.append(server)
        return server

    yield make
    for server in servers:
        server.close()


@pytest.fixture
def options(etcd: EmbeddedEtcd) -> EtcdOptions:
    return EtcdOptions(endpoints=(etcd.endpoint,), timeout=2.0)


@pytest.fixture
def kv(options: EtcdOptions) -> Iterator[EtcdKV]:
    client = EtcdKV(options)
    yield client
    client.close()


@pytest.fixture
def job() -> str:
    return f"test-{time.monotonic_ns()}-{next(_jobs)}"


@pytest.fixture
def store(kv: EtcdKV, job: str) -> MembershipStore:
    return MembershipStore(kv, job)


@pytest.fixture
def wait_until() -> WaitUntil:
    """Poll `predicate` until true or `timeout` (seconds) passes; fails with `message`. Real time, bounded."""

    def wait(predicate: Callable[[], bool], timeout: float = 10.0, message: str = "condition") -> None:
        deadline = time.monotonic() + timeout
        while not predicate():
            if time.monotonic() > deadline:
                pytest.fail(f"timed out after {timeout} s waiting for {message}")
            time.sleep(0.01)

    return wait
