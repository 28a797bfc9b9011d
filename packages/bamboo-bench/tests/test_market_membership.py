"""The emulated market driving real membership agents against a real embedded etcd.

A notice from the market (SIGTERM to the node's leader) must reach etcd as the node's preemption
notice, and a kill (SIGKILL to the node's process group) must end the node's lease, so the rest
of the cluster sees it leave. The market's clock is driven by hand; only the agents and etcd
run in real time.
"""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import attrs
import pytest
from bamboo.bench.emulated.market import SpotMarket, plan_market
from bamboo.bench.emulated.processes import ProcessCluster

membership = pytest.importorskip("bamboo.membership")
if shutil.which("etcd") is None:
    pytest.skip("the etcd binary is not installed", allow_module_level=True)


@attrs.frozen
class Ev:
    time_s: float
    kind: str
    node: str
    zone: str


@pytest.mark.slow
def test_notice_and_kill_reach_etcd(tmp_path: Path, fake_clock, proc_helpers) -> None:
    from bamboo.membership import EmbeddedEtcd, EtcdKV, EtcdOptions, MembershipStore, NodeState

    trace = [Ev(0, "add", "t0", "zone-a"), Ev(0, "add", "t1", "zone-b"), Ev(10, "remove", "t1", "zone-b")]
    plan = plan_market(trace, time_scale=1.0, notice_s=5.0)
    with EmbeddedEtcd() as etcd:
        kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
        store = MembershipStore(kv, "market")

        def agent(node: str, zone: str) -> list[str]:
            return [
                sys.executable, "-m", "bamboo.membership", "--etcd", etcd.endpoint, "--job", "market",
                "--node", node, "--zone", zone, "--ttl", "1", "--no-detector", "--notice-window", "60",
            ]  # fmt: skip

        try:
            with ProcessCluster(agent, log_dir=tmp_path / "logs") as cluster:
                market = SpotMarket(plan, cluster, clock=fake_clock)
                market.run_due()
                registered = proc_helpers.wait(lambda: set(store.list_nodes()) == {"node0", "node1"}, 60)
                assert registered, (tmp_path / "logs" / "node1.log").read_text()
                assert store.list_nodes()["node1"].zone == "zone-b"
                # The agent prints its ready line after installing its SIGTERM handler.
                ready = tmp_path / "logs" / "node1.log"
                assert proc_helpers.wait(lambda: '"node": "node1"' in ready.read_text(), 30), (
                    ready.read_text()
                )

                fake_clock.advance(5.0)
                market.run_due()  # the notice: SIGTERM to node1's agent
                assert proc_helpers.wait(lambda: kv.get(store.keys.notice("node1")) is not None, 20)
                assert proc_helpers.wait(
                    lambda: store.list_nodes()["node1"].state == NodeState.NODE_STATE_PREEMPTING
                )
                assert cluster.processes["node1"].poll() is None  # noticed, not dead

                fake_clock.advance(5.0)
                market.run_due()  # the kill: SIGKILL to node1's process group
                assert cluster.processes["node1"].returncode == -9
                assert proc_helpers.wait(lambda: "node1" not in store.list_nodes(), 20), "lease never expired"
                assert set(store.list_nodes()) == {"node0"}
                assert kv.get(store.keys.notice("node0")) is None
        finally:
            kv.close()
