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

from bamboo.launch.k8s_agents import agent_objects, token_secret
from bamboo.launch.k8s_config import (
    AGENT_ARGS_DOC,
    AGENT_TLS_MOUNT,
    AGENT_TOKEN_MOUNT,
    CLOUDS,
    KUBERNETES_VERSION,
    RUN_DIR,
    ZONE_SPREADS,
    K8sConfig,
    Manifest,
    agent_token_secret_name,
)
from bamboo.launch.k8s_etcd import etcd_objects

__all__ = [
    "AGENT_ARGS_DOC",
    "AGENT_TLS_MOUNT",
    "AGENT_TOKEN_MOUNT",
    "CLOUDS",
    "KUBERNETES_VERSION",
    "RUN_DIR",
    "ZONE_SPREADS",
    "K8sConfig",
    "Manifest",
    "ManifestValidationError",
    "agent_token_secret_name",
    "dump_yaml",
    "render_manifests",
    "validate_manifests",
]


def render_manifests(config: K8sConfig, *, agent_token: str | None = None) -> list[Manifest]:
    """Every object the job needs, in apply order: RBAC, the token's Secret, etcd, then the agents (their
    NetworkPolicy before the pods, so that no agent is ever reachable from outside the job).

    The token's Secret is rendered only when the config names neither ``agent_token_secret`` nor
    ``agent_tls_secret``; it holds ``agent_token``, or a fresh ``secrets.token_hex(32)`` when None.
    """
    if agent_token is not None and (not agent_token.isprintable() or not agent_token.strip()
                                    or any(c.isspace() for c in agent_token)):
        raise ValueError("agent_token must be one printable word without spaces (the value given is not)")
    agents = agent_objects(config)
    rendered_token = config.agent_token_secret is None and config.agent_tls_secret is None
    token = [token_secret(config, agent_token or secrets.token_hex(32))] if rendered_token else []
    etcd = [] if config.etcd_endpoints else etcd_objects(config)
    return agents[:3] + token + etcd + agents[3:]


def dump_yaml(manifests: Sequence[Manifest]) -> str:
    """The manifests as one multi-document YAML text, keys in insertion order, no anchors."""
    import yaml

    class PlainDumper(yaml.SafeDumper):
        def ignore_aliases(self, data: object) -> bool:
            return True

    return yaml.dump_all(list(manifests), Dumper=PlainDumper, sort_keys=False)


class ManifestValidationError(ValueError):
    """A manifest does not match the Kubernetes schema; the message names the object and field."""


def validate_manifests(manifests: Sequence[object], kubernetes_version: str = KUBERNETES_VERSION) -> None:
    """Validate each manifest (a document as YAML or JSON gives it, which must be an object) against the
    Kubernetes JSON schemas (strict: unknown fields fail).

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
