"""Cloud preemption notices, read from the instance metadata servers, as hooks for the agent.

A hook is a callable that returns the preemption deadline (unix seconds) once the cloud has announced one,
and None until then; `NodeAgent.watch_preemption_hook(hook, interval, source=hook.source)` calls it in a
loop and turns the first deadline into a `PreemptionNotice` (`python -m bamboo.membership
--preemption-notices aws|gce` does this). A hook raises `MetadataError` when the metadata server answers
something it cannot read; the agent logs it and calls again after the interval.

- **AWS** (`AwsSpotNotice`), IMDSv2: `PUT /latest/api/token` with header
  `X-aws-ec2-metadata-token-ttl-seconds` gives a session token; then
  `GET /latest/meta-data/spot/instance-action` with header `X-aws-ec2-metadata-token` answers 404 while
  no interruption is planned, and `{"action": "terminate"|"stop"|"hibernate", "time": "...Z"}` about two
  minutes before it: the deadline is that `time`. The token is renewed before it expires, and at once
  when the server answers 401. AWS suggests polling every 5 s.
- **GCE** (`GcePreemptionNotice`): `GET /computeMetadata/v1/instance/preempted` with header
  `Metadata-Flavor: Google` answers `FALSE`, or `TRUE` once the VM is being preempted. The first call
  reads it at once; later calls are hanging GETs (`wait_for_change=true`, `last_etag`, `timeout_sec`)
  that return as soon as the value changes (`last_etag` makes a change between two calls return at
  once). GCE stops the VM about 30 s after the notice (`GCE_NOTICE_S`): the deadline is then.

Base URLs default to the real metadata endpoints and can be changed (tests serve the same paths from a
local HTTP server). Timeouts (`bamboo.membership.timeouts`): `METADATA_HTTP_TIMEOUT_S` per request,
`AWS_TOKEN_TTL_S`, `GCE_HANGING_GET_S`, `GCE_NOTICE_S`.
"""

from __future__ import annotations

import datetime
import json
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Callable
from typing import Protocol

from bamboo.membership import timeouts

__all__ = [
    "AWS_METADATA_URL",
    "GCE_METADATA_URL",
    "PREEMPTION_NOTICE_KINDS",
    "AwsSpotNotice",
    "GcePreemptionNotice",
    "MetadataError",
    "PreemptionHook",
    "preemption_hook",
]

AWS_METADATA_URL = "http://169.254.169.254"
GCE_METADATA_URL = "http://metadata.google.internal"
PREEMPTION_NOTICE_KINDS = ("none", "aws", "gce")

AWS_TOKEN_PATH = "/latest/api/token"
AWS_INSTANCE_ACTION_PATH = "/latest/meta-data/spot/instance-action"
GCE_PREEMPTED_PATH = "/computeMetadata/v1/instance/preempted"
AWS_ACTIONS = ("terminate", "stop", "hibernate")


class MetadataError(RuntimeError):
    """The metadata server could not be reached, or answered something unexpected (the message quotes it)."""


class PreemptionHook(Protocol):
    """Returns the preemption deadline (unix seconds) once announced, None before. `source` names the cloud."""

    source: str

    def __call__(self) -> float | None: ...


def _request(method: str, url: str, headers: dict[str, str], timeout: float) -> tuple[int, bytes, dict[str, str]]:
    """One HTTP request: (status, body, headers). HTTP error statuses are returned, not raised."""
    request = urllib.request.Request(url, method=method, headers=headers, data=b"" if method == "PUT" else None)
    try:
        with urllib.request.urlopen(request, timeout=timeout) as response:
            return response.status, response.read(), dict(response.headers)
    except urllib.error.HTTPError as exc:
        with exc:
            return exc.code, exc.read(), dict(exc.headers or {})
    except (urllib.error.URLError, OSError) as exc:
        raise MetadataError(f"{method} {url}: {exc}") from exc


def _base(url: str) -> str:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise ValueError(f"metadata base URL must be http(s)://host[:port], got {url!r}")
    return url.rstrip("/")


class AwsSpotNotice:
    """AWS spot interruption notice through IMDSv2 (see the module docstring). Call it to poll once."""

    source = "aws-spot"

    def __init__(
        self,
        base_url: str = AWS_METADATA_URL,
        *,
        timeout: float = timeouts.METADATA_HTTP_TIMEOUT_S,
        token_ttl: int = timeouts.AWS_TOKEN_TTL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not 1 <= token_ttl <= 21600:
            raise ValueError(f"AwsSpotNotice: token_ttl must be 1..21600 s (IMDSv2's range), got {token_ttl!r}")
        self.base_url = _base(base_url)
        self.timeout = timeout
        self.token_ttl = token_ttl
        self.clock = clock
        self._token: str | None = None
        self._token_renew_at = 0.0
        self.tokens_fetched = 0

    def _session_token(self) -> str:
        now = self.clock()
        if self._token is None or now >= self._token_renew_at:
            url = f"{self.base_url}{AWS_TOKEN_PATH}"
            status, body, _ = _request("PUT", url, {"X-aws-ec2-metadata-token-ttl-seconds": str(self.token_ttl)},
                                       self.timeout)
            if status != 200 or not body.strip():
                raise MetadataError(f"PUT {url} answered {status}: {body[:200]!r}")
            self._token = body.decode().strip()
            self._token_renew_at = now + self.token_ttl * 0.9  # renew before it expires
            self.tokens_fetched += 1
        return self._token

    def __call__(self) -> float | None:
        url = f"{self.base_url}{AWS_INSTANCE_ACTION_PATH}"
        for attempt in (0, 1):
            status, body, _ = _request("GET", url, {"X-aws-ec2-metadata-token": self._session_token()}, self.timeout)
            if status == 401 and attempt == 0:
                self._token = None  # expired or revoked: get a new one and ask again
                continue
            break
        if status == 404:
            return None
        if status != 200:
            raise MetadataError(f"GET {url} answered {status}: {body[:200]!r}")
        return self.parse(body, url)

    @staticmethod
    def parse(body: bytes, where: str = AWS_INSTANCE_ACTION_PATH) -> float:
        """The deadline in an `instance-action` document, as unix seconds."""
        try:
            data = json.loads(body)
            action, when = data["action"], data["time"]
            deadline = datetime.datetime.fromisoformat(str(when).replace("Z", "+00:00"))
        except (ValueError, TypeError, KeyError) as exc:
            raise MetadataError(f"{where}: not an instance-action document ({exc}): {body[:200]!r}") from exc
        if action not in AWS_ACTIONS:
            raise MetadataError(f"{where}: unknown action {action!r} (expected one of {AWS_ACTIONS})")
        if deadline.tzinfo is None:
            deadline = deadline.replace(tzinfo=datetime.timezone.utc)
        return deadline.timestamp()


class GcePreemptionNotice:
    """GCE preemption notice through the metadata server (see the module docstring). Each call may hang for
    up to `hang` seconds waiting for a change, unless it is the first."""

    source = "gce-preempted"

    def __init__(
        self,
        base_url: str = GCE_METADATA_URL,
        *,
        timeout: float = timeouts.METADATA_HTTP_TIMEOUT_S,
        hang: float = timeouts.GCE_HANGING_GET_S,
        notice: float = timeouts.GCE_NOTICE_S,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        if hang < 1:
            raise ValueError(f"GcePreemptionNotice: hang must be at least 1 s, got {hang!r}")
        self.base_url = _base(base_url)
        self.timeout = timeout
        self.hang = hang
        self.notice = notice
        self.wall_clock = wall_clock
        self._etag: str | None = None
        self._first = True

    def __call__(self) -> float | None:
        url = f"{self.base_url}{GCE_PREEMPTED_PATH}"
        timeout = self.timeout
        if not self._first:
            query = {"wait_for_change": "true", "timeout_sec": str(int(self.hang))}
            if self._etag is not None:
                query["last_etag"] = self._etag
            url = f"{url}?{urllib.parse.urlencode(query)}"
            timeout = self.hang + self.timeout
        status, body, headers = _request("GET", url, {"Metadata-Flavor": "Google"}, timeout)
        if status != 200:
            raise MetadataError(f"GET {url} answered {status}: {body[:200]!r}")
        self._first = False
        self._etag = headers.get("ETag") or headers.get("Etag") or self._etag
        value = body.decode(errors="replace").strip().upper()
        if value == "TRUE":
            return self.wall_clock() + self.notice
        if value == "FALSE":
            return None
        raise MetadataError(f"GET {url}: expected TRUE or FALSE, got {body[:200]!r}")


def preemption_hook(kind: str, base_url: str | None = None) -> AwsSpotNotice | GcePreemptionNotice | None:
    """The hook for `--preemption-notices KIND` (`none`, `aws`, `gce`), at `base_url` or the cloud's own."""
    if kind == "none":
        return None
    if kind == "aws":
        return AwsSpotNotice(base_url or AWS_METADATA_URL)
    if kind == "gce":
        return GcePreemptionNotice(base_url or GCE_METADATA_URL)
    raise ValueError(f"preemption notices must be one of {PREEMPTION_NOTICE_KINDS}, got {kind!r}")
