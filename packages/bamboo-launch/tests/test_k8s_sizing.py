"""``k8s render`` at scale: etcd's resources and the agents' lease TTL sized for ``--nodes`` by
:func:`bamboo.launch.k8s_sizing.size_for`, the manifests still schema-valid, and a job too large for the rule
refused in one line."""

from __future__ import annotations

from typing import Any

import pytest
import yaml
from bamboo.launch import timeouts
from bamboo.launch.cli import main
from bamboo.launch.k8s import validate_manifests
from bamboo.launch.k8s_sizing import ETCD_CLASSES, MAX_NODES, size_for
from bamboo.membership import timeouts as membership_timeouts


def _render(capsys: pytest.CaptureFixture[str], *flags: str) -> dict[str, dict[str, Any]]:
    assert main(["k8s", "render", *flags]) == 0  # validated before it is written
    documents = [d for d in yaml.safe_load_all(capsys.readouterr().out) if d is not None]
    validate_manifests(documents)
    return {d["kind"]: d for d in documents if d["kind"] in ("StatefulSet", "Deployment")}


def _etcd(objects: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str, str]:
    statefulset = objects["StatefulSet"]
    (container,) = statefulset["spec"]["template"]["spec"]["containers"]
    (claim,) = statefulset["spec"]["volumeClaimTemplates"]
    return container["resources"], container["command"][-1], claim["spec"]["resources"]["requests"]["storage"]


def _ttl(objects: dict[str, dict[str, Any]]) -> int:
    args = objects["Deployment"]["spec"]["template"]["spec"]["containers"][0]["args"]
    return int(args[args.index("--ttl") + 1])


def test_the_default_job_renders_a_small_etcd_and_the_default_lease(capsys: pytest.CaptureFixture[str]) -> None:
    objects = _render(capsys)
    resources, command, storage = _etcd(objects)
    assert resources == {"requests": {"cpu": "500m", "memory": "1024Mi"}, "limits": {"memory": "2048Mi"}}
    assert "--auto-compaction-retention=1h --quota-backend-bytes=1073741824" in command and storage == "2Gi"
    assert _ttl(objects) == membership_timeouts.LEASE_TTL_S and objects["Deployment"]["spec"]["replicas"] == 8


def test_512_nodes_render_a_large_etcd_and_a_longer_lease(capsys: pytest.CaptureFixture[str]) -> None:
    objects = _render(capsys, "--nodes", "512", "--stages", "8", "--pipelines", "60")
    resources, command, storage = _etcd(objects)
    # 1,024 clients (an agent and a worker per node) and 512 lease refreshes a second: etcd's large class
    assert resources == {"requests": {"cpu": "2000m", "memory": "4096Mi"}, "limits": {"memory": "8192Mi"}}
    assert "--quota-backend-bytes=1073741824" in command and storage == "2Gi"
    assert _ttl(objects) == 3  # 512 x 4.5 ms of start-up burst, rounded up
    assert objects["Deployment"]["spec"]["replicas"] == 512
    assert "cpu" not in resources["limits"]  # a throttled etcd misses its heartbeats


def test_an_explicit_etcd_volume_is_kept(capsys: pytest.CaptureFixture[str]) -> None:
    assert _etcd(_render(capsys, "--nodes", "512", "--etcd-storage", "20Gi"))[2] == "20Gi"


@pytest.mark.parametrize("nodes", [8, 64, 256, 512, 1000, MAX_NODES])
def test_the_rule_keeps_etcd_inside_its_class_and_every_lease_past_the_start_up_burst(nodes: int) -> None:
    sizing = size_for(nodes)
    assert sizing.lease_ttl_s >= max(membership_timeouts.LEASE_TTL_S, nodes * timeouts.K8S_LEASE_PER_NODE_S)
    assert sizing.requests_per_s == pytest.approx(3 * nodes / sizing.lease_ttl_s) and sizing.clients == 2 * nodes
    chosen = next(c for c in ETCD_CLASSES if c.name == sizing.etcd_class)
    assert sizing.clients < chosen.clients and sizing.requests_per_s < chosen.requests_per_s
    smaller = ETCD_CLASSES[: ETCD_CLASSES.index(chosen)]
    assert all(sizing.clients >= c.clients or sizing.requests_per_s >= c.requests_per_s for c in smaller)
    assert int(sizing.etcd_cpu.removesuffix("m")) >= chosen.cpu_millis
    assert int(sizing.etcd_memory_limit.removesuffix("Mi")) == 2 * int(sizing.etcd_memory_request.removesuffix("Mi"))
    assert sizing.quota_backend_bytes >= 2**30 and int(sizing.etcd_storage.removesuffix("Gi")) * 2**30 >= (
        2 * sizing.quota_backend_bytes)


def test_more_nodes_than_the_rule_sizes_an_etcd_for_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    too_many = str(MAX_NODES + 1)
    assert main(["k8s", "render", "--nodes", too_many]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"bamboo-launch: error: --nodes={too_many} is more than the {MAX_NODES} an in-cluster etcd")
    assert "--etcd HOST:PORT" in error and len(error.strip().splitlines()) == 1
    # with an external etcd, sized by its operator, the agents' lease is still sized
    objects = _render(capsys, "--nodes", too_many, "--cloud", "none", "--etcd", "etcd.example:2379")
    assert "StatefulSet" not in objects and _ttl(objects) == 10
