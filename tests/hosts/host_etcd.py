"""A real single-member etcd server running inside one emulated host (see `netns.Host`).

`HostEtcd(host, data_dir)` starts ``/usr/bin/etcd`` in the host's namespace with its client URL on
the host's address (``http://<host.address>:2379`` by default) and its peer URL on the host's own
loopback, waits until ``/health`` answers (asked from the test process, over the bridge: the root
namespace has an address there), and can SIGKILL it (a crash), stop it (SIGTERM) and restart it on
the same data directory and ports, so that clients reconnect to the address they already know.
It mirrors `bamboo.membership.EmbeddedEtcd`, which can only start etcd in the caller's namespace.

Timeouts (seconds, constructor arguments):
- ``start_timeout`` (default 20): how long `start()` waits for ``/health``;
- ``stop_timeout`` (default 10): how long `stop()` waits after SIGTERM before it sends SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType

from .netns import Host

__all__ = ["HostEtcd", "HostEtcdError"]

DEFAULT_ETCD_BINARY = "/usr/bin/etcd"
_POLL_INTERVAL_S = 0.02


class HostEtcdError(RuntimeError):
    """etcd exited or did not become healthy in time; the message quotes the tail of its log."""


class HostEtcd:
    """etcd inside `host`, with its data in `data_dir` (kept across restarts; the caller owns it)."""

    def __init__(
        self,
        host: Host,
        data_dir: str | Path,
        *,
        client_port: int = 2379,
        peer_port: int = 2380,
        name: str = "bamboo-etcd",
        binary: str = DEFAULT_ETCD_BINARY,
        start_timeout: float = 20.0,
        stop_timeout: float = 10.0,
    ) -> None:
        if not Path(binary).exists():
            raise FileNotFoundError(f"etcd binary not found: {binary!r} (install the Debian package etcd-server)")
        for label, value in (("start_timeout", start_timeout), ("stop_timeout", stop_timeout)):
            if value <= 0:
                raise ValueError(f"HostEtcd: {label} must be > 0, got {value!r}")
        self.host = host
        self.data_dir = Path(data_dir)
        self.log_path = self.data_dir.parent / f"{name}-{host.label}.log"
        self.client_port = client_port
        self.peer_port = peer_port
        self.name = name
        self.binary = binary
        self.start_timeout = start_timeout
        self.stop_timeout = stop_timeout
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def endpoint(self) -> str:
        """``address:port`` of the client API, the form `EtcdOptions.endpoints` takes."""
        return f"{self.host.address}:{self.client_port}"

    @property
    def client_url(self) -> str:
        return f"http://{self.endpoint}"

    @property
    def peer_url(self) -> str:
        """Peer traffic stays on the host's loopback: this is a one-member cluster."""
        return f"http://127.0.0.1:{self.peer_port}"

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        return self._proc.pid if self.running else None

    def _command(self) -> list[str]:
        return [
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
        ]  # fmt: skip

    def start(self) -> HostEtcd:
        """Start etcd in the host (same data dir and ports as before, if it ran already); wait for health."""
        if self.running:
            return self
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self._proc = self.host.popen(self._command(), stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + self.start_timeout
        while not self.healthy():
            if self._proc.poll() is not None:
                raise HostEtcdError(
                    f"etcd in host {self.host.label} exited with code {self._proc.returncode} at start "
                    f"(client {self.client_url}); log tail:\n{self.log_tail()}"
                )
            if time.monotonic() >= deadline:
                self.kill()
                raise HostEtcdError(
                    f"etcd at {self.client_url} (host {self.host.label}) not healthy after {self.start_timeout} s; "
                    f"log tail:\n{self.log_tail()}"
                )
            time.sleep(_POLL_INTERVAL_S)
        return self

    def healthy(self, timeout: float = 0.5) -> bool:
        """True when etcd answers ``GET /health`` with ``{"health": "true"}`` (asked from the root namespace)."""
        try:
            with urllib.request.urlopen(f"{self.client_url}/health", timeout=timeout) as resp:
                return bool(json.loads(resp.read().decode()).get("health") == "true")
        except (OSError, ValueError, urllib.error.URLError):
            return False

    def kill(self) -> None:
        """SIGKILL etcd (a crash); the data dir is kept for `start()`/`restart()`."""
        if self._proc is None:
            return
        if self._proc.poll() is None:
            self._proc.kill()
            self._proc.wait()
        self._proc = None

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after ``stop_timeout`` seconds. The data dir is kept."""
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

    def restart(self) -> HostEtcd:
        """Stop and start again on the same data dir and ports."""
        self.stop()
        return self.start()

    def log_tail(self, lines: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        return "(no log)"

    def __enter__(self) -> HostEtcd:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"HostEtcd(endpoint={self.endpoint!r}, host={self.host.label!r}, pid={self.pid})"
