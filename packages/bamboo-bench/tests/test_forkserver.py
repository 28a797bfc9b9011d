"""The fork server of emulated clusters (`bamboo.bench.emulated.forkserver`, and its client
`bamboo.launch.forkserver`): a forked process runs the command it
replaces, with its environment, directory, files and process group, and its exit status comes back as
``subprocess.Popen`` gives it. The server preloads only ``json`` here (fast); the e2e tests run it with torch."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from bamboo.bench.emulated.forkserver import ForkServer
from bamboo.bench.emulated.processes import ProcessCluster
from bamboo.launch.forkserver import FORK_SERVER_ENV, ForkServerError, run_to_end, spawn

CHILD = '''
import json, os, sys, time
print(json.dumps({"argv": sys.argv, "x": os.environ.get("X"), "pid": os.getpid(), "pgid": os.getpgrp(),
                  "cwd": os.getcwd(), "nice": os.nice(0), "main": __name__, "path0": sys.path[0]}), flush=True)
print("on stderr", file=sys.stderr, flush=True)
action = sys.argv[1] if len(sys.argv) > 1 else ""
if action == "sleep":
    time.sleep(120)
if action == "raise":
    raise ValueError("bad value 7")
if action == "message":
    sys.exit("a one-line error")
if action == "signals":  # the dispositions that differ between a forked and an exec'd process if nobody sets them
    import signal
    names = ("SIGPIPE", "SIGXFSZ", "SIGCHLD", "SIGTERM")
    print(json.dumps({n: repr(signal.getsignal(getattr(signal, n))) for n in names}), flush=True)
    import socket
    left, right = socket.socketpair()
    right.close()
    try:
        for _ in range(64):
            left.send(b"x" * 65536)
    except BrokenPipeError:
        print("broken pipe raised", flush=True)
if action == "spawn":  # an agent starting its worker through the server it came from
    from bamboo.launch.forkserver import spawn
    worker = spawn([sys.executable, __file__, "sleep"], env=dict(os.environ))
    print(json.dumps({"worker": worker.pid}), flush=True)
    time.sleep(120)
sys.exit(int(action) if action.isdigit() else 0)
'''


@pytest.fixture(scope="module")
def server() -> Iterator[ForkServer]:
    started = ForkServer(preload=("json",))
    yield started
    started.close()


@pytest.fixture
def child(tmp_path: Path) -> Path:
    path = tmp_path / "child.py"
    path.write_text(CHILD)
    return path


def _lines(path: Path) -> list[str]:
    return [line for line in path.read_text().splitlines() if line.strip()]


def _wait_for(predicate: object, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


def test_a_forked_script_gets_its_argv_environment_directory_files_group_and_priority(
    server: ForkServer, child: Path, tmp_path: Path,
) -> None:
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        process = server.start([sys.executable, str(child), "3"], env={"X": "y"}, cwd=str(tmp_path), stdout=out,
                               stderr=subprocess.STDOUT, process_group=0, niceness=4)
        assert process.wait(30) == 3 and process.returncode == 3 and process.poll() == 3
    first, second = _lines(log)
    seen = json.loads(first)
    assert seen["argv"] == [str(child), "3"] and seen["x"] == "y" and seen["cwd"] == str(tmp_path)
    assert seen["pid"] == process.pid == seen["pgid"] and seen["nice"] == os.nice(0) + 4
    assert seen["main"] == "__main__" and seen["path0"] == str(child.parent)
    assert second == "on stderr"


def test_modules_run_as_main_and_errors_give_python_s_statuses(server: ForkServer, child: Path,
                                                                tmp_path: Path) -> None:
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        assert server.start([sys.executable, "-m", "json.tool", "--help"], env={}, stdout=out).wait(30) == 0
        assert "usage:" in log.read_text()
        assert server.start([sys.executable, str(child), "raise"], env={}, stdout=out,
                            stderr=subprocess.STDOUT).wait(30) == 1
        assert "ValueError: bad value 7" in log.read_text()
        assert server.start([sys.executable, str(child), "message"], env={}, stdout=out,
                            stderr=subprocess.STDOUT).wait(30) == 1
        assert _lines(log)[-1] == "a one-line error"


def test_a_forked_process_has_an_exec_d_interpreter_s_signals_and_a_write_to_a_closed_socket_raises(
    server: ForkServer, child: Path, tmp_path: Path,
) -> None:
    """The server's own handlers (SIGCHLD's wake-up) must not leak into the child, and Python's start-up ignores
    SIGPIPE: a worker writing to a killed peer's socket gets ``BrokenPipeError`` (reported), not death by SIGPIPE
    (an exit status of -13 that an e2e run once read as a second, false failure). (SIGINT is left out: an exec'd
    child inherits it ignored from a parent that ignores it, as xdist's workers do.)"""
    log = tmp_path / "out.log"
    with open(log, "wb") as out:
        assert server.start([sys.executable, str(child), "signals"], env={}, stdout=out,
                            stderr=subprocess.DEVNULL).wait(30) == 0
    execd = subprocess.run([sys.executable, str(child), "signals"], capture_output=True, text=True, timeout=30,
                           check=True)
    assert _lines(log)[1:] == execd.stdout.splitlines()[1:]
    assert _lines(log)[-1] == "broken pipe raised"


def test_a_killed_group_reports_the_signal_and_a_command_it_cannot_run_is_refused(
    server: ForkServer, child: Path,
) -> None:
    process = server.start([sys.executable, str(child), "sleep"], env={}, stdout=subprocess.DEVNULL,
                           stderr=subprocess.DEVNULL, process_group=0)
    assert process.poll() is None
    with pytest.raises(subprocess.TimeoutExpired):
        process.wait(0.1)
    os.killpg(process.pid, signal.SIGKILL)
    assert process.wait(30) == -signal.SIGKILL
    with pytest.raises(ForkServerError, match=r"runs 'python -m MODULE \.\.\.' or 'python SCRIPT \.\.\.', not"):
        server.start([sys.executable, "-c", "print(1)"])
    with pytest.raises(ForkServerError, match=r"runs its own interpreter .*, not \['ip'\]"):
        server.start(["ip", "netns", "exec", "n1", sys.executable, "-m", "json.tool"])


def test_a_process_leads_its_group_as_soon_as_it_is_started(server: ForkServer, child: Path) -> None:
    """A kill of the new group right after the start lands: the server sets the child's group before it answers
    (the child alone did it only after the answer in about half of these starts, and a killpg then found no
    group)."""
    started = [server.start([sys.executable, str(child), "sleep"], env={}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, process_group=0) for _ in range(20)]
    try:
        leaders = [os.getpgid(process.pid) == process.pid for process in started]
        for process in started:
            os.killpg(process.pid, signal.SIGKILL)
        assert [process.wait(30) for process in started] == [-signal.SIGKILL] * len(started)
    finally:
        for process in started:
            if process.poll() is None:
                process.kill()
                process.wait(30)
    assert all(leaders), f"{leaders.count(False)} of {len(started)} started processes did not lead their group yet"


def test_run_to_end_uses_the_named_server_and_kills_what_outruns_its_timeout(
    server: ForkServer, child: Path, tmp_path: Path,
) -> None:
    with open(tmp_path / "out.log", "wb") as out:
        assert run_to_end([sys.executable, str(child), "5"], env={FORK_SERVER_ENV: server.address}, stdout=out,
                          timeout_s=30) == 5
        started = time.monotonic()
        with pytest.raises(subprocess.TimeoutExpired):
            run_to_end([sys.executable, str(child), "sleep"], env={FORK_SERVER_ENV: server.address}, stdout=out,
                       timeout_s=0.5)
        assert time.monotonic() - started < 20
        pid = json.loads(_lines(tmp_path / "out.log")[-2])["pid"]
        _wait_for(lambda: not Path(f"/proc/{pid}").exists())


def test_run_to_end_forks_from_the_server_this_process_started_when_the_environment_names_none(
    server: ForkServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The launcher's own script runs (``describe``, ``reference``) come from the server it started (its
    ``shared_fork_server``, named to bamboo-launch with ``use_local_server``); without one they are exec'd."""
    from bamboo.launch import forkserver

    script = tmp_path / "parent.py"
    script.write_text("import os\nprint(os.getppid())\n")
    monkeypatch.setattr(forkserver, "_local", None)
    for named, parent in ((None, os.getpid()), (server, server._server.pid)):
        forkserver.use_local_server(named)
        with open(tmp_path / "out.log", "wb") as out:
            assert run_to_end([sys.executable, str(script)], env={}, stdout=out, timeout_s=30) == 0
        assert int(_lines(tmp_path / "out.log")[-1]) == parent


def test_a_preloaded_module_run_with_dash_m_runs_once_as_main_without_runpy_s_warning(tmp_path: Path) -> None:
    """The worker's module is preloaded and run with ``-m``: it runs as after an exec, once, as ``__main__``; runpy
    warned in every node's log ("found in sys.modules ... unpredictable behaviour") while the preloaded copy
    stayed importable beside it."""
    preloading = ForkServer(preload=("json", "json.tool"))
    try:
        log = tmp_path / "out.log"
        with open(log, "wb") as out:
            assert preloading.start([sys.executable, "-m", "json.tool", "--help"], env={}, stdout=out,
                                    stderr=subprocess.STDOUT).wait(30) == 0
        assert "usage:" in log.read_text() and "Warning" not in log.read_text(), log.read_text()
    finally:
        preloading.close()


def test_a_preloaded_module_is_in_every_forked_process_and_one_that_does_not_import_is_named(
    server: ForkServer, tmp_path: Path,
) -> None:
    """``--preload``: a training script's heavy imports, made once by the server. A module nothing else imports
    (``colorsys``) is there in a process forked from a server that preloads it, before the process imports
    anything; a module that does not import keeps the server from starting, with its name in the error."""
    script = tmp_path / "has.py"
    script.write_text("import sys\nprint('colorsys' in sys.modules)\n")
    with_it = ForkServer(preload=("json", "colorsys"))
    try:
        for named, found in ((server, "False"), (with_it, "True")):
            with open(tmp_path / "out.log", "wb") as out:
                assert run_to_end([sys.executable, str(script)], env={FORK_SERVER_ENV: named.address}, stdout=out,
                                  timeout_s=30) == 0
            assert _lines(tmp_path / "out.log")[-1] == found
    finally:
        with_it.close()
    with pytest.raises(ForkServerError, match="cannot import no_such_module_here: ModuleNotFoundError"):
        ForkServer(preload=("json", "no_such_module_here"))


def test_the_shared_server_of_each_preload_is_started_once_and_runs_the_launcher_s_own_scripts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    from bamboo.bench.emulated import forkserver as server_module
    from bamboo.launch import forkserver

    monkeypatch.setattr(server_module, "PRELOAD", ("json",))
    monkeypatch.setattr(server_module, "_shared", {})
    monkeypatch.setattr(forkserver, "_local", None)
    plain = server_module.shared_fork_server()
    try:
        preloading = server_module.shared_fork_server(("colorsys",))
        assert preloading is not plain and server_module.shared_fork_server(("colorsys",)) is preloading
        script = tmp_path / "has.py"
        script.write_text("import sys\nprint('colorsys' in sys.modules)\n")
        with open(tmp_path / "out.log", "wb") as out:  # the launcher's describe run: from the server it asked for
            assert run_to_end([sys.executable, str(script)], env={}, stdout=out, timeout_s=30) == 0
        assert _lines(tmp_path / "out.log")[-1] == "True"
        assert server_module.shared_fork_server() is plain
    finally:
        for started in server_module._shared.values():
            started.close()


def test_without_a_server_spawn_execs_the_command(child: Path) -> None:
    process = spawn([sys.executable, str(child), "4"], env={k: v for k, v in os.environ.items()
                                                           if k != FORK_SERVER_ENV})
    assert isinstance(process, subprocess.Popen) and process.wait(60) == 4


def test_a_node_s_worker_joins_its_group_and_dies_when_the_node_is_killed(
    server: ForkServer, child: Path, tmp_path: Path,
) -> None:
    with ProcessCluster(lambda node, zone: [sys.executable, str(child), "spawn"], log_dir=tmp_path / "logs",
                        fork_server=server) as cluster:
        node = cluster.add("a")
        log = tmp_path / "logs" / f"{node}.log"
        _wait_for(lambda: log.exists() and any('"worker"' in line for line in _lines(log)))
        agent = json.loads(_lines(log)[0])
        worker = next(json.loads(line)["worker"] for line in _lines(log) if '"worker"' in line)
        _wait_for(lambda: sum(1 for line in _lines(log) if line.startswith("{\"argv\"")) == 2)
        seen = [json.loads(line) for line in _lines(log) if line.startswith("{\"argv\"")]
        assert agent["pgid"] == agent["pid"] and seen[1]["pid"] == worker and seen[1]["pgid"] == agent["pid"]
        assert seen[1]["nice"] == seen[0]["nice"]  # no niceness asked: the worker's priority is the agent's
        cluster.kill(node)
        assert cluster.processes[node].poll() == -signal.SIGKILL
        _wait_for(lambda: _gone(worker))


def _gone(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(") ", 1)[1].startswith("Z")  # dead, not yet reaped
    except (OSError, IndexError):
        return True


def test_the_pid_and_an_exit_status_that_came_together_are_read_as_two_lines() -> None:
    """A process that ends at once: the server has sent its pid and its exit status before the starter reads."""
    from bamboo.launch.forkserver import _read_line

    ours, servers = socket.socketpair()
    with ours, servers:
        servers.sendall(b"774\n0\n")
        servers.shutdown(socket.SHUT_WR)
        assert [_read_line(ours), _read_line(ours), _read_line(ours)] == ["774", "0", ""]


def test_a_requester_gone_before_its_answer_leaves_the_server_serving_and_its_process_killed(
    child: Path, tmp_path: Path,
) -> None:
    """An agent SIGKILLed while it asked for its worker: the server's answer finds no one. It used to die of the
    broken pipe, and every process it had started then read as killed (a whole emulated cluster, in one run)."""
    server = ForkServer(preload=("json",))
    try:
        survivor = server.start([sys.executable, str(child), "sleep"], env={}, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, process_group=0)
        out = tmp_path / "orphan.log"
        os.kill(server._server.pid, signal.SIGSTOP)  # the request is in the socket before the server reads it
        try:
            with open(out, "wb") as stream, socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as connection:
                connection.connect(server.address)
                request = {"args": [sys.executable, str(child), "sleep"], "env": {}, "cwd": str(tmp_path),
                           "process_group": 0, "niceness": 0}
                null = os.open(os.devnull, os.O_RDWR)
                socket.send_fds(connection, [json.dumps(request).encode() + b"\n"], [null, stream.fileno(), null])
                os.close(null)
        finally:
            os.kill(server._server.pid, signal.SIGCONT)
        assert server.start([sys.executable, str(child), "3"], env={}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL).wait(30) == 3
        assert server.alive() and survivor.poll() is None
        _wait_for(lambda: all(_gone(json.loads(line)["pid"]) for line in _lines(out)))
        survivor.kill()
        assert survivor.wait(30) == -signal.SIGKILL
    finally:
        server.close()
