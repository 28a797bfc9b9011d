"""What ``bamboo-launch agent`` takes: :class:`AgentOptions`, its one-line :class:`AgentError`, and the
defaults an agent derives from its flags (its run dir, the job-spec fields among them)."""

from __future__ import annotations

import tempfile
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import attrs
from bamboo.launch import timeouts
from bamboo.launch.spec import EtcdAccess, SpecFields
from bamboo.membership import timeouts as membership_timeouts

__all__ = ["AgentError", "AgentOptions", "default_run_dir", "split_flags"]


class AgentError(Exception):
    """Bad input for the agent (a flag, or a conflict with the job's stored spec): one line, exit status 2."""


@attrs.frozen
class AgentOptions:
    """Everything ``bamboo-launch agent`` takes (see ``bamboo-launch agent --help``).

    ``spec`` holds the job-spec fields this agent was given explicitly (field -> value, see
    :data:`bamboo.launch.spec.FLAG_OF`): the first agent writes them (with the defaults for the rest),
    later agents check them against the stored spec.
    """

    job: str
    etcd: EtcdAccess
    node: str
    zone: str = ""
    k8s_node: str | None = None
    host: str = "127.0.0.1"
    port: int = 0
    run_dir: str = "."
    events: str | None = None
    spec: SpecFields = attrs.field(factory=SpecFields)
    token_file: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None
    tls_ca: str | None = None
    tls_server_name: str | None = None
    """The name peers check in this agent's certificate (one certificate for every pod of the job)."""
    insecure: bool = False
    notice_window_s: float = membership_timeouts.NOTICE_WINDOW_S
    """Seconds from SIGTERM (a preemption notice) to the machine's end (``--notice-window``)."""
    preemption_notices: str = "none"
    """Also poll the cloud's metadata server for preemption notices: ``none``, ``aws`` or ``gce``."""
    metadata_url: str | None = None
    """The metadata server's base URL (default: the cloud's own)."""
    spec_timeout_s: float = timeouts.SPEC_WAIT_S
    device: str | None = None
    """The worker's device (``--device``, given to it as ``BAMBOO_DEVICE``); None: its own default."""

    def __attrs_post_init__(self) -> None:
        if not self.node or "/" in self.node:
            raise AgentError(f"--node must be a non-empty id without '/', got {self.node!r}")
        if (self.tls_cert is None) != (self.tls_key is None):
            raise AgentError(f"--tls-cert and --tls-key go together (got cert={self.tls_cert!r}, key={self.tls_key!r})")


def default_run_dir(job: str) -> str:
    """Where an agent keeps its files when ``--run-dir`` is not given."""
    return str(Path(tempfile.gettempdir()) / f"bamboo-{job}")


_Value = TypeVar("_Value")


def split_flags(values: Mapping[str, _Value], names: Sequence[str]) -> dict[str, _Value]:
    """The job-spec fields among ``values`` (the flags that were given: not None)."""
    return {name: values[name] for name in names if values.get(name) is not None}
