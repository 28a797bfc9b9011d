"""Self-tests of the multi-host harness: hosts reach each other, etcd runs in a host, partitions stall,
kill_all empties a host, and nothing is left behind (after close, at exit, after a crash or a failed test).
"""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from .host_etcd import HostEtcd
from .netns import (
    Host,
    HostNetwork,
    NetemUnavailable,
    cleanup_leftovers,
    leftover_names,
    namespaces_unavailable_reason,
)

pytestmark = pytest.mark.netns

TESTS_DIR = Path(__file__).resolve().parents[1]
ECHO_PORT = 7000
REPLY_DEADLINE_S = 20.0
"""How long a test waits for a helper process to answer before it fails (not a performance bound)."""
STALL_TIMEOUT_S = 0.3
"""Socket timeout used to show that a partitioned exchange stalls (it can never succeed, so any value works)."""

ECHO_SERVER = textwrap.dedent(
    """
    import socket, sys, threading

    def serve(conn):
        with conn:
            while data := conn.recv(65536):
                conn.sendall(data)

    server = socket.create_server((sys.argv[1], int(sys.argv[2])))
    print("listening", flush=True)
    while True:
        conn, _ = server.accept()
        threading.Thread(target=serve, args=(conn,), daemon=True).start()
    """
)

# Reads commands on stdin, answers one JSON line each: "send TEXT", "recv N TIMEOUT", "connect TIMEOUT".
ECHO_CLIENT = textwrap.dedent(
    """
    import errno, json, socket, sys

    address, port = sys.argv[1], int(sys.argv[2])

    def outcome(exc):
        if isinstance(exc, TimeoutError):
            return {"error": "timeout"}
        return {"error": errno.errorcode.get(exc.errno, repr(exc))}

    conn = socket.create_connection((address, port), timeout=10)
    print(json.dumps({"connected": True}), flush=True)
    for line in sys.stdin:
        command = line.split()
        try:
            if command[0] == "send":
                conn.sendall(command[1].encode())
                reply = {"sent": command[1]}
            elif command[0] == "recv":
                conn.settimeout(float(command[2]))
                got = b""
                while len(got) < int(command[1]):
                    got += conn.recv(int(command[1]) - len(got))
                reply = {"got": got.decode()}
            else:
                with socket.create_connection((address, port), timeout=float(command[1])) as other:
                    other.sendall(b"ping")
                    reply = {"got": other.recv(4).decode()}
        except OSError as exc:
            reply = outcome(exc)
        print(json.dumps(reply), flush=True)
    """
)

ECHO_ONCE = textwrap.dedent(
    """
    import errno, json, socket, sys

    try:
        with socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])) as conn:
            conn.sendall(b"ping")
            print(json.dumps({"got": conn.recv(4).decode()}))
    except TimeoutError:
        print(json.dumps({"error": "timeout"}))
    except OSError as exc:
        print(json.dumps({"error": errno.errorcode.get(exc.errno, repr(exc))}))
    """
)


class LineReader:
    """The JSON lines a process prints, read by a thread, so that a test waits with a deadline."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        self.proc = proc
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._pump, args=(proc.stdout,), daemon=True).start()

    def _pump(self, stream: Any) -> None:
        for line in stream:
            self.lines.put(line)

    def next(self, timeout: float = REPLY_DEADLINE_S) -> Any:
        try:
            line = self.lines.get(timeout=timeout)
        except queue.Empty:
            raise AssertionError(f"process {self.proc.args!r} printed nothing within {timeout} s") from None
        return json.loads(line) if line.startswith("{") else line.strip()

    def ask(self, command: str) -> Any:
        assert self.proc.stdin is not None
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()
        return self.next()


def start_echo_server(host: Host) -> subprocess.Popen[str]:
    proc = host.popen([sys.executable, "-c", ECHO_SERVER, host.address, str(ECHO_PORT)],
                      stdout=subprocess.PIPE, text=True)
    assert LineReader(proc).next() == "listening"
    return proc


def echo_once(host: Host, address: str, timeout: float) -> dict[str, str]:
    """One connect + ping from inside `host` to the echo server at `address`."""
    done = host.run([sys.executable, "-c", ECHO_ONCE, address, str(ECHO_PORT), str(timeout)],
                    timeout=REPLY_DEADLINE_S, capture_output=True, text=True)
    return dict(json.loads(done.stdout))


def echo_from_root(address: str, timeout: float) -> dict[str, str]:
    """One connect + ping from the test process (the root namespace) to the echo server at `address`."""
    try:
        with socket.create_connection((address, ECHO_PORT), timeout=timeout) as conn:
            conn.sendall(b"ping")
            return {"got": conn.recv(4).decode()}
    except TimeoutError:
        return {"error": "timeout"}
    except OSError as exc:
        return {"error": repr(exc)}


def all_names() -> set[str]:
    """Every namespace (``ip netns list``) and every link (``ip link``) of the machine."""
    netns_dir = Path("/run/netns")
    namespaces = set(os.listdir(netns_dir)) if netns_dir.exists() else set()
    return namespaces | set(os.listdir("/sys/class/net"))


def gone(pid: int) -> bool:
    """True when `pid` has exited (no such process, or a zombie nobody reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except FileNotFoundError:
        return True


def run_python(script: str, timeout: float = REPLY_DEADLINE_S) -> subprocess.CompletedProcess[str]:
    """Run `script` in a fresh interpreter that can import the harness as ``hosts.netns``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS_DIR), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True,
                          timeout=timeout, env=env, check=False)


# -- the network ----------------------------------------------------------------------------------


def test_hosts_get_short_unique_names_and_addresses_of_one_subnet(host_network: HostNetwork) -> None:
    a, b = host_network.add_hosts(2)
    assert a.address != b.address
    assert {a.address, b.address, host_network.root_address} <= {str(ip) for ip in host_network.subnet}
    assert host_network.root_address == str(host_network.subnet.network_address + 1)
    for name in host_network.names():
        assert len(name) <= 15, name
    assert set(host_network.names()) <= all_names()
    routes = a.run(["ip", "-4", "route"], timeout=REPLY_DEADLINE_S, capture_output=True, text=True).stdout
    assert "default" not in routes  # nothing a host sends can leave the machine


def test_two_hosts_reach_each_other_over_tcp(host_network: HostNetwork) -> None:
    a, b = host_network.add_hosts(2)
    start_echo_server(a)
    start_echo_server(b)
    assert echo_once(b, a.address, REPLY_DEADLINE_S) == {"got": "ping"}
    assert echo_once(a, b.address, REPLY_DEADLINE_S) == {"got": "ping"}
    assert echo_from_root(a.address, REPLY_DEADLINE_S) == {"got": "ping"}
    # A host's loopback is its own: the server listens on the host's address only, not on 127.0.0.1.
    assert echo_once(a, "127.0.0.1", REPLY_DEADLINE_S) == {"error": "ECONNREFUSED"}


def test_etcd_in_one_host_serves_a_client_in_another(host_etcd: HostEtcd, host_network: HostNetwork) -> None:
    from bamboo.membership import EtcdKV, EtcdOptions

    client_host = host_network.add_host("client")
    script = (
        "import sys\n"
        "from bamboo.membership import EtcdKV, EtcdOptions\n"
        "with EtcdKV(EtcdOptions(endpoints=(sys.argv[1],))) as kv:\n"
        "    kv.put('/netns/written-by', sys.argv[2].encode())\n"
        "    print(kv.get('/netns/written-by').value.decode())\n"
    )
    done = client_host.run([sys.executable, "-c", script, host_etcd.endpoint, client_host.label],
                           timeout=REPLY_DEADLINE_S * 3, capture_output=True, text=True)
    assert done.stdout.strip() == "client"
    with EtcdKV(EtcdOptions(endpoints=(host_etcd.endpoint,))) as kv:  # the root namespace reads it too
        found = kv.get("/netns/written-by")
        assert found is not None and found.value == b"client"
        first_pid = host_etcd.pid
        host_etcd.kill()
        host_etcd.start()  # same data dir and address: the same client reads the key again
        assert host_etcd.pid != first_pid
        found = kv.get("/netns/written-by")
        assert found is not None and found.value == b"client"


# -- partitions -----------------------------------------------------------------------------------


def test_partition_stalls_tcp_both_ways_and_heal_resumes_it(host_network: HostNetwork) -> None:
    a, b = host_network.add_hosts(2)
    start_echo_server(a)
    start_echo_server(b)
    client = b.popen([sys.executable, "-c", ECHO_CLIENT, a.address, str(ECHO_PORT)],
                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    replies = LineReader(client)
    assert replies.next() == {"connected": True}
    assert replies.ask("send before") == {"sent": "before"}
    assert replies.ask(f"recv 6 {REPLY_DEADLINE_S}") == {"got": "before"}

    a.partition()
    assert a.partitioned
    # In flight: the bytes go out but no echo comes back. Not refused, not unreachable: silence.
    assert replies.ask("send during") == {"sent": "during"}
    assert replies.ask(f"recv 6 {STALL_TIMEOUT_S}") == {"error": "timeout"}
    assert replies.ask(f"connect {STALL_TIMEOUT_S}") == {"error": "timeout"}
    assert echo_once(a, b.address, STALL_TIMEOUT_S) == {"error": "timeout"}  # from inside the partition
    assert echo_from_root(a.address, STALL_TIMEOUT_S) == {"error": "timeout"}
    assert echo_once(a, a.address, REPLY_DEADLINE_S) == {"got": "ping"}  # the host still reaches itself

    a.heal()
    assert not a.partitioned
    # The stalled connection resumes on its next retransmission; new connections work at once.
    assert replies.ask(f"recv 6 {REPLY_DEADLINE_S}") == {"got": "during"}
    assert replies.ask(f"connect {REPLY_DEADLINE_S}") == {"got": "ping"}
    assert echo_once(a, b.address, REPLY_DEADLINE_S) == {"got": "ping"}
    assert echo_from_root(a.address, REPLY_DEADLINE_S) == {"got": "ping"}


def test_slow_adds_latency_each_way(host_network: HostNetwork) -> None:
    a, b = host_network.add_hosts(2)
    start_echo_server(a)
    reason = host_network.netem_unavailable_reason()
    if reason is not None:
        with pytest.raises(NetemUnavailable):
            a.slow(50)
        pytest.skip(reason)
    a.slow(50)
    started = time.monotonic()
    assert echo_from_root(a.address, REPLY_DEADLINE_S) == {"got": "ping"}
    # A lower bound only: connect and ping each cross the link both ways, 50 ms per crossing.
    assert time.monotonic() - started >= 0.2
    a.unslow()
    assert echo_once(b, a.address, REPLY_DEADLINE_S) == {"got": "ping"}


# -- processes --------------------------------------------------------------------------------------


def test_kill_all_leaves_no_process_in_the_host(host_network: HostNetwork) -> None:
    a, b = host_network.add_hosts(2)
    shell = a.popen(["sh", "-c", "sleep 600 & sleep 600 & wait"])
    # A daemon: double-forked into its own session, so it is no child of ours and in no group we know.
    daemon = a.popen([sys.executable, "-c",
                      "import os, time\n"
                      "if os.fork() == 0:\n"
                      "    os.setsid()\n"
                      "    print(os.getpid(), flush=True)\n"
                      "    time.sleep(600)\n"],
                     stdout=subprocess.PIPE, text=True)
    daemon_pid = int(LineReader(daemon).next())
    daemon.wait(timeout=REPLY_DEADLINE_S)  # its launcher exits after the fork: reaped, it is no process of a's
    bystander = b.popen(["sleep", "600"])
    deadline = time.monotonic() + REPLY_DEADLINE_S
    while len(a.pids()) < 4:  # sh, two sleeps, the daemon
        assert time.monotonic() < deadline, f"processes in host a: {a.pids()}"
        time.sleep(0.01)
    assert daemon_pid in a.pids()

    stopped = a.signal_all(signal.SIGSTOP)  # kill_all also works on stopped processes
    assert set(stopped) == set(a.pids())
    a.kill_all()

    assert a.pids() == []
    assert shell.returncode == -signal.SIGKILL
    assert gone(daemon_pid)
    assert bystander.poll() is None and b.pids() == [bystander.pid]  # other hosts are untouched


# -- cleanup --------------------------------------------------------------------------------------


def test_close_removes_everything_even_with_processes_running(network_namespaces: None) -> None:
    before = all_names()
    network = HostNetwork(hosts=2)
    a, b = network.hosts
    sleeper = a.popen(["sleep", "600"])
    b.popen(["sh", "-c", "sleep 600 & wait"])
    a.partition()
    names = set(network.names())
    assert names <= all_names()

    network.close()
    network.close()  # idempotent

    after = all_names()
    assert not names & after
    assert not {n for n in after - before if n.startswith(network.tag)}
    assert sleeper.returncode == -signal.SIGKILL
    assert leftover_names(os.getpid()) == ([], [])


def test_exit_without_close_removes_everything(network_namespaces: None) -> None:
    done = run_python(
        """
        import json, subprocess
        from hosts.netns import HostNetwork
        network = HostNetwork(hosts=2)
        sleeper = network.hosts[0].popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(json.dumps({"names": network.names(), "sleeper": sleeper.pid}))
        """
    )
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    assert not set(report["names"]) & all_names()
    assert gone(report["sleeper"])


def test_leftovers_of_a_crashed_run_are_removed(network_namespaces: None) -> None:
    done = run_python(
        """
        import json, os, subprocess
        from hosts.netns import HostNetwork
        network = HostNetwork(hosts=2)
        sleeper = network.hosts[1].popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        print(json.dumps({"names": network.names(), "sleeper": sleeper.pid, "pid": os.getpid()}), flush=True)
        os._exit(3)  # a crash: no atexit, no close
        """
    )
    assert done.returncode == 3, done.stderr
    report = json.loads(done.stdout)
    assert set(report["names"]) <= all_names()
    assert not gone(report["sleeper"])

    removed = cleanup_leftovers()

    assert set(report["names"]) <= set(removed)
    assert not set(report["names"]) & all_names()
    assert leftover_names(report["pid"]) == ([], [])
    assert gone(report["sleeper"])


def test_fixture_tears_down_after_a_failing_test(tmp_path: Path, network_namespaces: None) -> None:
    names_file = tmp_path / "names.json"
    (tmp_path / "conftest.py").write_text(
        f"import sys\nsys.path.insert(0, {str(TESTS_DIR)!r})\n"
        "from hosts.conftest import host_network, network_namespaces  # noqa: F401\n"
    )
    (tmp_path / "test_inner.py").write_text(
        textwrap.dedent(
            f"""
            import json

            def test_fails(host_network):
                host = host_network.add_host()
                host.popen(["sleep", "600"])
                host.partition()
                with open({str(names_file)!r}, "w") as out:
                    json.dump(host_network.names(), out)
                assert False, "this test fails on purpose"
            """
        )
    )
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--rootdir", str(tmp_path),
         str(tmp_path / "test_inner.py")],
        capture_output=True, text=True, timeout=REPLY_DEADLINE_S * 3, cwd=tmp_path, check=False,
    )
    assert done.returncode == 1, done.stdout + done.stderr
    assert "1 failed" in done.stdout and "error" not in done.stdout.splitlines()[-1], done.stdout
    names = json.loads(names_file.read_text())
    assert names and not set(names) & all_names()


def test_unavailable_namespaces_give_a_reason() -> None:
    """Where ``ip netns add`` is refused (here: root only inside a user namespace), the probe says so."""
    if namespaces_unavailable_reason() is not None:
        pytest.skip(f"network namespaces unavailable: {namespaces_unavailable_reason()}")
    unshare = shutil.which("unshare")
    if unshare is None:
        pytest.skip("no `unshare` binary to make an unprivileged root")
    env = {**os.environ, "PYTHONPATH": str(TESTS_DIR)}
    done = subprocess.run(
        [unshare, "--user", "--map-root-user", sys.executable, "-c",
         "from hosts.netns import namespaces_unavailable_reason; print(namespaces_unavailable_reason())"],
        capture_output=True, text=True, timeout=REPLY_DEADLINE_S, env=env, check=False,
    )
    if done.returncode != 0 and "unshare" in done.stderr:
        pytest.skip(f"cannot make a user namespace: {done.stderr.strip()}")
    assert done.stdout.startswith("`ip netns add` failed"), done.stdout + done.stderr
