"""Run a real single-member etcd v3 server on free loopback ports, for tests and for the launcher.

`EmbeddedEtcd` starts `/usr/bin/etcd` (or the binary you name) with a data directory (and, given
`tls_cert`/`tls_key`, HTTPS on the client port), waits until it answers `/health`, stops it by PID (SIGTERM, or SIGKILL to emulate a crash) and restarts it on the same
data directory and the same ports, so that clients reconnect to the address they already know.

Given `niceness` below 0 (an emulated cluster passes `ETCD_NICENESS`), the server runs at that higher CPU priority
where this process may raise one (root): the cluster's control plane, which on real machines runs apart from the
training, and every lease depends on it.

A server this process started and never stopped is stopped when this process exits normally (its data is kept), so
a script or a test that forgets `stop()` leaves no etcd behind; a process that is killed cannot do that.

Timeouts (all in seconds, constructor arguments; defaults in `bamboo.membership.timeouts`):
- `start_timeout` (`ETCD_START_TIMEOUT_S`, 20): how long `start()` waits for `/health` before giving up;
- `stop_timeout` (`ETCD_STOP_TIMEOUT_S`, 10): how long `stop()` waits after SIGTERM before sending SIGKILL;
- `/health` is checked every `ETCD_HEALTH_POLL_S` with a deadline of `ETCD_HEALTH_TIMEOUT_S` per check.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import random
import re
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from bamboo.membership import timeouts

__all__ = ["ETCD_NICENESS", "EmbeddedEtcd", "EtcdStartError", "free_port"]

DEFAULT_ETCD_BINARY = "/usr/bin/etcd"

ETCD_NICENESS = -10
"""The niceness an emulated cluster's server asks for (`EmbeddedEtcd(niceness=...)`; it gets it where this process
is root, and runs at this process's own priority otherwise). On a machine shared with training (an emulated
cluster; a test suite's parallel lanes), etcd starved of CPU answered nothing for up to 2 s (measured: its threads
waited 0.8 to 1.0 s per second on the run queue while they ran 0.15 s, and 0.4 to 0.5 s at this niceness), and
every lease that was due for a refresh meanwhile expired: live nodes were declared dead. Not the default: with a
thousand agents on two cores (`bench_scale.py`), a server at this priority delayed the agents that read its
events (10 kills at once seen by all at p99 170 to 335 ms, against 141 to 231 ms at niceness 0)."""


_RUNNING: dict[EmbeddedEtcd, int] = {}  # each server started and not stopped: the pid that started it


def _stop_left_running() -> None:
    """At this process's exit: stop every server it started and left running (not a forked child's parent's)."""
    for server, owner in list(_RUNNING.items()):
        if owner == os.getpid():
            server.stop()


atexit.register(_stop_left_running)


class EtcdStartError(RuntimeError):
    """The etcd server did not become healthy in time; the message quotes the tail of its log."""


class _PortTakenError(EtcdStartError):
    """etcd exited at start because another process held one of its ports (`port`)."""

    def __init__(self, message: str, port: int) -> None:
        super().__init__(message)
        self.port = port


_EPHEMERAL_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST_LISTEN_PORT = 20000
"""Ports below this are left to well-known services; `free_port` draws from here up to the ephemeral range."""
_PORT_DRAWS = 64
"""How many random ports below the ephemeral range `free_port` tries before it falls back to port 0."""
_PORT_TAKEN = re.compile(r"listen tcp [^\s\"]*:(\d+): bind: address already in use")


def _ephemeral_low() -> int:
    """The first port the kernel hands to outgoing connections (32768 when the file cannot be read)."""
    with contextlib.suppress(OSError, ValueError, IndexError):
        return int(_EPHEMERAL_RANGE_FILE.read_text().split()[0])
    return 32768


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError:
            return False
        return True


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port on `host` that was free a moment ago, for a server that binds it a moment later.

    Drawn at random below the kernel's ephemeral range, so that the many outgoing connections of a
    busy machine (which take their ports from that range) cannot take it in between; binding
    port 0 instead would hand out exactly the ports those connections use.
    """
    low, high = _LOWEST_LISTEN_PORT, _ephemeral_low() - 1
    rng = random.SystemRandom()
    for _ in range(_PORT_DRAWS if high > low else 0):
        port = rng.randint(low, high)
        if _bindable(host, port):
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return int(sock.getsockname()[1])


class EmbeddedEtcd:
    """A real etcd server owned by this process.

    Use as a context manager, or call `start()` / `stop()`. `data_dir=None` makes a temporary
    directory that `close()` removes; a given `data_dir` is kept.
    """

    def __init__(
        self,
        data_dir: str | os.PathLike[str] | None = None,
        *,
        host: str = "127.0.0.1",
        client_port: int | None = None,
        peer_port: int | None = None,
        name: str = "bamboo-etcd",
        binary: str = DEFAULT_ETCD_BINARY,
        start_timeout: float = timeouts.ETCD_START_TIMEOUT_S,
        stop_timeout: float = timeouts.ETCD_STOP_TIMEOUT_S,
        tls_cert: str | os.PathLike[str] | None = None,
        tls_key: str | os.PathLike[str] | None = None,
        niceness: int = 0,
    ) -> None:
        if (tls_cert is None) != (tls_key is None):
            raise ValueError(f"EmbeddedEtcd: tls_cert and tls_key go together (cert={tls_cert!r}, key={tls_key!r})")
        self.tls_cert = None if tls_cert is None else str(tls_cert)
        self.tls_key = None if tls_key is None else str(tls_key)
        self.niceness = niceness
        resolved = shutil.which(binary) or binary
        if not Path(resolved).exists():
            raise FileNotFoundError(f"etcd binary not found: {binary!r} (install the Debian package etcd-server)")
        self.binary = resolved
        self.host = host
        self.name = name
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._owns_dir = data_dir is None
        self._root = Path(tempfile.mkdtemp(prefix="bamboo-etcd-")) if data_dir is None else Path(data_dir)
        self.data_dir = self._root / "data" if self._owns_dir else self._root
        self.log_path = (self._root if self._owns_dir else self._root.parent) / f"{name}.log"
        self._given_ports = (client_port, peer_port)
        self._started_once = False
        self._pick_ports()
        self._proc: subprocess.Popen[bytes] | None = None

    def _pick_ports(self) -> None:
        client_port, peer_port = self._given_ports
        self.client_port = client_port if client_port is not None else free_port(self.host)
        self.peer_port = peer_port if peer_port is not None else free_port(self.host)

    # -- addresses -------------------------------------------------------------------------------

    @property
    def endpoint(self) -> str:
        """`host:port` of the client API, the form `EtcdOptions.endpoints` takes."""
        return f"{self.host}:{self.client_port}"

    @property
    def client_url(self) -> str:
        scheme = "https" if self.tls_cert else "http"
        return f"{scheme}://{self.host}:{self.client_port}"

    @property
    def peer_url(self) -> str:
        return f"http://{self.host}:{self.peer_port}"

    @property
    def pid(self) -> int | None:
        """PID of the running server, or None when it is not running."""
        return self._proc.pid if self.running else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # -- lifecycle -------------------------------------------------------------------------------

    def _command(self) -> list[str]:
        nice = shutil.which("nice")
        boost = [nice, "-n", str(self.niceness)] if self.niceness < 0 and nice is not None and os.geteuid() == 0 else []
        return [
            *boost,
            self.binary,
            "--name", self.name,
            "--data-dir", str(self.data_dir),
            "--listen-client-urls", self.client_url,
            "--advertise-client-urls", self.client_url,
            "--listen-peer-urls", self.peer_url,
            "--initial-advertise-peer-urls", self.peer_url,
            "--initial-cluster", f"{self.name}={self.peer_url}",
            "--initial-cluster-state", "new",
            "--logger", "zap",
            "--log-level", "warn",
            *(["--cert-file", self.tls_cert, "--key-file", self.tls_key] if self.tls_cert else []),
        ]  # fmt: skip

    def start(self) -> EmbeddedEtcd:
        """Start the server (on the same data dir and ports as before, if it ran already) and wait for health.

        On the first start, ports this object picked itself are picked again (up to `_PORT_DRAWS`
        times) when another process bound one of them in between; ports you gave are never changed.
        """
        if self.running:
            return self
        for _ in range(_PORT_DRAWS - 1):
            fresh_data_dir = not self.data_dir.exists()
            try:
                return self._start_once()
            except _PortTakenError as error:
                if self._started_once or error.port in self._given_ports:
                    raise
                if fresh_data_dir:
                    shutil.rmtree(self.data_dir, ignore_errors=True)
                self._pick_ports()
        return self._start_once()

    def _start_once(self) -> EmbeddedEtcd:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        log = self.log_path.open("ab")
        try:
            self._proc = subprocess.Popen(
                self._command(), stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL
            )
            _RUNNING[self] = os.getpid()
        finally:
            log.close()
        deadline = time.monotonic() + self.start_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                message = (
                    f"etcd exited with code {self._proc.returncode} at start "
                    f"(client {self.client_url}, data dir {self.data_dir}); log tail:\n{self.log_tail()}"
                )
                taken = _PORT_TAKEN.search(self._log_since(log_start))
                raise EtcdStartError(message) if taken is None else _PortTakenError(message, int(taken[1]))
            if self.healthy():
                self._started_once = True
                return self
            time.sleep(timeouts.ETCD_HEALTH_POLL_S)
        self.kill()
        raise EtcdStartError(
            f"etcd at {self.client_url} not healthy after {self.start_timeout} s; log tail:\n{self.log_tail()}"
        )

    def healthy(self, timeout: float = timeouts.ETCD_HEALTH_TIMEOUT_S) -> bool:
        """True when the server answers `GET /health` with `{"health": "true"}`."""
        context = ssl.create_default_context(cafile=self.tls_cert) if self.tls_cert else None
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=timeout, context=context) as resp:
                return json.loads(resp.read().decode()).get("health") == "true"
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def stop(self) -> None:
        """Stop the server by PID: SIGTERM, then SIGKILL after `stop_timeout` seconds. Data is kept."""
        _RUNNING.pop(self, None)
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.send_signal(signal.SIGTERM)
            try:
                self._proc.wait(timeout=self.stop_timeout)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        self._proc = None

    def kill(self) -> None:
        """SIGKILL the server by PID (a crash); the data dir is kept for `restart()`."""
        _RUNNING.pop(self, None)
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def restart(self) -> EmbeddedEtcd:
        """Stop and start again on the same data dir and ports."""
        self.stop()
        return self.start()

    def close(self) -> None:
        """Stop the server and remove the temporary directory if this object made it."""
        self.stop()
        if self._owns_dir:
            shutil.rmtree(self._root, ignore_errors=True)

    def _log_since(self, offset: int) -> str:
        with contextlib.suppress(OSError), self.log_path.open("rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")
        return ""

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def __enter__(self) -> EmbeddedEtcd:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"EmbeddedEtcd(endpoint={self.endpoint!r}, pid={self.pid}, data_dir={str(self.data_dir)!r})"
