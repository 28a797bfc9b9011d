"""EmbeddedEtcd itself: a clear error when etcd cannot start, a crash (SIGKILL) and restart keep the data."""

from __future__ import annotations

import socket

import pytest
from bamboo.membership.embedded import EmbeddedEtcd, EtcdStartError
from bamboo.membership.kv import EtcdKV, EtcdOptions


def test_port_in_use_gives_a_clear_start_error() -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        server = EmbeddedEtcd(client_port=port, start_timeout=10)
        with pytest.raises(EtcdStartError, match=f"127.0.0.1:{port}"):
            server.start()
        assert not server.running
        server.close()


def test_missing_binary_is_named() -> None:
    with pytest.raises(FileNotFoundError, match="'/nonexistent/etcd'"):
        EmbeddedEtcd(binary="/nonexistent/etcd")


def test_kill_and_restart_keep_the_data_and_the_address() -> None:
    with EmbeddedEtcd() as server:
        endpoint, pid = server.endpoint, server.pid
        kv = EtcdKV(EtcdOptions(endpoints=(endpoint,), timeout=2))
        kv.put("/bamboo/e/k", b"v")
        server.kill()
        assert server.pid is None and not server.healthy()
        server.start()
        assert server.endpoint == endpoint and server.pid != pid
        assert kv.get("/bamboo/e/k").value == b"v"
        kv.close()
    assert not server.data_dir.exists()
