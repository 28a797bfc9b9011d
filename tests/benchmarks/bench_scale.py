"""A thousand nodes: Bamboo's control plane measured at the sizes spot jobs reach, on one real etcd.

Run: `.venv/bin/python tests/benchmarks/bench_scale.py --agents 64,256,1000` (`--help` for the flags). Not
collected by pytest (tests/test_bench_scale.py runs `--agents 16` and checks that every agent saw the failure
and the layout).

For each N it starts one `EmbeddedEtcd`, writes the job's spec (P stages, D pipelines: 96% of the nodes in
pipelines, the rest on standby; the first layout waits for all N), and starts N emulated nodes in host processes
(`_scale_host.py`), --per-process to a process (with `--process-kills`, the nodes that may be killed, drawn at
random, three more than the kills need, one per process instead). Each node is the real agent (`NodeAgent`:
registration, lease, probes, detector; the elected `Coordinator` and the layout it writes; the supervisor's watch
of the job's end) with its worker replaced by a stub that reports steps (`_scale_host.py` says what the stub does).
Then, on the machine's monotonic clock:

- **start-up**: from the first registration to each node having read the first layout (its role, or standby);
- **steady state** (`--steady-s`): etcd's gRPC messages received and bytes in and out per agent per second
  (etcd's own counters), probes per agent per second, the agent processes' CPU per agent (percent of one core,
  and CPU seconds per hour), etcd's CPU, and revisions written per hour;
- **one kill** (`--kills` trials): a random node of the layout (not the coordinator's) dies; from the kill to
  each live node of the layout having seen the published failure event (every one of them acts on it);
- **1% killed at once**: max(1, N/100) nodes die together; from the first kill to each live node of the layout
  having seen events naming them all.

  A victim dies in its shared process (`_scale_host.py`: its port closed, then its connections broken), as a
  machine that vanishes looks to its peers. With `--process-kills` the victims run alone and die by a real
  `kill -9` of their process, back to back (a victim that became the coordinator or went on standby is replaced
  by a node of a shared process, killed in process; the JSON's `kills` counts both kinds). On 2 cores that costs
  more than the emulated death: the exit of each killed process's threads runs on the cores that the other
  agents use (at 1,000 agents, 28 to 35 ms from a kill to a neighbour's first report, against 2 to 7 ms in
  process; 133 to 142 ms for ten kills, against 6 to 7 ms), and the fifteen more processes add their own
  clients and watches to the start-up;
- **baseline** (same run): one etcd put of a failure event, delivered through the same watches to every node
  of the layout: the floor of any failure notice that goes through etcd;
- **a reconfiguration at a step boundary**: the lowest live rank decides (`bamboo.reconfig.decide`: rebuild
  redundancy after the failovers) to stop two steps ahead, as the worker does; from that step boundary to
  each live node having read the next layout (its new role, or standby);
- **etcd's health**: revisions per hour (steady state), and the database size after writing an hour of that
  traffic, then after compaction and defragmentation.

`lost_events` counts every delivery that never came (a node that never read a layout, a live node of the layout
that never saw a failure event) within `--deadline-s`; `crashes` counts errors the nodes reported. `--repeat K`
runs each size K times; after the runs (one JSON object each with `--json`) comes one summary per size
(`_scale_summary.py`: `"summary": true`, the crashes and lost events of all K runs, each p99's worst run and its
min / median / max).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from _bench_common import Log, percentile
from _scale_etcd import EtcdCounters, database_after, process_cpu_s
from _scale_summary import summarize, summary_lines
from bamboo.bench.argtypes import default_of
from bamboo.launch.events import EVENTS_PER_WRITER
from bamboo.launch.notices import epoch_decision
from bamboo.launch.spec import JobSpec
from bamboo.membership import EmbeddedEtcd, EtcdKV, EtcdOptions, MembershipStore
from bamboo.membership.records import NodeFailed, encode_json
from bamboo.rc import FailureEvent

HOST = Path(__file__).resolve().parent / "_scale_host.py"
JOB = "scale"
LAYER = {"param_bytes": 4_000_000, "optimizer_bytes": 8_000_000, "compute_cost": 1.0}
ZONES = ("zone-a", "zone-b", "zone-c", "zone-d")


class Hosts:
    """The host processes of one run and what they report (JSON lines, read by one thread each)."""

    def __init__(self, endpoint: str, groups: list[list[tuple[str, str]]], step_s: float) -> None:
        self.events: list[dict[str, Any]] = []
        self.cond = threading.Condition()
        self.procs: list[subprocess.Popen[str]] = []
        self.owner: dict[str, int] = {}
        self.killed: set[int] = set()  # the hosts this benchmark killed (a victim's own process)
        for index, group in enumerate(groups):
            nodes = ",".join(f"{node}@{zone}" for node, zone in group)
            proc = subprocess.Popen([sys.executable, str(HOST), "--etcd", endpoint, "--job", JOB, "--nodes", nodes,
                                     "--step-s", str(step_s)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    text=True, bufsize=1)
            self.procs.append(proc)
            for node, _ in group:
                self.owner[node] = index
            threading.Thread(target=self._read, args=(index, proc), daemon=True).start()

    def _read(self, index: int, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                record = json.loads(line)
            except json.JSONDecodeError:
                continue
            record["host"] = index
            with self.cond:
                self.events.append(record)
                self.cond.notify_all()
        with self.cond:
            self.events.append({"ev": "exited", "host": index, "code": proc.wait(), "t": time.monotonic()})
            self.cond.notify_all()

    def live(self) -> list[int]:
        """The hosts not killed by this benchmark."""
        return [index for index in range(len(self.procs)) if index not in self.killed]

    def send(self, command: dict[str, Any], hosts: list[int] | None = None) -> None:
        for index in self.live() if hosts is None else hosts:
            stdin = self.procs[index].stdin
            assert stdin is not None
            stdin.write(json.dumps(command) + "\n")
            stdin.flush()

    def select(self, ev: str, since: int = 0, **match: Any) -> list[dict[str, Any]]:
        with self.cond:
            return [e for e in self.events[since:] if e["ev"] == ev and all(e.get(k) == v for k, v in match.items())]

    def wait(self, done: Callable[[], bool], timeout: float) -> bool:
        with self.cond:
            return self.cond.wait_for(done, timeout)

    def mark(self) -> int:
        with self.cond:
            return len(self.events)

    def stats(self) -> list[dict[str, Any]]:
        since = self.mark()
        self.send({"cmd": "stats"})
        self.wait(lambda: len(self.select("stats", since)) >= len(self.live()), 30)
        return self.select("stats", since)

    def kill_processes(self, victims: list[str]) -> None:
        """``kill -9`` the processes of ``victims`` (each runs alone in its own), back to back; a ``killed`` record
        for each (``t`` before the first signal, ``gone`` after the last, as the in-process kill records them)."""
        hosts = sorted({self.owner[victim] for victim in victims})
        t = time.monotonic()
        for index in hosts:
            self.killed.add(index)
            os.kill(self.procs[index].pid, signal.SIGKILL)
        gone = time.monotonic()
        with self.cond:
            self.events.extend({"ev": "killed", "node": victim, "t": t, "gone": gone, "host": self.owner[victim]}
                               for victim in victims)
            self.cond.notify_all()

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    self.send({"cmd": "quit"}, [self.procs.index(proc)])
                    proc.wait(10)
                except (OSError, subprocess.TimeoutExpired):
                    proc.kill()
                    proc.wait()


def spread(values: list[float]) -> dict[str, float]:
    """p50, p99 and max of ``values`` (NaN when there are none: written null in the JSON)."""
    if not values:
        return {"p50": math.nan, "p99": math.nan, "max": math.nan}
    return {"p50": percentile(values, 50), "p99": percentile(values, 99), "max": max(values)}


class Run:
    """One measured run at N agents (the phases of the module docstring)."""

    def __init__(self, args: argparse.Namespace, n: int, say: Log) -> None:
        self.args, self.n, self.say = args, n, say
        self.stages = args.stages or (4 if n < 64 else 8)
        self.pipelines = max(1, int(n * 0.96) // self.stages)
        self.lost = 0
        self.rng = random.Random(args.seed + n)
        self.checks: dict[str, int] = {}
        self.one_percent = max(1, round(n / 100))  # the nodes killed at once
        self.kill_counts = [0, 0]  # victims killed as processes, and in process

    def execute(self) -> dict[str, Any]:
        with tempfile.TemporaryDirectory(prefix="bench-scale-") as folder, EmbeddedEtcd(Path(folder)) as etcd:
            etcd.start()
            self.etcd = etcd
            self.kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
            self.store = MembershipStore(self.kv, JOB)
            try:
                return self._phases()
            finally:
                self.hosts.close()
                self.kv.close()

    def _phases(self) -> dict[str, Any]:
        args, n = self.args, self.n
        spec = JobSpec(job=JOB, stages=self.stages, pipelines=self.pipelines, steps=10**9,
                       layers=[LAYER] * (2 * self.stages), config={}, micro_batches=2, created_unix=time.time(),
                       min_nodes=n, redundancy="eflb", ttl=args.ttl)
        self.kv.put(self.store.keys.root + "spec", spec.to_json().encode())
        nodes = [(f"node{i:04d}", ZONES[i % len(ZONES)]) for i in range(n)]
        # With --process-kills the victims-to-be each run alone, so that a kill is a real kill -9 of their process.
        # Three more than the kills need: the elected coordinator and the nodes put on standby are never killed
        # (when too few are left, a victim is taken from the shared hosts and killed in process).
        wanted = args.kills + self.one_percent + 3 if args.process_kills else 0
        alone = set(self.rng.sample(range(n), min(wanted, n - 1)))
        self.own_process = {nodes[i][0] for i in alone}
        shared = [node for i, node in enumerate(nodes) if i not in alone]
        groups = [[nodes[i]] for i in sorted(alone)] + [shared[i:i + args.per_process]
                                                        for i in range(0, len(shared), args.per_process)]
        self.say(f"N={n}: P={self.stages} D={self.pipelines} ({self.stages * self.pipelines} in pipelines, "
                 f"{n - self.stages * self.pipelines} on standby), {len(groups) - len(alone)} processes of up to "
                 f"{args.per_process} agents and {len(alone)} of one (the nodes that may be killed)")
        self.hosts = Hosts(self.etcd.endpoint, groups, args.step_s)
        if not self.hosts.wait(lambda: len(self.hosts.select("prepared")) == len(groups), args.deadline_s * 4):
            raise RuntimeError(f"the host processes did not start: {self.hosts.select('exited')}")
        directory = {node: port for e in self.hosts.select("prepared") for node, port in e["ports"].items()}
        self.t0 = time.monotonic()
        self.cpu_at_go = self._cpu_s()
        self.hosts.send({"cmd": "go", "directory": directory, "t0": self.t0})
        result: dict[str, Any] = {"agents": n, "processes": len(groups), "agents_per_process": args.per_process,
                                  "single_agent_processes": len(alone),
                                  "stages": self.stages, "pipelines": self.pipelines, "step_s": args.step_s}
        result.update(self._startup())
        if not any(rank is not None for rank in self.layout_ranks.values()):
            raise RuntimeError(f"no node read a first layout within {self.args.deadline_s * 4:g} s; "
                               f"{len(self.store.failures(0))} nodes were declared dead meanwhile, e.g. "
                               f"{next(iter(self.store.failures(0).values()), None)}")
        time.sleep(args.settle_s)
        result.update(self._steady())
        result.update(self._failures())
        result.update(self._reconfiguration())
        result.update(self._database(result["revisions_per_hour"]))
        killed = set(getattr(self, "dead", set()))
        false = [r for r in self.store.failures(0).values() if r.node not in killed]
        result["false_failures"] = len(false)  # nodes declared dead that the benchmark did not kill
        if false:
            self.say(f"{len(false)} live nodes were declared dead, e.g. {false[0].node}: {false[0].reason}")
        result["lost_events"] = self.lost
        result["crashes"] = len(self.hosts.select("error")) + sum(
            1 for e in self.hosts.select("exited") if e["code"] != 0 and e["host"] not in self.hosts.killed)
        result["kills"] = {"kill -9 of its process": self.kill_counts[0], "in process": self.kill_counts[1]}
        result["errors"] = [e.get("msg") for e in self.hosts.select("error")][:5]
        result["checks"] = self.checks
        return result

    # -- phases ----------------------------------------------------------------------------------

    def _roles(self, generation: int) -> dict[str, float]:
        return {e["node"]: e["t"] for e in self.hosts.select("role", generation=generation)}

    def _startup(self) -> dict[str, Any]:
        n = self.n
        self.hosts.wait(lambda: len(self._roles(0)) >= n or bool(self.hosts.select("exited")), self.args.deadline_s * 4)
        roles = self._roles(0)
        etcd_cpu, hosts_cpu = (after - before for after, before in zip(self._cpu_s(), self.cpu_at_go, strict=True))
        first = min((e["t"] for e in self.hosts.select("registering")), default=math.nan)
        latencies = [t - first for t in roles.values()]
        self.lost += n - len(roles)
        self.checks.update(layout_expected=n, layout_read_by=len(roles))
        self.layout_ranks = {e["node"]: e["rank"] for e in self.hosts.select("role", generation=0)}
        found = self.store.get_layout()
        self.layout_bytes = len(encode_json(found.value)) if found else 0  # as etcd stores it
        startup = spread(latencies)
        read_first = min(latencies, default=math.nan)
        registered = max((e["t"] for e in self.hosts.select("registered")), default=math.nan) - first
        started = max((e["t"] for e in self.hosts.select("started")), default=math.nan) - first
        written = min((e["t"] for e in self.hosts.select("first_layout_written")), default=math.nan) - first
        self.say(f"start-up: the last node registered {registered:.2f} s after the first, the last stub started "
                 f"{started:.2f} s after it, the coordinator had written the first layout and seen it {written:.2f} s "
                 f"after it, the first "
                 f"node read it {read_first:.2f} s after it")
        self.say(f"start-up: every node read the first layout ({self.layout_bytes} B) {startup['max']:.2f} s after "
                 f"the first registration (p50 {startup['p50']:.2f} s)")
        self.say(f"start-up: etcd used {etcd_cpu:.2f} CPU-s, the host processes {hosts_cpu:.2f} CPU-s "
                 f"({1e3 * hosts_cpu / n:.1f} ms per agent), from the go to the last node's first role")
        return {"startup_p50_s": startup["p50"], "startup_p99_s": startup["p99"], "startup_max_s": startup["max"],
                "layout_bytes": self.layout_bytes, "startup_etcd_cpu_s": etcd_cpu, "startup_hosts_cpu_s": hosts_cpu}

    def _cpu_s(self) -> tuple[float, float]:
        """CPU seconds used so far by etcd and by the host processes together."""
        return process_cpu_s(self.etcd.pid), sum(process_cpu_s(self.hosts.procs[index].pid)
                                                 for index in self.hosts.live())

    def _steady(self) -> dict[str, Any]:
        window = self.args.steady_s
        before, counters, etcd_cpu, revision = self.hosts.stats(), EtcdCounters.read(self.etcd.client_url), \
            process_cpu_s(self.etcd.pid), self.kv.revision()
        time.sleep(window)
        after, counters2, etcd_cpu2, revision2 = self.hosts.stats(), EtcdCounters.read(self.etcd.client_url), \
            process_cpu_s(self.etcd.pid), self.kv.revision()
        seconds = counters2.t - counters.t
        agents = sum(s["alive"] for s in after)
        cpu = sum(s["cpu_s"] for s in after) - sum(s["cpu_s"] for s in before)
        per_agent_cpu = cpu / agents / seconds
        probes = sum(s["probes_answered"] for s in after) - sum(s["probes_answered"] for s in before)
        result = {
            "etcd_requests_per_s_per_agent": (counters2.messages - counters.messages) / seconds / agents,
            "etcd_bytes_per_s_per_agent": (counters2.received_bytes - counters.received_bytes + counters2.sent_bytes
                                           - counters.sent_bytes) / seconds / agents,
            "probes_per_s_per_agent": probes / seconds / agents,
            "agent_cpu_pct": 100.0 * per_agent_cpu,
            "agent_cpu_s_per_hour": 3600.0 * per_agent_cpu,
            "etcd_cpu_pct": 100.0 * (etcd_cpu2 - etcd_cpu) / seconds,
            "revisions_per_hour": (revision2 - revision) / seconds * 3600.0,
            "host_rss_mb": max(s["rss_mb"] for s in after),
            "host_threads": max(s["threads"] for s in after),
        }
        self.say(f"steady state over {seconds:.0f} s: {result['etcd_requests_per_s_per_agent']:.2f} etcd requests/s "
                 f"and {result['etcd_bytes_per_s_per_agent']:.0f} B/s per agent, agent CPU "
                 f"{result['agent_cpu_pct']:.3f}% of a core, etcd CPU {result['etcd_cpu_pct']:.1f}%")
        return result

    def _leader(self) -> str | None:
        found = self.kv.get(self.store.keys.root + "leader")
        return None if found is None else json.loads(found.value)["node"]

    def _kill(self, victims: list[str]) -> tuple[float, dict[str, float]]:
        """Kill ``victims`` together; (first kill's time, each receiver's time of seeing them all)."""
        since = self.hosts.mark()
        ranks = {self.layout_ranks[v] for v in victims}
        alone = [victim for victim in victims if victim in self.own_process]
        if alone:
            self.hosts.kill_processes(alone)
        by_host: dict[int, list[str]] = {}
        for victim in victims:
            if victim not in self.own_process:
                by_host.setdefault(self.hosts.owner[victim], []).append(victim)
        for host, nodes in by_host.items():
            self.hosts.send({"cmd": "kill", "nodes": nodes}, [host])
        self.kill_counts[0] += len(alone)
        self.kill_counts[1] += len(victims) - len(alone)
        self.dead.update(victims)
        receivers = [node for node, rank in self.layout_ranks.items() if rank is not None and node not in self.dead]

        def seen() -> dict[str, float]:
            got: dict[str, set[int]] = {}
            when: dict[str, float] = {}
            for e in self.hosts.select("failure_seen", since, generation=0):
                got.setdefault(e["node"], set()).update(e["victims"])
                if ranks <= got[e["node"]] and e["node"] not in when:
                    when[e["node"]] = e["t"]
            return when

        self.hosts.wait(lambda: len(seen()) >= len(receivers), self.args.deadline_s)
        kills = self.hosts.select("killed", since)
        self.hosts.wait(lambda: len(self.hosts.select("killed", since)) >= len(victims), 5)
        kills = self.hosts.select("killed", since)
        when = seen()
        self.lost += sum(1 for node in receivers if node not in when)
        self.checks["failure_expected"] = self.checks.get("failure_expected", 0) + len(receivers)
        self.checks["failure_seen_by"] = self.checks.get("failure_seen_by", 0) + sum(
            1 for node in receivers if node in when)
        first = min((e["t"] for e in kills), default=math.nan)
        suspects = self.hosts.select("suspect", since)
        reports = [r for r in self.store.failures(0).values() if r.node in victims]
        offset = time.time() - time.monotonic()
        for report in reports:  # what held up a confirmation that took over a second: its path, its reports
            after = report.detected_at - offset - first
            if after > 1.0:
                seen_by = sorted(e["node"] for e in suspects if e["peer"] == report.node)
                slow = {"node": report.node, "after_s": round(after, 3), "path": NodeFailed.from_report(report).path,
                        "detected_by": report.detected_by, "reported_by": seen_by,
                        "neighbours": self._neighbours(report.node), "reason": report.reason}
                self.slow_confirmations.append(slow)
                self.say(f"  slow confirmation: {slow}")
        epochs: dict[int, tuple[float, int]] = {}  # each failure event: when a node first saw it, its victims
        for e in self.hosts.select("failure_seen", since, generation=0):
            if ranks & set(e["victims"]):
                seen_at, count = epochs.get(e["epoch"], (math.inf, len(e["victims"])))
                epochs[e["epoch"]] = (min(seen_at, e["t"]), count)
        self.say("  kill -> every victim gone {:.1f} ms; kill -> first neighbour report {:.1f} ms -> confirmed {:.1f} ms "
                 "-> first node saw it {:.1f} ms ({})".format(
            1e3 * (max((e.get("gone", e["t"]) for e in kills), default=math.nan) - first),
            1e3 * (min((e["t"] for e in suspects), default=math.nan) - first),
            1e3 * (max((r.detected_at for r in reports), default=math.nan) - offset - first),
            1e3 * (min(when.values(), default=math.nan) - first),
            ", ".join(f"event {epoch}: {count} victim(s), first seen at {1e3 * (t - first):.1f} ms"
                      for epoch, (t, count) in sorted(epochs.items()))))
        return first, {node: t for node, t in when.items() if node in receivers}

    def _neighbours(self, node: str) -> list[str]:
        """The nodes of the stages before and after ``node``'s in its pipeline, with ``(dead)`` after the killed."""
        rank, stages = self.layout_ranks[node], self.stages
        of_rank = {r: n for n, r in self.layout_ranks.items() if r is not None}
        near = [of_rank.get(r) for r in (rank - 1, rank + 1) if r // stages == rank // stages]
        return [f"{n} (dead)" if n in self.dead else n for n in near if n is not None]

    def _failures(self) -> dict[str, Any]:
        self.dead: set[str] = set()
        self.slow_confirmations: list[dict[str, Any]] = []
        placed = sorted(node for node, rank in self.layout_ranks.items() if rank is not None)
        single: list[float] = []
        for _ in range(self.args.kills):
            [victim] = self._victims(placed, 1)
            first, when = self._kill([victim])
            single += [t - first for t in when.values()]
            time.sleep(self.args.pause_s)
        count = self.one_percent
        victims = self._victims(placed, count)
        first, when = self._kill(victims)
        together = [t - first for t in when.values()]
        time.sleep(self.args.pause_s)
        baseline = self._baseline()
        one, many, base = spread(single), spread(together), spread(baseline)
        self.say(f"failure seen by every live node of the layout: one kill p50 {one['p50'] * 1e3:.1f} ms p99 "
                 f"{one['p99'] * 1e3:.1f} ms; {count} at once p99 {many['p99'] * 1e3:.1f} ms; baseline put->watch "
                 f"p99 {base['p99'] * 1e3:.1f} ms")
        return {"failure_p50_s": one["p50"], "failure_p99_s": one["p99"], "failure_max_s": one["max"],
                "failure_1pct_nodes": count, "failure_1pct_p50_s": many["p50"], "failure_1pct_p99_s": many["p99"],
                "failure_1pct_max_s": many["max"], "baseline_put_watch_p50_s": base["p50"],
                "baseline_put_watch_p99_s": base["p99"],
                "failure_p50_over_baseline": one["p50"] / base["p50"], "slow_confirmations": self.slow_confirmations}

    def _victims(self, placed: list[str], count: int) -> list[str]:
        """``count`` live nodes of the layout, none the elected coordinator: those in a process of their own first
        (a real kill -9), then any (killed in their shared process)."""
        leader = self._leader()
        live = [node for node in placed if node not in self.dead and node != leader]
        alone = [node for node in live if node in self.own_process]
        chosen = self.rng.sample(alone, min(count, len(alone)))
        rest = [node for node in live if node not in self.own_process]
        return chosen + self.rng.sample(rest, count - len(chosen))

    def _baseline(self) -> list[float]:
        """One put of a failure event (naming a node already dead) and its delivery to every live node."""
        since = self.hosts.mark()
        epochs = [e["epoch"] for e in self.hosts.select("failure_seen", 0, generation=0)]
        epoch = max(epochs, default=0) + 1
        dead_rank = self.layout_ranks[sorted(self.dead)[0]]
        receivers = [node for node, rank in self.layout_ranks.items() if rank is not None and node not in self.dead]
        start = time.monotonic()
        self.store.decide(epoch_decision(0, epoch), json.loads(FailureEvent(epoch, [dead_rank]).to_json()))
        self.hosts.wait(lambda: len(self.hosts.select("failure_seen", since, epoch=epoch)) >= len(receivers),
                        self.args.deadline_s)
        return [e["t"] - start for e in self.hosts.select("failure_seen", since, epoch=epoch)]

    def _reconfiguration(self) -> dict[str, Any]:
        since = self.hosts.mark()
        self.hosts.send({"cmd": "propose"})
        self.hosts.wait(lambda: bool(self.hosts.select("stop_decided", since)), self.args.deadline_s)
        decided = self.hosts.select("stop_decided", since)
        if not decided or decided[0]["step"] is None:
            self.say(f"reconfiguration: no stop was decided ({decided})")
            self.lost += self.n - len(self.dead)
            return {"reconfigure_p50_s": math.nan, "reconfigure_p99_s": math.nan, "reconfigure_max_s": math.nan,
                    "reconfigure_planned_s": math.nan}
        boundary = self.t0 + decided[0]["step"] * self.args.step_s
        live = [node for node in self.layout_ranks if node not in self.dead]
        self.hosts.wait(lambda: len(self._roles(1)) >= len(live), self.args.deadline_s + 3 * self.args.step_s)
        roles = self._roles(1)
        self.lost += sum(1 for node in live if node not in roles)
        self.checks.update(new_layout_expected=len(live), new_layout_read_by=sum(1 for n in live if n in roles))
        result = spread([roles[node] - boundary for node in live if node in roles])
        planned = self.hosts.select("planned", since)
        found = self.store.get_layout()
        planned_s = planned[0]["t"] - boundary if planned else math.nan
        if planned:
            self.say(f"barrier: every holder's record {planned[0]['all_ready'] - boundary:.3f} s after the boundary, "
                     f"the next layout written {planned_s:.3f} s after it")
        self.say(f"reconfiguration at the step boundary of step {decided[0]['step']}: every live node read its new "
                 f"role within {result['max']:.2f} s (p50 {result['p50']:.2f} s; the next layout was written "
                 f"{planned_s:.2f} s after the boundary); layout {len(json.dumps(found.value)) if found else 0} B")
        return {"reconfigure_p50_s": result["p50"], "reconfigure_p99_s": result["p99"],
                "reconfigure_max_s": result["max"], "reconfigure_planned_s": planned_s}

    def _database(self, revisions_per_hour: float) -> dict[str, Any]:
        started = self.kv.status()
        hours = self.args.replay_hours
        result = database_after(self.kv, JOB, math.ceil(revisions_per_hour * hours), 200, EVENTS_PER_WRITER)
        result["db_bytes_before_the_hour"] = started.db_size
        result["replay_hours"] = hours
        self.say(f"etcd: {revisions_per_hour:.0f} revisions per hour; database {started.db_size / 1e6:.1f} MB, "
                 f"{result['db_bytes_after_an_hour'] / 1e6:.1f} MB after {hours:g} hour(s) of them, "
                 f"{result['db_bytes_after_compaction'] / 1e6:.1f} MB after compaction")
        return result


def _table(results: list[dict[str, Any]]) -> str:
    def ms(value: float | None) -> str:
        return "-" if value is None or math.isnan(value) else f"{value * 1e3:.0f} ms" if value < 1 else f"{value:.2f} s"

    rows = [("agents (processes x per process)", lambda r: f"{r['agents']} ({r['processes']} x {r['agents_per_process']})"),
            ("start-up to layout, p50 / p99 / max", lambda r: f"{ms(r['startup_p50_s'])} / {ms(r['startup_p99_s'])} / {ms(r['startup_max_s'])}"),
            ("one kill seen by all who act, p50 / p99 / max", lambda r: f"{ms(r['failure_p50_s'])} / {ms(r['failure_p99_s'])} / {ms(r['failure_max_s'])}"),
            ("1% killed at once, p50 / p99 / max", lambda r: f"{r['failure_1pct_nodes']}: {ms(r['failure_1pct_p50_s'])} / {ms(r['failure_1pct_p99_s'])} / {ms(r['failure_1pct_max_s'])}"),
            ("baseline: one put -> every watcher, p50 / p99", lambda r: f"{ms(r['baseline_put_watch_p50_s'])} / {ms(r['baseline_put_watch_p99_s'])}"),
            ("reconfiguration, boundary -> new role, p50 / p99 / max", lambda r: f"{ms(r['reconfigure_p50_s'])} / {ms(r['reconfigure_p99_s'])} / {ms(r['reconfigure_max_s'])}"),
            ("etcd requests / s per agent", lambda r: f"{r['etcd_requests_per_s_per_agent']:.2f}"),
            ("etcd bytes / s per agent", lambda r: f"{r['etcd_bytes_per_s_per_agent']:.0f}"),
            ("probes / s per agent", lambda r: f"{r['probes_per_s_per_agent']:.3f}"),
            ("agent CPU, % of a core (CPU-s per hour)", lambda r: f"{r['agent_cpu_pct']:.3f} ({r['agent_cpu_s_per_hour']:.1f})"),
            ("etcd CPU, % of a core", lambda r: f"{r['etcd_cpu_pct']:.1f}"),
            ("etcd revisions per hour", lambda r: f"{r['revisions_per_hour']:.0f}"),
            ("etcd database: after an hour / compacted", lambda r: f"{r['db_bytes_after_an_hour'] / 1e6:.1f} MB / {r['db_bytes_after_compaction'] / 1e6:.1f} MB"),
            ("lost events / crashes", lambda r: f"{r['lost_events']} / {r['crashes']}")]
    width = max(len(name) for name, _ in rows)
    lines = [f"{name:<{width}}  " + "  ".join(f"{fmt(r):>28}" for r in results) for name, fmt in rows]
    return "\n".join(lines)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--agents", default="64,256,1000", help="comma-separated numbers of agents, one run each")
    parser.add_argument("--per-process", type=int, default=125, help="agents per host process")
    parser.add_argument("--process-kills", action="store_true",
                        help="run the nodes that may be killed one per process and kill a victim by a kill -9 of its "
                        "process, instead of inside its shared process (its port closed, its connections broken)")
    parser.add_argument("--stages", type=int, default=0, help="pipeline depth P (0: 4 below 64 agents, else 8)")
    parser.add_argument("--step-s", type=float, default=1.0, help="the stub workers' step time, s")
    parser.add_argument("--steady-s", type=float, default=20.0, help="the steady-state window, s")
    parser.add_argument("--settle-s", type=float, default=3.0, help="pause between start-up and the steady state, s")
    parser.add_argument("--kills", type=int, default=3, help="single-kill trials")
    parser.add_argument("--pause-s", type=float, default=1.0, help="pause after each failure trial, s")
    parser.add_argument("--deadline-s", type=float, default=30.0, help="how long a delivery may take before it counts "
                        "as lost")
    parser.add_argument("--ttl", type=int, default=default_of(JobSpec, "ttl"),
                        help="the agents' lease TTL, s (default: the job's, %(default)s; hundreds of agents emulated "
                        "on a few cores may need more: a host process starved longer than it loses every lease)")
    parser.add_argument("--replay-hours", type=float, default=1.0,
                        help="hours of the steady state's etcd writes replayed to size the database (the "
                        "db_bytes_after_an_hour keys are after this many hours; default: %(default)s)")
    parser.add_argument("--repeat", type=int, default=1, help="runs of each size; with more than one, a summary per "
                        "size follows the runs (their crashes and lost events in all, the spread of their p99s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true", help="print one JSON object per run instead of the table")
    args = parser.parse_args(argv)
    try:
        args.sizes = [int(v) for v in args.agents.split(",") if v.strip()]
    except ValueError:
        parser.error(f"--agents takes numbers separated by commas, got {args.agents!r}")
    if not args.sizes or min(args.sizes) < 8:
        parser.error(f"--agents: each size must be at least 8, got {args.agents!r}")
    if args.per_process < 1 or args.kills < 1 or args.repeat < 1 or args.step_s <= 0 or args.steady_s <= 0:
        parser.error("--per-process, --kills and --repeat must be >= 1; --step-s and --steady-s > 0")
    return args


def _print_json(result: dict[str, Any]) -> None:
    print(json.dumps({key: None if isinstance(value, float) and math.isnan(value) else value
                      for key, value in result.items()}), flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    say = Log()
    results = []
    for n in args.sizes:
        for attempt in range(args.repeat):
            say(f"--- {n} agents, run {attempt + 1} of {args.repeat} (load {os.getloadavg()[0]:.1f})")
            try:
                result = Run(args, n, say).execute()
            except RuntimeError as error:  # a run that could not start is a crash of that run, not of the series
                say(f"run {attempt + 1} failed: {error}")
                result = {"agents": n, "crashes": 1, "lost_events": 0, "error": str(error).splitlines()[0]}
            result["run"] = attempt + 1
            result["ttl_s"] = args.ttl
            result["load_avg_1m"] = os.getloadavg()[0]
            results.append(result)
            if args.json:  # as each run ends: a series cut short keeps the runs it made
                _print_json(result)
    summaries = summarize(results) if args.repeat > 1 else []
    if args.json:
        for summary in summaries:
            _print_json(summary)
    else:
        failed = [r for r in results if "error" in r]
        print("\n".join([_table([r for r in results if "error" not in r]), *summary_lines(summaries),
                         *(f"{r['agents']} agents, run {r['run']}: {r['error']}" for r in failed)]))
    return 0 if all(r["lost_events"] == 0 and r["crashes"] == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
