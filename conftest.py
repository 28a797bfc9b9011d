"""Test-suite wide settings: the one test clock (:class:`FakeClock`, fixture ``fake_clock``) and the lanes of
``make test``.

``make test`` runs pytest with three xdist workers (``-n 3``) under :class:`ClusterLane` scheduling. Every test
that starts a cluster of agents and workers (``CLUSTER_TESTS``) is one work unit, so those run one after
another on one worker: two clusters side by side on the 2-core machine would starve each other's lease
keep-alives (a 2 s TTL) and turn a slow machine into false failures. Every other test is its own unit,
spread over the other two workers, filling the CPU that a cluster test leaves idle (its waits for leases, its
single-process phases); a worker running those lowers its priority (`BACKGROUND_NICE`), so a cluster test
keeps most of the CPU when the lanes want more than there is. The tests in ``BACKGROUND_PROCESS_TESTS`` start
processes as well but do not depend on answers in time, and spend most of their time waiting: they come first
in the other lanes, beside the cluster tests, and the short tests fill every lane after them, so that the lanes
end together. Three lanes rather than two: on the 2-core machine the suite kept about 16% of the CPU idle with
two (a cluster test waiting on a lease, a short test waiting on its subprocess), and a third lane of niced short
tests takes that up (measured: 522 and 555 s with three, 570 to 582 s with two, the same tests). A plain
``pytest`` (no ``-n``) runs everything in one process, as before.

(xdist's own ``--dist loadgroup`` would do this with a marker, but xdist 3.8 tags the group onto a test id
that pytest 9.2 no longer reads; the scheduler below needs no marker.)
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest


class FakeClock:
    """The test suite's one clock: time moves only when someone sleeps on it or a test advances it.

    It reads as each clock of the code does: a callable (``EventLog``'s ``clock``, a detector's), the market's
    :class:`bamboo.bench.emulated.market.Clock` (``now()``, ``sleep(seconds, stop)``), and bamboo-rc's ``Clock``
    (``monotonic()``, ``time()``, ``sleep(seconds)``). ``t`` is its time in seconds; ``time()`` adds a Unix
    epoch; ``sleeps`` lists every sleep asked of it; ``on_sleep``, where a test sets it, runs after each sleep
    with the clock (what the other processes do meanwhile).
    """

    EPOCH = 1_700_000_000.0

    def __init__(self, start: float = 1000.0) -> None:
        self.t = start
        self.sleeps: list[float] = []
        self.on_sleep: Callable[[FakeClock], None] | None = None

    def __call__(self) -> float:
        return self.t

    def now(self) -> float:
        return self.t

    def monotonic(self) -> float:
        return self.t

    def time(self) -> float:
        return self.EPOCH + self.t

    def advance(self, seconds: float) -> None:
        """Move the time forward by ``seconds`` (as another process's work would take)."""
        self.t += max(0.0, seconds)

    def sleep(self, seconds: float, stop: threading.Event | None = None) -> None:
        self.sleeps.append(seconds)
        self.advance(seconds)
        if self.on_sleep is not None:
            self.on_sleep(self)


@pytest.fixture
def fake_clock() -> FakeClock:
    """A :class:`FakeClock` at ``t = 1000``."""
    return FakeClock()


@pytest.fixture
def sample_run() -> Callable[[], list[Any]]:
    """Makes the event log of a small run (a fresh list each call), shared by the event log's tests (launch) and the
    report's (bench): two nodes for an hour, one preempted at 30 min and replaced; 4 steps of 10 samples."""
    from bamboo.launch.events import (
        Checkpoint,
        Failover,
        Join,
        Preemption,
        Reconfiguration,
        RunEnd,
        RunStart,
        Step,
    )

    def make() -> list[Any]:
        return [
            RunStart(t=0.0, job="demo", unix_time=1.7e9, target_nodes=2, stages=2, pipelines=1),
            Join(t=0.0, node="n0", zone="a"),
            Join(t=0.0, node="n1", zone="b"),
            Step(t=900.0, step=0, samples=10, loss=2.0, nodes_active=2, duration_s=900.0),
            Preemption(t=1800.0, node="n1", zone="b", notice_s=2.0),
            Failover(t=1801.0, victim="n1", shadow="n0", stage=1, pause_s=1.0),
            Failover(t=1802.0, victim="n9", shadow="n0", stage=0, pause_s=3.0),
            Failover(t=1803.0, victim="n8", shadow="n0", stage=0, pause_s=2.0),
            Step(t=1800.0, step=1, samples=10, loss=1.5, nodes_active=2, duration_s=900.0),
            Join(t=2700.0, node="n2", zone="c"),
            Reconfiguration(t=2701.0, reason="join", pipelines=1, stages=2, standby=0, bytes_moved=4096,
                            duration_s=0.5),
            Checkpoint(t=2702.0, step=1, path="/tmp/ck/step-1", bytes=100, duration_s=0.1),
            Step(t=2700.0, step=2, samples=10, loss=1.0, nodes_active=1, duration_s=900.0),
            Step(t=3600.0, step=3, samples=10, loss=0.5, nodes_active=2, duration_s=900.0),
            RunEnd(t=3600.0, steps=4),
        ]

    return make

#: The tests whose verdict depends on other processes answering in time: clusters of agents and workers
#: (etcd leases of 2 to 3 s, real kills), and the membership agent's real processes (probe timeouts of
#: 0.25 s). Paths from the repository root: a directory or a file.
CLUSTER_TESTS = (
    "tests/e2e",
    "tests/hosts",
    "packages/bamboo-membership/tests/test_agent.py",
    "packages/bamboo-bench/tests/test_baseline.py",
    "packages/bamboo-launch/tests/test_manifests_run.py",
    "packages/bamboo-launch/tests/test_script_e2e.py",
    "tests/test_bench_scale.py",
)


#: Tests that start clusters too but whose verdict does not hang on a lease or a probe answering in time
#: (they check records and exit statuses, not how many failures the run saw; runs without failures use 10 s
#: leases): they run in the other lanes, lowered in priority further than every test there, and first, while the
#: cluster lane runs. They are long and mostly wait (``bamboo-bench compare`` uses about half a core); run last, as
#: they once were when the cluster lane was the suite's critical path, the last of them kept one lane busy and
#: the other idle for about 90 s after every other test had ended. ``bamboo-bench compare`` (three systems one
#: after another), a resumed run and its export, the training hooks in a real run. The checkpoint/restart
#: baseline's test is not one: how many survivors make torchrun's rendezvous in time decides its restart's
#: world size.
BACKGROUND_PROCESS_TESTS = (  # in the order they start: the longest first
    "tests/e2e/test_compare_e2e.py",
    "tests/e2e/test_resume_export_e2e.py",
    "packages/bamboo-launch/tests/test_hooks.py",
)


#: Test modules whose tests share a costly module-scoped fixture: each runs on one worker, as one work unit, so the
#: fixture is made once. Spread one test per unit over three workers, the packaging tests built every package's
#: wheels three times (about 10 CPU-s each), and the agent TLS tests made their certificates twice.
ONE_WORKER_MODULES = (
    "tests/test_packaging.py",
    "packages/bamboo-membership/tests/test_agent_auth.py",
)


def _under(path: str, roots: tuple[str, ...]) -> bool:
    return any(path == root or path.startswith(root + "/") for root in roots)


def is_cluster_test(path: str) -> bool:
    """Whether the test file ``path`` (relative to the repository root, ``/``-separated) runs in the cluster lane."""
    return _under(path, CLUSTER_TESTS) and not _under(path, BACKGROUND_PROCESS_TESTS)


#: The niceness of the worker that runs the other tests, and of the processes it starts. A cluster's agents
#: and etcd run at 0 and its workers at 5 (`bamboo.launch.agent.WORKER_NICENESS`): in a burst (a cluster's
#: workers all importing torch at once) the cluster lane gets most of the CPU, and its agents more still.
BACKGROUND_NICE = 10

#: The niceness of a background process test (`BACKGROUND_PROCESS_TESTS`): it runs on what the cluster lane
#: leaves idle, and slows that lane as little as it can.
BACKGROUND_PROCESS_NICE = 15


def _relative(item: pytest.Item) -> str:
    return Path(str(item.path)).resolve().relative_to(Path(str(item.config.rootpath))).as_posix()


def lane_scope(nodeid: str) -> str:
    """The xdist work unit of the test ``nodeid``: ``"clusters"`` for every cluster test (one lane, one at a time),
    its module's path for a test of ``ONE_WORKER_MODULES``, and the test itself otherwise."""
    path = nodeid.split("::", 1)[0]
    if is_cluster_test(path):
        return "clusters"
    return path if path in ONE_WORKER_MODULES else nodeid


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Under xdist, a worker that runs a test outside the cluster lane lowers its priority (and that of
    every process it starts) to `BACKGROUND_NICE`, or `BACKGROUND_PROCESS_NICE` for a background process test:
    the cluster tests keep the CPU their 2 s leases need."""
    path = _relative(item)
    if os.environ.get("PYTEST_XDIST_WORKER") and not is_cluster_test(path):
        wanted = BACKGROUND_PROCESS_NICE if _under(path, BACKGROUND_PROCESS_TESTS) else BACKGROUND_NICE
        current = os.nice(0)
        if current < wanted:
            os.nice(wanted - current)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The cluster tests first: the scheduler hands work out in collection order, so the long lane starts
    at once instead of after every short test; then the background process tests, the first the other lanes run;
    then the other tests marked ``slow``, then every other test. Long tests first, many short ones last, is how
    the lanes end together: in collection order the schedule package's local-search tests and the chaos runs
    (20 to 30 CPU-s each) came near the end, and one of them still running kept its lane going after the others
    had ended (the longest of them took 86 s in one run, 22 to 30 s in others)."""
    paths = {item: _relative(item) for item in items}
    clusters = [item for item in items if is_cluster_test(paths[item])]
    background = [item for item in items if _under(paths[item], BACKGROUND_PROCESS_TESTS)]
    background.sort(key=lambda item: [_under(paths[item], (root,)) for root in BACKGROUND_PROCESS_TESTS], reverse=True)
    grouped = set(clusters) | set(background)
    rest = [item for item in items if item not in grouped]
    rest.sort(key=lambda item: item.get_closest_marker("slow") is None)  # stable: the slow ones first, in order
    items[:] = clusters + background + rest


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    """xdist's load-scope scheduling with one scope for every cluster test, one per module of
    ``ONE_WORKER_MODULES``, and one per test otherwise."""
    from xdist.scheduler import LoadScopeScheduling

    class ClusterLane(LoadScopeScheduling):  # type: ignore[misc]
        def _split_scope(self, nodeid: str) -> str:
            return lane_scope(nodeid)

    return ClusterLane(config, log)
