"""Only the job's agents may talk to an agent: a job token in the call metadata, or mutual TLS.

Real gRPC servers on port 0 in this process. A client without the token or the certificate is refused on
every method (and its probe reads as DENIED, never as a dead node); one with it is accepted. An agent that
would listen beyond loopback with neither refuses to start unless told `insecure`.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grpc
import pytest
from bamboo.membership.agent import AgentClient, GrpcProber, NodeAgent, TlsFiles, load_token
from bamboo.membership.detector import ProbeOutcome
from bamboo.membership.records import PreemptionNotice
from bamboo.membership.store import MembershipStore
from bamboo.membership.v1 import membership_pb2 as pb
from bamboo.membership.v1 import membership_pb2_grpc as pb_grpc

TOKEN = "s3cret-job-token"


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=60)


def _ca_and_leaf(tmp: Path, name: str) -> tuple[Path, Path, Path]:
    """A CA, and a leaf certificate (127.0.0.1, localhost) with its key, signed by it."""
    ca_key, ca, key, csr, cert = (tmp / f"{name}-{part}" for part in ("ca.key", "ca.pem", "key.pem", "csr", "cert.pem"))
    ext = tmp / f"{name}.ext"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(ca_key), "-out", str(ca), "-days", "1",
             "-subj", f"/CN={name}-ca")
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(csr), "-subj", "/CN=localhost")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-out", str(cert), "-days", "1", "-extfile", str(ext))
    return ca, cert, key


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, TlsFiles]:
    if shutil.which("openssl") is None:
        pytest.skip("openssl is needed to make test certificates")
    tmp = tmp_path_factory.mktemp("pki")
    ca, cert, key = _ca_and_leaf(tmp, "job")
    other_ca, other_cert, other_key = _ca_and_leaf(tmp, "stranger")
    return {
        "job": TlsFiles(cert=str(cert), key=str(key), ca=str(ca)),
        # Trusts the job's CA (so it can reach the server) but holds a certificate the job's CA did not sign.
        "stranger": TlsFiles(cert=str(other_cert), key=str(other_key), ca=str(ca)),
        "server_only": TlsFiles(cert=str(cert), key=str(key)),
        "other_ca": TlsFiles(cert=str(other_cert), key=str(other_key), ca=str(other_ca)),
    }


def _every_call_is_refused(address: str, metadata: tuple[tuple[str, str], ...] | None) -> None:
    channel = grpc.insecure_channel(address)
    stub = pb_grpc.AgentStub(channel)
    calls = {
        "Probe": lambda: stub.Probe(pb.ProbeRequest(from_node="x"), timeout=5, metadata=metadata),
        "Notify": lambda: stub.Notify(pb.NotifyRequest(notice=PreemptionNotice(node="guarded", deadline=1.0)),
                                      timeout=5, metadata=metadata),
        "ReportPeerFailure": lambda: stub.ReportPeerFailure(pb.PeerFailureRequest(node="other"), timeout=5,
                                                            metadata=metadata),
        "Subscribe": lambda: list(stub.Subscribe(pb.SubscribeRequest(subscriber="x"), timeout=5, metadata=metadata)),
    }
    try:
        for name, call in calls.items():
            with pytest.raises(grpc.RpcError) as info:
                call()
            assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, name
            assert "job token" in info.value.details(), name
    finally:
        channel.close()


def test_a_job_token_is_required_on_every_call(store: MembershipStore) -> None:
    agent = NodeAgent(store, "guarded", ttl=5, token=TOKEN, progress=lambda: 3).start()
    try:
        _every_call_is_refused(agent.address, None)
        _every_call_is_refused(agent.address, (("authorization", "Bearer wrong"),))
        _every_call_is_refused(agent.address, (("authorization", TOKEN),))  # the scheme is part of it
        assert store.kv.get(store.keys.notice("guarded")) is None  # the refused Notify published nothing
        assert agent.detector.suspects() == []  # the refused report made no suspect
        refused = GrpcProber("x")(agent.record, 5.0)
        assert refused.outcome is ProbeOutcome.DENIED and "UNAUTHENTICATED" in refused.detail
        accepted = GrpcProber("x", token=TOKEN)(agent.record, 5.0)
        assert (accepted.outcome, accepted.progress) == (ProbeOutcome.ALIVE, 3)
        assert agent.prober()(agent.record, 5.0).outcome is ProbeOutcome.ALIVE
        client = AgentClient(agent.address, token=TOKEN)
        assert client.probe().node == "guarded"
        assert client.notify(PreemptionNotice(node="guarded", deadline=2e9, source="test"))
        assert store.kv.get(store.keys.notice("guarded")) is not None
        client.close()
    finally:
        agent.stop()


def test_mutual_tls_requires_a_certificate_signed_by_the_job_ca(store: MembershipStore, pki) -> None:
    agent = NodeAgent(store, "mtls", ttl=30, run_detector=False, tls=pki["job"], progress=lambda: 4).start()
    try:
        ok = agent.prober()(agent.record, 5.0)
        assert (ok.outcome, ok.progress) == (ProbeOutcome.ALIVE, 4)
        client = agent.client()
        assert client.notify(PreemptionNotice(node="mtls", deadline=2e9, source="test"))
        client.close()
        for name in ("server_only", "stranger", "other_ca"):
            files = pki[name]
            result = GrpcProber("x", files.channel_credentials())(agent.record, 5.0)
            assert result.outcome is ProbeOutcome.DENIED, (name, result)  # alive, never REFUSED
            outsider = AgentClient(agent.address, credentials=files.channel_credentials(), timeout=5)
            with pytest.raises(grpc.RpcError):
                outsider.notify(PreemptionNotice(node="mtls", deadline=1.0))
            outsider.close()
        plaintext = GrpcProber("x")(agent.record, 2.0)
        assert plaintext.outcome not in (ProbeOutcome.ALIVE, ProbeOutcome.REFUSED)
        assert store.get_node("mtls") is not None
    finally:
        agent.stop()
    gone = GrpcProber("x", pki["job"].channel_credentials())(agent.record, 2.0)
    assert gone.outcome is ProbeOutcome.REFUSED  # and a stopped agent still reads as gone


def test_listening_beyond_loopback_needs_a_token_or_mutual_tls(store: MembershipStore, pki) -> None:
    with pytest.raises(ValueError, match=r"0\.0\.0\.0.*--token-file.*mutual TLS.*--insecure"):
        NodeAgent(store, "open", host="0.0.0.0", port=4242)
    with pytest.raises(ValueError, match=r"10\.1\.2\.3"):
        NodeAgent(store, "open", host="10.1.2.3", tls=pki["server_only"])  # TLS alone lets anyone in
    NodeAgent(store, "open", host="0.0.0.0", insecure=True, run_detector=False)
    NodeAgent(store, "open", host="0.0.0.0", token=TOKEN, run_detector=False)
    NodeAgent(store, "open", host="0.0.0.0", tls=pki["job"], run_detector=False)
    NodeAgent(store, "open", host="::1", run_detector=False)  # loopback needs nothing
    agent = NodeAgent(store, "wide", host="0.0.0.0", token=TOKEN, run_detector=False).start()
    try:
        client = AgentClient(f"127.0.0.1:{agent.port}", token=TOKEN)
        assert client.probe().node == "wide"
        client.close()
        _every_call_is_refused(f"127.0.0.1:{agent.port}", None)
    finally:
        agent.stop()


def test_load_token(tmp_path: Path) -> None:
    path = tmp_path / "token"
    path.write_text(f"  {TOKEN}\n")
    assert load_token(path) == TOKEN
    path.write_text("\n")
    with pytest.raises(ValueError, match="is empty"):
        load_token(path)
    path.write_text("two words")
    with pytest.raises(ValueError, match="without spaces"):
        load_token(path)
    with pytest.raises(ValueError, match="missing"):
        load_token(tmp_path / "missing")


def test_agent_cli_refuses_to_listen_beyond_loopback_without_authentication(etcd, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "bamboo.membership", "--etcd", etcd.endpoint, "--job", "cli-auth", "--node", "n"]
    out = subprocess.run([*base, "--host", "0.0.0.0"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "Traceback" not in out.stderr
    assert out.stderr.startswith("bamboo agent: error: agent n: refusing to listen on 0.0.0.0")
    empty = tmp_path / "token"
    empty.write_text("")
    out = subprocess.run([*base, "--host", "0.0.0.0", "--token-file", str(empty)], capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 2 and "is empty" in out.stderr
