"""Cloud preemption-notice pollers against a local HTTP server that serves the metadata paths as AWS (IMDSv2:
token, then `spot/instance-action`) and GCE (`instance/preempted`, hanging GET with `wait_for_change`) document
them; then the agent and its CLI turning a notice into a `PreemptionNotice` in etcd."""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import urllib.parse
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from bamboo.membership.agent import NodeAgent
from bamboo.membership.cloud import (
    AwsSpotNotice,
    GcePreemptionNotice,
    MetadataError,
    preemption_hook,
)
from bamboo.membership.records import NodeState, PreemptionNotice, decode_message
from bamboo.membership.store import MembershipStore

ACTION = b'{"action": "terminate", "time": "2017-09-18T08:22:00Z"}'
ACTION_AT = 1505722920.0  # 2017-09-18T08:22:00Z as unix seconds
HTTP_TIMEOUT_S = 30.0
"""The hooks' per-request timeout here, instead of `METADATA_HTTP_TIMEOUT_S` (2 s): the fake metadata server answers
from a thread of this test's process, which a loaded `make test` starved for more than 2 s once (a token request
timed out); these tests check what the hooks read, not how fast."""


class FakeMetadata:
    """What the metadata servers hold, changed by the test; `cond` wakes GCE's hanging GETs."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.aws_tokens: set[str] = set()
        self.aws_token_ttls: list[str] = []
        self.aws_action: bytes | None = None
        self.gce_value = "FALSE"
        self.gce_etag = 1
        self.gce_hanging = 0
        self.gce_hung = 0
        self._serial = itertools.count(1)

    def set_gce(self, value: str) -> None:
        with self.cond:
            self.gce_value = value
            self.gce_etag += 1
            self.cond.notify_all()


def _handler(meta: FakeMetadata) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def _send(self, status: int, body: bytes, headers: dict[str, str] | None = None) -> None:
            self.send_response(status)
            for key, value in (headers or {}).items():
                self.send_header(key, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_PUT(self) -> None:
            if self.path != "/latest/api/token":
                return self._send(404, b"not found")
            ttl = self.headers.get("X-aws-ec2-metadata-token-ttl-seconds")
            if ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
                return self._send(400, b"bad ttl")
            token = f"token-{next(meta._serial)}"
            meta.aws_tokens.add(token)
            meta.aws_token_ttls.append(ttl)
            self._send(200, token.encode(), {"X-aws-ec2-metadata-token-ttl-seconds": ttl})

        def do_GET(self) -> None:
            url = urllib.parse.urlparse(self.path)
            if url.path == "/latest/meta-data/spot/instance-action":
                if self.headers.get("X-aws-ec2-metadata-token") not in meta.aws_tokens:
                    return self._send(401, b"")
                if meta.aws_action is None:
                    return self._send(404, b"<html>404 - Not Found</html>", {"Content-Type": "text/html"})
                return self._send(200, meta.aws_action, {"Content-Type": "text/plain"})
            if url.path == "/computeMetadata/v1/instance/preempted":
                if self.headers.get("Metadata-Flavor") != "Google":
                    return self._send(403, b"Missing Metadata-Flavor:Google header.")
                query = urllib.parse.parse_qs(url.query)
                with meta.cond:
                    if query.get("wait_for_change") == ["true"]:
                        last = query.get("last_etag", [None])[0]
                        if last is None or last == str(meta.gce_etag):
                            seen = meta.gce_etag
                            meta.gce_hanging += 1
                            meta.gce_hung += 1
                            meta.cond.notify_all()
                            meta.cond.wait_for(lambda: meta.gce_etag != seen,
                                               timeout=float(query.get("timeout_sec", ["60"])[0]))
                            meta.gce_hanging -= 1
                    value, etag = meta.gce_value, str(meta.gce_etag)
                return self._send(200, value.encode(), {"ETag": etag, "Metadata-Flavor": "Google"})
            self._send(404, b"not found")

    return Handler


@pytest.fixture
def metadata() -> Iterator[tuple[FakeMetadata, str]]:
    meta = FakeMetadata()
    server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(meta))
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield meta, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        meta.set_gce(meta.gce_value)  # release any hanging GET
        server.shutdown()
        server.server_close()


def test_aws_hook_uses_an_imdsv2_token_and_reads_the_instance_action(metadata) -> None:
    meta, url = metadata
    now = [0.0]
    hook = AwsSpotNotice(url, clock=lambda: now[0], timeout=HTTP_TIMEOUT_S)
    assert hook() is None and hook() is None  # 404: no interruption planned
    assert meta.aws_token_ttls == ["21600"] and hook.tokens_fetched == 1  # one token, reused
    meta.aws_action = ACTION
    assert hook() == ACTION_AT
    meta.aws_tokens.clear()  # the token expired or was revoked: 401, then a new token
    assert hook() == ACTION_AT and hook.tokens_fetched == 2
    now[0] += 0.9 * 21600  # renewed before it expires
    assert hook() == ACTION_AT and hook.tokens_fetched == 3


@pytest.mark.parametrize(("body", "error"), [
    (b"not json", "not an instance-action document"),
    (b'{"action": "reboot", "time": "2017-09-18T08:22:00Z"}', "unknown action 'reboot'"),
    (b'{"action": "stop"}', "not an instance-action document"),
])
def test_aws_hook_names_an_unreadable_answer(metadata, body: bytes, error: str) -> None:
    meta, url = metadata
    meta.aws_action = body
    with pytest.raises(MetadataError, match=error):
        AwsSpotNotice(url, timeout=HTTP_TIMEOUT_S)()


def test_aws_stop_and_hibernate_are_notices_too(metadata) -> None:
    meta, url = metadata
    meta.aws_action = b'{"action": "hibernate", "time": "2017-09-18T08:22:00Z"}'
    assert AwsSpotNotice(url, timeout=HTTP_TIMEOUT_S)() == ACTION_AT


def test_gce_hook_reads_then_hangs_until_preempted(metadata) -> None:
    meta, url = metadata
    hook = GcePreemptionNotice(url, wall_clock=lambda: 1000.0, timeout=HTTP_TIMEOUT_S)
    assert hook() is None  # FALSE, read at once
    answer: list[float | None] = []
    waiter = threading.Thread(target=lambda: answer.append(hook()), daemon=True)
    waiter.start()
    with meta.cond:
        assert meta.cond.wait_for(lambda: meta.gce_hanging == 1, timeout=30), "the hanging GET never arrived"
    assert not answer  # still waiting for a change
    meta.set_gce("TRUE")
    waiter.join(30)
    assert answer == [1000.0 + 30.0]  # GCE stops the VM about 30 s after the notice


def test_gce_hook_does_not_miss_a_change_between_two_calls(metadata) -> None:
    meta, url = metadata
    hook = GcePreemptionNotice(url, wall_clock=lambda: 5.0, timeout=HTTP_TIMEOUT_S)
    assert hook() is None
    meta.set_gce("TRUE")  # changes before the next hanging GET: last_etag makes it answer at once
    assert hook() == 35.0
    assert meta.gce_hung == 0


def test_gce_hook_names_an_unexpected_answer(metadata) -> None:
    meta, url = metadata
    meta.set_gce("MAYBE")
    with pytest.raises(MetadataError, match="expected TRUE or FALSE"):
        GcePreemptionNotice(url, timeout=HTTP_TIMEOUT_S)()


def test_preemption_hook_factory() -> None:
    assert preemption_hook("none") is None
    assert isinstance(preemption_hook("aws"), AwsSpotNotice)
    assert preemption_hook("gce", "http://127.0.0.1:1").base_url == "http://127.0.0.1:1"
    with pytest.raises(ValueError, match="'azure'"):
        preemption_hook("azure")
    with pytest.raises(ValueError, match=r"'169\.254\.169\.254'"):
        AwsSpotNotice("169.254.169.254")


def test_the_agent_publishes_the_aws_deadline(metadata, store: MembershipStore, wait_until) -> None:
    meta, url = metadata
    agent = NodeAgent(store, "spot", ttl=5, run_detector=False).start()
    try:
        agent.watch_preemption_hook(AwsSpotNotice(url, timeout=HTTP_TIMEOUT_S), interval=0.01)
        meta.aws_action = ACTION
        wait_until(agent.noticed.is_set, message="the notice")
        wait_until(lambda: store.kv.get(store.keys.notice("spot")) is not None, message="the notice in etcd")
        stored = store.kv.get(store.keys.notice("spot"))
        notice = decode_message(stored.key, stored.value, PreemptionNotice)
        assert (notice.deadline, notice.source) == (ACTION_AT, "aws-spot")
        assert store.get_node("spot").state == NodeState.NODE_STATE_PREEMPTING
    finally:
        agent.stop()


def test_the_agent_cli_polls_gce(metadata, etcd, store: MembershipStore, wait_until) -> None:
    meta, url = metadata
    meta.set_gce("TRUE")
    proc = subprocess.Popen(
        [sys.executable, "-m", "bamboo.membership", "--etcd", etcd.endpoint, "--job", store.keys.job,
         "--node", "gce-node", "--no-detector", "--preemption-notices", "gce", "--metadata-url", url],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert json.loads(proc.stdout.readline())["node"] == "gce-node"
        wait_until(lambda: store.kv.get(store.keys.notice("gce-node")) is not None, timeout=30,
                   message="the GCE notice in etcd")
        stored = store.kv.get(store.keys.notice("gce-node"))
        assert decode_message(stored.key, stored.value, PreemptionNotice).source == "gce-preempted"
    finally:
        proc.kill()
        proc.wait(timeout=30)
