"""Kubernetes manifests for a Bamboo job on spot node pools (EKS or GKE), and their validation.

:func:`render_manifests` turns a :class:`K8sConfig` into plain dicts, one per object:

- **ServiceAccount** ``<job>-agent``, with a **ClusterRole** and **ClusterRoleBinding** that allow
  exactly ``get`` on ``nodes``. That is all the agent asks of the API server: it reads its node's
  ``topology.kubernetes.io/zone`` label (the downward API cannot expose node labels), for
  zone-aware placement. Nodes are cluster-scoped, so a namespaced Role cannot grant it. Everything
  else (membership, roles, failure reports) goes through etcd, so there is no namespaced Role.
- **Secret** ``<job>-agent-token`` (key ``token``, a fresh ``secrets.token_hex(32)``): the job token
  that every call to an agent must carry. Not rendered when ``agent_token_secret`` names an existing
  Secret, nor with ``agent_tls_secret`` (mutual TLS instead). The rendered text then holds a secret.
- Unless ``etcd_endpoints`` are given, an **etcd StatefulSet** ``<job>-etcd`` (1, 3 or 5 members,
  persistent volumes, preferring on-demand nodes, since etcd is the part that must not be preempted)
  with a headless peer **Service** ``<job>-etcd-peer``, a client **Service** ``<job>-etcd``, a
  **PodDisruptionBudget** (a voluntary drain never takes its quorum) and a **NetworkPolicy**
  ``<job>-etcd`` that admits only the job's agents (client port) and the other members (both ports):
  the etcd rendered here has no TLS or auth, so the network is what keeps other pods out.
- **NetworkPolicy** ``<job>-agent``: the agent pods accept connections only from the job's agent pods,
  on every port. Every port because the workers (which live in the agent pods) connect to each other
  for gloo collectives on ephemeral ports; the agent's gRPC port is among them. Connections from the
  pod's own node (the kubelet's probes) are always admitted by Kubernetes.
- **Service** ``<job>-agent`` (headless): DNS for the agents' gRPC port.
- **Deployment** ``<job>-agent``: one agent per machine (a required pod anti-affinity on
  ``kubernetes.io/hostname``), spread across zones by a ``topology.kubernetes.io/zone`` spread
  constraint with maxSkew 1. ``zone_spread="best-effort"`` (default) makes it
  ``ScheduleAnyway``: when one zone has no spot capacity, the agents still run in the others,
  since an idle request trains nothing; ``"strict"`` makes it ``DoNotSchedule``. Requests: CPU,
  memory and GPUs; limits: memory and GPUs (no CPU limit, so data loading is not throttled).
  A Deployment, not a StatefulSet:
  Bamboo's agents are interchangeable (their role comes from etcd, not from an ordinal), and a
  Deployment replaces a preempted pod at once on another node, while a StatefulSet waits until the
  lost pod is force-deleted.

Spot pools: ``cloud="eks"`` requires ``eks.amazonaws.com/capacityType=SPOT`` (managed node
groups); ``cloud="gke"`` requires ``cloud.google.com/gke-spot=true`` and tolerates the
``cloud.google.com/gke-spot`` taint; ``cloud="none"`` adds no spot constraint. GPU nodes: the
``nvidia.com/gpu`` taint is tolerated and the GPU is requested when ``gpus_per_node > 0``.

The agent container runs ``bamboo-launch agent`` (:mod:`bamboo.launch.agent`) with the flags listed in
:data:`AGENT_ARGS_DOC`; ``tests/test_manifests_run.py`` runs exactly those command lines as local
processes and checks that a short job trains exactly.
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Sequence
from typing import Any

import attrs
from bamboo.launch import timeouts

__all__ = [
    "AGENT_ARGS_DOC",
    "AGENT_TLS_MOUNT",
    "AGENT_TOKEN_MOUNT",
    "CLOUDS",
    "KUBERNETES_VERSION",
    "RUN_DIR",
    "ZONE_SPREADS",
    "K8sConfig",
    "ManifestValidationError",
    "agent_token_secret_name",
    "dump_yaml",
    "render_manifests",
    "validate_manifests",
]

CLOUDS = ("eks", "gke", "none")
KUBERNETES_VERSION = "1.30"
"""The Kubernetes version whose schemas the manifests are validated against (``--kubernetes-version``)."""
ZONE_SPREADS = ("best-effort", "strict")

ETCD_TLS_MOUNT = "/etc/bamboo/etcd-tls"
AGENT_TOKEN_MOUNT = "/etc/bamboo/agent-token"
"""Where the job token's Secret is mounted (read-only); the agent reads ``token`` there."""
AGENT_TLS_MOUNT = "/etc/bamboo/agent-tls"
"""Where ``agent_tls_secret`` is mounted (read-only): ``ca.crt``, ``tls.crt``, ``tls.key``."""
RUN_DIR = "/var/lib/bamboo"
"""The agent's run dir (an emptyDir): worker contexts, logs, ``out/rank<R>.pt``."""

AGENT_ARGS_DOC = """\
The agent container runs `bamboo-launch agent` (see `bamboo-launch agent --help`) with:
  --job NAME                 the job: its etcd keys live under /bamboo/NAME/
  --etcd HOST:PORT           an etcd client endpoint (one flag per endpoint)
  --node $(POD_NAME)         this agent's id: the pod's name (downward API)
  --host $(POD_IP)           the gRPC service binds the pod IP; peers probe it there
  --port PORT                the agent's gRPC port (--grpc-port)
  --k8s-node $(NODE_NAME)    the agent reads its node's topology.kubernetes.io/zone label (the RBAC)
  --run-dir /var/lib/bamboo  this machine's files, on an emptyDir
  --notice-window S          seconds from SIGTERM (a preemption notice) to the kill (--grace-period)
  --stages P --pipelines D --steps S   the job's spec: the first agent writes it to etcd, the others
                             check theirs against it
  --token-file /etc/bamboo/agent-token/token   the job token (Secret JOB-agent-token, rendered with a
                             fresh random token unless --agent-token-secret names yours), or, with
                             --agent-tls-secret, --tls-ca/--tls-cert/--tls-key under /etc/bamboo/agent-tls
  --checkpoint-dir DIR       with --checkpoint-claim only: checkpoints on the shared volume
  --etcd-ca/--etcd-cert/--etcd-key FILE   TLS to etcd, from --etcd-tls-secret (if given)
  --etcd-user/--etcd-password             etcd auth, from --etcd-auth-secret (if given)
  -- SCRIPT ARGS             the training script (a path inside the image), if not the built-in example
A NetworkPolicy admits only the job's agent pods to the agent pods (every port: the workers' gloo
traffic between pods uses ephemeral ports). Unless --agent-token-secret or --agent-tls-secret is
given, the output contains a Secret (the job token): keep it private.
"""

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?$")
_ENDPOINT = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?:[0-9]{1,5}$")


def _dns_label(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or len(value) > 40 or not _DNS_LABEL.match(value):
        raise ValueError(
            f"{attribute.name} must be a lowercase DNS label of at most 40 characters "
            f"(a-z, 0-9, '-'), got {value!r}"
        )


def _quantity(instance: object, attribute: attrs.Attribute, value: str) -> None:
    if not isinstance(value, str) or not _QUANTITY.match(value):
        raise ValueError(
            f"{attribute.name} must be a Kubernetes quantity like 4, 500m or 16Gi, got {value!r}"
        )


_V = attrs.validators
_WHOLE = _V.and_(_V.instance_of(int), _V.ge(1))
_PORT = _V.and_(_V.instance_of(int), _V.ge(1), _V.le(65535))


def _endpoints(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    for endpoint in value:
        if not _ENDPOINT.match(endpoint) or not 1 <= int(endpoint.rsplit(":", 1)[1]) <= 65535:
            raise ValueError(f"{attribute.name} must be host:port entries, got {endpoint!r}")


def _optional_dns_label(instance: object, attribute: attrs.Attribute, value: str | None) -> None:
    if value is not None:
        _dns_label(instance, attribute, value)


def _zones(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    for zone in value:
        if not zone or not re.match(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$", zone):
            raise ValueError(f"{attribute.name} has an invalid zone name {zone!r}")


@attrs.frozen
class K8sConfig:
    """Everything the manifests depend on; validated, with the defaults of ``k8s render``."""

    job: str = attrs.field(default="bamboo", validator=_dns_label)
    namespace: str = attrs.field(default="default", validator=_dns_label)
    image: str = attrs.field(default="bamboo-launch:0.1.0", validator=attrs.validators.min_len(1))
    nodes: int = attrs.field(default=8, validator=_WHOLE)
    stages: int = attrs.field(default=4, validator=_WHOLE)
    pipelines: int = attrs.field(default=2, validator=_WHOLE)
    steps: int = attrs.field(default=1000, validator=_WHOLE)
    cloud: str = attrs.field(default="eks", validator=attrs.validators.in_(CLOUDS))
    zones: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_zones)
    zone_spread: str = attrs.field(default="best-effort", validator=attrs.validators.in_(ZONE_SPREADS))
    etcd_endpoints: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_endpoints)
    etcd_tls_secret: str | None = attrs.field(default=None, validator=_optional_dns_label)
    etcd_auth_secret: str | None = attrs.field(default=None, validator=_optional_dns_label)
    etcd_replicas: int = attrs.field(default=3)
    etcd_image: str = attrs.field(
        default="quay.io/coreos/etcd:v3.5.17", validator=attrs.validators.min_len(1)
    )
    etcd_storage: str = attrs.field(default="2Gi", validator=_quantity)
    cpu: str = attrs.field(default="4", validator=_quantity)
    memory: str = attrs.field(default="16Gi", validator=_quantity)
    gpus_per_node: int = attrs.field(default=1, validator=_V.and_(_V.instance_of(int), _V.ge(0)))
    grpc_port: int = attrs.field(default=50051, validator=_PORT)
    grace_period_s: int = attrs.field(default=timeouts.K8S_GRACE_PERIOD_S, validator=_WHOLE)
    checkpoint_dir: str = attrs.field(default="/checkpoints", validator=attrs.validators.min_len(1))
    checkpoint_claim: str | None = attrs.field(default=None, validator=_optional_dns_label)
    agent_token_secret: str | None = attrs.field(default=None, validator=_optional_dns_label)
    """An existing Secret with the job token under key ``token``; None: render ``<job>-agent-token``."""
    agent_tls_secret: str | None = attrs.field(default=None, validator=_optional_dns_label)
    """A Secret with ``ca.crt``, ``tls.crt`` and ``tls.key``: mutual TLS between the agents instead of a token."""
    script: tuple[str, ...] = attrs.field(default=(), converter=tuple)

    @etcd_replicas.validator
    def _check_etcd_replicas(self, attribute: attrs.Attribute, value: int) -> None:
        if value not in (1, 3, 5):
            raise ValueError(f"etcd_replicas must be 1, 3 or 5 (an odd quorum), got {value!r}")

    def __attrs_post_init__(self) -> None:
        if not self.etcd_endpoints and (self.etcd_tls_secret or self.etcd_auth_secret):
            raise ValueError(
                "etcd_tls_secret and etcd_auth_secret are for an external etcd (etcd_endpoints); "
                "the etcd rendered here runs without TLS or auth inside the cluster network"
            )
        if self.agent_token_secret is not None and self.agent_tls_secret is not None:
            raise ValueError(
                f"agent_token_secret {self.agent_token_secret!r} and agent_tls_secret {self.agent_tls_secret!r} "
                "are alternatives: the agents authenticate each other with a job token or with mutual TLS"
            )
        if self.stages * self.pipelines > self.nodes:
            raise ValueError(
                f"nodes={self.nodes} cannot hold stages*pipelines={self.stages}*{self.pipelines}="
                f"{self.stages * self.pipelines}"
            )


def _labels(config: K8sConfig, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "bamboo",
        "app.kubernetes.io/instance": config.job,
        "app.kubernetes.io/component": component,
    }


def _meta(config: K8sConfig, name: str, component: str, namespaced: bool = True) -> dict[str, Any]:
    meta: dict[str, Any] = {"name": name}
    if namespaced:
        meta["namespace"] = config.namespace
    meta["labels"] = _labels(config, component)
    return meta


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


def _on_demand_preference(config: K8sConfig) -> list[dict[str, Any]]:
    """Preferred (not required) on-demand placement for etcd: it must outlive spot preemptions."""
    if config.cloud == "eks":
        term = {"key": "eks.amazonaws.com/capacityType", "operator": "In", "values": ["ON_DEMAND"]}
    elif config.cloud == "gke":
        term = {"key": "cloud.google.com/gke-spot", "operator": "DoesNotExist"}
    else:
        return []
    return [{"weight": 100, "preference": {"matchExpressions": [term]}}]


def etcd_endpoints(config: K8sConfig) -> tuple[str, ...]:
    """The etcd endpoints the agents use: the external ones, or the in-cluster client Service."""
    if config.etcd_endpoints:
        return config.etcd_endpoints
    return (f"{config.job}-etcd.{config.namespace}.svc:2379",)


def agent_token_secret_name(config: K8sConfig) -> str | None:
    """The Secret that holds the job token the agents use (None with mutual TLS instead)."""
    if config.agent_tls_secret is not None:
        return None
    return config.agent_token_secret or f"{config.job}-agent-token"


def _agent_args(config: K8sConfig) -> list[str]:
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


def _field_env(name: str, path: str) -> dict[str, Any]:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def _agent_objects(config: K8sConfig) -> list[dict[str, Any]]:
    name = f"{config.job}-agent"
    labels = _labels(config, "agent")
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
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_IP", "status.podIP"),
        _field_env("NODE_NAME", "spec.nodeName"),
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
                "args": _agent_args(config),
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
        "metadata": _meta(config, name, "agent"),
        "automountServiceAccountToken": True,
    }
    role_name = f"{config.namespace}-{config.job}-agent-node-reader"
    cluster_role = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRole",
        "metadata": _meta(config, role_name, "agent", namespaced=False),
        "rules": [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}],
    }
    binding = {
        "apiVersion": "rbac.authorization.k8s.io/v1",
        "kind": "ClusterRoleBinding",
        "metadata": _meta(config, role_name, "agent", namespaced=False),
        "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "ClusterRole", "name": role_name},
        "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": config.namespace}],
    }
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": _meta(config, name, "agent"),
        "spec": {
            "clusterIP": "None",
            "selector": labels,
            "ports": [{"name": "grpc", "port": config.grpc_port, "targetPort": "grpc", "protocol": "TCP"}],
        },
    }
    deployment = {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": _meta(config, name, "agent"),
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
        "metadata": _meta(config, name, "agent"),
        "spec": {
            "podSelector": {"matchLabels": labels},
            "policyTypes": ["Ingress"],
            "ingress": [{"from": [{"podSelector": {"matchLabels": labels}}]}],
        },
    }
    return [service_account, cluster_role, binding, network_policy, service, deployment]


def _token_secret(config: K8sConfig, token: str) -> dict[str, Any]:
    """The job token's Secret: every call to an agent carries this token."""
    return {
        "apiVersion": "v1",
        "kind": "Secret",
        "metadata": _meta(config, f"{config.job}-agent-token", "agent"),
        "type": "Opaque",
        "stringData": {"token": token},
    }


def _etcd_objects(config: K8sConfig) -> list[dict[str, Any]]:
    name = f"{config.job}-etcd"
    peer = f"{name}-peer"
    labels = _labels(config, "etcd")
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
        "metadata": _meta(config, peer, "etcd"),
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
        "metadata": _meta(config, name, "etcd"),
        "spec": {
            "selector": labels,
            "ports": [{"name": "client", "port": 2379, "targetPort": "client", "protocol": "TCP"}],
        },
    }
    statefulset = {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "metadata": _meta(config, name, "etcd"),
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
                            "env": [_field_env("POD_NAME", "metadata.name")],
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
        "metadata": _meta(config, name, "etcd"),
        "spec": {"maxUnavailable": 1 if config.etcd_replicas > 1 else 0, "selector": {"matchLabels": labels}},
    }
    agents = _labels(config, "agent")
    # The etcd rendered here has no TLS or auth: only the job's agents (client port) and the other
    # members (both ports) may reach it. Reach it from elsewhere with kubectl port-forward.
    network_policy = {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": _meta(config, name, "etcd"),
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


def render_manifests(config: K8sConfig, *, agent_token: str | None = None) -> list[dict[str, Any]]:
    """Every object the job needs, in apply order: RBAC, the token's Secret, etcd, then the agents (their
    NetworkPolicy before the pods, so that no agent is ever reachable from outside the job).

    The token's Secret is rendered only when the config names neither ``agent_token_secret`` nor
    ``agent_tls_secret``; it holds ``agent_token``, or a fresh ``secrets.token_hex(32)`` when None.
    """
    if agent_token is not None and (not agent_token.isprintable() or not agent_token.strip()
                                    or any(c.isspace() for c in agent_token)):
        raise ValueError("agent_token must be one printable word without spaces (the value given is not)")
    agents = _agent_objects(config)
    rendered_token = config.agent_token_secret is None and config.agent_tls_secret is None
    token = [_token_secret(config, agent_token or secrets.token_hex(32))] if rendered_token else []
    etcd = [] if config.etcd_endpoints else _etcd_objects(config)
    return agents[:3] + token + etcd + agents[3:]


def dump_yaml(manifests: Sequence[dict[str, Any]]) -> str:
    """The manifests as one multi-document YAML text, keys in insertion order, no anchors."""
    import yaml

    class PlainDumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(list(manifests), Dumper=PlainDumper, sort_keys=False)


class ManifestValidationError(ValueError):
    """A manifest does not match the Kubernetes schema; the message names the object and field."""


def validate_manifests(manifests: Sequence[dict[str, Any]], kubernetes_version: str = KUBERNETES_VERSION) -> None:
    """Validate each manifest against the Kubernetes JSON schemas (strict: unknown fields fail).

    Uses ``kubernetes-validate``, which ships the schemas (no network). Raises
    :class:`ManifestValidationError` for an unsupported ``kubernetes_version`` or for the first
    invalid object, naming it and the field.
    """
    try:
        import kubernetes_validate
        from kubernetes_validate.utils import all_versions
    except ImportError as error:  # pragma: no cover - an optional dependency
        raise ManifestValidationError(
            "validating manifests needs kubernetes-validate: pip install 'bamboo-launch[k8s]' "
            "(or skip validation with --no-validate)"
        ) from error
    supported = [tuple(int(part) for part in v.split(".")[:2]) for v in all_versions()]
    match = re.match(r"^v?(\d+)\.(\d+)(\.\d+)?$", kubernetes_version)
    if match is None or not supported[0] <= (int(match.group(1)), int(match.group(2))) <= supported[-1]:
        low, high = ".".join(map(str, supported[0])), ".".join(map(str, supported[-1]))
        raise ManifestValidationError(
            f"Kubernetes version must be MAJOR.MINOR between {low} and {high} (the schemas shipped), "
            f"got {kubernetes_version!r}"
        )
    for index, manifest in enumerate(manifests):
        if not isinstance(manifest, dict) or "kind" not in manifest or "apiVersion" not in manifest:
            raise ManifestValidationError(
                f"document {index + 1} is not a Kubernetes object (no kind/apiVersion)"
            )
        metadata = manifest.get("metadata")
        name = metadata.get("name", "?") if isinstance(metadata, dict) else "?"
        where = f"document {index + 1} ({manifest['kind']}/{name})"
        try:
            kubernetes_validate.validate(manifest, kubernetes_version, strict=True)
        except kubernetes_validate.ValidationError as error:
            path = ".".join(str(part) for part in error.path) or "<root>"
            raise ManifestValidationError(f"{where}: {path}: {error.message}") from None
        except kubernetes_validate.SchemaNotFoundError as error:
            raise ManifestValidationError(f"{where}: {error.message}") from None
