"""Who may call an agent: the job token and TLS files, and the server-side check of the token.

`TlsFiles` (PEM files; with a CA, mutual TLS), `load_token` (the job token from a file), `TOKEN_METADATA_KEY`
(the call-metadata key that carries `Bearer <token>`), `is_loopback`, and `TokenCheck`, the gRPC server
interceptor that answers UNAUTHENTICATED to any call without the job token (compared in constant time).
"""

from __future__ import annotations

import hmac
import ipaddress
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs
import grpc

__all__ = ["TOKEN_FILE_ENV", "TOKEN_METADATA_KEY", "TlsFiles", "TokenCheck", "is_loopback", "load_token",
           "token_metadata"]

TOKEN_METADATA_KEY = "authorization"
"""The call-metadata key that carries the job token, as `Bearer <token>`."""

TOKEN_FILE_ENV = "BAMBOO_AGENT_TOKEN_FILE"
"""Environment variable naming the job token file when `--token-file` is not given."""


def _check_file(name: str, path: str) -> None:
    if not Path(path).is_file():
        raise ValueError(f"TlsFiles.{name}: no such file {path!r}")


@attrs.frozen
class TlsFiles:
    """PEM files for the agent's TLS (e.g. mounted from a Kubernetes Secret).

    The server presents `cert`/`key`. With `ca`, TLS is mutual: the server requires a client certificate
    signed by `ca`, and clients (probes, `AgentClient`) verify the server against `ca` and present
    `cert`/`key` themselves. Without `ca`, clients verify against `cert` and present nothing.
    `server_name` overrides the name clients check in the server's certificate (one certificate can then
    serve agents at any address, e.g. pod IPs).
    """

    cert: str = attrs.field(validator=lambda _, a, v: _check_file(a.name, v))
    key: str = attrs.field(validator=lambda _, a, v: _check_file(a.name, v))
    ca: str | None = attrs.field(default=None, validator=lambda _, a, v: v is None or _check_file(a.name, v))
    server_name: str | None = None

    @property
    def mutual(self) -> bool:
        """Whether clients must present a certificate (a CA is given)."""
        return self.ca is not None

    def server_credentials(self) -> grpc.ServerCredentials:
        pair = [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())]
        if self.ca is None:
            return grpc.ssl_server_credentials(pair)
        return grpc.ssl_server_credentials(pair, root_certificates=Path(self.ca).read_bytes(),
                                           require_client_auth=True)

    def channel_credentials(self) -> grpc.ChannelCredentials:
        if self.ca is None:
            return grpc.ssl_channel_credentials(root_certificates=Path(self.cert).read_bytes())
        return grpc.ssl_channel_credentials(root_certificates=Path(self.ca).read_bytes(),
                                            private_key=Path(self.key).read_bytes(),
                                            certificate_chain=Path(self.cert).read_bytes())

    def channel_options(self) -> list[tuple[str, str]]:
        return [] if self.server_name is None else [("grpc.ssl_target_name_override", self.server_name)]


def load_token(path: str | os.PathLike[str]) -> str:
    """The job token in `path` (surrounding whitespace stripped); ValueError naming the file if unusable."""
    try:
        token = Path(path).read_text().strip()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValueError(f"cannot read the job token file {str(path)!r}: {exc}") from exc
    if not token:
        raise ValueError(f"the job token file {str(path)!r} is empty")
    if any(c.isspace() for c in token) or not token.isprintable():
        raise ValueError(f"the job token in {str(path)!r} must be one printable word without spaces")
    return token


def token_metadata(token: str | None) -> tuple[tuple[str, str], ...] | None:
    return None if token is None else ((TOKEN_METADATA_KEY, f"Bearer {token}"),)


def is_loopback(host: str) -> bool:
    """Whether `host` is a loopback address (or `localhost`); names other than `localhost` count as not."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


class TokenCheck(grpc.ServerInterceptor):
    """Answers UNAUTHENTICATED to every call whose metadata lacks `authorization: Bearer <job token>`."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

        def deny(request: Any, context: grpc.ServicerContext) -> Any:
            context.abort(grpc.StatusCode.UNAUTHENTICATED, "this agent requires the job token "
                          f"('{TOKEN_METADATA_KEY}: Bearer <token>' in the call metadata)")

        self._deny_unary = grpc.unary_unary_rpc_method_handler(deny)
        self._deny_stream = grpc.unary_stream_rpc_method_handler(deny)

    def intercept_service(self, continuation: Callable[[Any], Any], details: grpc.HandlerCallDetails) -> Any:
        given = ""
        for key, value in details.invocation_metadata or ():
            if key == TOKEN_METADATA_KEY:
                given = value if isinstance(value, str) else value.decode(errors="replace")
        if hmac.compare_digest(given.encode(), self._expected):
            return continuation(details)
        handler = continuation(details)
        if handler is None:
            return None
        return self._deny_stream if handler.response_streaming else self._deny_unary
