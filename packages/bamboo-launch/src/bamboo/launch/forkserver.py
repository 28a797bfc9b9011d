"""Start a process through a fork server: the client side, what an agent needs.

An emulated cluster on one machine (``bamboo-launch run``, from bamboo-bench's
:mod:`bamboo.bench.emulated.forkserver`) starts one server that has imported torch and bamboo once, and forks
every agent and worker from it; the server's socket is named in each node's environment
(``BAMBOO_FORK_SERVER``). This module is what a process so started uses to ask that server for a process:

- :func:`spawn` starts a command through the server that ``env[FORK_SERVER_ENV]`` names (an agent starting its
  worker), or by exec when none is named (a real node: an agent always execs there);
- :func:`run_to_end` runs one to its end (a script's ``describe`` and ``reference`` runs) through that server,
  or through the one this process started (:func:`use_local_server`), or by exec;
- :class:`ForkClient` sends one request; :class:`ForkedProcess` is the started process, as a
  :class:`subprocess.Popen` reads.

The failure model does not change: a forked process joins the process group it is asked for, gets the
environment, directory and output files of the command it replaces, and its exit status (a negative signal
number when a signal killed it) comes back as a :class:`subprocess.Popen`'s would.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
from collections.abc import Mapping, Sequence
from typing import IO

__all__ = [
    "FORK_SERVER_ENV",
    "ForkClient",
    "ForkServerError",
    "ForkedProcess",
    "module_or_script",
    "run_to_end",
    "spawn",
    "use_local_server",
]

FORK_SERVER_ENV = "BAMBOO_FORK_SERVER"
"""The environment variable that names a fork server's socket: an agent started with it starts its worker
through that server."""


class ForkServerError(RuntimeError):
    """The fork server is gone, or refused a request."""


class ForkedProcess:
    """A process the fork server started: the part of :class:`subprocess.Popen`'s interface launchers use
    (``pid``, ``returncode``, ``poll``, ``wait``, ``send_signal``, ``kill``).

    The server is its parent; it reports the exit status on this process's own connection, which a daemon
    thread reads.
    """

    def __init__(self, connection: socket.socket, pid: int, args: Sequence[str]) -> None:
        self.pid = pid
        self.args = list(args)
        self.returncode: int | None = None
        self._connection = connection
        self._exited = threading.Event()
        threading.Thread(target=self._await_exit, name=f"bamboo-forked-{pid}", daemon=True).start()

    def _await_exit(self) -> None:
        line = _read_line(self._connection)
        self._connection.close()
        # a server that died first leaves no status: report the process as killed (it was, or is orphaned)
        self.returncode = int(line) if line else -signal.SIGKILL
        self._exited.set()

    def poll(self) -> int | None:
        return self.returncode if self._exited.is_set() else None

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, signal_number: int) -> None:
        if not self._exited.is_set():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal_number)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)


class ForkClient:
    """A connection to a running fork server at ``address`` (a unix socket; a process inherits it in
    ``BAMBOO_FORK_SERVER``)."""

    def __init__(self, address: str) -> None:
        self.address = address

    def alive(self) -> bool:
        """Whether the server still runs (a client cannot tell: it finds out on its next request)."""
        return True

    def start(self, args: Sequence[str], *, env: Mapping[str, str] | None = None, cwd: str | None = None,
              stdout: IO[bytes] | int | None = None, stderr: IO[bytes] | int | None = None,
              process_group: int | None = None, niceness: int = 0) -> ForkedProcess:
        """Start ``args`` (``[python, "-m", module, ...]`` or ``[python, script, ...]``), as
        ``subprocess.Popen(args, env=env, cwd=cwd, stdin=DEVNULL, stdout=stdout, stderr=stderr,
        process_group=process_group)`` would, ``niceness`` added to its priority.

        ``stdout`` and ``stderr`` are open files, ``subprocess.DEVNULL``, ``subprocess.STDOUT`` (stderr only)
        or None (this process's own); ``process_group`` is 0 (lead a new group), a group of this session to
        join, or None (the server's).
        """
        module_or_script(args)  # refuse a command the server cannot run before forking anything
        streams = [_descriptor(stdout, 1), _descriptor(stderr, 2)]
        if stderr == subprocess.STDOUT:
            streams[1] = streams[0]
        request = {"args": list(args), "env": dict(os.environ if env is None else env),
                   "cwd": cwd or os.getcwd(), "process_group": process_group, "niceness": niceness}
        connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        null = os.open(os.devnull, os.O_RDWR)
        try:
            connection.connect(self.address)
            payload = json.dumps(request).encode() + b"\n"
            socket.send_fds(connection, [payload], [null, *(null if fd is None else fd for fd in streams)])
            answer = _read_line(connection)
        except OSError as error:
            connection.close()
            raise ForkServerError(f"the fork server at {self.address} is gone: {error}") from error
        finally:
            os.close(null)
        if not answer.lstrip("-").isdigit():
            connection.close()
            raise ForkServerError(f"the fork server refused {list(args)}: {answer or 'it closed the connection'}")
        return ForkedProcess(connection, int(answer), args)


_local: ForkClient | None = None


def use_local_server(server: ForkClient | None) -> None:
    """Name the fork server this process started (None: none), which :func:`run_to_end` forks from when the
    environment names no other; its starter (the emulated cluster's launcher) calls this."""
    global _local
    _local = server


def spawn(args: Sequence[str], *, env: Mapping[str, str], process_group: int | None = None,
          niceness: int = 0) -> subprocess.Popen[bytes] | ForkedProcess:
    """Start ``args`` with ``env``: through the fork server that ``env[FORK_SERVER_ENV]`` names (the process
    joins ``process_group``: None for this process's group), or by exec when it names none. Output goes where
    this process's goes; standard input is empty."""
    address = env.get(FORK_SERVER_ENV)
    if not address:
        command = list(args)
        if niceness:
            command = ["nice", "-n", str(niceness), *command]
        return subprocess.Popen(command, env=dict(env), stdin=subprocess.DEVNULL, process_group=process_group)
    group = os.getpgrp() if process_group is None else process_group
    return ForkClient(address).start(args, env=env, process_group=group, niceness=niceness)


def run_to_end(args: Sequence[str], *, env: Mapping[str, str], stdout: IO[bytes], timeout_s: float) -> int:
    """Run ``args`` to its end, output to ``stdout``, standard input empty; its exit status
    (``subprocess.TimeoutExpired`` once it ran ``timeout_s``: it is killed). It is forked from the fork server
    that ``env`` names, or else from the one this process started (:func:`use_local_server`),
    or else exec'd."""
    address = env.get(FORK_SERVER_ENV)
    server = ForkClient(address) if address else (_local if _local is not None and _local.alive() else None)
    if server is None:
        return subprocess.run(list(args), env=dict(env), stdout=stdout, stderr=subprocess.STDOUT,
                              stdin=subprocess.DEVNULL, timeout=timeout_s, check=False).returncode
    process = server.start(args, env=env, stdout=stdout, stderr=subprocess.STDOUT)
    try:
        return process.wait(timeout_s)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
        raise


def _descriptor(stream: IO[bytes] | int | None, default: int) -> int | None:
    if stream is None:
        return default
    if stream == subprocess.DEVNULL:
        return None
    if stream == subprocess.STDOUT:
        return default
    if isinstance(stream, int):
        return stream
    return stream.fileno()


def _read_line(connection: socket.socket) -> str:
    """One line of the server's answers, without its newline ("" when the connection ended first).

    A byte at a time: the pid and the exit status come on one connection, and a process that ends at once
    sends both before the starter reads the first; reading more than the line would swallow the status.
    """
    data = bytearray()
    while not data.endswith(b"\n"):
        try:
            byte = connection.recv(1)
        except OSError:
            break
        if not byte:
            break
        data += byte
    return data.decode().strip()


def module_or_script(args: Sequence[str]) -> tuple[str, str, list[str]]:
    """("module" or "script", its name, its argv) of ``[python, "-m", module, ...]`` or ``[python, script, ...]``."""
    if not args or os.path.abspath(args[0]) != os.path.abspath(sys.executable):  # the same venv, not only the same binary
        raise ForkServerError(f"the fork server runs its own interpreter ({sys.executable}), not {list(args)[:1]}")
    if len(args) >= 3 and args[1] == "-m":
        return "module", args[2], [args[2], *args[3:]]
    if len(args) >= 2 and not args[1].startswith("-"):
        return "script", args[1], list(args[1:])
    raise ForkServerError(f"the fork server runs 'python -m MODULE ...' or 'python SCRIPT ...', not {list(args)}")
