"""EmbeddedEtcd itself: a clear error when etcd cannot start, a crash (SIGKILL) and restart keep the data, and the
server's CPU priority above the training's where it may have one."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from bamboo.membership.embedded import ETCD_NICENESS, EmbeddedEtcd, EtcdStartError, free_port
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


@pytest.mark.skipif(os.geteuid() != 0, reason="only root may raise a process's CPU priority")
def test_the_server_runs_at_a_higher_cpu_priority_than_its_starter_and_restarts_so() -> None:
    own = os.getpriority(os.PRIO_PROCESS, 0)
    with EmbeddedEtcd() as plain:
        assert os.getpriority(os.PRIO_PROCESS, plain.pid) == own  # not asked for
    with EmbeddedEtcd(niceness=ETCD_NICENESS) as server:
        assert os.getpriority(os.PRIO_PROCESS, server.pid) == max(-20, own + ETCD_NICENESS)
        server.kill()
        server.start()  # the same command again
        assert server.healthy() and os.getpriority(os.PRIO_PROCESS, server.pid) == max(-20, own + ETCD_NICENESS)


def test_a_port_it_picked_and_lost_before_the_start_is_picked_again() -> None:
    server = EmbeddedEtcd(start_timeout=10)
    lost = server.client_port
    with socket.socket() as thief:
        thief.bind(("127.0.0.1", lost))
        thief.listen()
        try:
            server.start()
            assert server.healthy() and server.client_port != lost
        finally:
            server.close()


def test_free_port_stays_below_the_ephemeral_range() -> None:
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    assert all(20000 <= free_port() < low for _ in range(20))


def test_a_server_left_running_is_stopped_when_its_process_exits(tmp_path: Path) -> None:
    """A script that starts an etcd and forgets to stop it leaves none behind once it exits normally."""
    script = ("import sys\nfrom pathlib import Path\nfrom bamboo.membership import EmbeddedEtcd\n"
              "etcd = EmbeddedEtcd(Path(sys.argv[1])).start()\nprint(etcd.pid, flush=True)\n")
    done = subprocess.run([sys.executable, "-c", script, str(tmp_path / "data")], capture_output=True, text=True,
                          timeout=60, check=True)
    pid = int(done.stdout.split()[-1])
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z":
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            raise AssertionError(f"etcd {pid} outlived the process that started it")
        time.sleep(0.05)
    assert (tmp_path / "data").is_dir()  # its data is kept
