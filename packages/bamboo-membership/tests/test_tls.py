"""The agent's optional TLS: a probe with the right CA gets through, a plaintext probe does not."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
from bamboo.membership.agent import GrpcProber, NodeAgent, TlsFiles
from bamboo.membership.detector import ProbeOutcome
from bamboo.membership.embedded import EmbeddedEtcd
from bamboo.membership.kv import EtcdKV, EtcdOptions, StoreUnavailableError
from bamboo.membership.store import MembershipStore


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is needed to make a test certificate")
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "1", "-subj", "/CN=localhost", "-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"],
        check=True, capture_output=True, timeout=60,
    )
    return TlsFiles(cert=str(cert), key=str(key), ca=str(cert))


def test_agent_with_tls_answers_probes_over_tls_only(store: MembershipStore, tls_files: TlsFiles) -> None:
    agent = NodeAgent(store, "secure", ttl=2, run_detector=False, tls=tls_files, progress=lambda: 5).start()
    try:
        ok = GrpcProber("t", tls_files.channel_credentials())(agent.record, 5.0)
        assert (ok.outcome, ok.progress) == (ProbeOutcome.ALIVE, 5)
        plaintext = GrpcProber("t")(agent.record, 1.0)
        assert plaintext.outcome is not ProbeOutcome.ALIVE
    finally:
        agent.stop()


def test_tls_files_must_exist(tmp_path: Path, tls_files: TlsFiles) -> None:
    with pytest.raises(ValueError, match=r"TlsFiles.key: no such file '.*missing.pem'"):
        TlsFiles(cert=tls_files.cert, key=str(tmp_path / "missing.pem"))
    with pytest.raises(ValueError, match=r"TlsFiles\.ca"):
        TlsFiles(cert=tls_files.cert, key=tls_files.key, ca=str(tmp_path / "nope.pem"))


def test_etcd_over_tls_with_the_ca_passed_through(tls_files: TlsFiles) -> None:
    with EmbeddedEtcd(tls_cert=tls_files.cert, tls_key=tls_files.key) as server:
        assert server.client_url.startswith("https://")
        secure = EtcdKV(EtcdOptions(endpoints=(server.endpoint,), ca_cert=tls_files.cert, timeout=3))
        store = MembershipStore(secure, "tls")
        assert store.decide("d", {"tls": True}).won
        secure.close()
        plaintext = EtcdKV(EtcdOptions(endpoints=(server.endpoint,), timeout=1))
        with pytest.raises(StoreUnavailableError):
            plaintext.get("/bamboo/tls/decisions/d")
        plaintext.close()
