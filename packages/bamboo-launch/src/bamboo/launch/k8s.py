"""Kubernetes manifests for a Bamboo job on spot node pools (EKS or GKE), and their validation.

:func:`render_manifests` turns a :class:`K8sConfig` into plain dicts, one per object:

- **ServiceAccount** ``<job>-agent``, with a **ClusterRole** and **ClusterRoleBinding** that allow
  exactly ``get`` on ``nodes``. That is all the agent asks of the API server: it reads its node's
  ``topology.kubernetes.io/zone`` label (the downward API cannot expose node labels), for
  zone-aware placement. Nodes are cluster-scoped, so a namespaced Role cannot grant it. Everything
  else (membership, roles, failure reports) goes through etcd, so there is no namespaced Role.
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
- **Service** ``<job>-agent`` (headless): DNS for the agents' gRPC port.
- Unless ``etcd_endpoints`` are given, an **etcd StatefulSet** ``<job>-etcd`` (1 or 3 members, persistent
  volumes, preferring on-demand nodes, since etcd is the part that must not be preempted) with a
  headless peer **Service** ``<job>-etcd-peer`` and a client **Service** ``<job>-etcd``.
- A **PodDisruptionBudget** for etcd, so a voluntary drain never takes its quorum.

Spot pools: ``cloud="eks"`` requires ``eks.amazonaws.com/capacityType=SPOT`` (managed node
groups); ``cloud="gke"`` requires ``cloud.google.com/gke-spot=true`` and tolerates the
``cloud.google.com/gke-spot`` taint; ``cloud="none"`` adds no spot constraint. GPU nodes: the
``nvidia.com/gpu`` taint is tolerated and the GPU is requested when ``gpus_per_node > 0``.

The agent's command line is ``bamboo-launch agent`` with the arguments documented in
:data:`AGENT_ARGS_DOC`; the agent itself is built by a later issue, these are the arguments the
manifests pass it.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

import attrs

__all__ = [
    "AGENT_ARGS_DOC",
    "CLOUDS",
    "ZONE_SPREADS",
    "K8sConfig",
    "ManifestValidationError",
    "dump_yaml",
    "render_manifests",
    "validate_manifests",
]

CLOUDS = ("eks", "gke", "none")
ZONE_SPREADS = ("best-effort", "strict")

AGENT_ARGS_DOC = """\
bamboo-launch agent (the arguments these manifests pass; the agent is built by a later issue; the
names follow the membership agent, python -m bamboo.membership, which it wraps):
  --job NAME            the job's name: etcd keys live under /bamboo/NAME/
  --etcd HOST:PORT      an etcd client endpoint (repeated for several)
  --node ID             this agent's unique id (the pod name)
  --host IP             the address the gRPC service binds to and peers reach (the pod IP)
  --port PORT           the agent's gRPC port
  --k8s-node NAME       the Kubernetes node; the agent reads its topology.kubernetes.io/zone label
  --notice-window S     seconds from SIGTERM (a preemption notice) to the kill
  --stages P            pipeline depth
  --pipelines D         data-parallel pipelines wanted
  --checkpoint-dir DIR  where asynchronous checkpoints go (a shared volume)
  --etcd-ca/--etcd-cert/--etcd-key FILE   TLS to etcd, from --etcd-tls-secret (if given)
  --etcd-user/--etcd-password             etcd auth, from --etcd-auth-secret (if given)
  -- SCRIPT ARGS        the training script, if not the built-in example
"""

_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_QUANTITY = re.compile(r"^[0-9]+(\.[0-9]+)?(m|k|Ki|Mi|Gi|Ti|M|G|T)?$")
_ENDPOINT = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9.]*[A-Za-z0-9])?:[0-9]{1,5}$")
ETCD_TLS_MOUNT = "/etc/bamboo/etcd-tls"


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


def _positive(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{attribute.name} must be an integer >= 1, got {value!r}")


def _non_negative(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"{attribute.name} must be an integer >= 0, got {value!r}")


def _port(instance: object, attribute: attrs.Attribute, value: int) -> None:
    if not isinstance(value, int) or not 1 <= value <= 65535:
        raise ValueError(f"{attribute.name} must be a port in 1..65535, got {value!r}")


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
    nodes: int = attrs.field(default=8, validator=_positive)
    stages: int = attrs.field(default=4, validator=_positive)
    pipelines: int = attrs.field(default=2, validator=_positive)
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
    gpus_per_node: int = attrs.field(default=1, validator=_non_negative)
    grpc_port: int = attrs.field(default=50051, validator=_port)
    grace_period_s: int = attrs.field(default=15, validator=_positive)
    checkpoint_dir: str = attrs.field(default="/checkpoints", validator=attrs.validators.min_len(1))
    checkpoint_claim: str | None = attrs.field(default=None, validator=_optional_dns_label)
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


def _agent_args(config: K8sConfig) -> list[str]:
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
        "--notice-window",
        str(config.grace_period_s),
        "--stages",
        str(config.stages),
        "--pipelines",
        str(config.pipelines),
        "--checkpoint-dir",
        config.checkpoint_dir,
    ]
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
    volume_mounts = [{"name": "dshm", "mountPath": "/dev/shm"}]
    volumes: list[dict[str, Any]] = [{"name": "dshm", "emptyDir": {"medium": "Memory"}}]
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
    env = [
        _field_env("POD_NAME", "metadata.name"),
        _field_env("POD_IP", "status.podIP"),
        _field_env("NODE_NAME", "spec.nodeName"),
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
    return [service_account, cluster_role, binding, service, deployment]


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
    return [peer_service, client_service, statefulset, budget]


def render_manifests(config: K8sConfig) -> list[dict[str, Any]]:
    """Every object the job needs, in apply order (RBAC, then etcd, then the agents)."""
    agents = _agent_objects(config)
    etcd = [] if config.etcd_endpoints else _etcd_objects(config)
    return agents[:3] + etcd + agents[3:]


def dump_yaml(manifests: Sequence[dict[str, Any]]) -> str:
    """The manifests as one multi-document YAML text, keys in insertion order, no anchors."""
    import yaml

    class PlainDumper(yaml.SafeDumper):
        def ignore_aliases(self, data: Any) -> bool:
            return True

    return yaml.dump_all(list(manifests), Dumper=PlainDumper, sort_keys=False)


class ManifestValidationError(ValueError):
    """A manifest does not match the Kubernetes schema; the message names the object and field."""


def validate_manifests(manifests: Sequence[dict[str, Any]], kubernetes_version: str = "1.30") -> None:
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
