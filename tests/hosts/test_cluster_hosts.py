"""``bamboo-launch agent`` on separate hosts: each agent in its own network namespace, etcd in another.

Every agent listens on its host's own address (so it needs the job token), its worker's gloo groups too;
nothing leaves the machine (the bridge has no uplink). Kills, partitions and the etcd restart are real:
``kill -9`` of every process of a host, the host's link taken down, etcd SIGKILLed and restarted.

The cases (issue 14) are three phases of ONE job on one cluster of four hosts (the module's ``hosts`` fixture:
it stays warm from one case to the next, instead of each case starting its network, etcd and eight processes
that import torch cold), in this order, each checking what happened from its own start:

1. a partition shorter than the grace period and an etcd restart: nothing is lost, no failover, no step lost or
   done twice;
2. a partition longer than the lease: the node is fenced (nothing it wrote after the cut reached the job) and
   comes back as a fresh node that trains in a layout;
3. a host killed (failover) and then the elected agent's host killed (another agent takes over); the case asks
   the job to finish (``bamboo-launch finish``) five steps after it has played out, and checks the whole run:
   every agent that was not killed exits 0 and the final parameters equal a fault-free single-process run of
   the same steps (so every phase before it was exact too).

Each case also runs alone (``-k``) on a cluster of its own; only the third ends the job and compares the final
parameters. Once a case fails, the cases after it on the same cluster fail at once, naming it.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from .host_etcd import HostEtcd
from .netns import Host, HostNetwork

pytestmark = [pytest.mark.netns, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parents[2]
STAGES, PIPELINES = 2, 2
TTL_S, GRACE_S = 3, 3.0
ZONES = ("a", "b", "c", "a")
STEPS = 2000  # more than the three cases need: the third asks the job to finish once it has played out
CHECKPOINT_EVERY = 10  # the second case checks which checkpoint commits the fenced node made


class HostCluster:
    """Four agents (P=2, D=2 of the built-in example) on four hosts, against etcd on a fifth."""

    def __init__(self, network: HostNetwork, etcd: HostEtcd, tmp: Path, steps: int,
                 checkpoint_every: int | None = None) -> None:
        from bamboo.membership import EtcdKV, EtcdOptions, MembershipStore

        self.network, self.etcd, self.tmp, self.steps = network, etcd, tmp, steps
        self.job = f"hosts-{secrets.token_hex(3)}"
        self.token = tmp / "token"
        self.token.write_text(secrets.token_hex(16))
        self.checkpoints = tmp / "checkpoints" if checkpoint_every else None
        self.checkpoint_every = checkpoint_every
        self.hosts: dict[str, Host] = {}
        self.agents: dict[str, subprocess.Popen[bytes]] = {}
        self.killed: set[str] = set()
        self.kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
        self.membership = MembershipStore(self.kv, self.job)
        self.failed_case: str | None = None

    def start(self) -> None:
        for index, zone in enumerate(ZONES):
            node = f"node{index}"
            host = self.network.add_host(node)
            self.hosts[node] = host
            command = [sys.executable, "-m", "bamboo.launch", "agent", "--job", self.job, "--etcd", self.etcd.endpoint,
                       "--node", node, "--zone", zone, "--host", host.address, "--port", "0",
                       "--token-file", str(self.token), "--run-dir", str(self.tmp / node),
                       "--stages", str(STAGES), "--pipelines", str(PIPELINES), "--steps", str(self.steps), "--layers", "2",
                       "--min-nodes", str(len(ZONES)), "--ttl", str(TTL_S), "--grace", str(GRACE_S),
                       "--group-timeout", "30", "--confirm-timeout", "30",
                       "--redundancy", "eflb"]  # failovers and fencing are what these tests are about
            if self.checkpoints is not None:
                command += ["--checkpoint-dir", str(self.checkpoints), "--checkpoint-every", str(self.checkpoint_every)]
            env = {**os.environ, "PYTHONWARNINGS": "ignore", "DS_ACCELERATOR": "cpu"}
            log = open(self.tmp / f"{node}.log", "wb")  # noqa: SIM115 - closed by the process's end
            self.agents[node] = host.popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)

    @contextlib.contextmanager
    def case(self, name: str) -> Iterator[None]:
        """One case on this cluster: refused at once when an earlier case failed on it (naming that case), and
        remembered as the failed case when it fails."""
        if self.failed_case is not None:
            pytest.fail(f"the cluster these cases share is unusable: {self.failed_case} failed on it")
        try:
            yield
        except BaseException:
            self.failed_case = name
            raise

    def events(self) -> list[Any]:
        from bamboo.launch.events import read_etcd_events

        try:
            return read_etcd_events(self.kv, self.job)
        except Exception:  # etcd restarting
            return []

    def wait(self, what: str, condition: Callable[[], bool], timeout: float = 120.0) -> float:
        """Poll `condition` until it holds; returns the monotonic time it did."""
        deadline = time.monotonic() + timeout
        while not condition():
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} within {timeout:g} s; logs under {self.tmp}")
            dead = {node: agent.returncode for node, agent in self.agents.items()
                    if agent.poll() not in (None, 0) and node not in self.killed}
            assert not dead or what.startswith("every agent"), f"agents exited early {dead}; logs in {self.tmp}"
            time.sleep(0.05)
        return time.monotonic()

    def step(self) -> int:
        from bamboo.launch.events import Step

        return max((event.step for event in self.events() if isinstance(event, Step)), default=0)

    def leader(self) -> str | None:
        try:
            found = self.kv.get(self.membership.keys.root + "leader")
        except Exception:
            return None
        return None if found is None else json.loads(found.value)["node"]

    def layout(self) -> Any:
        from bamboo.launch.coordinator import read_layout

        return read_layout(self.membership)

    def settle(self, steps_after: int = 5) -> None:
        """Wait until the layout in etcd trains: its generation's start finished (generation 0 once training
        started, a later one once its reconfiguration record is written), then `steps_after` more steps. A case
        that follows another starts from a steady job, as it would on a cluster of its own (a kill during the
        switch to a prepared layout is the reconfigure-kill e2e tests' subject, not these cases')."""

        def switched() -> bool:
            layout = self.layout()
            if layout is None:
                return False
            return layout.generation == 0 or any(
                (e.generation or 0) >= layout.generation for e in _kinds(self.events(), "reconfiguration"))

        self.wait("training starts", lambda: self.step() >= 15)
        self.wait("the layout in etcd trains", switched)
        target = self.step() + steps_after
        self.wait(f"step {target}", lambda: self.step() >= target)

    def kill_host(self, node: str) -> float:
        """``kill -9`` of every process of `node`'s host (`node` a host's node, or an incarnation of it: ``node1.2``)."""
        host = node.split(".", 1)[0]
        self.killed.add(host)
        self.hosts[host].kill_all()
        return time.monotonic()

    def finish_after(self, what: str, condition: Callable[[], bool], steps_after: int = 5) -> None:
        """Once `condition` holds and `steps_after` more steps have trained, end the job with ``bamboo-launch
        finish`` (from the test's host, over the bridge to etcd): the case ends when it has played out."""
        self.wait(what, condition)
        target = self.step() + steps_after
        self.wait(f"step {target}", lambda: self.step() >= target)
        done = subprocess.run([sys.executable, "-m", "bamboo.launch", "finish", "--etcd", self.etcd.endpoint,
                               "--job", self.job, "--by", "the test"], capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stderr

    def finish(self) -> dict[str, int | None]:
        """Wait for every agent that was not killed to exit; returns the exit statuses."""
        self.wait("every agent exits", lambda: all(
            agent.poll() is not None for node, agent in self.agents.items() if node not in self.killed), 180.0)
        return {node: agent.returncode for node, agent in self.agents.items()}

    def compare(self) -> dict[str, Any]:
        """The final parameters of every worker against the fault-free single-process reference."""
        import torch
        from bamboo.bench.emulated.reference import compare_reports
        from bamboo.launch.spec import JobSpec

        spec = JobSpec.from_json(self.kv.get(self.membership.keys.root + "spec").value)
        reports = [torch.load(path, weights_only=False) for path in sorted(self.tmp.glob("node*/out/rank*.pt"))]
        assert reports, f"no worker wrote a final report under {self.tmp}"
        return compare_reports(reports, spec)

    def close(self) -> None:
        self.kv.close()


@pytest.fixture(scope="module")
def hosts_network(network_namespaces: None) -> Iterator[HostNetwork]:
    """The module's `HostNetwork` (see ``host_network`` in conftest.py, whose teardown it shares)."""
    network = HostNetwork()
    try:
        yield network
    finally:
        network.close()


@pytest.fixture(scope="module")
def hosts_etcd(hosts_network: HostNetwork, tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostEtcd]:
    """etcd in its own host of the module's network (see ``host_etcd`` in conftest.py)."""
    etcd = HostEtcd(hosts_network.add_host("etcd"), tmp_path_factory.mktemp("hosts-etcd") / "data")
    etcd.start()
    try:
        yield etcd
    finally:
        etcd.kill()


@pytest.fixture(scope="module")
def hosts(hosts_network: HostNetwork, hosts_etcd: HostEtcd,
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostCluster]:
    """The job the module's cases share: four agents started once, checkpointing every `CHECKPOINT_EVERY` steps."""
    cluster = HostCluster(hosts_network, hosts_etcd, tmp_path_factory.mktemp("hosts"), STEPS, CHECKPOINT_EVERY)
    cluster.start()
    try:
        yield cluster
    finally:
        cluster.close()


def _kinds(events: list[Any], kind: str) -> list[Any]:
    return [event for event in events if kind == type(event).KIND]


def _since(hosts: HostCluster, seen: int, kind: str) -> list[Any]:
    """The events of `kind` after the first `seen` of them (those an earlier case left)."""
    return _kinds(hosts.events(), kind)[seen:]


def test_a_partition_shorter_than_the_grace_period_and_an_etcd_restart_lose_nothing(hosts: HostCluster) -> None:
    with hosts.case("the short partition and the etcd restart"):
        hosts.settle()
        events = hosts.events()
        failovers, preemptions = len(_kinds(events, "failover")), len(_kinds(events, "preemption"))
        victim = next(node for node in hosts.layout().ranks if node != hosts.leader())
        before = hosts.step()
        hosts.hosts[victim.split(".", 1)[0]].partition()
        time.sleep(1.0)  # shorter than the 3 s grace period and the 3 s lease
        hosts.hosts[victim.split(".", 1)[0]].heal()
        hosts.wait("training goes on after the short partition", lambda: hosts.step() >= before + 15, timeout=60.0)
        hosts.etcd.kill()
        time.sleep(1.0)
        hosts.etcd.restart()
        restarted_at_step = hosts.step()
        hosts.wait("training goes on after the etcd restart", lambda: hosts.step() >= restarted_at_step + 10)
        events = hosts.events()
        lost = _kinds(events, "failover")[failovers:] + _kinds(events, "preemption")[preemptions:]
        assert not lost, lost
        steps = sorted(e.step for e in _kinds(events, "step"))
        assert steps == list(range(1, steps[-1] + 1)), "a step was lost or done twice"
        assert all(agent.poll() is None for agent in hosts.agents.values()), "an agent exited"


def test_a_partition_longer_than_the_lease_fences_the_node_and_it_comes_back_fresh(hosts: HostCluster) -> None:
    with hosts.case("the long partition"):
        hosts.settle()
        preemptions = len(_kinds(hosts.events(), "preemption"))
        leader = hosts.leader()
        victim = next(node for node in hosts.layout().ranks if node != leader and "." not in node)
        step_at_cut = hosts.step()
        cut_unix, cut_at = time.time(), time.monotonic()
        hosts.hosts[victim].partition()
        confirmed_at = hosts.wait(f"{victim} declared dead", lambda: any(
            e.node == victim for e in _since(hosts, preemptions, "preemption")), timeout=30.0)
        hosts.wait("the others carry on without it", lambda: hosts.step() >= step_at_cut + 10, timeout=60.0)
        hosts.hosts[victim].heal()  # its lease expired (that is how it was declared dead): it must come back fresh
        healed_at = time.monotonic()
        fresh = f"{victim}.2"
        fresh_at = hosts.wait(f"{victim} comes back as {fresh}",
                              lambda: hosts.membership.get_decision(f"warm-{fresh}") is not None, timeout=60.0)
        hosts.wait(f"{fresh} is in a layout", lambda: fresh in getattr(hosts.layout(), "ranks", {}))
        hosts.settle()  # and trains in it
        assert fresh in hosts.layout().ranks
        assert [e.node for e in _since(hosts, preemptions, "preemption")] == [victim]
        # fenced: nothing the old identity wrote after the cut reached the job
        old_writers = [item for role in ("agent", "worker")
                       for item in hosts.kv.get_prefix(f"/bamboo/{hosts.job}/events/{victim}.{role}.")]
        start = json.loads(hosts.kv.get(hosts.membership.keys.root + "spec").value)["created_unix"]
        late = [item.key for item in old_writers if json.loads(item.value)["t"] > cut_unix - start + 0.5]
        assert old_writers and not late, f"{victim} wrote events after it was cut off: {late[:3]}"
        assert hosts.kv.get_prefix(f"/bamboo/{hosts.job}/events/{fresh}."), f"{fresh} wrote nothing"
        commits = hosts.kv.get_prefix(hosts.membership.keys.decision("checkpoint-"))  # checkpoint-<step>-<shard>
        steps_by_victim = [int(item.key.rsplit("/", 1)[1].split("-")[1]) for item in commits
                           if json.loads(item.value)["node"] == victim]
        assert commits and all(step <= step_at_cut + 10 for step in steps_by_victim), steps_by_victim
        assert hosts.layout() is not None and victim not in hosts.layout().ranks
        assert all(agent.poll() is None for agent in hosts.agents.values()), "an agent exited"
        print(f"\npartition of {victim}: declared dead {confirmed_at - cut_at:.2f} s after the cut (lease TTL {TTL_S} s, "
              f"grace {GRACE_S} s); came back as {fresh} {fresh_at - healed_at:.2f} s after the link came back")


def test_a_killed_host_fails_over_and_a_killed_coordinator_is_taken_over(hosts: HostCluster) -> None:
    """The last case: it ends the job and checks the whole run (exit statuses, the final parameters)."""
    with hosts.case("the killed hosts"):
        hosts.settle()
        events = hosts.events()
        failovers, preemptions = len(_kinds(events, "failover")), len(_kinds(events, "preemption"))
        reconfigurations = len(_kinds(events, "reconfiguration"))
        leader = hosts.leader()
        assert leader is not None
        first = next(node for node in hosts.layout().ranks if node != leader and "." not in node)
        hosts.kill_host(first)
        hosts.wait(f"a failover after {first} was killed", lambda: bool(_since(hosts, failovers, "failover")))
        hosts.wait("the reconfiguration that rebuilds redundancy",
                   lambda: bool(_since(hosts, reconfigurations, "reconfiguration")))
        leader = hosts.leader()
        assert leader is not None and leader != first
        killed_leader_at = hosts.kill_host(leader)
        taken_over_at = hosts.wait("another agent takes the coordinator over",
                                   lambda: hosts.leader() not in (None, leader), timeout=30.0)
        hosts.finish_after(f"{leader}'s preemption confirmed", lambda: leader in {
            e.node for e in _since(hosts, preemptions, "preemption")})
        codes = hosts.finish()
        assert all(code == 0 for node, code in codes.items() if node not in hosts.killed), codes
        failovers_here = _since(hosts, failovers, "failover")
        assert failovers_here[0].victim == first
        print(f"\nkill -9 of host {first}: failover pause {failovers_here[0].pause_s:.3f} s; kill -9 of the "
              f"coordinator's host {leader}: another agent took the coordinator over "
              f"{taken_over_at - killed_leader_at:.2f} s later (lease TTL {TTL_S} s)")
        # How soon is a figure, printed above, not a verdict: under load the takeover can come just past the lease
        # TTL (3.17 s against 3 s in one whole run), and timing goals belong in the benchmarks. The verdict is
        # that another agent took over at all (the wait above, 30 s).
        assert {e.node for e in _since(hosts, preemptions, "preemption")} == {first, leader}
        comparison = hosts.compare()
        assert 15 < comparison["steps"] < STEPS  # it ended where the test asked it to
        assert comparison["max_relative_diff"] <= 1e-6, comparison
