"""``bamboo-launch k8s render`` and ``bamboo-launch k8s validate``: a job's Kubernetes manifests, and checking them.

Each flag of ``render`` defaults to :class:`bamboo.launch.k8s.K8sConfig`'s field; the manifests are validated
against the Kubernetes schemas before they are written.
"""

from __future__ import annotations

import argparse
import re
import sys
from pathlib import Path

import attrs
from bamboo.bench.argtypes import zones
from bamboo.launch.cli.common import endpoints, error_line, fail
from bamboo.launch.k8s import (
    AGENT_ARGS_DOC,
    CLOUDS,
    KUBERNETES_VERSION,
    ZONE_SPREADS,
    K8sConfig,
    Manifest,
    dump_yaml,
    render_manifests,
    validate_manifests,
)

__all__ = ["add_parser", "render", "validate"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``k8s render`` and ``k8s validate``."""
    defaults = K8sConfig()
    k8s = subparsers.add_parser("k8s", help="Kubernetes manifests for EKS or GKE spot node pools")
    k8s_commands = k8s.add_subparsers(dest="k8s_command", required=True, metavar="{render,validate}")
    command = k8s_commands.add_parser(
        "render",
        help="write the manifests of a job (agents, etcd, RBAC, the job token, network policies)",
        usage="bamboo-launch k8s render [options] [-- SCRIPT ARGS...]",
        description=(
            "Write the Kubernetes objects of a Bamboo job: one agent per node spread across zones, an etcd "
            "StatefulSet (or --etcd URL of an external one), the minimum RBAC, spot-pool scheduling, the job "
            "token's Secret (or --agent-token-secret / --agent-tls-secret) and NetworkPolicies that admit only "
            "the job's agents. etcd's resources, quota and volume and the agents' lease TTL are sized for --nodes "
            "(docs/failure-model.md, 'At scale'). The manifests are validated against the Kubernetes schemas before "
            "they are written. Anything after -- is the training script the agents run, a path inside the image "
            "(default: the built-in example)."
        ),
        epilog=AGENT_ARGS_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_cluster_flags(command, defaults)
    _add_etcd_flags(command, defaults)
    _add_resource_flags(command, defaults)
    _add_security_and_output_flags(command, defaults)
    command.set_defaults(handler=render, script=[])

    checker = k8s_commands.add_parser(
        "validate",
        help="validate YAML manifests against the Kubernetes schemas",
        description="Validate every object in the given YAML files against the Kubernetes JSON schemas (strict).",
    )
    checker.add_argument("files", nargs="+", help="YAML files, several documents each allowed")
    checker.add_argument(
        "--kubernetes-version", default=KUBERNETES_VERSION, help="schema version (default: %(default)s)"
    )
    checker.set_defaults(handler=validate)


def _add_cluster_flags(command: argparse.ArgumentParser, defaults: K8sConfig) -> None:
    """The job and its cluster: name, image, shape, cloud and zones."""
    command.add_argument(
        "--job", default=defaults.job, help="job name: object names and etcd prefix (default: %(default)s)"
    )
    command.add_argument(
        "--namespace", default=defaults.namespace, help="namespace of the objects (default: %(default)s)"
    )
    command.add_argument(
        "--image",
        default=defaults.image,
        help="container image with bamboo-launch installed (default: %(default)s)",
    )
    command.add_argument(
        "--nodes", type=int, default=defaults.nodes, help="agents to run, one per node (default: %(default)s)"
    )
    command.add_argument(
        "--stages", type=int, default=defaults.stages, help="pipeline depth P (default: %(default)s)"
    )
    command.add_argument(
        "--pipelines",
        type=int,
        default=defaults.pipelines,
        help="data-parallel pipelines D (default: %(default)s)",
    )
    command.add_argument(
        "--steps", type=int, default=defaults.steps, help="training steps of the job (default: %(default)s)"
    )
    command.add_argument(
        "--cloud",
        choices=CLOUDS,
        default=defaults.cloud,
        help="spot pool to target: eks (capacityType=SPOT), gke (gke-spot=true), none (default: %(default)s)",
    )
    command.add_argument(
        "--zones",
        type=zones,
        default=(),
        help="restrict agents to these zones, e.g. us-east-1a,us-east-1b (default: any)",
    )
    command.add_argument(
        "--zone-spread",
        choices=ZONE_SPREADS,
        default=defaults.zone_spread,
        help="best-effort: spread over zones but run anyway when a zone has no capacity; strict: never skew by more "
        "than one (default: %(default)s)",
    )


def _add_etcd_flags(command: argparse.ArgumentParser, defaults: K8sConfig) -> None:
    """An external etcd, or the one to deploy."""
    command.add_argument(
        "--etcd",
        dest="etcd_endpoints",
        type=endpoints,
        default=(),
        help="use this external etcd, host:port[,host:port...], instead of deploying one",
    )
    command.add_argument(
        "--etcd-tls-secret",
        default=None,
        help="external etcd only: a Secret with ca.crt, tls.crt and tls.key for TLS to etcd (default: no TLS)",
    )
    command.add_argument(
        "--etcd-auth-secret",
        default=None,
        help="external etcd only: a Secret with username and password keys for etcd auth (default: none)",
    )
    command.add_argument(
        "--etcd-replicas",
        type=int,
        default=defaults.etcd_replicas,
        help="etcd members to deploy: 1, 3 or 5 (default: %(default)s)",
    )
    command.add_argument("--etcd-image", default=defaults.etcd_image, help="etcd image (default: %(default)s)")
    command.add_argument(
        "--etcd-storage",
        default=defaults.etcd_storage,
        help="etcd volume size per member (default: twice etcd's quota, sized for --nodes: 2Gi up to 2000 nodes)",
    )


def _add_resource_flags(command: argparse.ArgumentParser, defaults: K8sConfig) -> None:
    """What each agent's pod asks for."""
    command.add_argument("--cpu", default=defaults.cpu, help="CPU request per agent (default: %(default)s)")
    command.add_argument(
        "--memory", default=defaults.memory, help="memory request and limit per agent (default: %(default)s)"
    )
    command.add_argument(
        "--gpus-per-node",
        type=int,
        default=defaults.gpus_per_node,
        help="nvidia.com/gpu per agent, 0 for CPU (default: %(default)s)",
    )
    command.add_argument(
        "--grpc-port", type=int, default=defaults.grpc_port, help="agent gRPC port (default: %(default)s)"
    )
    command.add_argument(
        "--grace-period",
        dest="grace_period_s",
        type=int,
        default=defaults.grace_period_s,
        help="seconds from SIGTERM (a preemption notice) to the kill; GKE spot gives non-system pods 15 s, "
        "EKS a 2-minute notice through its node drain (default: %(default)s)",
    )


def _add_security_and_output_flags(command: argparse.ArgumentParser, defaults: K8sConfig) -> None:
    """Checkpoints, who may call an agent, validation and the output."""
    command.add_argument(
        "--checkpoint-dir",
        default=defaults.checkpoint_dir,
        help="where --checkpoint-claim is mounted and the agents write checkpoints; without a claim the job "
        "writes none, since a pod's own disk cannot serve a restore (default: %(default)s)",
    )
    command.add_argument(
        "--checkpoint-claim",
        default=None,
        help="a ReadWriteMany PersistentVolumeClaim to mount at --checkpoint-dir for checkpoints (default: none, "
        "no checkpoints)",
    )
    auth = command.add_mutually_exclusive_group()
    auth.add_argument(
        "--agent-token-secret",
        default=None,
        metavar="NAME",
        help="an existing Secret whose key 'token' is the job token that calls to an agent must carry "
        "(default: render JOB-agent-token with a fresh random token; the output then contains a secret)",
    )
    auth.add_argument(
        "--agent-tls-secret",
        default=None,
        metavar="NAME",
        help="a Secret with ca.crt, tls.crt and tls.key: the agents authenticate each other with mutual TLS "
        "instead of a job token (default: a job token)",
    )
    command.add_argument(
        "--kubernetes-version",
        default=KUBERNETES_VERSION,
        help="schema version to validate against (default: %(default)s)",
    )
    command.add_argument("--no-validate", action="store_true", help="skip the schema validation")
    command.add_argument(
        "-o",
        "--out",
        default="-",
        help="output: a YAML file, a directory (one file per object) or - for stdout (default: -)",
    )


_FLAG_OF_FIELD = {"etcd_endpoints": "--etcd", "grace_period_s": "--grace-period"}


def _flag_names(message: str) -> str:
    """Say ``--etcd-replicas`` where the config's validation says ``etcd_replicas``."""
    for field in sorted((f.name for f in attrs.fields(K8sConfig)), key=len, reverse=True):
        flag = _FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))
        message = re.sub(rf"(?<![\w-])'?{field}'?(?![\w-])", flag, message)
    return message


def render(args: argparse.Namespace) -> int:
    """``k8s render``: write the manifests (validated first, unless ``--no-validate``)."""
    try:
        config = K8sConfig(
            job=args.job,
            namespace=args.namespace,
            image=args.image,
            nodes=args.nodes,
            stages=args.stages,
            pipelines=args.pipelines,
            steps=args.steps,
            cloud=args.cloud,
            zones=args.zones,
            zone_spread=args.zone_spread,
            etcd_endpoints=args.etcd_endpoints,
            etcd_tls_secret=args.etcd_tls_secret,
            etcd_auth_secret=args.etcd_auth_secret,
            etcd_replicas=args.etcd_replicas,
            etcd_image=args.etcd_image,
            etcd_storage=args.etcd_storage,
            cpu=args.cpu,
            memory=args.memory,
            gpus_per_node=args.gpus_per_node,
            grpc_port=args.grpc_port,
            grace_period_s=args.grace_period_s,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_claim=args.checkpoint_claim,
            agent_token_secret=args.agent_token_secret,
            agent_tls_secret=args.agent_tls_secret,
            script=tuple(args.script),
        )
    except (ValueError, TypeError) as error:
        fail(_flag_names(error_line(error)))
    manifests = render_manifests(config)
    if not args.no_validate:
        validate_manifests(manifests, args.kubernetes_version)

    def text(objects: list[Manifest]) -> str:
        secrets = [m["metadata"]["name"] for m in objects if m["kind"] == "Secret"]
        warning = "".join(
            f"# Secret {name} holds the job token that every call to an agent must carry: keep this file "
            "private (or render with --agent-token-secret NAME of a Secret you manage).\n"
            for name in secrets
        )
        return warning + dump_yaml(objects)

    def write(path: Path, objects: list[Manifest]) -> None:
        private = any(m["kind"] == "Secret" for m in objects)
        if private:  # created private, before the secret is written
            path.touch(mode=0o600, exist_ok=True)
            path.chmod(0o600)
        path.write_text(text(objects), encoding="utf-8")

    if args.out == "-":
        sys.stdout.write(text(manifests))
        return 0
    out = Path(args.out)
    if out.is_dir() or args.out.endswith("/"):
        out.mkdir(parents=True, exist_ok=True)
        for index, manifest in enumerate(manifests):
            name = f"{index:02d}-{manifest['kind'].lower()}-{manifest['metadata']['name']}.yaml"
            write(out / name, [manifest])
    else:
        write(out, manifests)
    secret_note = "".join(
        f"; Secret {m['metadata']['name']} holds the job token: keep the output private"
        for m in manifests
        if m["kind"] == "Secret"
    )
    print(f"wrote {len(manifests)} objects to {out}{secret_note}", file=sys.stderr)
    return 0


def validate(args: argparse.Namespace) -> int:
    """``k8s validate``: check YAML files against the Kubernetes schemas."""
    import yaml

    total = 0
    for name in args.files:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except OSError as error:
            fail(f"cannot read {name}: {error.strerror or error}")
        try:
            documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
        except yaml.YAMLError as error:
            fail(f"{name}: not valid YAML: {str(error).splitlines()[0]}")
        try:
            validate_manifests(documents, args.kubernetes_version)
        except ValueError as error:
            fail(f"{name}: {error}")
        total += len(documents)
    print(f"{total} objects in {len(args.files)} file(s) are valid Kubernetes {args.kubernetes_version}")
    return 0
