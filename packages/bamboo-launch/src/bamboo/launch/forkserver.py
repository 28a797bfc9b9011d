"""Start the processes of an emulated cluster from one preloaded interpreter (a fork server).

On one machine, an emulated cluster of N nodes starts N agents and N workers; each of them would import
torch and bamboo on its own (4 CPU-seconds a worker on a laptop core, most of a small test's work). The fork
server imports them once, then forks each process asked of it: the process starts with everything loaded,
and runs the same ``python -m <module>`` or ``python <script>`` command line it would have run by exec.

The failure model does not change. A forked process joins the process group it is asked for (a node's
agent leads a group of its own, and its worker joins that group), so that killing a node's group kills the
node, its worker included, exactly as before; it gets the environment, working directory and output files
of the command it replaces, and its exit status (a negative signal number when a signal killed it) comes
back as a :class:`subprocess.Popen`'s would.

Only emulated clusters on one machine use it (``bamboo-launch run``, the tests, the demo): the server is
single-threaded Python that has opened no connection (gRPC and gloo are started in the children only), which
is what makes forking it safe. A real node's agent starts its worker by exec, as before.

- :class:`ForkServer` starts the server (:func:`serve`, in a process of its own) and asks it for processes;
  :func:`shared_fork_server` is the one a launcher process shares among its clusters;
- :func:`spawn` starts a command through the server named by ``BAMBOO_FORK_SERVER`` in the environment, or
  by exec when none is named; :func:`run_to_end` runs one to its end (a script's ``describe`` and
  ``reference`` runs) through that server, or this process's shared one.

The server exits when the process that started it does (its standard input reaches end of file).
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import runpy
import select
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import IO

from bamboo.launch import timeouts

__all__ = [
    "FORK_SERVER_ENV",
    "PRELOAD",
    "ForkServer",
    "ForkServerError",
    "ForkedProcess",
    "run_to_end",
    "serve",
    "shared_fork_server",
    "spawn",
]

FORK_SERVER_ENV = "BAMBOO_FORK_SERVER"
"""The environment variable that names a fork server's socket: an agent started with it starts its worker
through that server."""

PRELOAD = ("torch", "torch.distributed", "torch.fx.experimental.symbolic_shapes", "bamboo.rc.engine",
           "bamboo.rc.worker", "bamboo.launch.worker", "bamboo.launch.copy_service", "bamboo.launch.cli",
           "bamboo.launch.agent")
"""The modules the server imports before it forks anything. ``torch.fx.experimental.symbolic_shapes`` (and sympy
through it) is what torch's first backward with a gradient imports lazily in every worker
(:func:`bamboo.rc.worker.preload_autograd`): about a CPU-second a worker when each imports it after the fork."""

_OWN_GROUP = 0  # "process_group": lead a new group


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


class ForkServer:
    """A running fork server (see the module docstring); ``close`` (or the end of this process) stops it."""

    def __init__(self, preload: Sequence[str] = PRELOAD, *,
                 start_timeout_s: float = timeouts.FORK_SERVER_START_S) -> None:
        self._folder = tempfile.mkdtemp(prefix="bamboo-forks-")
        self.address = str(Path(self._folder) / "socket")
        self._server = subprocess.Popen(
            [sys.executable, "-c", "import sys; from bamboo.launch.forkserver import serve; serve(sys.argv[1], sys.argv[2:])",
             self.address, *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, process_group=_OWN_GROUP)
        assert self._server.stdout is not None
        ready, _, _ = select.select([self._server.stdout], [], [], start_timeout_s)
        line = self._server.stdout.readline().decode().strip() if ready else ""
        if line != "ready":
            self.close()
            raise ForkServerError(f"the fork server did not start within {start_timeout_s:g} s "
                                  f"(it printed {line!r}, exit status {self._server.poll()})")

    def alive(self) -> bool:
        return self._server.poll() is None

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
        _module_or_script(args)  # refuse a command the server cannot run before forking anything
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

    def close(self) -> None:
        if self._server.stdin is not None and not self._server.stdin.closed:
            self._server.stdin.close()  # end of file: the server exits
        try:
            self._server.wait(timeouts.REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        if self._server.stdout is not None:
            self._server.stdout.close()
        for path in (Path(self.address), Path(self._folder)):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()


_shared: ForkServer | None = None
_shared_lock = threading.Lock()


def shared_fork_server() -> ForkServer:
    """This process's fork server, started on first use and stopped when the process exits."""
    global _shared
    with _shared_lock:
        if _shared is None or not _shared.alive():
            _shared = ForkServer()
            atexit.register(_shared.close)
        return _shared


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
    return _Client(address).start(args, env=env, process_group=group, niceness=niceness)


def run_to_end(args: Sequence[str], *, env: Mapping[str, str], stdout: IO[bytes], timeout_s: float) -> int:
    """Run ``args`` to its end, output to ``stdout``, standard input empty; its exit status
    (``subprocess.TimeoutExpired`` once it ran ``timeout_s``: it is killed). It is forked from the fork server
    that ``env`` names, or else from this process's shared one if it started one, or else exec'd."""
    address = env.get(FORK_SERVER_ENV)
    server: ForkServer | None = _Client(address) if address else (_shared if _shared and _shared.alive() else None)
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


class _Client(ForkServer):
    """A connection to a fork server another process started (its address inherited in the environment)."""

    def __init__(self, address: str) -> None:
        self.address = address


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


def _module_or_script(args: Sequence[str]) -> tuple[str, str, list[str]]:
    """("module" or "script", its name, its argv) of ``[python, "-m", module, ...]`` or ``[python, script, ...]``."""
    if not args or os.path.abspath(args[0]) != os.path.abspath(sys.executable):  # the same venv, not only the same binary
        raise ForkServerError(f"the fork server runs its own interpreter ({sys.executable}), not {list(args)[:1]}")
    if len(args) >= 3 and args[1] == "-m":
        return "module", args[2], [args[2], *args[3:]]
    if len(args) >= 2 and not args[1].startswith("-"):
        return "script", args[1], list(args[1:])
    raise ForkServerError(f"the fork server runs 'python -m MODULE ...' or 'python SCRIPT ...', not {list(args)}")


# ---- the server -----------------------------------------------------------------------------------------


def serve(address: str, preload: Sequence[str]) -> None:
    """Run a fork server on the unix socket ``address`` after importing ``preload`` (what :class:`ForkServer`
    starts); it prints ``ready`` once it listens, and returns when its standard input reaches end of file."""
    import importlib

    for name in preload:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(address)
    listener.listen(64)
    wake_read, wake_write = os.pipe()
    os.set_blocking(wake_write, False)
    signal.set_wakeup_fd(wake_write)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a handler, so that the wakeup byte is written
    children: dict[int, socket.socket] = {}
    print("ready", flush=True)
    while True:
        try:
            readable, _, _ = select.select([listener, wake_read, sys.stdin], [], [])
        except InterruptedError:
            continue
        if sys.stdin in readable and not os.read(sys.stdin.fileno(), 1):
            break  # the launcher is gone: forked processes live on, as exec'd ones would
        if wake_read in readable:
            os.read(wake_read, 512)
            _reap(children)
        if listener in readable:
            connection, _ = listener.accept()
            pid = _fork_one(connection, [listener.fileno(), wake_read, wake_write,
                                         *(c.fileno() for c in children.values())])
            if pid is not None:
                children[pid] = connection
            else:
                connection.close()
    listener.close()


def _reap(children: dict[int, socket.socket]) -> None:
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        connection = children.pop(pid, None)
        if connection is not None:
            with contextlib.suppress(OSError):
                connection.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
            connection.close()


def _fork_one(connection: socket.socket, inherited: list[int]) -> int | None:
    """Fork the process ``connection`` asks for; its pid (None when the request was bad, and answered)."""
    try:
        payload, fds, _, _ = socket.recv_fds(connection, 1 << 20, 4)
        while not payload.endswith(b"\n"):
            more = connection.recv(1 << 20)
            if not more:
                raise ValueError("the request was cut short")
            payload += more
        request = json.loads(payload)
        kind, name, argv = _module_or_script(request["args"])
        if len(fds) != 3:
            raise ValueError(f"{len(fds)} descriptors were passed, not 3")
    except (OSError, ValueError, KeyError, ForkServerError) as error:
        with contextlib.suppress(OSError):  # a requester already gone needs no answer
            connection.sendall(f"error: {error}\n".encode())
        return None
    pid = os.fork()
    if pid == 0:
        for fd in inherited:
            os.close(fd)
        _become(connection, request, kind, name, argv, fds)  # never returns
    for fd in fds:
        os.close(fd)
    try:
        connection.sendall(f"{pid}\n".encode())
    except OSError:
        # The requester is gone (an agent killed while it started its worker): nobody holds the process, so it
        # goes too; it stays a child, reaped as any other. The server itself carries on: every process it started
        # reports its exit status through it.
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return pid


def _become(connection: socket.socket, request: dict[str, object], kind: str, name: str, argv: list[str],
            fds: list[int]) -> None:
    """In the forked child: take on the request's group, streams, directory and environment, then run."""
    code = 1
    try:
        connection.close()
        signal.set_wakeup_fd(-1)
        for number in (signal.SIGCHLD, signal.SIGTERM, signal.SIGPIPE):
            signal.signal(number, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        group = request["process_group"]
        if isinstance(group, int):
            os.setpgid(0, group)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.chdir(str(request["cwd"]))
        environment = request["env"]
        assert isinstance(environment, dict)
        os.environ.clear()
        os.environ.update(environment)
        niceness = request["niceness"]
        if isinstance(niceness, int) and niceness:
            os.nice(niceness)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115 - the descriptors were replaced under these objects
        sys.stdout = open(1, "w", closefd=False)  # noqa: SIM115
        sys.stderr = open(2, "w", closefd=False)  # noqa: SIM115
        sys.argv = argv
        code = _run(kind, name)
    except BaseException:
        traceback.print_exc()
    finally:
        os._exit(code)


def _run(kind: str, name: str) -> int:
    """Run the module or script as ``__main__``, then shut down as the interpreter would; its exit status."""
    try:
        if kind == "module":
            sys.path[0] = os.getcwd()
            runpy.run_module(name, run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = str(Path(name).resolve().parent)
            runpy.run_path(name, run_name="__main__")
        code = 0
    except SystemExit as exit_:
        code = _exit_status(exit_.code)
    except BaseException:
        traceback.print_exc()
        code = 1
    threading._shutdown()  # type: ignore[attr-defined]  # wait for non-daemon threads, as at exit
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):
            stream.flush()
    return code


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    print(code, file=sys.stderr)
    return 1
