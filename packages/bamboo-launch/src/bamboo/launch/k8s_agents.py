"""The agents' Kubernetes objects: their ServiceAccount and RBAC, the job token's Secret, the NetworkPolicy,
the headless Service and the Deployment (one agent per machine, spread across zones, on the spot pool)."""

from __future__ import annotations

from typing import Any

from bamboo.launch.k8s_config import (
    AGENT_TLS_MOUNT,
    AGENT_TOKEN_MOUNT,
    ETCD_TLS_MOUNT,
    RUN_DIR,
    K8sConfig,
    agent_token_secret_name,
    etcd_endpoints,
    field_env,
    object_labels,
    object_meta,
)

__all__ = ["agent_args", "agent_objects", "token_secret"]


def _spot_scheduling(config: K8sConfig) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """Required node-selector terms and tolerations for the cloud's spot pool (and the zones)."""
    expressions: list[dict[str, Any]] = []
    tolerations: list[dict[str, Any]] = []
    if config.cloud == "eks":
        expressions.append({"key": "eks.amazonaws.com/capacityType", "operator": "In", "values": ["SPOT"]})
    elif config.cloud == "gke":
        expressions.append({"key": "cloud.google.com/gke-spot", "operator": "In", "values": ["true"]})
        tolerations.append(
            {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
        )
    if config.zones:
        expressions.append(
            {"key": "topology.kubernetes.io/zone", "operator": "In", "values": list(config.zones)}
        )
    if config.gpus_per_node > 0:
        tolerations.append({"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"})
    return expressions, tolerations


def agent_args(config: K8sConfig) -> list[str]:
    """The arguments of ``bamboo-launch agent`` in the agent container (see :data:`AGENT_ARGS_DOC`)."""
    args = ["agent", "--job", config.job]
    for endpoint in etcd_endpoints(config):
        args += ["--etcd", endpoint]
    args += [
        "--node",
        "$(POD_NAME)",
        "--host",
        "$(POD_IP)",
        "--port",
        str(config.grpc_port),
        "--k8s-node",
        "$(NODE_NAME)",
        "--run-dir",
        RUN_DIR,
        "--notice-window",
        str(config.grace_period_s),
        "--stages",
        str(config.stages),
        "--pipelines",
        str(config.pipelines),
        "--steps",
        str(config.steps),
    ]
    if config.agent_tls_secret is not None:
        args += [
            "--tls-ca",
            f"{AGENT_TLS_MOUNT}/ca.crt",
            "--tls-cert",
            f"{AGENT_TLS_MOUNT}/tls.crt",
            "--tls-key",
            f"{AGENT_TLS_MOUNT}/tls.key",
        ]
    else:
        args += ["--token-file", f"{AGENT_TOKEN_MOUNT}/token"]
    # Checkpoints only on storage that every machine sees: a pod's own disk would hold one stage's
    # shards, which no restore can use (and which could fill the node's ephemeral storage).
    if config.checkpoint_claim is not None:
        args += ["--checkpoint-dir", config.checkpoint_dir]
    if config.etcd_tls_secret is not None:
        args += [
            "--etcd-ca",
            f"{ETCD_TLS_MOUNT}/ca.crt",
            "--etcd-cert",
            f"{ETCD_TLS_MOUNT}/tls.crt",
            "--etcd-key",
            f"{ETCD_TLS_MOUNT}/tls.key",
        ]
    if config.etcd_auth_secret is not None:
        args += ["--etcd-user", "$(ETCD_USER)", "--etcd-password", "$(ETCD_PASSWORD)"]
    if config.script:
        args += ["--", *config.script]
    return args


def agent_objects(config: K8sConfig) -> list[dict[str, Any]]:
    name = f"{config.job}-agent"
    labels = object_labels(config, "agent")
    expressions, tolerations = _spot_scheduling(config)
    resources: dict[str, dict[str, str]] = {
        "requests": {"cpu": config.cpu, "memory": config.memory},
        "limits": {"memory": config.memory},
    }
    if config.gpus_per_node > 0:
        resources["requests"]["nvidia.com/gpu"] = str(config.gpus_per_node)
        resources["limits"]["nvidia.com/gpu"] = str(config.gpus_per_node)
    volume_mounts: list[dict[str, Any]] = [
        {"name": "dshm", "mountPath": "/dev/shm"},
        {"name": "run", "mountPath": RUN_DIR},
    ]
    volumes: list[dict[str, Any]] = [
        {"name": "dshm", "emptyDir": {"medium": "Memory"}},
        {"name": "run", "emptyDir": {}},
    ]
    if config.checkpoint_claim is not None:
        volume_mounts.append({"name": "checkpoints", "mountPath": config.checkpoint_dir})
        volumes.append(
            {"name": "checkpoints", "persistentVolumeClaim": {"claimName": config.checkpoint_claim}}
        )
    if config.etcd_tls_secret is not None:
        volume_mounts.append({"name": "etcd-tls", "mountPath": ETCD_TLS_MOUNT, "readOnly": True})
        volumes.append(
            {"name": "etcd-tls", "secret": {"secretName": config.etcd_tls_secret, "defaultMode": 0o400}}
        )
    token_secret = agent_token_secret_name(config)
    if token_secret is not None:
        volume_mounts.append({"name": "agent-token", "mountPath": AGENT_TOKEN_MOUNT, "readOnly": True})
        volumes.append({"name": "agent-token", "secret": {"secretName": token_secret, "defaultMode": 0o400}})
    else:
        volume_mounts.append({"name": "agent-tls", "mountPath": AGENT_TLS_MOUNT, "readOnly": True})
        volumes.append(
            {"name": "agent-tls", "secret": {"secretName": config.agent_tls_secret, "defaultMode": 0o400}}
        )
    env: list[dict[str, Any]] = [
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_IP", "status.podIP"),
        field_env("NODE_NAME", "spec.nodeName"),
        # bamboo-rc trains on CPU tensors over gloo: DeepSpeed must not pick a GPU accelerator.
        {"name": "DS_ACCELERATOR", "value": "cpu"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if config.etcd_auth_secret is not None:
        for variable, key in (("ETCD_USER", "username"), ("ETCD_PASSWORD", "password")):
            env.append(
                {
                    "name": variable,
                    "valueFrom": {"secretKeyRef": {"name": config.etcd_auth_secret, "key": key}},
                }
            )
    affinity: dict[str, Any] = {
        "podAntiAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": [
                {"labelSelector": {"matchLabels": labels}, "topologyKey": "kubernetes.io/hostname"}
            ]
        }
    }
    if expressions:
        affinity["nodeAffinity"] = {
            "requiredDuringSchedulingIgnoredDuringExecution": {
                "nodeSelectorTerms": [{"matchExpressions": expressions}]
            }
        }
    pod_spec: dict[str, Any] = {
        "serviceAccountName": name,
        "terminationGracePeriodSeconds": config.grace_period_s,
        "affinity": affinity,
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "DoNotSchedule" if config.zone_spread == "strict" else "ScheduleAnyway",
                "labelSelector": {"matchLabels": labels},
            },
        ],
        "containers": [
            {
                "name": "agent",
                "image": config.image,
                "command": ["bamboo-launch"],
                "args": agent_args(config),
                "env": env,
                "ports": [{"name": "grpc", "containerPort": config.grpc_port, "protocol": "TCP"}],
                "resources": resources,
                "readinessProbe": {
                    "tcpSocket": {"port": "grpc"},
                    "periodSeconds": 5,
                    "failureThreshold": 3,
                },
                "volumeMounts": volume_mounts,
            }
        ],
        "volumes": volumes,
    }
    if tolerations:
        pod_spec["tolerations"] = tolerations
    service_account = {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(config, name, "agent"),
        "automountServiceAccountToken": True,
    }
    role_name = f"{config.namespace}-{config.job}-agent-node-reader"
    cluster_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": object_meta(config, role_name, "agent", namespaced=False),
        "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": object_meta(config, role_name, "agent", namespaced=False),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": config.namespace}],
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": object_meta(config, name, "agent"),
        "spec": {
            "clusterIP": "None",
            "selector": labels,
            "ports": [{"name": "grpc", "port": config.grpc_port, "targetPort": "grpc", "protocol": "TCP"}],
        },
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(config, name, "agent"),
        "spec": {
            "replicas": config.nodes,
            "selector": {"matchLabels": labels},
            # Never take agents down on purpose to roll out an update: replace them one by one.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": {"metadata": {"labels": labels}, "spec": pod_spec},
        },
    }
    # Only the job's agent pods may connect to an agent pod, on any port: the agents' gRPC port, and the
    # ephemeral ports of the workers' gloo connections to each other. The pod's own node (the kubelet's
    # probes) is always admitted. Egress is not restricted (etcd, the API server, data).
    network_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(config, name, "agent"),
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": labels}}]}],
        },
    }
    return [service_account, cluster_role, binding, network_policy, service, deployment]


def token_secret(config: K8sConfig, token: str) -> dict[str, Any]:
    """The job token's Secret: every call to an agent carries this token."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(config, f"{config.job}-agent-token", "agent"),
        "type": "Opaque",
        "stringData": {"token": token},
    }
