"""A worker's start rides out an etcd that is down: its first read (the job's spec) waits instead of failing;
what it imports only to plan at a barrier waits for its first step; and the agent that describes the model keeps
its spec writer's lease meanwhile.

Before, only the reads after the start went through the patient store: one refused connection at the start
killed the worker, and its peers then waited out the gloo group timeout for it.
"""

from __future__ import annotations

import threading
import time
import types
from pathlib import Path

import pytest
from bamboo.launch import notices
from bamboo.launch.agent_spec import _kept_alive
from bamboo.launch.generation import WorkerState, _first_step_records
from bamboo.launch.spec import EtcdAccess, JobSpec, WorkerContext
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


def test_the_startup_record_is_written_after_the_first_step_once() -> None:
    """The worker writes its ``startup`` record when its first step is done: once per worker, whatever layouts
    follow."""
    written: list[object] = []
    log = types.SimpleNamespace(write=written.append, now=lambda: 1.0)
    run = types.SimpleNamespace(log=log, node="node0")
    state = WorkerState(startup=StartupClock())
    engine = types.SimpleNamespace(build_seconds={"model": 0.1, "groups": 0.2})
    layout = types.SimpleNamespace(generation=0, ranks={"node0": 0})
    for _ in range(3):
        _first_step_records(run, layout, engine, state, 0.5, prepared=False)  # type: ignore[arg-type]
    assert [type(record).__name__ for record in written] == ["Startup"]


class _LeaseKV:
    """Counts lease refreshes; ``refreshed`` is set at the second."""

    def __init__(self) -> None:
        self.refreshes: list[int] = []
        self.refreshed = threading.Event()

    def refresh_lease(self, lease_id: int) -> int:
        self.refreshes.append(lease_id)
        if len(self.refreshes) >= 2:
            self.refreshed.set()
        return 10


def test_the_spec_writer_keeps_its_lease_while_it_describes_the_model() -> None:
    """A description that outlasts the spec writer's lease no longer lets a second agent describe the model too:
    the lease is refreshed while the description runs, and no more after it."""
    kv = _LeaseKV()
    with _kept_alive(kv, 7, ttl_s=0.03):  # type: ignore[arg-type]
        assert kv.refreshed.wait(30.0), "the lease was not refreshed while the description ran"
    assert set(kv.refreshes) == {7}
    assert not [t for t in threading.enumerate() if t.name == "spec-writer-lease"]  # no refresh after it
