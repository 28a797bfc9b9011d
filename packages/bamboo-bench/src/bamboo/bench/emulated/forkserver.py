"""Start the processes of an emulated cluster from one preloaded interpreter (a fork server): the server.

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

- :class:`ForkServer` starts the server (:func:`serve`, in a process of its own) and asks it for processes
  (the asking is bamboo-launch's :class:`bamboo.launch.forkserver.ForkClient`, which an agent uses through
  :func:`bamboo.launch.forkserver.spawn`); :func:`shared_fork_server` is the one a launcher process shares
  among its clusters.

The server exits when the process that started it does (its standard input reaches end of file).
"""

from __future__ import annotations

import atexit
import contextlib
import gc
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
from collections.abc import Callable, Sequence
from pathlib import Path
from types import FrameType

from bamboo.bench.emulated import timeouts as emulated_timeouts
from bamboo.launch.forkserver import ForkClient, ForkServerError, module_or_script, use_local_server

__all__ = ["PRELOAD", "ForkServer", "serve", "shared_fork_server"]

PRELOAD = ("torch", "torch.distributed", "bamboo.rc.engine", "bamboo.rc.worker", "bamboo.launch.worker",
           "bamboo.launch.copy_service", "bamboo.launch.cli", "bamboo.launch.agent")
"""The modules the server imports before it forks anything. (torch's symbolic shapes, and sympy through them, are
not among them: a stage's backward from a received gradient no longer imports them,
:func:`bamboo.rc.precision.backward_through`.)"""

_OWN_GROUP = 0  # "process_group": lead a new group


class ForkServer(ForkClient):
    """A running fork server (see the module docstring); ``close`` (or the end of this process) stops it."""

    def __init__(self, preload: Sequence[str] = PRELOAD, *,
                 start_timeout_s: float = emulated_timeouts.FORK_SERVER_START_S) -> None:
        self._folder = tempfile.mkdtemp(prefix="bamboo-forks-")
        self.address = str(Path(self._folder) / "socket")
        self._server = subprocess.Popen(
            [sys.executable, "-c", "import sys; from bamboo.bench.emulated.forkserver import serve; serve(sys.argv[1], sys.argv[2:])",
             self.address, *preload],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, process_group=_OWN_GROUP)
        assert self._server.stdout is not None
        ready, _, _ = select.select([self._server.stdout], [], [], start_timeout_s)
        line = self._server.stdout.readline().decode().strip() if ready else ""
        if line != "ready":
            self.close()
            why = line or f"it said nothing within {start_timeout_s:g} s"
            raise ForkServerError(f"the fork server did not start ({why}; exit status {self._server.poll()})")

    def alive(self) -> bool:
        return self._server.poll() is None

    def close(self) -> None:
        if self._server.stdin is not None and not self._server.stdin.closed:
            self._server.stdin.close()  # end of file: the server exits
        try:
            self._server.wait(emulated_timeouts.REAP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self._server.kill()
            self._server.wait()
        if self._server.stdout is not None:
            self._server.stdout.close()
        for path in (Path(self.address), Path(self._folder)):
            with contextlib.suppress(OSError):
                path.rmdir() if path.is_dir() else path.unlink()


_shared: dict[tuple[str, ...], ForkServer] = {}  # by the modules preloaded beyond PRELOAD
_shared_lock = threading.Lock()

EXEC_SIGNALS: dict[signal.Signals, Callable[[int, FrameType | None], object] | int] = {
    signal.SIGCHLD: signal.SIG_DFL,
    signal.SIGTERM: signal.SIG_DFL,
    signal.SIGINT: signal.default_int_handler,
    signal.SIGPIPE: signal.SIG_IGN,
    signal.SIGXFSZ: signal.SIG_IGN,
}
"""The signal dispositions of a freshly exec'd Python interpreter, which a forked process takes on: Python ignores
SIGPIPE and SIGXFSZ at start-up (a write to a closed socket raises ``BrokenPipeError``), so a worker whose peer was
killed gets an error it reports, not a SIGPIPE that kills it (status -13) as a second, false failure."""


def shared_fork_server(extra: Sequence[str] = ()) -> ForkServer:
    """This process's fork server that has also imported ``extra`` (a training script's own heavy imports, after
    :data:`PRELOAD`), started on first use and stopped when the process exits; it becomes the server that
    :func:`bamboo.launch.forkserver.run_to_end` uses."""
    key = tuple(extra)
    with _shared_lock:
        server = _shared.get(key)
        if server is None or not server.alive():
            server = _shared[key] = ForkServer((*PRELOAD, *key))
            atexit.register(server.close)
        use_local_server(server)
        return server


# ---- the server -----------------------------------------------------------------------------------------


def serve(address: str, preload: Sequence[str]) -> None:
    """Run a fork server on the unix socket ``address`` after importing ``preload`` (what :class:`ForkServer`
    starts); it prints ``ready`` once it listens, and returns when its standard input reaches end of file."""
    import importlib

    for name in preload:
        try:
            importlib.import_module(name)
        except Exception as error:  # told to the launcher instead of "ready" (ForkServer's error names it)
            print(f"cannot import {name}: {type(error).__name__}: {error}", flush=True)
            sys.exit(1)
    gc.freeze()  # the children's collections leave the preloaded heap alone (bamboo.rc.worker.heap_frozen_for_forks)
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
        kind, name, argv = module_or_script(request["args"])
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
    group = request["process_group"]
    if isinstance(group, int):
        # The child joins its group itself too, but maybe only after the requester has its pid: a kill of the
        # group sent in between (a preemption that lands as a node starts) found no such group, and the node
        # lived on. Set here as well, before the answer, the group exists once the requester knows the pid.
        with contextlib.suppress(OSError):  # the child got there first and ran on, or is gone already
            os.setpgid(pid, group)
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
        for number, disposition in EXEC_SIGNALS.items():
            signal.signal(number, disposition)
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
            # A module the server preloaded (the worker's) runs as after an exec: once, as __main__, not also left
            # importable under its own name (runpy warned in every node's log that both existed; its imports stay
            # preloaded). A package (``-m bamboo.launch``) runs its ``__main__``, which nothing preloads.
            if not hasattr(sys.modules.get(name), "__path__"):
                sys.modules.pop(name, None)
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
