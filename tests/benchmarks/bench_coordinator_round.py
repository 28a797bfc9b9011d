"""Micro-benchmark: one round of the elected coordinator at N registered nodes, before and after a change.

The coordinator (:class:`bamboo.launch.coordinator.Coordinator`) runs a round whenever something woke it: a
failure notice, the leader key, the layout, the membership. This measures, on one real etcd with N node records
(one leased: the coordinator's own; the others plain records), a coordinator whose real
:class:`bamboo.membership.FailureDetector` follows them all, once the first layout of the N nodes is written:

- ``steady``: a round that no membership change preceded (woken by a failure notice or the leader key), the
  median of ``--rounds``;
- ``after a change``: a round right after one node's record changed (a standby node re-registered with another
  incarnation), the median of ``--changes``.

Every round here also reads etcd three times (the leader key, which a started coordinator follows by a watch
instead; the failure reports; the published events), which is in the figures; so is what a round derives from the
membership (its copy, the zones). Those three reads alone are timed too (``etcd_reads``), and the in-process work
of a round is the round less them (medians). ``--against REV`` runs the same
measurement again on the sources of commit REV (``git archive`` into a temporary folder, first on the child's
``PYTHONPATH``) and prints both and the ratio ``REV / now``. No threshold: the figures are for reading.

    .venv/bin/python tests/benchmarks/bench_coordinator_round.py --nodes 1000 --against 583fc50
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
ZONES = ("zone-a", "zone-b", "zone-c")
LAYER = {"param_bytes": 4000, "optimizer_bytes": 8000, "compute_cost": 100.0}


class _Events:
    """The coordinator's event log, kept in memory (this benchmark publishes no failure)."""

    def now(self) -> float:
        return 0.0

    def write(self, event: object) -> None:
        pass


class _Agent:
    """What the coordinator asks of its agent: its id, its registration (the leader key's lease), its detector."""

    def __init__(self, node_id: str, registration: Any, detector: Any) -> None:
        self.node_id, self.registration, self.detector = node_id, registration, detector


def _alive(record: Any, timeout: float) -> Any:
    from bamboo.membership import ProbeOutcome, ProbeResult

    return ProbeResult(ProbeOutcome.ALIVE, incarnation=record.incarnation)


def _timed(call: Any) -> float:
    started = time.perf_counter()
    call()
    return time.perf_counter() - started


def measure(nodes: int, rounds: int, changes: int) -> dict[str, Any]:
    """Time the coordinator's rounds at ``nodes`` registered nodes (see the module docstring)."""
    import bamboo.launch.coordinator as coordinator_module
    from bamboo.launch.coordinator import Coordinator, published_events, read_layout
    from bamboo.launch.spec import JobSpec
    from bamboo.membership import (
        EmbeddedEtcd,
        EtcdKV,
        EtcdOptions,
        FailureDetector,
        MembershipStore,
        NodeRecord,
    )
    from bamboo.membership.records import NodeState, encode_message

    def record(index: int, incarnation: int = 1) -> NodeRecord:
        return NodeRecord(id=f"node{index:04d}", zone=ZONES[index % len(ZONES)], address="10.0.0.1",
                          agent_port=50051, incarnation=incarnation, state=NodeState.NODE_STATE_ACTIVE)

    with tempfile.TemporaryDirectory(prefix="bench-round-") as folder, EmbeddedEtcd(Path(folder)) as etcd:
        etcd.start()
        kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
        store = MembershipStore(kv, "bench-round")
        try:
            for index in range(1, nodes):
                kv.put(store.keys.node(f"node{index:04d}"), encode_message(record(index)))
            registration = store.register(record(0), ttl=60)
            detector = FailureDetector(store, "node0000", _alive, follow_membership=False).start(probe_loop=False)
            stages = 8
            spec = JobSpec(job="bench-round", stages=stages, pipelines=max(1, int(nodes * 0.96) // stages),
                           layers=[LAYER] * (2 * stages), config={}, micro_batches=2, created_unix=time.time(),
                           min_nodes=nodes, redundancy="eflb")
            coordinator = Coordinator(store.fenced(registration), _Agent("node0000", registration, detector), spec,
                                      _Events())  # type: ignore[arg-type]
            deadline = time.monotonic() + 120
            while read_layout(store) is None:  # elected, it follows the membership, then writes the first layout
                coordinator.round()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no first layout of {nodes} nodes within 120 s")
            for _ in range(5):
                coordinator.round()  # warm: the layout decoded, the zones derived
            steady = [_timed(coordinator.round) for _ in range(rounds)]
            generation = read_layout(store).generation
            leader = store.keys.root + "leader"
            reads = [_timed(lambda: (kv.get(leader), kv.get_prefix(store.keys.failures),
                                     published_events(store, generation))) for _ in range(rounds)]
            standby = sorted(set(range(nodes)) - {int(n.removeprefix("node")) for n in read_layout(store).ranks})
            changed = []
            for attempt in range(changes):
                index = standby[attempt % len(standby)] if standby else nodes - 1
                new = record(index, incarnation=2 + attempt)
                kv.put(store.keys.node(new.id), encode_message(new))
                deadline = time.monotonic() + 30
                while detector.known_nodes().get(new.id, NodeRecord()).incarnation != new.incarnation:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"the detector did not see {new.id} change within 30 s")
                    time.sleep(0.002)
                changed.append(_timed(coordinator.round))
            detector.stop()
            registration.leave()
        finally:
            kv.close()
    return {"nodes": nodes, "rounds": rounds, "changes": changes,
            "steady_round_median_s": statistics.median(steady), "steady_round_p90_s": _p90(steady),
            "changed_round_median_s": statistics.median(changed), "changed_round_p90_s": _p90(changed),
            "etcd_reads_median_s": statistics.median(reads),
            "coordinator_source": coordinator_module.__file__}


def _p90(values: list[float]) -> float:
    return sorted(values)[int(0.9 * (len(values) - 1))]


def _against(revision: str, args: argparse.Namespace) -> dict[str, Any]:
    """The same measurement on the sources of ``revision``, in a child process."""
    with tempfile.TemporaryDirectory(prefix="bench-round-src-") as folder:
        archive = subprocess.run(["git", "-C", str(ROOT), "archive", revision, "packages"], check=True,
                                 capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", folder], input=archive, check=True)
        sources = sorted(str(p) for p in Path(folder, "packages").glob("*/src"))
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([*sources, os.environ.get("PYTHONPATH", "")])}
        done = subprocess.run([sys.executable, __file__, "--nodes", str(args.nodes), "--rounds", str(args.rounds),
                               "--changes", str(args.changes), "--json"], env=env, capture_output=True, text=True,
                              check=False)
        if done.returncode != 0:
            raise RuntimeError(f"the run on {revision} failed: {done.stderr[-2000:]}")
        result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
        if not result["coordinator_source"].startswith(folder):
            raise RuntimeError(f"the run on {revision} imported {result['coordinator_source']}, not its sources")
        result["revision"] = revision
        return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--nodes", type=int, default=1000, help="registered nodes (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=300, help="steady rounds timed (default: %(default)s)")
    parser.add_argument("--changes", type=int, default=30, help="rounds after a change timed (default: %(default)s)")
    parser.add_argument("--against", metavar="REV", help="also measure the sources of commit REV; print the ratio")
    parser.add_argument("--json", action="store_true", help="print only the JSON objects, one per measurement")
    args = parser.parse_args(argv)
    if args.nodes < 16 or args.rounds < 1 or args.changes < 1:
        parser.error(f"--nodes must be >= 16 and --rounds, --changes >= 1; got {args.nodes}, {args.rounds}, "
                     f"{args.changes}")
    now = measure(args.nodes, args.rounds, args.changes)
    results = [now] + ([_against(args.against, args)] if args.against else [])
    if args.json:
        for result in results:
            print(json.dumps(result))
        return 0
    for result in results:
        print(f"{result.get('revision', 'this tree')}: {result['nodes']} registered nodes: a round after no "
              f"change {result['steady_round_median_s'] * 1e3:.3f} ms (median; p90 "
              f"{result['steady_round_p90_s'] * 1e3:.3f} ms), after one change "
              f"{result['changed_round_median_s'] * 1e3:.3f} ms (p90 {result['changed_round_p90_s'] * 1e3:.3f} ms); "
              f"its three etcd reads alone {result['etcd_reads_median_s'] * 1e3:.3f} ms")
    if args.against:
        before = results[1]

        def local(result: dict[str, Any], key: str) -> float:
            return max(result[key] - result["etcd_reads_median_s"], 1e-9)

        print(f"ratio {args.against} / this tree: after no change "
              f"{before['steady_round_median_s'] / now['steady_round_median_s']:.2f}x (in-process work "
              f"{local(before, 'steady_round_median_s') * 1e3:.3f} -> {local(now, 'steady_round_median_s') * 1e3:.3f} ms, "
              f"{local(before, 'steady_round_median_s') / local(now, 'steady_round_median_s'):.1f}x), after one change "
              f"{before['changed_round_median_s'] / now['changed_round_median_s']:.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
