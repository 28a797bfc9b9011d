"""The agents' Kubernetes objects: their ServiceAccount and RBAC, the job token's Secret, the NetworkPolicy,
the headless Service and the Deployment (one agent per machine, spread across zones, on the spot pool)."""

from __future__ import annotations

from bamboo.launch.json_types import JSONObject
from bamboo.launch.k8s_config import (
    AGENT_TLS_MOUNT,
    AGENT_TOKEN_MOUNT,
    ETCD_TLS_MOUNT,
    RUN_DIR,
    K8sConfig,
    Manifest,
    agent_token_secret_name,
    container_port,
    etcd_endpoints,
    field_env,
    ingress_policy,
    object_labels,
    object_meta,
    pod_template,
    pods,
    service,
    service_port,
)

__all__ = ["agent_args", "agent_objects", "token_secret"]


def _spot_scheduling(config: K8sConfig) -> tuple[list[JSONObject], list[JSONObject]]:
    """Required node-selector terms and tolerations for the cloud's spot pool (and the zones)."""
    expressions: list[JSONObject] = []
    tolerations: list[JSONObject] = []
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
        "--ttl",
        str(config.sizing.lease_ttl_s),
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


def agent_objects(config: K8sConfig) -> list[Manifest]:
    """The agents' objects in apply order: ServiceAccount, ClusterRole, ClusterRoleBinding, NetworkPolicy,
    Service, Deployment."""
    name = f"{config.job}-agent"
    cluster_role, binding = _node_reader_rbac(config, name)
    # Only the job's agent pods may connect to an agent pod, on any port: the agents' gRPC port, and the
    # ephemeral ports of the workers' gloo connections to each other. The pod's own node (the kubelet's
    # probes) is always admitted. Egress is not restricted (etcd, the API server, data).
    network_policy = ingress_policy(config, name, "agent", [{"from": [pods(object_labels(config, "agent"))]}])
    headless = service(config, name, "agent", [service_port("grpc", config.grpc_port)], headless=True)
    return [_service_account(config, name), cluster_role, binding, network_policy, headless, _deployment(config, name)]


def _service_account(config: K8sConfig, name: str) -> Manifest:
    """The agents' identity towards the API server (the RBAC below grants it reading nodes)."""
    return {
        "apiVersion": "v1",
        "kind": "ServiceAccount",
        "metadata": object_meta(config, name, "agent"),
        "automountServiceAccountToken": True,
    }


def _node_reader_rbac(config: K8sConfig, account: str) -> tuple[Manifest, Manifest]:
    """The ClusterRole that allows ``get`` on nodes (an agent reads its node's zone label) and its binding to the
    agents' ServiceAccount: nodes are cluster-scoped, so a namespaced Role cannot grant it."""
    role_name = f"{config.namespace}-{config.job}-agent-node-reader"
    cluster_role: Manifest = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": object_meta(config, role_name, "agent", namespaced=False),
        "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}],
    }
    binding: Manifest = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": object_meta(config, role_name, "agent", namespaced=False),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": account, "namespace": config.namespace}],
    }
    return cluster_role, binding


def _deployment(config: K8sConfig, name: str) -> Manifest:
    """One agent per node, replaced one by one on an update."""
    labels = object_labels(config, "agent")
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": object_meta(config, name, "agent"),
        "spec": {
            "replicas": config.nodes,
            "selector": {"matchLabels": labels},
            # Never take agents down on purpose to roll out an update: replace them one by one.
            "strategy": {"type": "RollingUpdate", "rollingUpdate": {"maxSurge": 1, "maxUnavailable": 0}},
            "template": pod_template(labels, _pod_spec(config, name, labels)),
        },
    }


def _pod_spec(config: K8sConfig, account: str, labels: dict[str, str]) -> JSONObject:
    """An agent pod: on the spot pool, one per node, spread over zones, its container and volumes."""
    expressions, tolerations = _spot_scheduling(config)
    mounts, volumes = _volumes(config)
    spec: JSONObject = {
        "serviceAccountName": account,
        "terminationGracePeriodSeconds": config.grace_period_s,
        "affinity": _affinity(labels, expressions),
        "topologySpreadConstraints": [
            {
                "maxSkew": 1,
                "topologyKey": "topology.kubernetes.io/zone",
                "whenUnsatisfiable": "DoNotSchedule" if config.zone_spread == "strict" else "ScheduleAnyway",
                "labelSelector": {"matchLabels": labels},
            },
        ],
        "containers": [_container(config, mounts)],
        "volumes": volumes,
    }
    if tolerations:
        spec["tolerations"] = tolerations
    return spec


def _affinity(labels: dict[str, str], expressions: list[JSONObject]) -> JSONObject:
    """Never two agents on one node; only on the nodes that ``expressions`` select (the spot pool, the zones)."""
    affinity: JSONObject = {
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
    return affinity


def _container(config: K8sConfig, mounts: list[JSONObject]) -> JSONObject:
    """The agent container: ``bamboo-launch agent`` with :func:`agent_args`, ready once its gRPC port listens."""
    return {
        "name": "agent",
        "image": config.image,
        "command": ["bamboo-launch"],
        "args": agent_args(config),
        "env": _env(config),
        "ports": [container_port("grpc", config.grpc_port)],
        "resources": _resources(config),
        "readinessProbe": {"tcpSocket": {"port": "grpc"}, "periodSeconds": 5, "failureThreshold": 3},
        "volumeMounts": mounts,
    }


def _env(config: K8sConfig) -> list[JSONObject]:
    """The pod's name, IP and node (downward API) for the agent's flags, and etcd's credentials when given."""
    env: list[JSONObject] = [
        field_env("POD_NAME", "metadata.name"),
        field_env("POD_IP", "status.podIP"),
        field_env("NODE_NAME", "spec.nodeName"),
        # bamboo-rc trains on CPU tensors over gloo: DeepSpeed must not pick a GPU accelerator.
        {"name": "DS_ACCELERATOR", "value": "cpu"},
        {"name": "PYTHONUNBUFFERED", "value": "1"},
    ]
    if config.etcd_auth_secret is not None:
        for variable, key in (("ETCD_USER", "username"), ("ETCD_PASSWORD", "password")):
            env.append({"name": variable, "valueFrom": {"secretKeyRef": {"name": config.etcd_auth_secret, "key": key}}})
    return env


def _resources(config: K8sConfig) -> JSONObject:
    """Requests: CPU, memory and GPUs; limits: memory and GPUs (no CPU limit: data loading is not throttled)."""
    requests = {"cpu": config.cpu, "memory": config.memory}
    limits = {"memory": config.memory}
    if config.gpus_per_node > 0:
        requests["nvidia.com/gpu"] = str(config.gpus_per_node)
        limits["nvidia.com/gpu"] = str(config.gpus_per_node)
    return {"requests": requests, "limits": limits}


def _volumes(config: K8sConfig) -> tuple[list[JSONObject], list[JSONObject]]:
    """``(mounts, volumes)``: shared memory, the run dir, the checkpoint claim, etcd's TLS, the job token or the
    agents' TLS."""
    mounts: list[JSONObject] = [{"name": "dshm", "mountPath": "/dev/shm"}, {"name": "run", "mountPath": RUN_DIR}]
    volumes: list[JSONObject] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}, {"name": "run", "emptyDir": {}}]
    if config.checkpoint_claim is not None:
        mounts.append({"name": "checkpoints", "mountPath": config.checkpoint_dir})
        volumes.append({"name": "checkpoints", "persistentVolumeClaim": {"claimName": config.checkpoint_claim}})
    secrets: list[tuple[str, str, str]] = []  # (volume, Secret, mount path), each mounted read-only
    if config.etcd_tls_secret is not None:
        secrets.append(("etcd-tls", config.etcd_tls_secret, ETCD_TLS_MOUNT))
    token = agent_token_secret_name(config)
    if token is not None:
        secrets.append(("agent-token", token, AGENT_TOKEN_MOUNT))
    elif config.agent_tls_secret is not None:
        secrets.append(("agent-tls", config.agent_tls_secret, AGENT_TLS_MOUNT))
    for name, secret, mount in secrets:
        mounts.append({"name": name, "mountPath": mount, "readOnly": True})
        volumes.append({"name": name, "secret": {"secretName": secret, "defaultMode": 0o400}})
    return mounts, volumes


def token_secret(config: K8sConfig, token: str) -> Manifest:
    """The job token's Secret: every call to an agent carries this token."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": object_meta(config, f"{config.job}-agent-token", "agent"),
        "type": "Opaque",
        "stringData": {"token": token},
    }
