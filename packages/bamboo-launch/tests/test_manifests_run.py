"""The rendered Kubernetes manifests start a working system: their command lines train a job exactly.

``bamboo-launch k8s render`` writes the manifests; this test runs what a cluster would run from them,
without a cluster: for each replica of the agents' Deployment it takes the container's ``command``,
``args`` and ``env``, fills in the downward-API values a pod would get (the pod's name, a pod IP, a node
name), maps every volume mount to a local folder (a Secret's mount holds the rendered Secret's data, the
checkpoint claim is one folder shared by all, emptyDirs are one folder per pod), and starts the command
line as a local process in its own session, against an embedded etcd. ``--k8s-node`` makes each agent
read its node's zone label from the Kubernetes API, served here by a small HTTP server that checks the
service-account token. The job must end (every agent exits 0) with every stage's parameters equal to a
fault-free single-process run's.

Each pod gets its own loopback address (127.0.0.2, 127.0.0.3, ...) as its IP: the manifests give every
agent the same gRPC port, as pods with distinct IPs can have. Nothing but mount paths is rewritten: the
flags are the manifests'.
"""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml
from bamboo.bench.emulated.run import RunOptions, RunResult, compare_with_reference
from bamboo.launch.cli import main
from bamboo.launch.events import Join, read_etcd_events
from bamboo.membership import EmbeddedEtcd, EtcdKV, EtcdOptions
from bamboo.membership.embedded import free_port

JOB = "k8s-run"
NODES, STAGES, PIPELINES, STEPS = 4, 2, 2, 5
ZONES = ("zone-a", "zone-b", "zone-c")
TOLERANCE = 1e-6
"""The largest relative difference from the reference allowed (``--verify``'s bound)."""
JOB_TIMEOUT_S = float(os.environ.get("BAMBOO_TEST_MANIFESTS_TIMEOUT_S", "240"))
"""How long the agents may take to finish the job (about 25 s on 2 cores); override with the variable."""


class FakeNodesApi:
    """``GET /api/v1/nodes/<name>`` of the Kubernetes API: each node with its zone label, for one bearer token."""

    def __init__(self, zones: dict[str, str], token: str) -> None:
        self.zones = zones
        self.token = token
        self.requests: list[tuple[str, bool]] = []
        api = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                authorized = self.headers.get("Authorization") == f"Bearer {api.token}"
                api.requests.append((self.path, authorized))
                match = re.fullmatch(r"/api/v1/nodes/([^/]+)", self.path)
                if not authorized:
                    self.answer(401, {"kind": "Status", "reason": "Unauthorized"})
                elif match is None or match.group(1) not in api.zones:
                    self.answer(404, {"kind": "Status", "reason": "NotFound"})
                else:
                    name = match.group(1)
                    labels = {"kubernetes.io/hostname": name, "topology.kubernetes.io/zone": api.zones[name]}
                    self.answer(200, {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "labels": labels}})

            def answer(self, status: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, name="fake-k8s-api", daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def expand(text: str, env: dict[str, str]) -> str:
    """Kubernetes' expansion of ``$(VAR)`` in command, args and env values (``$$`` escapes a ``$``)."""
    return re.sub(r"\$\$|\$\(([A-Za-z_][A-Za-z0-9_]*)\)",
                  lambda m: "$" if m.group(0) == "$$" else env.get(m.group(1), m.group(0)), text)


def secret_data(secret: dict[str, Any]) -> dict[str, bytes]:
    """A Secret's keys and values, from ``data`` (base64) and ``stringData``."""
    data = {key: base64.b64decode(value) for key, value in secret.get("data", {}).items()}
    data.update({key: value.encode() for key, value in secret.get("stringData", {}).items()})
    return data


class Pod:
    """One replica of the agents' Deployment, as local folders and a command line."""

    def __init__(self, index: int, template: dict[str, Any], secrets_by_name: dict[str, dict[str, Any]],
                 shared: dict[str, Path], root: Path) -> None:
        self.name = f"{JOB}-agent-{index}"
        self.ip = f"127.0.0.{index + 2}"
        self.node = f"fake-node-{index}"
        self.root = root / self.name
        spec = template["spec"]
        (container,) = spec["containers"]
        volumes = {volume["name"]: volume for volume in spec["volumes"]}
        self.mounts: dict[str, Path] = {}
        for mount in container["volumeMounts"]:
            volume = volumes[mount["name"]]
            if "secret" in volume:
                folder = self.root / "secrets" / mount["name"]
                folder.mkdir(parents=True)
                for key, value in secret_data(secrets_by_name[volume["secret"]["secretName"]]).items():
                    (folder / key).write_bytes(value)
                    (folder / key).chmod(volume["secret"].get("defaultMode", 0o644))
            elif "persistentVolumeClaim" in volume:
                folder = shared[volume["persistentVolumeClaim"]["claimName"]]
            else:
                assert "emptyDir" in volume, f"unexpected volume {volume}"
                folder = self.root / "volumes" / mount["name"]
                folder.mkdir(parents=True)
            self.mounts[mount["mountPath"]] = folder
        downward = {"metadata.name": self.name, "status.podIP": self.ip, "spec.nodeName": self.node}
        self.env: dict[str, str] = {}
        for variable in container["env"]:
            if "value" in variable:
                self.env[variable["name"]] = expand(variable["value"], self.env)
            else:
                self.env[variable["name"]] = downward[variable["valueFrom"]["fieldRef"]["fieldPath"]]
        command = [expand(part, self.env) for part in container["command"] + container["args"]]
        # The image's PATH holds bamboo-launch; here it is this virtualenv's.
        executable = shutil.which(command[0], path=str(Path(sys.executable).parent))
        assert executable is not None, f"{command[0]} is not installed next to {sys.executable}"
        self.argv = [executable, *map(self.local_path, command[1:])]

    def local_path(self, argument: str) -> str:
        """``argument`` with a mount path at its start replaced by the mount's local folder."""
        for mount_path in sorted(self.mounts, key=len, reverse=True):
            if argument == mount_path or argument.startswith(mount_path + "/"):
                return str(self.mounts[mount_path]) + argument[len(mount_path):]
        return argument

    @property
    def run_dir(self) -> Path:
        """The local folder of ``--run-dir`` (``argv`` holds the local paths already: mapping one again would move
        a test folder that lies under a mount path, such as ``/dev/shm``, into that mount's folder)."""
        return Path(self.argv[self.argv.index("--run-dir") + 1])


def check_agent_requires_the_token(address: str, token: str, node: str, process: subprocess.Popen[bytes],
                                   deadline: float) -> None:
    """Once the agent at ``address`` serves, a call without the job token is refused and one with it answered."""
    import grpc
    from bamboo.membership import AgentClient
    from bamboo.membership.v1 import membership_pb2 as pb
    from bamboo.membership.v1 import membership_pb2_grpc as pb_grpc

    # Retried every 0.1 s: gRPC's own reconnect backoff (1 s, growing) outlasted a job of a few seconds whose agents
    # began to serve just after the first try.
    backoff = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 100),
               ("grpc.min_reconnect_backoff_ms", 100)]
    with grpc.insecure_channel(address, options=backoff) as channel:
        while True:
            try:
                grpc.channel_ready_future(channel).result(timeout=1.0)
                break
            except grpc.FutureTimeoutError:
                assert process.poll() is None, f"agent {node} exited with {process.returncode} before serving"
                assert time.monotonic() < deadline, f"agent {node} did not serve at {address}"
        with pytest.raises(grpc.RpcError) as refused:
            pb_grpc.AgentStub(channel).Probe(pb.ProbeRequest(from_node="outsider"), timeout=10)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
    client = AgentClient(address, token=token, name="test", timeout=10)
    try:
        assert client.probe().node == node
    finally:
        client.close()


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EmbeddedEtcd]:
    with EmbeddedEtcd(tmp_path / "etcd") as server:
        yield server


def test_rendered_manifests_train_a_job_exactly(tmp_path: Path, etcd: EmbeddedEtcd,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    manifests_path = tmp_path / "manifests.yaml"
    port = free_port()
    assert main(["k8s", "render", "--job", JOB, "--cloud", "none", "--etcd", etcd.endpoint,
                 "--nodes", str(NODES), "--stages", str(STAGES), "--pipelines", str(PIPELINES),
                 "--steps", str(STEPS), "--gpus-per-node", "0", "--grpc-port", str(port),
                 "--checkpoint-claim", "checkpoints", "-o", str(manifests_path)]) == 0
    assert "holds the job token" in capsys.readouterr().err
    assert manifests_path.stat().st_mode & 0o077 == 0  # the file holds a secret
    documents = [d for d in yaml.safe_load_all(manifests_path.read_text()) if d is not None]
    (deployment,) = [d for d in documents if d["kind"] == "Deployment"]
    secrets_by_name = {d["metadata"]["name"]: d for d in documents if d["kind"] == "Secret"}
    assert set(secrets_by_name) == {f"{JOB}-agent-token"}

    template = deployment["spec"]["template"]
    claims = {v["persistentVolumeClaim"]["claimName"] for v in template["spec"]["volumes"]
              if "persistentVolumeClaim" in v}
    shared = {claim: tmp_path / "claims" / claim for claim in claims}
    for folder in shared.values():
        folder.mkdir(parents=True)
    pods = [Pod(i, template, secrets_by_name, shared, tmp_path / "pods")
            for i in range(deployment["spec"]["replicas"])]
    assert len(pods) == NODES

    service_account_token = tmp_path / "serviceaccount-token"
    service_account_token.write_text(secrets.token_hex(16))
    zone_of_node = {pod.node: ZONES[i % len(ZONES)] for i, pod in enumerate(pods)}
    api = FakeNodesApi(zone_of_node, service_account_token.read_text())
    # What a pod's service account gives the agent, pointed at the fake API server.
    base_env = {**os.environ, "BAMBOO_K8S_API": api.url, "BAMBOO_K8S_TOKEN_FILE": str(service_account_token)}
    processes: dict[str, subprocess.Popen[bytes]] = {}
    try:
        for pod in pods:
            log = open(pod.root / "agent.log", "wb")  # noqa: SIM115 - closed when the process is reaped
            processes[pod.name] = subprocess.Popen(pod.argv, env={**base_env, **pod.env}, cwd=pod.root,
                                                   stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                                   start_new_session=True)
            log.close()
        deadline = time.monotonic() + JOB_TIMEOUT_S
        token = secret_data(secrets_by_name[f"{JOB}-agent-token"])["token"].decode()
        # Every agent at once: the job trains as soon as every node is up, so agents checked one after another
        # may have finished it before the last one's turn.
        with futures.ThreadPoolExecutor(len(pods)) as pool:
            checks = [pool.submit(check_agent_requires_the_token, f"{pod.ip}:{port}", token, pod.name,
                                  processes[pod.name], deadline) for pod in pods]
        for check in checks:
            check.result()
        codes = {}
        for name, process in processes.items():
            try:
                codes[name] = process.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                codes[name] = None
        logs = {pod.name: (pod.root / "agent.log").read_text(errors="replace")[-2000:] for pod in pods}
        assert codes == dict.fromkeys(processes, 0), f"agents' exit codes {codes}; logs: {logs}"
    finally:
        for process in processes.values():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)  # the agent and its worker, whatever is left
            process.wait()
        api.close()

    # Every agent read its own node, with the service account's token.
    assert sorted(api.requests) == sorted((f"/api/v1/nodes/{pod.node}", True) for pod in pods)
    kv = EtcdKV(EtcdOptions(endpoints=(etcd.endpoint,)))
    try:
        joins = {event.node: event.zone for event in read_etcd_events(kv, JOB) if isinstance(event, Join)}
        spec = kv.get(f"/bamboo/{JOB}/spec")
        assert spec is not None
    finally:
        kv.close()
    # Each agent joined with its node's zone; on a loaded machine one may also come back as a fresh node
    # (``<pod>.<incarnation>``, bamboo.launch.agent), which joins with the same zone.
    zone_of_pod = {pod.name: zone_of_node[pod.node] for pod in pods}
    assert zone_of_pod.items() <= joins.items()
    assert {node: zone_of_pod.get(node.rsplit(".", 1)[0]) for node in joins} == joins

    # The workers' final reports, one per rank, each in its own pod's run dir.
    import torch

    reports = {}
    for pod in pods:
        for path in sorted((pod.run_dir / "out").glob("rank*.pt")):
            report = torch.load(path, weights_only=False)
            reports[int(report["rank"])] = report
    assert sorted(reports) == list(range(STAGES * PIPELINES))
    assert {report["steps_done"] for report in reports.values()} == {STEPS}
    assert {stage for report in reports.values() for stage in report["hosted"]} == set(range(STAGES))
    verify_dir = tmp_path / "verify"
    verify_dir.mkdir()
    (verify_dir / "spec.json").write_bytes(spec.value)
    result = RunResult(run_dir=verify_dir, events=verify_dir / "events.jsonl", reports=reports, failed_ranks=(),
                       failed_nodes=(), node_of_rank={}, exit_codes=dict(codes), timed_out=False, seconds=0.0)
    comparison = compare_with_reference(result, RunOptions(nodes=NODES, stages=STAGES, pipelines=PIPELINES,
                                                           steps=STEPS))
    assert comparison["steps"] == STEPS and comparison["tensors"] > 0
    assert comparison["max_relative_diff"] <= TOLERANCE, comparison
