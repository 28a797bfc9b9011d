"""The etcd the manifests deploy when no external one is given: a StatefulSet of 1, 3 or 5 members sized
for the job, its peer and client Services, a PodDisruptionBudget and a NetworkPolicy."""

from __future__ import annotations

from bamboo.launch.json_types import JSONObject
from bamboo.launch.k8s_config import (
    ETCD_CLIENT_PORT,
    ETCD_PEER_PORT,
    K8sConfig,
    Manifest,
    container_port,
    field_env,
    ingress_policy,
    object_labels,
    object_meta,
    pod_template,
    pods,
    service,
    service_port,
)

__all__ = ["etcd_objects"]


def _on_demand_preference(config: K8sConfig) -> list[JSONObject]:
    """Preferred (not required) on-demand placement for etcd: it must outlive spot preemptions."""
    term: JSONObject
    if config.cloud == "eks":
        term = {"key": "eks.amazonaws.com/capacityType", "operator": "In", "values": ["ON_DEMAND"]}
    elif config.cloud == "gke":
        term = {"key": "cloud.google.com/gke-spot", "operator": "DoesNotExist"}
    else:
        return []
    return [{"weight": 100, "preference": {"matchExpressions": [term]}}]


def etcd_objects(config: K8sConfig) -> list[Manifest]:
    """etcd's objects in apply order: the peer and client Services, the StatefulSet, the PodDisruptionBudget and
    the NetworkPolicy."""
    name = f"{config.job}-etcd"
    peer = f"{name}-peer"
    peer_ports = [service_port("peer", ETCD_PEER_PORT), service_port("client", ETCD_CLIENT_PORT)]
    return [
        service(config, peer, "etcd", peer_ports, headless=True, publish_not_ready=True),
        service(config, name, "etcd", [service_port("client", ETCD_CLIENT_PORT)]),
        _statefulset(config, name, peer),
        _disruption_budget(config, name),
        _network_policy(config, name),
    ]


def _statefulset(config: K8sConfig, name: str, peer: str) -> Manifest:
    """The members, started together, each with its persistent volume."""
    labels = object_labels(config, "etcd")
    pod_spec: JSONObject = {
        "automountServiceAccountToken": False,
        "affinity": _affinity(config, labels),
        "containers": [_container(config, name, peer)],
    }
    return {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(config, name, "etcd"),
        "spec": {
            "serviceName": peer,
            "replicas": config.etcd_replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": pod_template(labels, pod_spec),
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": config.etcd_storage or config.sizing.etcd_storage}},
                    },
                }
            ],
        },
    }


def _affinity(config: K8sConfig, labels: dict[str, str]) -> JSONObject:
    """Members preferably in different zones, and preferably on on-demand nodes."""
    affinity: JSONObject = {
        "podAntiAffinity": {
            "preferredDuringSchedulingIgnoredDuringExecution": [
                {
                    "weight": 100,
                    "podAffinityTerm": {
                        "labelSelector": {"matchLabels": labels},
                        "topologyKey": "topology.kubernetes.io/zone",
                    },
                }
            ]
        }
    }
    preference = _on_demand_preference(config)
    if preference:
        affinity["nodeAffinity"] = {"preferredDuringSchedulingIgnoredDuringExecution": preference}
    return affinity


def _container(config: K8sConfig, name: str, peer: str) -> JSONObject:
    """One member: ``etcd`` named after its pod, ready once it answers ``/health``; its resources sized for the job
    (no CPU limit: a throttled etcd misses its heartbeats)."""
    sizing = config.sizing
    return {
        "name": "etcd",
        "image": config.etcd_image,
        "command": ["/bin/sh", "-ec", _command(config, name, peer)],
        "env": [field_env("POD_NAME", "metadata.name")],
        "ports": [container_port("client", ETCD_CLIENT_PORT), container_port("peer", ETCD_PEER_PORT)],
        "resources": {"requests": {"cpu": sizing.etcd_cpu, "memory": sizing.etcd_memory_request},
                      "limits": {"memory": sizing.etcd_memory_limit}},
        "readinessProbe": {"httpGet": {"path": "/health", "port": "client"}, "periodSeconds": 5},
        "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
    }


def _command(config: K8sConfig, name: str, peer: str) -> str:
    """The member's shell command: every member's peer URL under the peer Service's DNS name, compaction and quota
    as sized for the job."""
    sizing = config.sizing
    domain = f"{peer}.{config.namespace}.svc"
    initial_cluster = ",".join(
        f"{name}-{i}=http://{name}-{i}.{domain}:{ETCD_PEER_PORT}" for i in range(config.etcd_replicas)
    )
    return (
        "exec etcd --name=${POD_NAME} --data-dir=/var/lib/etcd "
        f"--listen-client-urls=http://0.0.0.0:{ETCD_CLIENT_PORT} "
        f"--advertise-client-urls=http://${{POD_NAME}}.{domain}:{ETCD_CLIENT_PORT} "
        f"--listen-peer-urls=http://0.0.0.0:{ETCD_PEER_PORT} "
        f"--initial-advertise-peer-urls=http://${{POD_NAME}}.{domain}:{ETCD_PEER_PORT} "
        f"--initial-cluster={initial_cluster} "
        f"--initial-cluster-token={config.job}-etcd --initial-cluster-state=new "
        f"--auto-compaction-retention={sizing.auto_compaction_retention} "
        f"--quota-backend-bytes={sizing.quota_backend_bytes}"
    )


def _disruption_budget(config: K8sConfig, name: str) -> Manifest:
    """A voluntary drain never takes etcd's quorum: one member at a time (none of a single member)."""
    return {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(config, name, "etcd"),
        "spec": {
            "maxUnavailable": 1 if config.etcd_replicas > 1 else 0,
            "selector": {"matchLabels": object_labels(config, "etcd")},
        },
    }


def _network_policy(config: K8sConfig, name: str) -> Manifest:
    """The etcd rendered here has no TLS or auth: only the job's agents (client port) and the other members
    (both ports) may reach it. Reach it from elsewhere with kubectl port-forward."""
    client: JSONObject = {"protocol": "TCP", "port": ETCD_CLIENT_PORT}
    peer: JSONObject = {"protocol": "TCP", "port": ETCD_PEER_PORT}
    return ingress_policy(config, name, "etcd", [
        {"from": [pods(object_labels(config, "agent"))], "ports": [client]},
        {"from": [pods(object_labels(config, "etcd"))], "ports": [client, peer]},
    ])
