"""Every command, started as a user starts it, with bad input or with an etcd that does not answer: one line on
stderr and a non-zero exit status, never a traceback.

Most commands run in this process through the very function their console script calls
(``sys.exit(main(argv))``), with stderr captured; the agent's and one of bamboo-bench's also run as real
processes (``python -m bamboo.launch``, ``python -m bamboo.bench``), at once. The agent's four cases of issue 37: no ``--steps`` (the spec's default), etcd unreachable (said at once, then one
line after ``--etcd-timeout``), a node id that a live agent holds (one line naming ``--node``), and ``--host
0.0.0.0`` without a token (refused before anything is written to etcd).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from bamboo.launch.cli import main
from bamboo.launch.spec import DEFAULT_STEPS, JobSpec
from bamboo.membership import EmbeddedEtcd, EtcdKV, EtcdOptions

LAUNCH = [sys.executable, "-m", "bamboo.launch"]
BENCH = [sys.executable, "-m", "bamboo.bench"]


def _closed_port() -> int:
    """A loopback port nothing listens on (bound, then released)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


@pytest.fixture(scope="module")
def etcd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedEtcd]:
    server = EmbeddedEtcd(tmp_path_factory.mktemp("etcd")).start()
    yield server
    server.close()


def _run_all(commands: dict[str, list[str]], cwd: Path) -> dict[str, subprocess.CompletedProcess[str]]:
    """Start every command at once; their results by name once all have exited."""
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "TMPDIR": str(cwd)}  # what a command leaves in /tmp is seen
    started = {name: subprocess.Popen(command, cwd=cwd, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                      stderr=subprocess.PIPE, text=True) for name, command in commands.items()}
    done = {}
    for name, process in started.items():
        out, err = process.communicate(timeout=120)
        done[name] = subprocess.CompletedProcess(process.args, process.returncode, out, err)
    return done


def _one_line(result: subprocess.CompletedProcess[str], status: int, *phrases: str) -> None:
    shown = f"status {result.returncode}\nstdout: {result.stdout}\nstderr: {result.stderr}"
    assert result.returncode == status, shown
    assert "Traceback" not in result.stdout + result.stderr, shown
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, shown
    assert lines[0].startswith(("bamboo-launch", "bamboo-bench", "bamboo-schedule", "bamboo-reconfig", "bamboo-rc"))
    assert ": error: " in lines[0], shown
    for phrase in phrases:
        assert phrase in lines[0], shown


def _check(status: int, out: str, err: str, *phrases: str) -> None:
    _one_line(subprocess.CompletedProcess([], status, out, err), 2, *phrases)


def test_every_command_with_bad_input_or_no_etcd_says_one_line(tmp_path: Path,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    dead = f"127.0.0.1:{_closed_port()}"
    trace = tmp_path / "bad.csv"
    trace.write_text("0,add,node1\n0,add,node2\nsoon,remove,node1\n")
    log = tmp_path / "events.jsonl"
    log.write_text('{"kind":"jump","t":1}\n')
    launch_cases: list[tuple[list[str], tuple[str, ...]]] = [
        (["agent", "--job", "j", "--etcd", dead, "--steps", "0"], ("--steps", ">= 1")),
        (["agent", "--job", "j"], ("--etcd",)),
        (["agent", "--job", "j", "--etcd", dead, "--token-file", str(tmp_path / "none")], ("--token-file",)),
        (["run", "--nodes", "1", "--stages", "2"], ("--nodes 1",)),
        (["run", "--etcd", dead, "--nodes", "2", "--stages", "2", "--pipelines", "1", "--no-live", "--run-dir",
          str(tmp_path / "run")], (dead,)),
        (["run", "--nodes", "2", "--stages", "2", "--pipelines", "1", "--preemptions", str(trace)], (f"{trace}:3",)),
        (["run", "--nodes", "2", "--stages", "2", "--pipelines", "1", "--preload", "no_such.module"],
         ("--preload no_such.module", "no module")),
        (["run", "--nodes", "2", "--stages", "2", "--pipelines", "1", "--preload", "colorsys", "--no-fork-server"],
         ("--preload colorsys", "--no-fork-server")),
        (["report", "--etcd", dead, "--job", "j"], (dead,)),
        (["report", str(log)], (f"{log}:1",)),
        (["watch", "--etcd", dead, "--job", "j", "--once"], (dead,)),
        (["watch", "--etcd", dead, "--job", "j"], (dead,)),  # the live view: refused before it is drawn
        (["finish", "--etcd", dead, "--job", "j"], (dead,)),
        (["finish", "--etcd", dead], ("--job",)),
        (["export", str(tmp_path / "none"), "-o", str(tmp_path / "m.pt")], ("none: no such run directory",)),
        (["k8s", "render", "--etcd-replicas", "2"], ("--etcd-replicas",)),
        (["k8s", "validate", str(tmp_path / "x.yaml")], ("x.yaml",)),
        (["market", "--preemptions", "synthetic:2", "--dry-run"], ("RATE",)),
        (["run", "--nodes", "2", "--stages", "2", "--pipelines", "1", "--checkpoint-every", "often"],
         ("--checkpoint-every", "steps or 'auto'", "'often'")),
        (["run", "--nodes", "2", "--stages", "2", "--pipelines", "1", "--memory-copy-every", "-1"],
         ("--memory-copy-every must be >= 0",)),
        (["agent", "--job", "j", "--etcd", dead, "--checkpoint-every", "0"], ("--checkpoint-every", ">= 1")),
    ]
    for argv, phrases in launch_cases:
        status = main(argv)
        captured = capsys.readouterr()
        _check(status, captured.out, captured.err, *phrases)
        if argv[0] == "watch":
            assert captured.out == "", captured.out  # no empty view drawn before the error
    from bamboo.bench.cli import main as bench

    bench_cases: list[tuple[list[str], tuple[str, ...]]] = [
        (["measure", "bamboo", "--nodes", "1", "--stages", "2", "--pipelines", "1", "--steps", "5", "--run-dir",
          str(tmp_path / "m")], ("--nodes 1",)),
        (["simulate", "--trace", str(tmp_path / "none.csv")], ("none.csv",)),
    ]
    for argv, phrases in bench_cases:
        status = bench(argv)
        captured = capsys.readouterr()
        _check(status, captured.out, captured.err, *phrases)
    with pytest.raises(SystemExit) as exited:  # argparse's own exit, with its one line
        bench(["measure", "bamboo", "--nodes", "2", "--stages", "2", "--pipelines", "1", "--steps", "5", "--run-dir",
               str(tmp_path / "m"), "--checkpoint-every", "sometimes"])
    captured = capsys.readouterr()
    _check(int(str(exited.value.code)), captured.out, captured.err, "--checkpoint-every", "'sometimes'")


def test_the_lower_packages_commands_say_one_line_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """bamboo-schedule, bamboo-reconfig and bamboo-rc: a bad flag, a missing one or a missing file is one line
    (argparse's own errors too, which printed the usage first)."""
    from bamboo.rc.cli import main as rc
    from bamboo.reconfig.cli import main as reconfig
    from bamboo.schedule.cli import main as schedule

    missing = str(tmp_path / "none.json")
    cases = [
        (schedule, ["show", "-P", "4"], ("--microbatches",)),
        (schedule, ["show", "-P", "0", "-M", "8"], ("--stages",)),
        (schedule, ["draw"], ("draw",)),
        (reconfig, ["plan", "--nodes", missing, "--stages", "x", "--pipelines", "1"], ("--stages", "'x'")),
        (reconfig, ["plan", "--nodes", missing, "--stages", "2", "--pipelines", "1"], ("none.json",)),
        (rc, ["verify", "--stages", "x"], ("--stages",)),
    ]
    for command, argv, phrases in cases:
        try:
            status = command(argv)
        except SystemExit as exit_:  # argparse's errors exit from parse_args
            status = exit_.code if isinstance(exit_.code, int) else 1
        captured = capsys.readouterr()
        _check(status, captured.out, captured.err, *phrases)


def test_the_console_commands_say_one_line_too(tmp_path: Path) -> None:
    """As processes: an agent whose etcd does not answer says so at once and gives up after --etcd-timeout with
    one line; bamboo-bench compare with an unknown system."""
    dead = f"127.0.0.1:{_closed_port()}"
    results = _run_all({
        "agent": [*LAUNCH, "agent", "--job", "j", "--etcd", dead, "--stages", "2", "--pipelines", "1", "--run-dir",
                  str(tmp_path / "agent"), "--etcd-timeout", "1"],
        "compare": [*BENCH, "compare", "--preemptions", "synthetic:0.1", "--nodes", "4", "--stages", "2",
                    "--pipelines", "1", "--steps", "5", "--systems", "spot"],
    }, tmp_path)
    _one_line(results["agent"], 2, dead, "--etcd-timeout")
    assert f"etcd at {dead} does not answer; trying again for up to 1 s" in results["agent"].stdout
    _one_line(results["compare"], 2, "spot")
    assert not list(tmp_path.glob("bamboo-compare-*")), "a refused compare left its default --out folder behind"


def test_an_agent_without_steps_takes_the_spec_default(capsys: pytest.CaptureFixture[str]) -> None:
    """`--help` says 20, and the spec an agent without --steps writes has 20 (it used to fail on a missing
    argument of JobSpec)."""
    spec = JobSpec(job="j", stages=2, pipelines=1, layers=[{"param_bytes": 1, "optimizer_bytes": 1,
                                                            "compute_cost": 1.0}] * 2,
                   config={}, micro_batches=2, created_unix=1.7e9)
    assert spec.steps == DEFAULT_STEPS == 20
    with pytest.raises(SystemExit):
        main(["agent", "--help"])
    assert f"training steps (default: {DEFAULT_STEPS})" in " ".join(capsys.readouterr().out.split())


def test_two_agents_with_one_id_and_an_open_agent_without_a_token(etcd: EmbeddedEtcd, tmp_path: Path) -> None:
    kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
    try:
        lease = kv.grant_lease(60)  # a live agent's registration as node "twin"
        kv.put("/bamboo/busy/nodes/twin", b"{}", lease=lease)
        results = _run_all({
            "twin": [*LAUNCH, "agent", "--job", "busy", "--etcd", etcd.endpoint, "--node", "twin", "--ttl", "1",
                     "--stages", "2", "--pipelines", "1", "--run-dir", str(tmp_path / "twin")],
            "open": [*LAUNCH, "agent", "--job", "open", "--etcd", etcd.endpoint, "--node", "n0", "--host", "0.0.0.0",
                     "--stages", "2", "--pipelines", "1", "--run-dir", str(tmp_path / "open")],
        }, tmp_path)
        _one_line(results["twin"], 2, "'twin'", "--node")
        _one_line(results["open"], 2, "--host 0.0.0.0", "--token-file")
        assert kv.get_prefix("/bamboo/open/") == []  # refused before anything was written
        assert [item.key for item in kv.get_prefix("/bamboo/busy/")] == ["/bamboo/busy/nodes/twin"]
    finally:
        kv.close()
