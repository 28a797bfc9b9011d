"""Fixtures for bamboo.membership tests: a real etcd on free loopback ports, clients, per-test job names.

The etcd fixture is a thin wrapper around the library's `EmbeddedEtcd` (started once per session, stopped
by PID). Tests that restart or kill etcd start their own instance with `etcd_factory`. `TcpProxy` (fixture
`proxy`) sits between a client and etcd to cut the client off, or to make etcd look hung.

`wait_until` waits for a condition with a generous bound that only turns a hang into a failure; no test
asserts how fast anything happened (latency is measured in tests/benchmarks/bench_membership.py).
"""

from __future__ import annotations

import contextlib
import itertools
import socket
import threading
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


class TcpProxy:
    """A TCP forwarder on a free loopback port in front of `target` (host:port), to cut clients off.

    Modes: `open()` forwards; `cut()` drops every connection and closes new ones at once (a partition
    that the client sees); `blackhole()` drops every connection, then accepts new ones and reads what
    they send without ever answering (a server that never answers); `stall()` keeps the connections but
    holds back every byte until `open()` (a hung server that then recovers, nothing lost).
    """

    def __init__(self, target: str) -> None:
        host, _, port = target.rpartition(":")
        self.target = (host, int(port))
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._mode = "open"
        self._lock = threading.Lock()
        self._sockets: list[socket.socket] = []
        self._closed = False
        self._flowing = threading.Event()
        self._flowing.set()
        self.accepted = 0
        threading.Thread(target=self._accept, name="test-proxy", daemon=True).start()

    @property
    def endpoint(self) -> str:
        return f"127.0.0.1:{self.port}"

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                self.accepted += 1
                mode = self._mode
                self._sockets.append(client)
            if mode == "cut":
                self._close(client)
            elif mode == "blackhole":
                threading.Thread(target=self._swallow, args=(client,), daemon=True).start()
            else:
                try:
                    upstream = socket.create_connection(self.target, timeout=5)
                except OSError:
                    self._close(client)
                    continue
                upstream.settimeout(None)
                with self._lock:
                    self._sockets.append(upstream)
                threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
                threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                self._flowing.wait()
                sink.sendall(data)
        except OSError:
            pass
        self._close(source)
        self._close(sink)

    def _swallow(self, client: socket.socket) -> None:
        try:
            while client.recv(65536):
                pass
        except OSError:
            pass

    @staticmethod
    def _close(sock: socket.socket) -> None:
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            sock.close()

    def _set(self, mode: str) -> None:
        if mode == "stall":
            self._flowing.clear()
            return
        self._flowing.set()
        with self._lock:
            self._mode = mode
            sockets, self._sockets = self._sockets, []
        if mode != "open":
            for sock in sockets:
                self._close(sock)
        else:
            with self._lock:
                self._sockets.extend(sockets)

    def open(self) -> None:
        self._set("open")

    def cut(self) -> None:
        self._set("cut")

    def blackhole(self) -> None:
        self._set("blackhole")

    def stall(self) -> None:
        self._set("stall")

    def close(self) -> None:
        self._closed = True
        self._set("cut")
        self._close(self._listener)


@pytest.fixture
def proxy(etcd: EmbeddedEtcd) -> Iterator[TcpProxy]:
    """A `TcpProxy` in front of the session's etcd."""
    made = TcpProxy(etcd.endpoint)
    yield made
    made.close()
