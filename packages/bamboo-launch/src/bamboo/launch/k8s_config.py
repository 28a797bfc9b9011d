"""What the Kubernetes manifests of a job depend on: :class:`K8sConfig` (validated, with the defaults of
``bamboo-launch k8s render``), the names and mount points they share, and the small helpers every object
uses (its labels and metadata, the etcd endpoints the agents use, the job token's Secret) and the shapes that
the agents' and etcd's objects share (a Service, an ingress NetworkPolicy, their ports, a pod template).
"""

from __future__ import annotations

import re
from typing import NotRequired, TypedDict

import attrs
from bamboo.launch import timeouts
from bamboo.launch.json_types import JSONObject
from bamboo.launch.k8s_sizing import Sizing, size_for

__all__ = [
    "AGENT_ARGS_DOC",
    "AGENT_TLS_MOUNT",
    "AGENT_TOKEN_MOUNT",
    "CLOUDS",
    "ETCD_CLIENT_PORT",
    "ETCD_PEER_PORT",
    "ETCD_TLS_MOUNT",
    "KUBERNETES_VERSION",
    "RUN_DIR",
    "ZONE_SPREADS",
    "K8sConfig",
    "Manifest",
    "ObjectMeta",
    "agent_token_secret_name",
    "container_port",
    "etcd_endpoints",
    "field_env",
    "ingress_policy",
    "object_labels",
    "object_meta",
    "pod_template",
    "pods",
    "service",
    "service_port",
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
ETCD_CLIENT_PORT = 2379
ETCD_PEER_PORT = 2380
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
  --ttl S                    (spec) the lease TTL, sized for --nodes: see docs/failure-model.md, "At scale"
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
    etcd_storage: str | None = attrs.field(default=None, validator=attrs.validators.optional(_quantity))
    """etcd's volume per member; None: sized for ``nodes`` (:func:`bamboo.launch.k8s_sizing.size_for`)."""
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
        size_for(self.nodes, in_cluster_etcd=not self.etcd_endpoints)  # a job too large for the rule: its error
        if self.stages * self.pipelines > self.nodes:
            raise ValueError(
                f"nodes={self.nodes} cannot hold stages*pipelines={self.stages}*{self.pipelines}="
                f"{self.stages * self.pipelines}"
            )


    @property
    def sizing(self) -> Sizing:
        """etcd's resources and the agents' lease TTL for ``nodes`` (:func:`bamboo.launch.k8s_sizing.size_for`)."""
        return size_for(self.nodes, in_cluster_etcd=not self.etcd_endpoints)


def object_labels(config: K8sConfig, component: str) -> dict[str, str]:
    return {
        "app.kubernetes.io/name": "bamboo",
        "app.kubernetes.io/instance": config.job,
        "app.kubernetes.io/component": component,
    }


class ObjectMeta(TypedDict):
    """An object's ``metadata``: its name, its namespace (none for a cluster-scoped object) and its labels."""

    name: str
    namespace: NotRequired[str]
    labels: dict[str, str]


class Manifest(TypedDict):
    """A Kubernetes object as rendered: its API version, kind and metadata, and the fields of its kind."""

    apiVersion: str
    kind: str
    metadata: ObjectMeta
    spec: NotRequired[JSONObject]
    rules: NotRequired[list[JSONObject]]
    roleRef: NotRequired[JSONObject]
    subjects: NotRequired[list[JSONObject]]
    automountServiceAccountToken: NotRequired[bool]
    type: NotRequired[str]
    stringData: NotRequired[dict[str, str]]


def object_meta(config: K8sConfig, name: str, component: str, namespaced: bool = True) -> ObjectMeta:
    if namespaced:
        return {"name": name, "namespace": config.namespace, "labels": object_labels(config, component)}
    return {"name": name, "labels": object_labels(config, component)}


def etcd_endpoints(config: K8sConfig) -> tuple[str, ...]:
    """The etcd endpoints the agents use: the external ones, or the in-cluster client Service."""
    if config.etcd_endpoints:
        return config.etcd_endpoints
    return (f"{config.job}-etcd.{config.namespace}.svc:{ETCD_CLIENT_PORT}",)


def agent_token_secret_name(config: K8sConfig) -> str | None:
    """The Secret that holds the job token the agents use (None with mutual TLS instead)."""
    if config.agent_tls_secret is not None:
        return None
    return config.agent_token_secret or f"{config.job}-agent-token"


def field_env(name: str, path: str) -> JSONObject:
    return {"name": name, "valueFrom": {"fieldRef": {"fieldPath": path}}}


def container_port(name: str, port: int) -> JSONObject:
    """A container's named TCP port."""
    return {"name": name, "containerPort": port, "protocol": "TCP"}


def service_port(name: str, port: int) -> JSONObject:
    """A Service's TCP port, forwarded to the pods' port of the same name."""
    return {"name": name, "port": port, "targetPort": name, "protocol": "TCP"}


def service(
    config: K8sConfig, name: str, component: str, ports: list[JSONObject], *, headless: bool = False,
    publish_not_ready: bool = False,
) -> Manifest:
    """A Service over the pods of ``component``: headless (DNS per pod, no virtual IP) or not, and with
    ``publish_not_ready`` also naming pods that are not ready yet (etcd's members find each other so)."""
    spec: JSONObject = {}
    if headless:
        spec["clusterIP"] = "None"
    if publish_not_ready:
        spec["publishNotReadyAddresses"] = True
    spec["selector"] = object_labels(config, component)
    spec["ports"] = ports
    return {"apiVersion": "v1", "kind": "Service", "metadata": object_meta(config, name, component), "spec": spec}


def pods(labels: dict[str, str]) -> JSONObject:
    """A NetworkPolicy peer: the pods with ``labels``."""
    return {"podSelector": {"matchLabels": labels}}


def ingress_policy(config: K8sConfig, name: str, component: str, ingress: list[JSONObject]) -> Manifest:
    """A NetworkPolicy that admits to the pods of ``component`` only the connections ``ingress`` lists."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": object_meta(config, name, component),
        "spec": {
            **pods(object_labels(config, component)),
            "policyTypes": ["Ingress"],
            "ingress": ingress,
        },
    }


def pod_template(labels: dict[str, str], spec: JSONObject) -> JSONObject:
    """A workload's pod template: its pods' labels and spec."""
    return {"metadata": {"labels": labels}, "spec": spec}
