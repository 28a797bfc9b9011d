"""One process of bench_scale.py: many emulated nodes, each the real agent with its worker replaced by a stub.

Run by bench_scale.py (``python _scale_host.py``), never by hand. Each node here is what ``bamboo-launch agent``
runs, made of the same classes: a ``NodeAgent`` (gRPC service, lease-held record, failure detector that does not
follow the membership), its ``EtcdEventLog`` (a ``join`` record), the job's ``Coordinator`` (elected through
etcd), and the supervisor's watch of the job's end; plus a *stub worker*: it publishes ``warm-<node>``, waits for
a role with the worker's own ``RoleWatch``, learns failure events with the worker's own ``EtcdFailureNotices``,
keeps a TCP connection to the next stage of its pipeline (as gloo would: when a peer dies, the connection breaks
and the stub reports the peer to its agent, as the runtime does), counts steps on a shared clock (the host of the
last stage of pipeline 0 writes the ``step`` records), and takes part in a reconfiguration at a step boundary: the
lowest live rank proposes the stop with the worker's ``reconfiguration_reason`` (``bamboo.reconfig.decide``),
every holder publishes what it holds, and the lowest live holder plans the next layout with the worker's
``plan_next`` and publishes it. The nodes of one process share one etcd client (one channel, one watch stream,
one keepalive stream), since a thousand Python processes do not fit two cores.

A node dies in process (the ``kill`` command), as a ``kill -9`` looks from outside: its port closes (probes are
refused), its connections break, its lease is no longer refreshed, and nothing of it writes again. A node that runs
alone in its process (``bench_scale.py --process-kills``) dies by a real ``kill -9`` of the process instead.

Protocol: JSON lines. stdin: ``{"cmd": "go"|"kill"|"propose"|"stats"|"quit", ...}``. stdout: ``{"ev": ...}``
records with ``t`` on the machine's monotonic clock (shared by every process on it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import selectors
import socket
import sys
import threading
import time
from concurrent import futures
from types import SimpleNamespace
from typing import Any

from bamboo.launch.barrier import plan_next, publish_layout
from bamboo.launch.coordinator import Coordinator
from bamboo.launch.events import EtcdEventLog, EtcdEventReader, Join, Step
from bamboo.launch.notices import EtcdFailureNotices
from bamboo.launch.records import BarrierReady, NodeJoined, StopDecision, WorkerWarm
from bamboo.launch.role_watch import RoleWatch
from bamboo.launch.spec import JobSpec
from bamboo.launch.stop import reconfiguration_reason
from bamboo.membership import DetectorConfig, EtcdKV, EtcdOptions, MembershipStore, NodeAgent, WatchedKey
from bamboo.rc import FailureEvent

_out_lock = threading.Lock()
_pending: list[dict[str, Any]] = []


def emit(**record: Any) -> None:
    """Report ``record`` to bench_scale.py; records are written every 20 ms by one thread (their ``t`` is taken
    when they happen), so that reporting does not delay what is measured."""
    with _out_lock:
        _pending.append(record)


def _write_out() -> None:
    while True:
        time.sleep(0.02)
        with _out_lock:
            records = list(_pending)
            _pending.clear()
        if records:
            sys.stdout.write("".join(json.dumps(record) + "\n" for record in records))
            sys.stdout.flush()


class TimedNotices(EtcdFailureNotices):
    """The worker's failure notices, telling the node when each event arrives."""

    def __init__(self, sim: SimNode, *args: Any) -> None:
        self._sim = sim
        self._told: set[int] = set()
        super().__init__(*args)

    def _store(self, key: str, value: bytes) -> FailureEvent | None:
        event = super()._store(key, value)  # parsed once, as a worker does
        if event is not None and event.epoch not in self._told:
            self._told.add(event.epoch)
            self._sim.failure_seen(self.generation, event)
        return event


class SimNode:
    """One emulated node: the real agent and a stub worker (module docstring)."""

    def __init__(self, host: Host, node: str, zone: str) -> None:
        self.host, self.node, self.zone = host, node, zone
        self.alive = True
        self.step = 0
        self.layout: Any = None
        self.rank: int | None = None
        self.notices: TimedNotices | None = None
        self.stop_key: WatchedKey | None = None
        self.stop_step: int | None = None
        self.dead_ranks: set[int] = set()
        self.peers: list[socket.socket] = []
        self.agent = NodeAgent(host.store, node, zone=zone, ttl=host.spec.ttl, follow_membership=False,
                               detector_config=DetectorConfig(grace_period=host.spec.grace_s),
                               progress=lambda: self.step).bind()
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.listener.setblocking(False)
        self.port = self.listener.getsockname()[1]

    # -- start-up --------------------------------------------------------------------------------

    def start(self) -> None:
        spec = self.host.spec
        emit(ev="registering", node=self.node, t=time.monotonic())
        self.agent.start()
        emit(ev="registered", node=self.node, t=time.monotonic())
        self.fenced = self.host.store.fenced(self.agent.registration)
        self.event_reader = EtcdEventReader(self.fenced.kv, spec.job)  # as the worker's session keeps one
        pid = os.getpid()
        self.events = EtcdEventLog(self.fenced.kv, spec.job, f"{self.node}.agent.{pid}", spec.created_unix,
                                   guard=self.fenced.guard)
        self.events.write(Join(t=self.events.now(), node=self.node, zone=self.zone))
        self.fenced.decide(f"joined-{self.node}", NodeJoined(self.node, time.time(), self.zone).to_dict())  # as the agent
        self.coordinator = Coordinator(self.fenced, self.agent, spec, self.events, say=self._coordinator_said).start()
        self.end = WatchedKey(self.fenced.kv, self.fenced.keys.decision("end"))  # the supervisor's
        self.log = EtcdEventLog(self.fenced.kv, spec.job, f"{self.node}.worker.{pid}", spec.created_unix,
                                guard=self.fenced.guard)
        self.fenced.decide(f"warm-{self.node}", WorkerWarm(self.node, time.time()).to_dict())
        self.roles = RoleWatch(self.fenced, self.node)
        emit(ev="started", node=self.node, t=time.monotonic())
        threading.Thread(target=self._follow_roles, name=f"stub-{self.node}", daemon=True).start()

    def _coordinator_said(self, line: str) -> None:
        """The elected coordinator's lines: the time it wrote the first layout (the start-up's breakdown)."""
        if line.startswith("first layout:"):
            emit(ev="first_layout_written", node=self.node, t=time.monotonic())

    def _follow_roles(self) -> None:
        generation = -1
        while self.alive:
            layout = self.roles.next_layout(generation)
            if layout is None or not self.alive:
                return
            generation = layout.generation
            self.enter(layout)

    def enter(self, layout: Any) -> None:
        """Take this node's role in ``layout`` (or standby): failure notices, the pipeline connection."""
        with self.host.lock:
            self._leave_generation(layout.generation)
            self.layout, self.rank = layout, layout.ranks.get(self.node)
            self.dead_ranks, self.stop_step = set(), None
            self.step = layout.start_step
        emit(ev="role", node=self.node, generation=layout.generation, rank=self.rank, t=time.monotonic())
        if self.rank is None:
            return
        self.notices = TimedNotices(self, self.fenced, layout.generation, self.agent, layout.node_of_rank)
        key = self.fenced.keys.decision(f"g{layout.generation}-stop")
        self.stop_key = WatchedKey(self.fenced.kv, key, on_change=lambda found: self._on_stop(found))
        self._on_stop(self.stop_key.value)
        stages = layout.stages
        if self.rank % stages != stages - 1:  # connect to the next stage of the pipeline, as gloo would
            successor = layout.node_of_rank[self.rank + 1]
            self.host.connect(self, successor, layout.generation)

    def _leave_generation(self, entering: int) -> None:
        """Close the connections of the generations before ``entering``, as a worker releases
        its old groups. A predecessor that entered ``entering`` first may already have connected: closing its
        connection too left the pipeline without it, so the node's death later went unreported (no neighbour saw
        a connection break) until its lease expired: the 9 s outliers of earlier runs."""
        keep = [peer for peer in self.peers if self.host.generation_of.get(peer, entering) == entering]
        for peer in self.peers:
            if peer not in keep:
                self.host.forget(peer)
        self.peers = keep
        if self.notices is not None:
            self.notices.close()
        if self.stop_key is not None:
            self.stop_key.close()
        self.notices = self.stop_key = None

    def _on_stop(self, found: Any) -> None:
        if found is not None:
            self.stop_step = StopDecision.from_dict(json.loads(found.value)).step

    # -- failures --------------------------------------------------------------------------------

    def peer_broke(self, peer: str) -> None:
        """The connection to ``peer`` broke: report it to the agent, as the runtime does."""
        notices, layout = self.notices, self.layout
        if not self.alive or notices is None or layout is None or peer not in layout.ranks:
            return
        if self.stop_step is not None and self.step >= self.stop_step:
            return  # at the barrier the old generation's connections close on purpose (groups are released)
        emit(ev="suspect", node=self.node, peer=peer, t=time.monotonic())
        notices.suspect(0, self.rank or 0, layout.ranks[peer], "recv")

    def failure_seen(self, generation: int, event: FailureEvent) -> None:
        with self.host.lock:
            self.dead_ranks.update(event.victims)
        emit(ev="failure_seen", node=self.node, generation=generation, epoch=event.epoch,
             victims=list(event.victims), t=time.monotonic())

    def kill(self) -> None:
        """Vanish as a killed process would (module docstring)."""
        t = time.monotonic()
        self.alive = False
        # The agent's port closes first, then the connections break, as at a kill -9 (where they go together):
        # breaking them first let a neighbour's probe reach the still-open port under load, be answered
        # "alive", and leave the node to its lease expiry (a 9 s outlier among 10 nodes killed at once).
        self.agent.stop(leave=False, grace=0)  # the lease is left to expire
        for peer in [*self.peers, self.listener]:
            self.host.forget(peer)
        emit(ev="killed", node=self.node, t=t, gone=time.monotonic())
        self.coordinator.stop()
        for closing in (self.roles, self.end):
            closing.close()
        if self.notices is not None:
            self.notices.close()
        if self.stop_key is not None:
            self.stop_key.close()

    # -- steps and the barrier -------------------------------------------------------------------

    def tick(self, step: int) -> None:
        """Step ``step`` ended on the shared clock."""
        layout = self.layout
        if not self.alive or self.rank is None or layout is None or step <= self.step:
            return
        if self.stop_step is not None and self.step >= self.stop_step:
            return  # at the barrier
        self.step = step
        stages = layout.stages
        if self.rank == stages - 1:  # the host of the last stage of pipeline 0 writes the step records
            self.log.write(Step(t=self.log.now(), step=step, samples=layout.global_batch, loss=1.0,
                                nodes_active=len(layout.ranks) - len(self.dead_ranks), duration_s=0.0,
                                generation=layout.generation))
        if self.stop_step is not None and self.step >= self.stop_step:
            self.host.pool.submit(self._at_barrier)  # every holder publishes at once, as on separate machines

    def live_ranks(self) -> list[int]:
        return sorted(r for r in self.layout.ranks.values() if r not in self.dead_ranks)

    def propose(self) -> None:
        """The lowest live rank proposes a stop, as the worker does after each step (bamboo.reconfig.decide)."""
        layout = self.layout
        if not self.alive or self.rank is None or self.rank != min(self.live_ranks()):
            return
        run = SimpleNamespace(membership=self.fenced, layers=self.host.layers, spec=self.host.spec,
                              event_reader=self.event_reader)
        executor = SimpleNamespace(step=self.step, dead=set(self.dead_ranks))
        reason = reconfiguration_reason(run, layout, executor)  # type: ignore[arg-type]
        proposal = None if reason is None else StopDecision(self.step + 2, reason)  # met at the barrier
        decided = self.fenced.decide(f"g{layout.generation}-stop", proposal.to_dict()) if proposal else None
        emit(ev="stop_decided", node=self.node, t=time.monotonic(), proposed=proposal is not None,
             step=None if decided is None else decided.value["step"], generation=layout.generation)

    def _at_barrier(self) -> None:
        try:
            self._publish_ready()
        except Exception as error:
            emit(ev="error", node=self.node, msg=f"barrier: {type(error).__name__}: {error}")

    def _publish_ready(self) -> None:
        layout, step = self.layout, self.step
        stages = layout.stages
        holds = sorted({self.rank % stages, (self.rank % stages + 1) % stages})
        self.fenced.decide(f"g{layout.generation}-ready-{self.node}",
                           BarrierReady(step=step, holds=holds, at=time.time()).to_dict())
        if self.rank == min(self.live_ranks()):
            threading.Thread(target=self._plan, args=(layout,), daemon=True).start()

    def _plan(self, base: Any) -> None:
        try:
            self._plan_and_publish(base)
        except Exception as error:
            emit(ev="error", node=self.node, msg=f"planning: {type(error).__name__}: {error}")

    def _plan_and_publish(self, base: Any) -> None:
        """The lowest live holder waits for every live holder's record, then plans and publishes the next layout."""
        prefix = self.fenced.keys.decision(f"g{base.generation}-ready-")
        expected = {node for node, rank in base.ranks.items() if rank not in self.dead_ranks}
        ready: dict[str, BarrierReady] = {}
        arrived = threading.Condition()

        def on_ready(event: Any) -> None:
            node = event.key.removeprefix(prefix)
            if event.value and node in expected:
                with arrived:
                    ready[node] = BarrierReady.from_dict(json.loads(event.value))
                    arrived.notify_all()

        stop = self.stop_key.value if self.stop_key is not None else None  # every record comes after the stop
        watch = self.fenced.kv.watch_prefix(prefix, on_ready, start_revision=stop.mod_revision if stop else 1)
        try:
            with arrived:
                if not arrived.wait_for(lambda: set(ready) >= expected, 120):
                    emit(ev="error", node=self.node, msg=f"barrier: missing {sorted(expected - set(ready))}")
                    return
        finally:
            watch.cancel()
        all_ready = time.monotonic()
        run = SimpleNamespace(membership=self.fenced, layers=self.host.layers, spec=self.host.spec,
                              event_reader=self.event_reader)
        planned = plan_next(run, base, ready, 0, "bench: rebuild redundancy")
        value = self.fenced.decide(f"g{base.generation}-next", planned.to_dict()).value
        from bamboo.reconfig import JobLayout

        publish_layout(run, JobLayout.from_dict(value))
        emit(ev="planned", node=self.node, t=time.monotonic(), all_ready=all_ready, generation=planned.generation)


class Host:
    """The nodes of this process, their shared etcd client, the step clock and the pipeline connections."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.kv = EtcdKV(EtcdOptions(endpoints=tuple(args.etcd)))
        self.store = MembershipStore(self.kv, args.job)
        found = self.kv.get(self.store.keys.root + "spec")
        assert found is not None, "bench_scale.py writes the spec first"
        self.spec = JobSpec.from_json(found.value)
        self.layers = self.spec.reconfig_layers()
        self.step_s = args.step_s
        self.lock = threading.RLock()
        self.pool = futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="stub-barrier")
        self.selector = selectors.DefaultSelector()
        self.directory: dict[str, int] = {}
        self.nodes = {node: SimNode(self, node, zone) for node, zone in
                      (item.split("@") for item in args.nodes.split(","))}
        self.by_socket: dict[socket.socket, tuple[SimNode, str | None]] = {}
        self.generation_of: dict[socket.socket, int] = {}  # the generation each connection was made for
        for sim in self.nodes.values():
            self.selector.register(sim.listener, selectors.EVENT_READ, ("listen", sim))
        threading.Thread(target=self._watch_sockets, name="stub-sockets", daemon=True).start()

    # -- the pipeline connections (one selector thread for every node of the process) ------------

    def connect(self, sim: SimNode, peer: str, generation: int) -> None:
        try:
            conn = socket.create_connection(("127.0.0.1", self.directory[peer]), timeout=5)
            conn.sendall(f"{sim.node} {generation}\n".encode())
        except OSError:
            sim.peer_broke(peer)
            return
        conn.setblocking(False)
        with self.lock:
            self.generation_of[conn] = generation
        self._track(conn, sim, peer)

    def _track(self, conn: socket.socket, sim: SimNode, peer: str | None) -> None:
        with self.lock:
            self.by_socket[conn] = (sim, peer)
            sim.peers.append(conn)
            self.selector.register(conn, selectors.EVENT_READ, ("conn", sim))

    def forget(self, conn: socket.socket) -> None:
        """Stop watching ``conn`` and close it; once only, under the lock, whichever thread comes first (a node's
        role thread leaving a generation, or the selector thread seeing it break): a second unregister of a closed
        socket searched the selector's table while the other thread changed it, and killed the selector thread."""
        with self.lock:
            self.by_socket.pop(conn, None)
            self.generation_of.pop(conn, None)
            if conn.fileno() == -1:
                return
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(conn)
            conn.close()

    def _watch_sockets(self) -> None:
        while True:
            for key, _ in self.selector.select(timeout=None):
                kind, sim = key.data
                if kind == "listen":
                    try:
                        conn, _ = key.fileobj.accept()
                    except OSError:
                        continue
                    conn.setblocking(False)
                    self._track(conn, sim, None)
                    continue
                conn = key.fileobj
                try:
                    data = conn.recv(4096)
                except BlockingIOError:
                    continue
                except OSError:
                    data = b""
                with self.lock:
                    owner, peer = self.by_socket.get(conn, (sim, None))
                if data:  # the hello: who connected, for which generation
                    node, generation = data.decode().split()
                    with self.lock:
                        self.by_socket[conn] = (owner, node)
                        self.generation_of[conn] = int(generation)
                    continue
                self.forget(conn)
                if peer is not None and owner.alive:
                    owner.peer_broke(peer)

    # -- commands --------------------------------------------------------------------------------

    def go(self, directory: dict[str, int], t0: float) -> None:
        self.directory = directory
        with futures.ThreadPoolExecutor(max_workers=16) as pool:
            for failure in pool.map(self._start, self.nodes.values()):
                if failure:
                    emit(ev="error", msg=failure)
        threading.Thread(target=self._clock, args=(t0,), name="stub-clock", daemon=True).start()

    def _start(self, sim: SimNode) -> str | None:
        try:
            sim.start()
        except Exception as error:
            return f"{sim.node} failed to start: {type(error).__name__}: {error}"
        return None

    def _clock(self, t0: float) -> None:
        while True:
            step = int((time.monotonic() - t0) / self.step_s)
            for sim in list(self.nodes.values()):
                try:
                    sim.tick(step)
                except Exception as error:
                    emit(ev="error", node=sim.node, msg=f"step {step}: {type(error).__name__}: {error}")
            time.sleep(max(0.0, t0 + (step + 1) * self.step_s - time.monotonic()))

    def stats(self) -> dict[str, Any]:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        alive = [sim for sim in self.nodes.values() if sim.alive]
        return {"cpu_s": usage.ru_utime + usage.ru_stime, "rss_mb": usage.ru_maxrss / 1024, "alive": len(alive),
                "probes_answered": sum(sim.agent.probes_answered for sim in self.nodes.values()),
                "probes_sent": sum(sim.agent.detector.probes_sent for sim in self.nodes.values()
                                   if sim.agent.detector is not None),
                "threads": threading.active_count(), "t": time.monotonic()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--etcd", action="append", required=True)
    parser.add_argument("--job", required=True)
    parser.add_argument("--nodes", required=True, help="node@zone,node@zone,...")
    parser.add_argument("--step-s", type=float, required=True)
    args = parser.parse_args()
    threading.Thread(target=_write_out, name="stub-out", daemon=True).start()
    host = Host(args)
    emit(ev="prepared", ports={node: sim.port for node, sim in host.nodes.items()}, pid=os.getpid())
    for line in sys.stdin:
        command = json.loads(line)
        name = command["cmd"]
        if name == "go":
            threading.Thread(target=host.go, args=(command["directory"], command["t0"]), daemon=True).start()
        elif name == "kill":
            for node in command["nodes"]:
                threading.Thread(target=host.nodes[node].kill, daemon=True).start()
        elif name == "propose":
            for sim in host.nodes.values():
                sim.propose()
        elif name == "stats":
            emit(ev="stats", **host.stats())
        elif name == "quit":
            break
    time.sleep(0.05)  # the last records out
    sys.stdout.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
