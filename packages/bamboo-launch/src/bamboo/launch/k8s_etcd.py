"""The etcd the manifests deploy when no external one is given: a StatefulSet of 1, 3 or 5 members sized
for the job, its peer and client Services, a PodDisruptionBudget and a NetworkPolicy."""

from __future__ import annotations

from typing import Any

from bamboo.launch.k8s_config import K8sConfig, field_env, object_labels, object_meta

__all__ = ["etcd_objects"]


def _on_demand_preference(config: K8sConfig) -> list[dict[str, Any]]:
    """Preferred (not required) on-demand placement for etcd: it must outlive spot preemptions."""
    if config.cloud == "eks":
        term = {"key": "eks.amazonaws.com/capacityType", "operator": "In", "values": ["ON_DEMAND"]}
    elif config.cloud == "gke":
        term = {"key": "cloud.google.com/gke-spot", "operator": "DoesNotExist"}
    else:
        return []
    return [{"weight": 100, "preference": {"matchExpressions": [term]}}]


def etcd_objects(config: K8sConfig) -> list[dict[str, Any]]:
    name = f"{config.job}-etcd"
    peer = f"{name}-peer"
    labels = object_labels(config, "etcd")
    domain = f"{peer}.{config.namespace}.svc"
    initial_cluster = ",".join(
        f"{name}-{i}=http://{name}-{i}.{domain}:2380" for i in range(config.etcd_replicas)
    )
    script = (
        "exec etcd --name=${POD_NAME} --data-dir=/var/lib/etcd "
        "--listen-client-urls=http://0.0.0.0:2379 "
        f"--advertise-client-urls=http://${{POD_NAME}}.{domain}:2379 "
        "--listen-peer-urls=http://0.0.0.0:2380 "
        f"--initial-advertise-peer-urls=http://${{POD_NAME}}.{domain}:2380 "
        f"--initial-cluster={initial_cluster} "
        f"--initial-cluster-token={config.job}-etcd --initial-cluster-state=new "
        "--auto-compaction-retention=1h --quota-backend-bytes=1073741824"
    )
    affinity: dict[str, Any] = {
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
    peer_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(config, peer, "etcd"),
        "spec": {
            "clusterIP": "None",
            "publishNotReadyAddresses": True,
            "selector": labels,
            "ports": [
                {"name": "peer", "port": 2380, "targetPort": "peer", "protocol": "TCP"},
                {"name": "client", "port": 2379, "targetPort": "client", "protocol": "TCP"},
            ],
        },
    }
    client_service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(config, name, "etcd"),
        "spec": {
            "selector": labels,
            "ports": [{"name": "client", "port": 2379, "targetPort": "client", "protocol": "TCP"}],
        },
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": object_meta(config, name, "etcd"),
        "spec": {
            "serviceName": peer,
            "replicas": config.etcd_replicas,
            "podManagementPolicy": "Parallel",
            "selector": {"matchLabels": labels},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    "automountServiceAccountToken": False,
                    "affinity": affinity,
                    "containers": [
                        {
                            "name": "etcd",
                            "image": config.etcd_image,
                            "command": ["/bin/sh", "-ec", script],
                            "env": [field_env("POD_NAME", "metadata.name")],
                            "ports": [
                                {"name": "client", "containerPort": 2379, "protocol": "TCP"},
                                {"name": "peer", "containerPort": 2380, "protocol": "TCP"},
                            ],
                            "resources": {
                                "requests": {"cpu": "500m", "memory": "512Mi"},
                                "limits": {"memory": "1Gi"},
                            },
                            "readinessProbe": {
                                "httpGet": {"path": "/health", "port": "client"},
                                "periodSeconds": 5,
                            },
                            "volumeMounts": [{"name": "data", "mountPath": "/var/lib/etcd"}],
                        }
                    ],
                },
            },
            "volumeClaimTemplates": [
                {
                    "metadata": {"name": "data"},
                    "spec": {
                        "accessModes": ["ReadWriteOnce"],
                        "resources": {"requests": {"storage": config.etcd_storage}},
                    },
                }
            ],
        },
    }
    budget = {
        "apiVersion": "policy/v1",
        "kind": "PodDisruptionBudget",
        "metadata": object_meta(config, name, "etcd"),
        "spec": {"maxUnavailable": 1 if config.etcd_replicas > 1 else 0, "selector": {"matchLabels": labels}},
    }
    agents = object_labels(config, "agent")
    # The etcd rendered here has no TLS or auth: only the job's agents (client port) and the other
    # members (both ports) may reach it. Reach it from elsewhere with kubectl port-forward.
    network_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(config, name, "etcd"),
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            "ingress": [
                {
                    "from": [{"podSelector": {"matchLabels": agents}}],
                    "ports": [{"protocol": "TCP", "port": 2379}],
                },
                {
                    "from": [{"podSelector": {"matchLabels": labels}}],
                    "ports": [{"protocol": "TCP", "port": 2379}, {"protocol": "TCP", "port": 2380}],
                },
            ],
        },
    }
    return [peer_service, client_service, statefulset, budget, network_policy]
