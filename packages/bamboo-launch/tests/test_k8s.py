"""Tests of the Kubernetes manifests: schema-valid for every cloud, and the right scheduling."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from bamboo.launch.cli import main
from bamboo.launch.k8s import (
    AGENT_TLS_MOUNT,
    AGENT_TOKEN_MOUNT,
    RUN_DIR,
    K8sConfig,
    ManifestValidationError,
    render_manifests,
    validate_manifests,
)

CONFIGS = {
    "eks-embedded-etcd": K8sConfig(cloud="eks", zones=("us-east-1a", "us-east-1b", "us-east-1c")),
    "gke-single-etcd-cpu": K8sConfig(cloud="gke", etcd_replicas=1, gpus_per_node=0, zone_spread="strict"),
    "none-external-etcd": K8sConfig(
        cloud="none",
        etcd_endpoints=("etcd-0.example:2379", "etcd-1.example:2379"),
        etcd_tls_secret="etcd-client-tls",
        etcd_auth_secret="etcd-auth",
        checkpoint_claim="ckpt",
        script=("train.py", "--lr", "0.1"),
    ),
    "gke-agent-mtls": K8sConfig(cloud="gke", agent_tls_secret="agent-mtls", steps=50),
    "eks-own-token-secret": K8sConfig(cloud="eks", agent_token_secret="my-token", etcd_replicas=5),
}


def by_kind(manifests: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    kinds: dict[str, list[dict[str, Any]]] = {}
    for manifest in manifests:
        kinds.setdefault(manifest["kind"], []).append(manifest)
    return kinds


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_every_rendered_manifest_is_schema_valid(name: str) -> None:
    manifests = render_manifests(CONFIGS[name])
    validate_manifests(manifests, "1.30")
    # Round-trip through YAML, as kubectl would read it.
    validate_manifests(list(yaml.safe_load_all(yaml.safe_dump_all(manifests))), "1.33")


def broken_unknown_field(manifests: list[dict[str, Any]]) -> str:
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["imagePullPolicyy"] = "Always"
    return "imagePullPolicyy"


def broken_wrong_type(manifests: list[dict[str, Any]]) -> str:
    deployment = next(m for m in manifests if m["kind"] == "Deployment")
    deployment["spec"]["replicas"] = "eight"
    return "spec.replicas"


def broken_missing_required(manifests: list[dict[str, Any]]) -> str:
    statefulset = next(m for m in manifests if m["kind"] == "StatefulSet")
    del statefulset["spec"]["selector"]
    return "selector"


def broken_bad_enum(manifests: list[dict[str, Any]]) -> str:
    service = next(m for m in manifests if m["kind"] == "Service")
    service["spec"]["ports"][0]["port"] = "grpc"
    return "port"


@pytest.mark.parametrize(
    "breaker", [broken_unknown_field, broken_wrong_type, broken_missing_required, broken_bad_enum]
)
def test_a_broken_manifest_fails_validation(breaker) -> None:
    manifests = copy.deepcopy(render_manifests(K8sConfig()))
    expected = breaker(manifests)
    with pytest.raises(ManifestValidationError, match=expected):
        validate_manifests(manifests)


@pytest.mark.parametrize("version", ["abc", "1.10", "9.99", "1"])
def test_unsupported_kubernetes_version_is_named(version: str) -> None:
    with pytest.raises(ManifestValidationError, match=f"between 1.25 and .* got '{version}'"):
        validate_manifests(render_manifests(K8sConfig()), version)


def test_unknown_kind_fails() -> None:
    with pytest.raises(ManifestValidationError, match="Couldn't find schema"):
        validate_manifests([{"apiVersion": "v1", "kind": "Teapot", "metadata": {"name": "t"}}])
    with pytest.raises(ManifestValidationError, match="document 1 is not a Kubernetes object"):
        validate_manifests([{"name": "x"}])


def test_agents_spread_one_per_node_on_spot_pools() -> None:
    config = CONFIGS["eks-embedded-etcd"]
    kinds = by_kind(render_manifests(config))
    deployment = kinds["Deployment"][0]
    pod = deployment["spec"]["template"]["spec"]
    assert deployment["spec"]["replicas"] == 8
    (spread,) = pod["topologySpreadConstraints"]
    assert spread["topologyKey"] == "topology.kubernetes.io/zone" and spread["maxSkew"] == 1
    assert spread["whenUnsatisfiable"] == "ScheduleAnyway"
    anti = pod["affinity"]["podAntiAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][0]
    assert anti["topologyKey"] == "kubernetes.io/hostname"
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    expressions = {e["key"]: e["values"] for e in terms[0]["matchExpressions"]}
    assert expressions == {
        "eks.amazonaws.com/capacityType": ["SPOT"],
        "topology.kubernetes.io/zone": ["us-east-1a", "us-east-1b", "us-east-1c"],
    }
    container = pod["containers"][0]
    assert container["resources"]["requests"]["nvidia.com/gpu"] == "1"
    assert container["resources"]["limits"] == {"memory": "16Gi", "nvidia.com/gpu": "1"}
    assert container["command"] == ["bamboo-launch"] and container["args"][0] == "agent"
    args = container["args"]
    assert args[args.index("--etcd") + 1] == "bamboo-etcd.default.svc:2379"
    assert args[args.index("--node") + 1] == "$(POD_NAME)" and args[args.index("--port") + 1] == "50051"
    assert args[args.index("--notice-window") + 1] == str(pod["terminationGracePeriodSeconds"]) == "15"
    assert args[args.index("--stages") + 1] == "4" and args[args.index("--pipelines") + 1] == "2"
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in pod["tolerations"]
    # etcd: 3 members, preferring on-demand nodes and different zones.
    statefulset = kinds["StatefulSet"][0]
    assert statefulset["spec"]["replicas"] == 3
    etcd_pod = statefulset["spec"]["template"]["spec"]
    preferred = etcd_pod["affinity"]["nodeAffinity"]["preferredDuringSchedulingIgnoredDuringExecution"][0]
    assert preferred["preference"]["matchExpressions"][0]["values"] == ["ON_DEMAND"]
    script = etcd_pod["containers"][0]["command"][2]
    assert "bamboo-etcd-2=http://bamboo-etcd-2.bamboo-etcd-peer.default.svc:2380" in script


def test_gke_spot_toleration_and_strict_spread() -> None:
    pod = by_kind(render_manifests(CONFIGS["gke-single-etcd-cpu"]))["Deployment"][0]["spec"]["template"][
        "spec"
    ]
    assert pod["tolerations"] == [
        {"key": "cloud.google.com/gke-spot", "operator": "Equal", "value": "true", "effect": "NoSchedule"}
    ]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"
    ]
    assert terms[0]["matchExpressions"] == [
        {"key": "cloud.google.com/gke-spot", "operator": "In", "values": ["true"]}
    ]
    assert pod["topologySpreadConstraints"][0]["whenUnsatisfiable"] == "DoNotSchedule"
    assert "nvidia.com/gpu" not in pod["containers"][0]["resources"]["requests"]


def test_minimum_rbac_is_get_nodes_only() -> None:
    kinds = by_kind(render_manifests(K8sConfig(namespace="ml", job="gpt")))
    (role,) = kinds["ClusterRole"]
    assert role["rules"] == [{"apiGroups": [""], "resources": ["nodes"], "verbs": ["get"]}]
    (binding,) = kinds["ClusterRoleBinding"]
    assert binding["subjects"] == [{"kind": "ServiceAccount", "name": "gpt-agent", "namespace": "ml"}]
    assert binding["roleRef"]["name"] == role["metadata"]["name"] == "ml-gpt-agent-node-reader"
    assert "Role" not in kinds and "RoleBinding" not in kinds
    etcd_pod = kinds["StatefulSet"][0]["spec"]["template"]["spec"]
    assert etcd_pod["automountServiceAccountToken"] is False


def test_external_etcd_deploys_none() -> None:
    config = CONFIGS["none-external-etcd"]
    kinds = by_kind(render_manifests(config))
    assert "StatefulSet" not in kinds and "PodDisruptionBudget" not in kinds
    assert [s["metadata"]["name"] for s in kinds["Service"]] == ["bamboo-agent"]
    pod = kinds["Deployment"][0]["spec"]["template"]["spec"]
    container = pod["containers"][0]
    args = container["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--etcd"] == [
        "etcd-0.example:2379",
        "etcd-1.example:2379",
    ]
    assert args[args.index("--etcd-ca") + 1] == "/etc/bamboo/etcd-tls/ca.crt"
    assert args[args.index("--etcd-password") + 1] == "$(ETCD_PASSWORD)"
    assert {
        "name": "ETCD_PASSWORD",
        "valueFrom": {"secretKeyRef": {"name": "etcd-auth", "key": "password"}},
    } in (container["env"])
    assert {"name": "etcd-tls", "secret": {"secretName": "etcd-client-tls", "defaultMode": 0o400}} in pod[
        "volumes"
    ]
    assert args[-4:] == ["--", "train.py", "--lr", "0.1"]
    assert "nodeAffinity" not in pod["affinity"]
    assert {"name": "checkpoints", "persistentVolumeClaim": {"claimName": "ckpt"}} in pod["volumes"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"job": "Bad_Name"}, "job must be a lowercase DNS label"),
        ({"nodes": 4, "stages": 4, "pipelines": 2}, "nodes=4 cannot hold stages\\*pipelines=4\\*2=8"),
        ({"etcd_replicas": 2}, "etcd_replicas must be 1, 3 or 5 .*got 2"),
        ({"memory": "lots"}, "memory must be a Kubernetes quantity.*'lots'"),
        (
            {"etcd_endpoints": ("http://etcd:2379",)},
            "etcd_endpoints must be host:port entries, got 'http://etcd:2379'",
        ),
        ({"etcd_endpoints": ("etcd:99999",)}, "etcd_endpoints must be host:port entries, got 'etcd:99999'"),
        ({"etcd_tls_secret": "tls"}, "are for an external etcd"),
        ({"cloud": "azure"}, "'cloud' must be in"),
    ],
)
def test_config_errors_name_the_value(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        K8sConfig(**kwargs)


def test_cli_render_to_directory_then_validate(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "manifests"
    assert (
        main(["k8s", "render", "--cloud", "gke", "--nodes", "12", "--zones", "a1,b1", "-o", f"{out}/"]) == 0
    )
    files = sorted(out.iterdir())
    assert len(files) == 12 and files[0].name == "00-serviceaccount-bamboo-agent.yaml"
    assert main(["k8s", "validate", *map(str, files)]) == 0
    assert "12 objects in 12 file(s) are valid" in capsys.readouterr().out
    # Only the Secret's file holds the token: it alone is private and says so.
    (secret_file,) = [f for f in files if "-secret-" in f.name]
    assert secret_file.name == "03-secret-bamboo-agent-token.yaml"
    assert secret_file.stat().st_mode & 0o777 == 0o600
    assert secret_file.read_text().startswith("# Secret bamboo-agent-token holds the job token")
    assert all(not f.read_text().startswith("#") for f in files if f != secret_file)
    deployment = yaml.safe_load(next(f for f in files if "deployment" in f.name).read_text())
    assert deployment["spec"]["replicas"] == 12


def test_cli_render_script_after_dashes(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["k8s", "render", "--etcd", "http://e:2379", "--", "my_train.py", "--epochs", "3"]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["args"][-4:] == [
        "--",
        "my_train.py",
        "--epochs",
        "3",
    ]


def test_cli_validate_fails_on_a_broken_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    manifests = render_manifests(K8sConfig())
    broken_wrong_type(manifests)
    path = tmp_path / "broken.yaml"
    path.write_text(yaml.safe_dump_all(manifests))
    assert main(["k8s", "validate", str(path)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"bamboo-launch: error: {path}: document ")
    assert "Deployment/bamboo-agent" in error and "spec.replicas" in error and "'eight'" in error
    assert len(error.strip().splitlines()) == 1


def test_cli_etcd_endpoints(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["k8s", "render", "--etcd", "http://a:2379/, b:2379"]) == 0
    documents = list(yaml.safe_load_all(capsys.readouterr().out))
    args = next(d for d in documents if d["kind"] == "Deployment")["spec"]["template"]["spec"]["containers"][
        0
    ]["args"]
    assert [args[i + 1] for i, a in enumerate(args) if a == "--etcd"] == ["a:2379", "b:2379"]
    assert main(["k8s", "render", "--etcd", "https://a:2379"]) == 2
    assert "give etcd endpoints as host:port and TLS with --etcd-tls-secret" in capsys.readouterr().err


def test_cli_bad_flag_value_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["k8s", "render", "--etcd-replicas", "4"]) == 2
    error = capsys.readouterr().err
    assert error == "bamboo-launch: error: --etcd-replicas must be 1, 3 or 5 (an odd quorum), got 4\n"
    assert main(["k8s", "render", "--cloud", "none", "--etcd", "etcd:port"]) == 2
    assert "--etcd must be host:port entries, got 'etcd:port'" in capsys.readouterr().err
    assert main(["k8s", "render", "--etcd-tls-secret", "tls"]) == 2
    assert (
        "--etcd-tls-secret and --etcd-auth-secret are for an external etcd (--etcd)"
        in capsys.readouterr().err
    )
    assert main(["k8s", "render", "--nodes", "3"]) == 2
    assert "--nodes=3 cannot hold --stages*--pipelines=4*2=8" in capsys.readouterr().err


def agent_container(manifests: list[dict[str, Any]]) -> dict[str, Any]:
    (deployment,) = by_kind(manifests)["Deployment"]
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    return container


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_the_agent_command_line_is_one_the_agent_accepts(name: str) -> None:
    """Every flag the manifests pass exists: the real `bamboo-launch agent` parser takes the args."""
    from bamboo.launch.cli import agent as agent_command
    from bamboo.launch.cli import build_parser

    config = CONFIGS[name]
    container = agent_container(render_manifests(config))
    assert container["command"] == ["bamboo-launch"]
    downward = {"POD_NAME": "bamboo-agent-abc12", "POD_IP": "10.1.2.3", "NODE_NAME": "ip-10-0-0-1",
                "ETCD_USER": "user", "ETCD_PASSWORD": "secret"}
    assert {e["name"] for e in container["env"] if "valueFrom" in e} <= set(downward)
    args = [re.sub(r"\$\((\w+)\)", lambda m: downward[m.group(1)], arg) for arg in container["args"]]
    flags, script = (args[: args.index("--")], args[args.index("--") + 1 :]) if "--" in args else (args, [])
    parsed = build_parser().parse_args(flags)
    assert parsed.command == "agent" and parsed.handler is agent_command.run
    assert (parsed.job, parsed.node, parsed.host, parsed.k8s_node) == (config.job, "bamboo-agent-abc12", "10.1.2.3",
                                                                        "ip-10-0-0-1")
    assert (parsed.port, parsed.stages, parsed.pipelines, parsed.steps) == (
        config.grpc_port, config.stages, config.pipelines, config.steps)
    assert parsed.run_dir == RUN_DIR and parsed.notice_window == config.grace_period_s
    assert not parsed.insecure
    assert script == list(config.script)
    mounts = {m["mountPath"] for m in container["volumeMounts"]}
    assert RUN_DIR in mounts
    if config.agent_tls_secret is None:
        assert parsed.token_file == f"{AGENT_TOKEN_MOUNT}/token" and AGENT_TOKEN_MOUNT in mounts
        assert parsed.tls_ca is None and parsed.tls_cert is None and parsed.tls_key is None
    else:
        assert parsed.token_file is None and AGENT_TLS_MOUNT in mounts
        assert (parsed.tls_ca, parsed.tls_cert, parsed.tls_key) == (
            f"{AGENT_TLS_MOUNT}/ca.crt", f"{AGENT_TLS_MOUNT}/tls.crt", f"{AGENT_TLS_MOUNT}/tls.key")
    # Checkpoints only on the shared claim: a pod's own disk cannot serve a restore.
    if config.checkpoint_claim is None:
        assert parsed.checkpoint_dir is None
    else:
        assert parsed.checkpoint_dir == config.checkpoint_dir and config.checkpoint_dir in mounts


def test_the_job_token_secret_is_rendered_by_default_with_a_fresh_token() -> None:
    config = K8sConfig(job="gpt", namespace="ml")
    first, second = render_manifests(config), render_manifests(config)
    (secret,) = by_kind(first)["Secret"]
    assert secret["metadata"]["name"] == "gpt-agent-token" and secret["metadata"]["namespace"] == "ml"
    token = secret["stringData"]["token"]
    assert re.fullmatch(r"[0-9a-f]{64}", token)
    assert by_kind(second)["Secret"][0]["stringData"]["token"] != token
    volumes = by_kind(first)["Deployment"][0]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "agent-token", "secret": {"secretName": "gpt-agent-token", "defaultMode": 0o400}} in volumes
    mount = next(m for m in agent_container(first)["volumeMounts"] if m["name"] == "agent-token")
    assert mount == {"name": "agent-token", "mountPath": AGENT_TOKEN_MOUNT, "readOnly": True}
    # The Secret comes before the pods that mount it.
    kinds = [m["kind"] for m in first]
    assert kinds.index("Secret") < kinds.index("Deployment")
    given = render_manifests(config, agent_token="t0ken")
    assert by_kind(given)["Secret"][0]["stringData"] == {"token": "t0ken"}
    with pytest.raises(ValueError, match="agent_token must be one printable word"):
        render_manifests(config, agent_token="two words")


def test_an_existing_token_secret_or_mutual_tls_renders_no_secret() -> None:
    own = render_manifests(CONFIGS["eks-own-token-secret"])
    assert "Secret" not in by_kind(own)
    volumes = by_kind(own)["Deployment"][0]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "agent-token", "secret": {"secretName": "my-token", "defaultMode": 0o400}} in volumes
    args = agent_container(own)["args"]
    assert args[args.index("--token-file") + 1] == "/etc/bamboo/agent-token/token"
    tls = render_manifests(CONFIGS["gke-agent-mtls"])
    assert "Secret" not in by_kind(tls)
    args = agent_container(tls)["args"]
    assert "--token-file" not in args
    assert args[args.index("--tls-ca") + 1] == "/etc/bamboo/agent-tls/ca.crt"
    assert args[args.index("--tls-cert") + 1] == "/etc/bamboo/agent-tls/tls.crt"
    assert args[args.index("--tls-key") + 1] == "/etc/bamboo/agent-tls/tls.key"
    volumes = by_kind(tls)["Deployment"][0]["spec"]["template"]["spec"]["volumes"]
    assert {"name": "agent-tls", "secret": {"secretName": "agent-mtls", "defaultMode": 0o400}} in volumes
    with pytest.raises(ValueError, match="agent_token_secret 'a' and agent_tls_secret 'b' are alternatives"):
        K8sConfig(agent_token_secret="a", agent_tls_secret="b")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_network_policies_admit_only_the_jobs_agents(name: str) -> None:
    config = CONFIGS[name]
    manifests = render_manifests(config)
    policies = {p["metadata"]["name"]: p for p in by_kind(manifests)["NetworkPolicy"]}
    agents = {"app.kubernetes.io/name": "bamboo", "app.kubernetes.io/instance": config.job,
              "app.kubernetes.io/component": "agent"}
    (deployment,) = by_kind(manifests)["Deployment"]
    assert deployment["spec"]["template"]["metadata"]["labels"] == agents
    agent_policy = policies.pop(f"{config.job}-agent")
    assert agent_policy["apiVersion"] == "networking.k8s.io/v1"
    assert agent_policy["metadata"]["namespace"] == config.namespace
    # Selects the agent pods; admits connections from the agent pods of this namespace only, on every port
    # (no "ports": the workers' gloo connections between agent pods use ephemeral ports).
    assert agent_policy["spec"] == {
        "podSelector": {"matchLabels": agents},
        "policyTypes": ["Ingress"],
        "ingress": [{"from": [{"podSelector": {"matchLabels": agents}}]}],
    }
    kinds = [m["kind"] for m in manifests]
    assert kinds.index("NetworkPolicy") < kinds.index("Deployment")
    if config.etcd_endpoints:
        assert policies == {}
        return
    etcd = {**agents, "app.kubernetes.io/component": "etcd"}
    etcd_policy = policies.pop(f"{config.job}-etcd")
    assert policies == {}
    assert etcd_policy["spec"]["podSelector"] == {"matchLabels": etcd}
    assert etcd_policy["spec"]["ingress"] == [
        {"from": [{"podSelector": {"matchLabels": agents}}], "ports": [{"protocol": "TCP", "port": 2379}]},
        {"from": [{"podSelector": {"matchLabels": etcd}}],
         "ports": [{"protocol": "TCP", "port": 2379}, {"protocol": "TCP", "port": 2380}]},
    ]
    (statefulset,) = by_kind(manifests)["StatefulSet"]
    assert statefulset["spec"]["template"]["metadata"]["labels"] == etcd


def test_cli_agent_auth_flags(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["k8s", "render", "--agent-token-secret", "mine", "--steps", "7"]) == 0
    out = capsys.readouterr()
    documents = list(yaml.safe_load_all(out.out))
    assert not out.out.startswith("#") and "Secret" not in {d["kind"] for d in documents}
    args = agent_container(documents)["args"]
    assert args[args.index("--steps") + 1] == "7"
    assert main(["k8s", "render"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("# Secret bamboo-agent-token holds the job token")
    assert "Secret" in {d["kind"] for d in yaml.safe_load_all(out)}
    assert main(["k8s", "render", "--agent-token-secret", "a", "--agent-tls-secret", "b"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
    assert main(["k8s", "render", "--agent-tls-secret", "Bad_Secret"]) == 2
    assert "--agent-tls-secret must be a lowercase DNS label" in capsys.readouterr().err
    assert main(["k8s", "render", "--steps", "0"]) == 2
    assert "--steps must be >= 1: 0" in capsys.readouterr().err


REPO = Path(__file__).resolve().parents[3]


def test_the_dockerfile_installs_what_make_setup_installs() -> None:
    """The image recipe (not buildable here: no container daemon) keeps to setup.sh's steps and pins."""
    import sys

    dockerfile = (REPO / "Dockerfile").read_text()
    setup = (REPO / "scripts" / "setup.sh").read_text()
    pyprojects = {path.parent.name: path.read_text() for path in (REPO / "packages").glob("*/pyproject.toml")}
    # The interpreter setup.sh makes the virtualenv with (the torch wheel's Python).
    assert re.search(rf"^FROM python:{sys.version_info.major}\.{sys.version_info.minor}-slim$", dockerfile, re.M)
    for name in ("torch", "deepspeed"):
        (pin,) = set(re.findall(rf"'{name}==([^']+)'", setup))
        assert re.findall(rf"'{name}==([^']+)'", dockerfile) == [pin], name
        for package, text in pyprojects.items():  # every requirement of it, extras included
            for requirement in re.findall(rf'"({name}\b[^"]*)"', text):
                assert requirement == f"{name}=={pin}", f"{package} requires {requirement}; the image has {pin}"
    assert re.search(r"--index-url https://download.pytorch.org/whl/cpu 'torch==", dockerfile)
    assert re.search(r"--no-build-isolation 'deepspeed==", dockerfile)
    assert "DS_BUILD_OPS=0" in dockerfile and "DS_BUILD_OPS=0" in setup
    # The six packages of setup.sh, not editable, each after the bamboo packages it depends on.
    (packages,) = re.findall(r"^PACKAGES=\(([^)]*)\)$", setup, re.M)
    install = re.search(r"pip install --no-build-isolation \\\n((?:\s+packages/\S+(?: \\\n)?)+)", dockerfile)
    assert install is not None
    installed = re.findall(r"packages/bamboo-(\S+)", install.group(1))
    assert sorted(installed) == sorted(packages.split()) == sorted(p.removeprefix("bamboo-") for p in pyprojects)
    assert not re.search(r"\s(-e|--editable)\s", dockerfile)
    order = {name: index for index, name in enumerate(installed)}
    for package, text in pyprojects.items():
        (dependencies,) = re.findall(r"^dependencies = \[(.*)\]$", text, re.M)
        for dependency in re.findall(r'"bamboo-(\w+)', dependencies):
            assert order[dependency] < order[package.removeprefix("bamboo-")], (package, dependency)
    # Its name and entry point are the manifests'.
    config = K8sConfig()
    (version,) = re.findall(r'^version = "([^"]+)"$', pyprojects["bamboo-launch"], re.M)
    assert config.image == f"bamboo-launch:{version}"
    assert f"docker build -t {config.image} ." in dockerfile
    container = agent_container(render_manifests(config))
    assert re.search(rf"^ENTRYPOINT {re.escape(json.dumps(container['command']))}$", dockerfile, re.M)
    assert f"WORKDIR {RUN_DIR}" in dockerfile
