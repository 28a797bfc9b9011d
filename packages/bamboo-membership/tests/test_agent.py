"""The agent against real etcd and real processes: kill -9, SIGSTOP, SIGTERM notices, gRPC Probe/Notify/Subscribe.

These tests use real time (processes really stop and leases really expire), with a 2 s lease TTL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest
from bamboo.membership.agent import AgentClient, GrpcProber, NodeAgent
from bamboo.membership.detector import DetectorConfig, ProbeOutcome
from bamboo.membership.embedded import EmbeddedEtcd
from bamboo.membership.kv import EtcdKV, EtcdOptions
from bamboo.membership.records import NodeFailed, NodeRecord, NodeState, PreemptionNotice
from bamboo.membership.store import MembershipStore
from bamboo.membership.v1 import membership_pb2 as pb
from bamboo.membership.v1 import membership_pb2_grpc as pb_grpc

TTL = 2
GRACE = 1.5
MARGIN = 2.0  # watch delivery and the etcd lessor's expiry sweep, on a loaded 2-core machine
CONFIG = DetectorConfig(grace_period=GRACE, probe_timeout=0.2, probe_interval=0.1)


class AgentProcess:
    """`python -m bamboo.membership` as a child process."""

    def __init__(self, etcd: EmbeddedEtcd, job: str, node: str, *extra: str) -> None:
        cmd = [sys.executable, "-m", "bamboo.membership", "--etcd", etcd.endpoint, "--job", job,
               "--node", node, "--ttl", str(TTL), "--grace", str(GRACE), "--no-detector", *extra]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"agent {node} did not start: {self.proc.stderr.read()}")
        self.info = json.loads(line)

    def signal(self, signum: int) -> None:
        os.kill(self.proc.pid, signum)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(timeout=10)


@pytest.fixture
def spawn(etcd: EmbeddedEtcd, job: str) -> Iterator[Callable[..., AgentProcess]]:
    procs: list[AgentProcess] = []

    def make(node: str, *extra: str) -> AgentProcess:
        proc = AgentProcess(etcd, job, node, *extra)
        procs.append(proc)
        return proc

    yield make
    for proc in procs:
        with_cont = proc.proc.poll() is None
        if with_cont:
            os.kill(proc.proc.pid, signal.SIGCONT)
        proc.close()


@pytest.fixture
def watchers(options: EtcdOptions, job: str) -> Iterator[list[tuple[NodeAgent, list[NodeFailed]]]]:
    """Two in-process agents, each with its own etcd client and detector, recording NodeFailed."""
    made: list[tuple[NodeAgent, list[NodeFailed], EtcdKV]] = []
    for i in range(2):
        kv = EtcdKV(options)
        agent = NodeAgent(MembershipStore(kv, job), f"watcher{i}", ttl=TTL, detector_config=CONFIG)
        seen: list[NodeFailed] = []
        agent.start()
        agent.detector.subscribe(seen.append)
        made.append((agent, seen, kv))
    yield [(agent, seen) for agent, seen, _ in made]
    for agent, _, kv in made:
        agent.stop()
        kv.close()


def _failures(watchers: list[tuple[NodeAgent, list[NodeFailed]]], node: str) -> list[list[NodeFailed]]:
    return [[e for e in seen if e.node == node] for _, seen in watchers]


def test_kill_9_of_an_agent_is_seen_once_by_every_watcher_within_ttl_plus_margin(
    spawn, watchers, store: MembershipStore, wait_until
) -> None:
    victim = spawn("victim")
    wait_until(lambda: all("victim" in a.detector.known_nodes() for a, _ in watchers), message="the victim record")
    killed_at = time.monotonic()
    victim.signal(signal.SIGKILL)
    wait_until(lambda: all(_failures(watchers, "victim")), timeout=TTL + MARGIN + 2,
               message="NodeFailed(victim) at every watcher")
    elapsed = time.monotonic() - killed_at
    assert elapsed < TTL + MARGIN, f"detected after {elapsed:.2f} s"
    time.sleep(0.5)  # let any duplicate arrive before counting
    per_watcher = _failures(watchers, "victim")
    assert [len(events) for events in per_watcher] == [1, 1]
    assert per_watcher[0][0] == per_watcher[1][0]
    assert per_watcher[0][0].path == "lease_expiry" and per_watcher[0][0].epoch == 0
    assert set(store.failures(0)) == {"victim"}


def test_worker_reports_a_killed_peer_over_grpc_and_is_told_it_failed(spawn, watchers, wait_until) -> None:
    """The runtime's path: AgentClient.report_peer_failure -> probe refused -> NodeFailed on every stream."""
    victim = spawn("victim")
    (first, _), (second, _) = watchers
    wait_until(lambda: "victim" in first.detector.known_nodes(), message="the victim record")
    clients = [AgentClient(agent.address, name=f"worker-of-{agent.node_id}") for agent in (first, second)]
    told: list[list[object]] = [[], []]

    def listen(i: int) -> None:
        for event in clients[i].events():
            told[i].append(event)

    readers = [threading.Thread(target=listen, args=(i,), daemon=True) for i in range(2)]
    for reader in readers:
        reader.start()
    time.sleep(0.2)  # both Subscribe streams are registered
    victim.signal(signal.SIGKILL)
    victim.proc.wait(timeout=5)
    reported_at = time.monotonic()
    assert clients[0].report_peer_failure("victim", "recv from victim: Connection closed by peer")
    wait_until(lambda: all(told), timeout=TTL + MARGIN, message="NodeFailed on both workers' streams")
    assert time.monotonic() - reported_at < TTL  # well before the lease could have expired
    for events in told:
        assert len(events) == 1 and isinstance(events[0], NodeFailed)
        assert (events[0].node, events[0].epoch, events[0].detected_by) == ("victim", 0, "watcher0")
        assert events[0].path == "neighbour_report" and "Connection closed by peer" in events[0].reason
    assert clients[1].probe().node == "watcher1"
    with pytest.raises(grpc.RpcError) as info:
        clients[0].report_peer_failure("", "no node")
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    for client in clients:
        client.close()


def test_sigstop_shorter_than_grace_declares_nothing_and_longer_declares_failure(
    spawn, watchers, store: MembershipStore, wait_until
) -> None:
    victim = spawn("victim")
    (first, _), _ = watchers
    wait_until(lambda: "victim" in first.detector.known_nodes(), message="the victim record")
    # Slow: stopped for 0.5 s, while a neighbour reports it. Probes time out, then it answers again.
    victim.signal(signal.SIGSTOP)
    first.report_peer_failure("victim", "send to victim timed out")
    time.sleep(0.5)
    victim.signal(signal.SIGCONT)
    wait_until(lambda: first.detector.suspects() == [], timeout=GRACE + MARGIN, message="the suspicion to clear")
    time.sleep(TTL)  # the lease must not expire either
    assert _failures(watchers, "victim") == [[], []]
    assert "victim" in store.list_nodes()
    # Dead to us: stopped for longer than the grace period (and the lease TTL).
    victim.signal(signal.SIGSTOP)
    stopped_at = time.monotonic()
    first.report_peer_failure("victim", "send to victim timed out")
    wait_until(lambda: all(_failures(watchers, "victim")), timeout=TTL + MARGIN + 2, message="NodeFailed(victim)")
    assert time.monotonic() - stopped_at >= min(GRACE, TTL * 2 / 3) - 0.05  # probe path, or an early lease expiry
    time.sleep(0.5)
    assert [len(e) for e in _failures(watchers, "victim")] == [1, 1]
    assert _failures(watchers, "victim")[0][0].path in {"probe_timeout", "lease_expiry"}
    # Woken up after its lease expired, the victim fences itself off: it exits instead of carrying on.
    wait_until(lambda: "victim" not in store.list_nodes(), timeout=TTL + MARGIN, message="the lease to expire")
    victim.signal(signal.SIGCONT)
    assert victim.proc.wait(timeout=TTL + MARGIN + 5) == 3
    assert "lost its lease" in victim.proc.stderr.read()


def test_sigterm_publishes_a_preemption_notice_to_etcd_and_subscribers(
    spawn, watchers, store: MembershipStore, wait_until
) -> None:
    (first, _), _ = watchers
    channel = grpc.insecure_channel(first.address)
    stream = pb_grpc.AgentStub(channel).Subscribe(pb.SubscribeRequest(subscriber="worker"))
    received: list[pb.ClusterEvent] = []

    def read() -> None:
        with contextlib.suppress(grpc.RpcError):  # CANCELLED when the test ends the stream
            for event in stream:
                received.append(event)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    victim = spawn("victim", "--notice-window", "60")
    wait_until(lambda: "victim" in store.list_nodes(), message="the victim record")
    time.sleep(0.2)  # the Subscribe stream is registered
    before = time.time()
    victim.signal(signal.SIGTERM)
    wait_until(lambda: store.kv.get(store.keys.notice("victim")) is not None, message="the notice in etcd")
    wait_until(lambda: store.get_node("victim").state == NodeState.NODE_STATE_PREEMPTING, message="PREEMPTING")
    wait_until(lambda: any(e.HasField("preemption") for e in received), message="the notice on the stream")
    notice = next(e.preemption for e in received if e.HasField("preemption"))
    assert notice.node == "victim" and notice.source == "sigterm"
    assert before + 55 < notice.deadline < time.time() + 61
    assert victim.proc.poll() is None  # still running until the deadline
    victim.signal(signal.SIGKILL)
    wait_until(lambda: any(e.HasField("node_failed") for e in received), timeout=TTL + MARGIN + 2,
               message="NodeFailed on the stream")
    failed = next(e.node_failed for e in received if e.HasField("node_failed"))
    assert failed.node == "victim" and "preemption notice" in failed.reason
    stream.cancel()
    channel.close()


def test_probe_and_notify_over_grpc(store: MembershipStore, wait_until) -> None:
    agent = NodeAgent(store, "n1", incarnation=7, ttl=TTL, run_detector=False, progress=lambda: 42).start()
    try:
        result = GrpcProber("tester")(agent.record, 2.0)
        assert (result.outcome, result.incarnation, result.progress) == (ProbeOutcome.ALIVE, 7, 42)
        channel = grpc.insecure_channel(agent.address)
        stub = pb_grpc.AgentStub(channel)
        reply = stub.Notify(pb.NotifyRequest(notice=PreemptionNotice(node="n1", deadline=123.0, source="test")))
        assert reply.published
        assert store.get_node("n1").state == NodeState.NODE_STATE_PREEMPTING
        with pytest.raises(grpc.RpcError) as info:
            stub.Notify(pb.NotifyRequest(notice=PreemptionNotice(node="other", deadline=1.0)))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'other'" in info.value.details()
        channel.close()
    finally:
        agent.stop()
    gone = GrpcProber()(NodeRecord(id="n1", address="127.0.0.1", agent_port=agent.port), 1.0)
    assert gone.outcome is ProbeOutcome.REFUSED


def test_preemption_hook_turns_into_a_notice(store: MembershipStore, wait_until) -> None:
    agent = NodeAgent(store, "spot", ttl=TTL, run_detector=False).start()
    polls: list[int] = []

    def hook() -> float | None:
        polls.append(1)
        return None if len(polls) < 3 else 1.9e9

    try:
        agent.watch_preemption_hook(hook, interval=0.01)
        wait_until(agent.noticed.is_set, message="the hook's notice")
        wait_until(lambda: store.kv.get(store.keys.notice("spot")) is not None, message="the notice in etcd")
        assert len(polls) == 3
    finally:
        agent.stop()


def test_agent_cli_rejects_bad_input_with_one_line_and_no_traceback() -> None:
    out = subprocess.run([sys.executable, "-m", "bamboo.membership", "--etcd", "nohost", "--job", "j",
                          "--node", "n"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.strip() == "bamboo agent: error: EtcdOptions.endpoints: 'nohost' is not host:port"
    out = subprocess.run([sys.executable, "-m", "bamboo.membership", "--etcd", "127.0.0.1:1", "--job", "j",
                          "--node", "n"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2
    assert out.stderr.startswith("bamboo agent: error: etcd at 127.0.0.1:1 unavailable")
    assert "Traceback" not in out.stderr and out.stderr.count("\n") == 1
    out = subprocess.run([sys.executable, "-m", "bamboo.membership", "--help"], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 0 and "--grace" in out.stdout and "--tls-cert" in out.stdout
