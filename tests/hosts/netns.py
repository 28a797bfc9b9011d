"""Emulated hosts for multi-host tests: Linux network namespaces joined by veth pairs on one bridge.

What it makes
-------------
`HostNetwork` creates one Linux bridge with no uplink and, per `add_host()`, one network namespace
(a "host") with a veth pair: one end, ``eth0``, inside the namespace with an address of the
network's private /24, the other end attached to the bridge. Loopback is up in every namespace.
No host has a default route, so nothing a host sends can leave the machine.

Addresses: the network takes a free ``10.213.X.0/24`` (X is derived from the pid and checked
against every route of the root namespace, under a file lock, so parallel runs never share one).
``10.213.X.1`` is the bridge itself, the root namespace's address: the test process (which runs
in the root namespace) reaches every host from it, e.g. to read etcd or call an agent, without
running a client inside a namespace. The hosts get ``.2``, ``.3``, ... in the order they are added.
Every namespace (and the root namespace) holds a permanent neighbour (ARP) entry for every other
address, as a cloud VPC answers ARP itself: a host that is partitioned off is then silent (TCP
connects and reads time out) rather than unreachable (no ``EHOSTUNREACH`` after ARP gives up).

Names are short (interface names have 15 characters at most) and carry the owner's pid:
``bbn<pid hex>-<seq hex>`` is one network's tag; its bridge is ``<tag>b`` and host ``i`` is the
namespace ``<tag>h<i>`` whose bridge-side veth end has the same name.

How to use it from a test
-------------------------
The fixture ``host_network`` (``tests/hosts/conftest.py``) gives a fresh `HostNetwork` and tears it
down after the test, failed or not; it skips the test when namespaces cannot be made::

    def test_something(host_network):
        etcd_host, a, b = host_network.add_hosts(3)
        server = a.popen([sys.executable, "server.py", "--bind", a.address], stdout=log)
        a.partition()       # a's link goes down: in-flight TCP to and from a stalls
        a.heal()            # back up; returns once the link is up at both ends
        b.kill_all()        # SIGKILL every process in b's namespace and wait until they are gone
        b.slow(50)          # 50 ms more each way (tc netem; NetemUnavailable where the kernel lacks it)

`Host.popen` runs ``ip netns exec <namespace> argv...`` (``ip`` execs the command, so the `Popen`'s
pid is the command's own) in a new session, so ``os.killpg(proc.pid, sig)`` reaches its process
group; it returns once the process is inside the namespace. `Host.run` is the same to completion.
`Host.address` is the host's IPv4 address; a server inside a host binds to it (or to 0.0.0.0),
and ``127.0.0.1`` stays private to the host. `Host.signal_all(signal.SIGSTOP)` freezes a host
(slow, not dead: it still accepts connections); `HostNetwork.netem_unavailable_reason()` tells
up front whether `Host.slow` can work.

What it needs
-------------
Root (CAP_SYS_ADMIN and CAP_NET_ADMIN), iproute2 (``ip``, and ``tc`` for `Host.slow`), and a kernel
with network namespaces, veth and bridges. `namespaces_unavailable_reason()` probes all of that
once per process inside a throw-away namespace; the fixture turns its answer into
``pytest.skip("network namespaces unavailable: <why>")``. `Host.slow` also needs the kernel's netem
qdisc (``sch_netem``), which not every kernel has.

How it cleans up
----------------
`HostNetwork.close()` (also its context manager exit) SIGKILLs every process left in each
namespace and waits for them, reaps the processes it started, deletes each veth pair, the bridge
and the namespaces, and checks that none of its names is left. It runs at fixture teardown,
and at interpreter exit (``atexit``) for networks still open then (only in the process that made
them, never in a forked child). A run that died without either (SIGKILL, a crash) leaves names
whose pid is dead: `cleanup_leftovers()` removes those (processes first), and the fixtures call it
once per session. Networks of live processes, including parallel runs, are never touched.

Timeouts (seconds, `HostNetwork` constructor arguments, inherited by its hosts):
- ``command_timeout`` (default 10): how long one ``ip``/``tc`` command may run;
- ``kill_timeout`` (default 10): how long `Host.kill_all` waits for the namespace to be empty;
- ``link_timeout`` (default 5): how long `Host.heal` waits for the link to be up at both ends.
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import functools
import ipaddress
import itertools
import json
import os
import re
import select
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

__all__ = [
    "NAME_PREFIX",
    "Host",
    "HostNetwork",
    "HostNetworkError",
    "NamespacesUnavailable",
    "NetemUnavailable",
    "cleanup_leftovers",
    "leftover_names",
    "namespaces_unavailable_reason",
]

NAME_PREFIX = "bbn"
"""Every namespace, veth and bridge this module makes is named ``bbn<owner pid hex>-...``."""

IP_BINARY = shutil.which("ip") or "/usr/sbin/ip"
TC_BINARY = shutil.which("tc") or "/usr/sbin/tc"
NETNS_DIR = Path("/run/netns")
HOST_INTERFACE = "eth0"
"""Name of the veth end inside every host's namespace."""

MAX_HOSTS = 100
"""Host indexes are at most two digits, so that interface names stay within 15 characters."""

SUBNET_SECOND_OCTET = 213
"""Networks are ``10.213.X.0/24``."""

_NAME_PATTERN = re.compile(rf"^{NAME_PREFIX}(?P<pid>[0-9a-f]+)-[0-9a-z]+$")
_LOCK_PATH = (Path("/run/lock") if Path("/run/lock").is_dir() else Path("/tmp")) / "bamboo-hostnetwork.lock"
"""Machine-wide, as the subnets and bridges are: not under ``TMPDIR``, which ``make test`` sets per run."""
_POLL_INTERVAL_S = 0.01


class HostNetworkError(RuntimeError):
    """An ``ip``/``tc`` command failed, or a host did not reach the state asked of it in time."""


class NamespacesUnavailable(HostNetworkError):
    """Network namespaces (or veth, or bridges) cannot be made here; the message says why."""


class NetemUnavailable(HostNetworkError):
    """``tc netem`` cannot be used here (no ``tc`` binary, or a kernel without ``sch_netem``)."""


# -- commands -------------------------------------------------------------------------------------


def _run(argv: Sequence[str], timeout: float, error: type[HostNetworkError] = HostNetworkError) -> str:
    """Run one command; its stdout, or `error` quoting the command and its stderr."""
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise error(f"{' '.join(argv)!r} failed: {exc}") from exc
    if done.returncode != 0:
        raise error(f"{' '.join(argv)!r} exited with {done.returncode}: {done.stderr.strip()}")
    return done.stdout


def _ip(*args: str, timeout: float = 10.0) -> str:
    return _run([IP_BINARY, *args], timeout)


def _wait_until(condition: Callable[[], bool], timeout: float, what: str, interval: float = _POLL_INTERVAL_S
                ) -> None:
    """Poll `condition` every `interval` s until it holds; `HostNetworkError` naming `what` after `timeout` s."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() >= deadline:
            raise HostNetworkError(f"{what}: not within {timeout} s")
        time.sleep(interval)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _in_netns(pid: int, netns: str) -> bool:
    """True when process `pid` is in network namespace `netns` now."""
    try:
        target, found = os.stat(NETNS_DIR / netns), os.stat(f"/proc/{pid}/ns/net")
    except OSError:
        return False
    return (found.st_dev, found.st_ino) == (target.st_dev, target.st_ino)


def _netns_pids(netns: str) -> list[int]:
    """PIDs of the processes whose network namespace is `netns` (what ``ip netns pids`` prints)."""
    try:
        target = os.stat(NETNS_DIR / netns)
    except FileNotFoundError:
        return []
    pids = []
    with os.scandir("/proc") as entries:
        for entry in entries:
            if not entry.name.isdigit():
                continue
            try:
                found = os.stat(f"/proc/{entry.name}/ns/net")
            except OSError:  # gone, or a zombie (which has left its namespaces already)
                continue
            if (found.st_dev, found.st_ino) == (target.st_dev, target.st_ino):
                pids.append(int(entry.name))
    return sorted(pids)


def _signal_pids_in(netns: str, sig: int) -> list[int]:
    """Send `sig` to every process in `netns` once (through pidfds, so a reused pid is never hit)."""
    signalled = []
    for pid in _netns_pids(netns):
        try:
            fd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            signal.pidfd_send_signal(fd, sig)
            signalled.append(pid)
        except ProcessLookupError:
            pass
        finally:
            os.close(fd)
    return signalled


def _kill_all_in(netns: str, timeout: float) -> None:
    """SIGKILL every process in `netns` and wait (on pidfds) until none is left; raise after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        pids = _netns_pids(netns)
        if not pids:
            return
        if time.monotonic() >= deadline:
            raise HostNetworkError(f"processes {pids} still in namespace {netns} {timeout} s after SIGKILL")
        poller = select.poll()
        fds = []
        try:
            for pid in pids:
                try:
                    fd = os.pidfd_open(pid)
                except ProcessLookupError:
                    continue
                fds.append(fd)
                with contextlib.suppress(ProcessLookupError):
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                poller.register(fd, select.POLLIN)
            waiting = set(fds)
            while waiting:
                left_ms = int((deadline - time.monotonic()) * 1000)
                if left_ms <= 0:
                    break
                for fd, _ in poller.poll(left_ms):
                    waiting.discard(fd)
                    poller.unregister(fd)
        finally:
            for fd in fds:
                os.close(fd)
        # Loop: a process forked between the listing and the kill is found on the next pass.


# -- availability and leftovers -------------------------------------------------------------------


@functools.cache
def namespaces_unavailable_reason() -> str | None:
    """None when namespaces, veth pairs and bridges can be made here; else a one-line reason.

    Probes once per process: makes a namespace ``bbn<pid>-probe``, a bridge and a veth pair inside
    it (so the root namespace never sees them), and deletes the namespace.
    """
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return f"not root (euid {os.geteuid() if hasattr(os, 'geteuid') else 'unknown'}); namespaces need root"
    if not Path(IP_BINARY).exists():
        return f"no `ip` binary at {IP_BINARY} (install iproute2)"
    probe = f"{NAME_PREFIX}{os.getpid():x}-probe"
    with contextlib.suppress(HostNetworkError):
        _ip("netns", "delete", probe)
    try:
        _ip("netns", "add", probe)
    except HostNetworkError as exc:
        return f"`ip netns add` failed: {exc}"
    try:
        _ip("-n", probe, "link", "add", "probebr", "type", "bridge")
        _ip("-n", probe, "link", "add", "probe0", "type", "veth", "peer", "name", "probe1")
        _ip("-n", probe, "link", "set", "probe0", "master", "probebr")
    except HostNetworkError as exc:
        return f"cannot make a bridge and a veth pair: {exc}"
    finally:
        with contextlib.suppress(HostNetworkError):
            _ip("netns", "delete", probe)
    return None


def _link_names() -> list[str]:
    """Names of the root namespace's network interfaces (``ip link`` shows ``veth@ifN``; we strip that)."""
    return sorted(os.listdir("/sys/class/net"))


def _netns_names() -> list[str]:
    try:
        return sorted(os.listdir(NETNS_DIR))
    except FileNotFoundError:
        return []


def leftover_names(pid: int | None = None) -> tuple[list[str], list[str]]:
    """``(namespaces, links)`` named by this module; only those of owner `pid` when it is given."""

    def ours(name: str) -> bool:
        match = _NAME_PATTERN.match(name)
        return match is not None and (pid is None or int(match["pid"], 16) == pid)

    return [n for n in _netns_names() if ours(n)], [n for n in _link_names() if ours(n)]


def cleanup_leftovers(timeout: float = 10.0) -> list[str]:
    """Remove the namespaces and links of runs whose owner process is dead; the names removed.

    Processes left in such a namespace are SIGKILLed first (an etcd of a crashed run keeps nothing
    alive after this). Names of live processes, this one's open networks included, are kept;
    names of this process that belong to no open network (a half-made network) are removed.
    """
    own = os.getpid()
    with _LIVE_LOCK:
        live_names = {name for network in _LIVE for name in network.names()}
    namespaces, links = leftover_names()

    def stale(name: str) -> bool:
        match = _NAME_PATTERN.match(name)
        assert match is not None
        owner = int(match["pid"], 16)
        return name not in live_names if owner == own else not _pid_alive(owner)

    removed = []
    for netns in (n for n in namespaces if stale(n)):
        with contextlib.suppress(HostNetworkError):
            _kill_all_in(netns, timeout)
    for link in (n for n in links if stale(n)):
        with contextlib.suppress(HostNetworkError):  # deleting one veth end deletes its peer too
            _ip("link", "delete", link)
            removed.append(link)
    for netns in (n for n in namespaces if stale(n)):
        with contextlib.suppress(HostNetworkError):
            _ip("netns", "delete", netns)
            removed.append(netns)
    return removed


# -- the network ----------------------------------------------------------------------------------

_LIVE: set[HostNetwork] = set()
_LIVE_LOCK = threading.Lock()
_SEQUENCE = itertools.count()


def _close_live_networks() -> None:
    """atexit: close the networks this process made and did not close (never those of a fork parent)."""
    with _LIVE_LOCK:
        networks = [n for n in _LIVE if n.owner_pid == os.getpid()]
    for network in networks:
        with contextlib.suppress(Exception):
            network.close()


atexit.register(_close_live_networks)


@contextlib.contextmanager
def _subnet_lock() -> Iterator[None]:
    """Serialize subnet choice and bridge addressing between processes on this machine."""
    with _LOCK_PATH.open("a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _routed_networks() -> list[ipaddress.IPv4Network]:
    """Every IPv4 destination routed in the root namespace, the default route excepted."""
    routes = json.loads(_ip("-4", "-j", "route", "show", "table", "all") or "[]")
    networks = []
    for route in routes:
        dst = route.get("dst", "default")
        if dst == "default":
            continue
        with contextlib.suppress(ValueError):
            networks.append(ipaddress.IPv4Network(dst, strict=False))
    return networks


def _free_subnet(start: int) -> ipaddress.IPv4Network:
    """The first ``10.213.X.0/24`` from X = `start` on that overlaps no route of the root namespace."""
    taken = _routed_networks()
    for step in range(254):
        third = 1 + (start + step) % 254
        subnet = ipaddress.IPv4Network(f"10.{SUBNET_SECOND_OCTET}.{third}.0/24")
        if not any(subnet.overlaps(other) for other in taken):
            return subnet
    raise HostNetworkError(f"no free 10.{SUBNET_SECOND_OCTET}.X.0/24 left; routes: {[str(n) for n in taken]}")


class HostNetwork:
    """A bridge with no uplink and the hosts (network namespaces) attached to it; see the module docstring.

    ``HostNetwork(hosts=3)`` makes three hosts at once; `add_host` adds more. Use it as a context
    manager or call `close()`; either removes everything it made.
    """

    def __init__(
        self,
        hosts: int = 0,
        *,
        command_timeout: float = 10.0,
        kill_timeout: float = 10.0,
        link_timeout: float = 5.0,
    ) -> None:
        for label, value in (("command_timeout", command_timeout), ("kill_timeout", kill_timeout),
                             ("link_timeout", link_timeout)):
            if value <= 0:
                raise ValueError(f"HostNetwork: {label} must be > 0, got {value!r}")
        if not 0 <= hosts <= MAX_HOSTS:
            raise ValueError(f"HostNetwork: hosts must be within 0..{MAX_HOSTS}, got {hosts!r}")
        reason = namespaces_unavailable_reason()
        if reason is not None:
            raise NamespacesUnavailable(reason)
        self.command_timeout = command_timeout
        self.kill_timeout = kill_timeout
        self.link_timeout = link_timeout
        self.owner_pid = os.getpid()
        self.tag = f"{NAME_PREFIX}{self.owner_pid:x}-{next(_SEQUENCE) % 256:x}"
        self.bridge = f"{self.tag}b"
        self.hosts: list[Host] = []
        self._closed = False
        self._host_lock = threading.Lock()
        with _LIVE_LOCK:
            _LIVE.add(self)
        try:
            self._remove_stale_names()
            with _subnet_lock():
                self.subnet = _free_subnet(self.owner_pid)
                self.root_address = str(self.subnet.network_address + 1)
                # A bridge takes the lowest MAC of its ports unless its own is set: pin one, so that the
                # hosts' permanent neighbour entries for the root address stay right as hosts are added.
                self.root_mac = "02:" + ":".join(f"{byte:02x}" for byte in os.urandom(5))
                self._ip("link", "add", self.bridge, "address", self.root_mac, "type", "bridge")
                self._ip("addr", "add", f"{self.root_address}/{self.subnet.prefixlen}", "dev", self.bridge)
            self._ip("link", "set", self.bridge, "up")
            self.add_hosts(hosts)
        except BaseException:
            with contextlib.suppress(Exception):
                self.close()
            raise

    # -- commands ---------------------------------------------------------------------------------

    def _ip(self, *args: str) -> str:
        return _ip(*args, timeout=self.command_timeout)

    def _mac(self, link: str, netns: str | None = None) -> str:
        prefix = ("-n", netns) if netns is not None else ()
        return str(json.loads(self._ip(*prefix, "-j", "link", "show", "dev", link))[0]["address"])

    def _remove_stale_names(self) -> None:
        """Delete objects named like this network (a run of this pid long ago, or a leaked sequence number)."""
        namespaces, links = leftover_names(self.owner_pid)
        own_names = re.compile(re.escape(self.tag) + r"(?:b|h[0-9]+)")
        mine = [n for n in (*namespaces, *links) if own_names.fullmatch(n)]
        for name in mine:
            if name in links:
                with contextlib.suppress(HostNetworkError):
                    self._ip("link", "delete", name)
            if name in namespaces:
                with contextlib.suppress(HostNetworkError):
                    _kill_all_in(name, self.kill_timeout)
                    self._ip("netns", "delete", name)

    # -- hosts --------------------------------------------------------------------------------------

    def add_host(self, label: str | None = None) -> Host:
        """A new host: its namespace, its veth pair on the bridge and the next address of the subnet.

        `label` names the host in messages and reprs (default ``h<index>``).
        """
        with self._host_lock:
            if self._closed:
                raise HostNetworkError(f"HostNetwork {self.tag} is closed; cannot add a host")
            index = len(self.hosts)
            if index >= MAX_HOSTS:
                raise HostNetworkError(f"HostNetwork {self.tag} has {MAX_HOSTS} hosts already (the most it takes)")
            host = Host(self, index, label if label is not None else f"h{index}")
            self.hosts.append(host)
        netns, veth = host.netns, host.veth
        self._ip("netns", "add", netns)
        self._ip("link", "add", veth, "type", "veth", "peer", "name", HOST_INTERFACE, "netns", netns)
        self._ip("link", "set", veth, "master", self.bridge, "up")
        self._ip("-n", netns, "addr", "add", f"{host.address}/{self.subnet.prefixlen}", "dev", HOST_INTERFACE)
        self._ip("-n", netns, "link", "set", HOST_INTERFACE, "up")
        self._ip("-n", netns, "link", "set", "lo", "up")
        host.mac = self._mac(HOST_INTERFACE, netns)
        # Permanent neighbour entries both ways with the root namespace and every earlier host.
        self._ip("-n", netns, "neigh", "replace", self.root_address, "lladdr", self.root_mac, "nud", "permanent",
                 "dev", HOST_INTERFACE)
        self._ip("neigh", "replace", host.address, "lladdr", host.mac, "nud", "permanent", "dev", self.bridge)
        for other in self.hosts[:index]:
            self._ip("-n", netns, "neigh", "replace", other.address, "lladdr", other.mac, "nud", "permanent",
                     "dev", HOST_INTERFACE)
            self._ip("-n", other.netns, "neigh", "replace", host.address, "lladdr", host.mac, "nud", "permanent",
                     "dev", HOST_INTERFACE)
        return host

    def add_hosts(self, count: int) -> list[Host]:
        """`count` new hosts (see `add_host`)."""
        return [self.add_host() for _ in range(count)]

    def names(self) -> list[str]:
        """Every namespace and link name this network uses (the bridge, then each host's name)."""
        return [self.bridge, *(host.netns for host in self.hosts)]

    def netem_unavailable_reason(self) -> str | None:
        """None when `Host.slow` can work here; else why not (probed on the bridge, then removed)."""
        if not Path(TC_BINARY).exists():
            return f"no `tc` binary at {TC_BINARY} (install iproute2)"
        try:
            _run([TC_BINARY, "qdisc", "replace", "dev", self.bridge, "root", "netem", "delay", "1ms"],
                 self.command_timeout)
        except HostNetworkError as exc:
            return f"tc netem unavailable: {exc}"
        with contextlib.suppress(HostNetworkError):
            _run([TC_BINARY, "qdisc", "delete", "dev", self.bridge, "root"], self.command_timeout)
        return None

    # -- teardown -----------------------------------------------------------------------------------

    def close(self) -> None:
        """Kill every process in the hosts, delete the veth pairs, the bridge and the namespaces.

        Idempotent. Every step is attempted even when an earlier one fails; the failures are then
        raised together as one `HostNetworkError`, after a check that none of this network's names
        is left in ``ip netns list`` or ``ip link``.
        """
        with self._host_lock:
            if self._closed:
                return
            self._closed = True
        errors: list[str] = []
        for host in self.hosts:
            try:
                host.kill_all()
            except HostNetworkError as exc:
                errors.append(str(exc))
        namespaces, links = set(_netns_names()), set(_link_names())
        for host in self.hosts:
            if host.veth in links:  # deleting the bridge-side end deletes the end in the namespace too
                try:
                    self._ip("link", "delete", host.veth)
                except HostNetworkError as exc:
                    errors.append(str(exc))
        if self.bridge in links:
            try:
                self._ip("link", "delete", self.bridge)
            except HostNetworkError as exc:
                errors.append(str(exc))
        for host in self.hosts:
            if host.netns in namespaces:
                try:
                    self._ip("netns", "delete", host.netns)
                except HostNetworkError as exc:
                    errors.append(str(exc))
        with _LIVE_LOCK:
            _LIVE.discard(self)
        namespaces_left, links_left = leftover_names(self.owner_pid)
        left = [n for n in (*namespaces_left, *links_left) if n in self.names()]
        if left:
            errors.append(f"still present after teardown: {left}")
        if errors:
            raise HostNetworkError(f"HostNetwork {self.tag} teardown: " + "; ".join(errors))

    def __enter__(self) -> HostNetwork:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"HostNetwork(tag={self.tag!r}, subnet={str(getattr(self, 'subnet', None))!r}, hosts={self.hosts!r})"


class Host:
    """One emulated machine: a network namespace with one address on the network's bridge.

    Made by `HostNetwork.add_host`. `address` is its IPv4 address; `netns` its namespace's name
    (for ``ip netns exec``); `veth` the name of its link's bridge-side end in the root namespace.
    """

    def __init__(self, network: HostNetwork, index: int, label: str) -> None:
        self.network = network
        self.index = index
        self.label = label
        self.netns = f"{network.tag}h{index}"
        self.veth = self.netns
        self.address = str(network.subnet.network_address + 2 + index)
        self.mac = ""
        self.partitioned = False
        self.delay_ms: int | None = None
        self._processes: list[subprocess.Popen[Any]] = []

    # -- processes ----------------------------------------------------------------------------------

    def command(self, argv: Sequence[str]) -> list[str]:
        """`argv` prefixed to run inside this host (``ip netns exec <netns>``)."""
        if not argv:
            raise ValueError(f"Host {self.label}: empty argv")
        return [IP_BINARY, "netns", "exec", self.netns, *map(str, argv)]

    def popen(self, argv: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
        """Start `argv` inside this host, in a new session (its own process group), stdin from /dev/null.

        Keyword arguments go to `subprocess.Popen` (``env``, ``stdout``, ``stderr``, ``cwd``, ``text``,
        ...). The `Popen` is tracked: `kill_all` and teardown reap it.
        """
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        kwargs.setdefault("start_new_session", True)
        proc = subprocess.Popen(self.command(argv), **kwargs)
        self._processes.append(proc)
        # ``ip`` enters the namespace a moment after it starts: wait for that, so that `pids`,
        # `signal_all` and `kill_all` see the process as soon as this returns.
        _wait_until(lambda: proc.poll() is not None or _in_netns(proc.pid, self.netns),
                    self.network.command_timeout, f"{argv[0]!r} entering host {self.label} ({self.netns})",
                    interval=0.001)
        return proc

    def run(self, argv: Sequence[str], *, timeout: float, check: bool = True, **kwargs: Any
            ) -> subprocess.CompletedProcess[Any]:
        """Run `argv` inside this host to completion (`subprocess.run`; `timeout` seconds is required)."""
        kwargs.setdefault("stdin", subprocess.DEVNULL)
        return subprocess.run(self.command(argv), timeout=timeout, check=check, **kwargs)

    def pids(self) -> list[int]:
        """PIDs of every process in this host's namespace (as ``ip netns pids`` lists them)."""
        return _netns_pids(self.netns)

    def signal_all(self, sig: int) -> list[int]:
        """Send `sig` to every process in this host once (e.g. SIGSTOP to freeze it); the pids signalled."""
        return _signal_pids_in(self.netns, sig)

    def kill_all(self) -> None:
        """SIGKILL every process in this host and wait until none is left; reap those `popen` started.

        Raises `HostNetworkError` when a process outlives ``kill_timeout`` seconds.
        """
        for proc in self._processes:  # also those not in the namespace (yet, or any more)
            with contextlib.suppress(ProcessLookupError):
                if proc.poll() is None:
                    proc.kill()
        _kill_all_in(self.netns, self.network.kill_timeout)
        for proc in self._processes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=self.network.kill_timeout)
        self._processes = [proc for proc in self._processes if proc.returncode is None]

    # -- links --------------------------------------------------------------------------------------

    def partition(self) -> None:
        """Cut this host off: its bridge-side veth end goes down.

        Nothing is refused or reset: packets to and from the host are dropped, so TCP connects and
        reads stall on both sides until they time out (the permanent neighbour entries keep ARP
        from failing). The host keeps its address and routes, and processes inside it still reach
        each other over loopback and the host's own address. The root namespace is cut off too.
        """
        self.network._ip("link", "set", self.veth, "down")
        self.partitioned = True

    def heal(self) -> None:
        """Bring the link back up; return once both ends are up and the bridge port forwards.

        Connections that stalled resume on their next TCP retransmission (whose backoff may have
        grown to seconds during a long partition). Raises `HostNetworkError` after ``link_timeout`` s.
        """
        self.network._ip("link", "set", self.veth, "up")
        _wait_until(self._link_up, self.network.link_timeout, f"link of host {self.label} ({self.netns}) up")
        self.partitioned = False

    def _link_up(self) -> bool:
        sysfs = Path("/sys/class/net") / self.veth
        try:
            outer_up = (sysfs / "operstate").read_text().strip() == "up"
            forwarding = (sysfs / "brport" / "state").read_text().strip() == "3"  # BR_STATE_FORWARDING
        except OSError:
            return False
        if not (outer_up and forwarding):
            return False
        inner = json.loads(self.network._ip("-n", self.netns, "-j", "link", "show", "dev", HOST_INTERFACE))
        return bool(inner) and inner[0].get("operstate") == "UP"

    def slow(self, delay_ms: int) -> None:
        """Add `delay_ms` ms of latency each way on this host's link (``tc netem`` on both veth ends).

        Raises `NetemUnavailable` where ``tc`` or the kernel's netem qdisc is missing.
        """
        if delay_ms <= 0:
            raise ValueError(f"Host {self.label}: delay_ms must be > 0, got {delay_ms!r}")
        if not Path(TC_BINARY).exists():
            raise NetemUnavailable(f"no `tc` binary at {TC_BINARY} (install iproute2)")
        timeout = self.network.command_timeout
        netem = ["root", "netem", "delay", f"{delay_ms}ms"]
        _run([TC_BINARY, "-n", self.netns, "qdisc", "replace", "dev", HOST_INTERFACE, *netem], timeout,
             NetemUnavailable)
        _run([TC_BINARY, "qdisc", "replace", "dev", self.veth, *netem], timeout, NetemUnavailable)
        self.delay_ms = delay_ms

    def unslow(self) -> None:
        """Remove the delay `slow` added (no-op when there is none)."""
        if self.delay_ms is None:
            return
        timeout = self.network.command_timeout
        _run([TC_BINARY, "-n", self.netns, "qdisc", "delete", "dev", HOST_INTERFACE, "root"], timeout)
        _run([TC_BINARY, "qdisc", "delete", "dev", self.veth, "root"], timeout)
        self.delay_ms = None

    def __repr__(self) -> str:
        return f"Host({self.label!r}, address={self.address!r}, netns={self.netns!r})"
