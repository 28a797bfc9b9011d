"""A worker's start rides out an etcd that is down: its first read (the job's spec) waits instead of failing;
what it imports only to plan at a barrier waits for its first step; and the built-in example's worker starts
with its agent, its imports overlapping the agent's start, and waits for the context the agent writes.

Before, only the reads after the start went through the patient store: one refused connection at the start
killed the worker, and its peers then waited out the gloo group timeout for it.
"""

from __future__ import annotations

import os
import threading
import time
import types
from pathlib import Path

import attrs
import pytest
from bamboo.launch import notices, supervisor
from bamboo.launch.agent_options import AgentOptions
from bamboo.launch.generation import WorkerState, _first_step_records
from bamboo.launch.spec import ENV_CONTEXT, EtcdAccess, JobSpec, WorkerContext
from bamboo.launch.worker import _spec_of
from bamboo.launch.worker_records import StartupClock
from bamboo.membership import EmbeddedEtcd, EtcdKV, EtcdOptions, MembershipStore


def test_the_spec_read_at_a_worker_start_waits_for_a_restarting_etcd(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    retrying = threading.Event()  # set when the patient store sleeps before a retry: etcd refused a call

    def sleep_before_retry(seconds: float) -> None:
        retrying.set()
        time.sleep(seconds)

    monkeypatch.setattr(notices, "time", types.SimpleNamespace(monotonic=time.monotonic, sleep=sleep_before_retry))
    server = EmbeddedEtcd(tmp_path / "etcd").start()
    try:
        spec = JobSpec(job="patient", stages=2, pipelines=1, steps=1, micro_batches=2, created_unix=1.0,
                       layers=[{"param_bytes": 4, "optimizer_bytes": 8, "compute_cost": 1.0}] * 2, config={})
        kv = EtcdKV(EtcdOptions(endpoints=(server.endpoint,)))
        kv.put(MembershipStore(kv, "patient").keys.root + "spec", spec.to_json().encode())
        kv.close()
        context = WorkerContext(job="patient", node="node0", zone="a", agent_address="127.0.0.1:1",
                                etcd=EtcdAccess(endpoints=(server.endpoint,)), run_dir=str(tmp_path / "run"))
        server.kill()
        read: dict[str, object] = {}
        reader = threading.Thread(target=lambda: read.update(spec=_spec_of(context)), daemon=True)
        reader.start()
        assert retrying.wait(30.0), f"the read never retried against the dead etcd: {read}"
        assert reader.is_alive(), f"the read gave up while etcd was down: {read}"
        server.start()
        reader.join(timeout=30.0)
        assert read.get("spec") == spec
    finally:
        server.close()


def test_the_planning_solver_is_preloaded_after_the_first_step_once() -> None:
    """The worker's session starts the import of the barrier's solver (scipy.optimize) when its first step is done
    (with the ``startup`` record), not while the worker starts: once per worker, whatever layouts follow."""
    written: list[object] = []
    preloads: list[str] = []
    log = types.SimpleNamespace(write=written.append, now=lambda: 1.0)
    run = types.SimpleNamespace(log=log, node="node0", preload_planning=lambda: preloads.append("node0"))
    state = WorkerState(startup=StartupClock())
    engine = types.SimpleNamespace(build_seconds={"model": 0.1, "groups": 0.2})
    layout = types.SimpleNamespace(generation=0, ranks={"node0": 0})
    assert preloads == []
    for _ in range(3):
        _first_step_records(run, layout, engine, state, 0.5, prepared=False)  # type: ignore[arg-type]
    assert preloads == ["node0"]
    assert [type(record).__name__ for record in written] == ["Startup"]


def _context(tmp_path: Path) -> WorkerContext:
    return WorkerContext(job="j", node="node0", zone="a", agent_address="127.0.0.1:1",
                         etcd=EtcdAccess(endpoints=("127.0.0.1:2379",)), run_dir=str(tmp_path))


def test_a_prestarted_worker_waits_for_the_context_its_agent_writes_once_registered(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    path = tmp_path / "node0.json"
    monkeypatch.setenv(ENV_CONTEXT, str(path))
    sleeps: list[float] = []

    def sleep(seconds: float) -> None:  # the agent registers during the third look
        sleeps.append(seconds)
        if len(sleeps) == 3:
            _context(tmp_path).write(path)

    assert WorkerContext.from_environment(poll_s=0.02, sleep=sleep) == _context(tmp_path)
    assert sleeps == [0.02, 0.02, 0.02]
    monkeypatch.setenv(ENV_CONTEXT, str(tmp_path / "missing.json"))
    with pytest.raises(FileNotFoundError):  # without poll_s, a missing file is an error at once
        WorkerContext.from_environment(sleep=sleep)
    assert len(sleeps) == 3


class _FakeWorker:
    """A started worker as the supervisor sees it (``poll``, ``send_signal``, ``wait``)."""

    def __init__(self) -> None:
        self.signals: list[int] = []

    def poll(self) -> int | None:
        return -9 if self.signals else None

    def send_signal(self, number: int) -> None:
        self.signals.append(number)

    def wait(self, timeout: float | None = None) -> int:
        return -9


def test_the_agent_prestarts_its_worker_and_adopts_it_unless_the_job_runs_another_program(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    started: list[tuple[list[str], dict[str, str]]] = []

    def spawn(command: list[str], *, env: dict[str, str], niceness: int = 0) -> _FakeWorker:
        started.append((command, env))
        return _FakeWorker()

    monkeypatch.setattr(supervisor, "spawn", spawn)
    monkeypatch.setattr(supervisor.Supervisor, "context", lambda self: _context(tmp_path))
    options = AgentOptions(job="j", etcd=EtcdAccess(endpoints=("127.0.0.1:2379",)), node="node0",
                           run_dir=str(tmp_path))
    stale = tmp_path / "workers" / f"node0.{os.getpid()}.json"
    stale.parent.mkdir()
    stale.write_text("{}")  # an earlier run's context: it must not start the new worker before registration
    prestarted = supervisor.prestart_worker(options)
    assert not stale.exists()
    assert started[0][0][1:] == ["-m", "bamboo.launch.worker"] and started[0][1][ENV_CONTEXT] == str(stale)
    spec = JobSpec(job="j", stages=1, pipelines=1, steps=1, micro_batches=1, created_unix=1.0,
                   layers=[{"param_bytes": 4, "optimizer_bytes": 8, "compute_cost": 1.0}], config={})

    def run(spec: JobSpec, worker: _FakeWorker | None) -> object:
        return supervisor.Supervisor(options, spec, None, "node0", "a", lambda _: None,  # type: ignore[arg-type]
                                     threading.Event(), prestarted=worker).spawn()

    assert run(spec, prestarted) is prestarted and len(started) == 1  # adopted: no second worker
    assert WorkerContext.from_json(stale.read_text()) == _context(tmp_path)
    scripted = attrs.evolve(spec, script=("train.py",))
    other = _FakeWorker()
    assert run(scripted, other) is not other and other.signals  # the stored spec runs a script: it starts instead
    assert started[1][0][1:] == ["train.py"]
    options = attrs.evolve(options, spec={"script": ("train.py", "--lr", "3")})  # given the script: that one starts
    prestarted = supervisor.prestart_worker(options)
    assert started[2][0][1:] == ["train.py", "--lr", "3"] and started[2][1][ENV_CONTEXT] == str(stale)
    assert run(attrs.evolve(spec, script=("train.py", "--lr", "3")), prestarted) is prestarted and len(started) == 3
