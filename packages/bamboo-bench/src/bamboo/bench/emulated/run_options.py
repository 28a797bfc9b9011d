"""What ``bamboo-launch run`` takes (:class:`RunOptions`), what a run leaves (:class:`RunResult`), what a
callback can act on while it trains (:class:`RunHandles`), and its one error (:class:`RunError`)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

import attrs
from bamboo.bench.emulated import timeouts as emulated_timeouts
from bamboo.launch import timeouts
from bamboo.launch.spec import (
    AUTO_EVERY,
    DEFAULT_REDUNDANCY,
    DEFAULT_STEPS,
    REDUNDANCY,
    Every,
    steps_or_auto_at_least,
)
from bamboo.launch.worker_records import WorkerReport
from bamboo.membership import timeouts as membership_timeouts

if TYPE_CHECKING:
    from bamboo.bench.emulated.processes import ProcessCluster
    from bamboo.membership import EmbeddedEtcd, MembershipStore

__all__ = ["RunError", "RunHandles", "RunOptions", "RunResult", "Verification", "WorkerReport"]


class RunError(RuntimeError):
    """The run could not start or finish; the message says why."""


_POSITIVE = attrs.validators.gt(0)
_MODULE_NAME = attrs.validators.deep_iterable(attrs.validators.matches_re(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)*"))


def _script_file(instance: object, attribute: attrs.Attribute, value: tuple[str, ...]) -> None:
    if not value:
        return
    path = Path(value[0])
    if not path.exists():
        raise ValueError(f"script {value[0]!r} not found")
    if not path.is_file():
        raise ValueError(f"script {value[0]!r} is not a file")


@attrs.frozen
class RunOptions:
    """Everything ``bamboo-launch run`` takes (see ``bamboo-launch run --help``)."""

    nodes: int = attrs.field(default=8, validator=_POSITIVE)
    stages: int = attrs.field(default=4, validator=_POSITIVE)
    pipelines: int = attrs.field(default=2, validator=_POSITIVE)
    steps: int = attrs.field(default=DEFAULT_STEPS, validator=_POSITIVE)
    zones: tuple[str, ...] | None = None
    etcd: tuple[str, ...] | None = None
    etcd_user: str | None = None
    etcd_password: str | None = attrs.field(default=None, repr=False)
    etcd_ca: str | None = None
    etcd_cert: str | None = None
    etcd_key: str | None = None
    preemptions: str | None = None
    time_scale: float = attrs.field(default=60.0, validator=_POSITIVE)
    hours: float = attrs.field(default=1.0, validator=_POSITIVE)
    trace_seed: int = 0
    allocation_delay_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    notice_s: float = attrs.field(default=0.0, validator=attrs.validators.ge(0))
    checkpoint_dir: str | None = None
    """Where the job's checkpoints go (None: ``RUN_DIR/checkpoints``; a job never runs without them)."""
    checkpoint_every: Every = attrs.field(default=AUTO_EVERY, validator=steps_or_auto_at_least(1))
    """Steps between checkpoints, or ``auto``: each generation's, by Young's rule
    (:mod:`bamboo.launch.restore_interval`)."""
    memory_copy_every: Every = attrs.field(default=AUTO_EVERY, validator=steps_or_auto_at_least(0))
    """Steps between in-memory copies of every stage (0: none), or ``auto``: each generation's."""
    resume: bool = False
    """Start from the newest good checkpoint in ``checkpoint_dir`` (refused when it has none)."""
    confirm_timeout_s: float | None = None
    """The runtime's confirm timeout (None: bamboo-rc's default)."""
    group_timeout_s: float | None = None
    """The runtime's gloo group timeout (None: bamboo-rc's default)."""
    reconfigure_timeout_s: float = attrs.field(default=timeouts.RECONFIGURE_TIMEOUT_S, validator=_POSITIVE)
    run_dir: str | None = None
    events: str | None = None
    job: str | None = None
    redundancy: str = attrs.field(default=DEFAULT_REDUNDANCY, validator=attrs.validators.in_(REDUNDANCY))
    preemption_rate: float | None = attrs.field(default=None, validator=attrs.validators.optional(
        attrs.validators.ge(0)))
    """Preemptions per node-hour that ``--redundancy auto`` assumes before the job's own history (None: default)."""
    size: dict[str, int] = attrs.field(factory=dict)
    seed: int = 0
    ttl: int = attrs.field(default=membership_timeouts.LEASE_TTL_S, validator=_POSITIVE)
    grace_s: float = attrs.field(default=membership_timeouts.GRACE_PERIOD_S, validator=_POSITIVE)
    timeout_s: float = attrs.field(default=emulated_timeouts.RUN_TIMEOUT_S, validator=_POSITIVE)
    live: bool = False
    progress_every: int = attrs.field(default=10, validator=_POSITIVE)
    """Without the live view, a progress line each time the step crosses a multiple of this."""
    device: str | None = None
    """Every worker's device (``--device``: ``cpu``, ``cuda``, ``cuda:N``, ``auto``); None: the workers' default."""
    fork_server: bool = True
    """Fork every node's agent and worker from one preloaded interpreter (:mod:`bamboo.bench.emulated.forkserver`)
    instead of exec'ing each; the same processes, groups and files."""
    preload: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_MODULE_NAME)
    """Modules the fork server imports too, before it forks a node (``--preload``): a training script's own heavy
    imports, which every worker would otherwise import by itself (a Hugging Face model's code: about 3.8 CPU-s a
    worker for GPT-2)."""
    script: tuple[str, ...] = attrs.field(default=(), converter=tuple, validator=_script_file)
    """``SCRIPT ARGS``: a training script calling :func:`bamboo.launch.train_worker`; empty: the built-in example."""

    def __attrs_post_init__(self) -> None:
        if self.nodes < self.stages * self.pipelines:
            raise ValueError(
                f"--nodes {self.nodes} cannot hold {self.pipelines} pipelines of {self.stages} stages "
                f"(needs at least {self.stages * self.pipelines})"
            )
        if self.preload and not self.fork_server:
            raise ValueError(f"--preload {' '.join(self.preload)} needs the fork server: drop --no-fork-server")
        if self.resume and self.checkpoint_dir is None and self.run_dir is None:
            raise ValueError("--resume needs --checkpoint-dir, or the --run-dir of the run to resume (its checkpoints)")


class Verification(TypedDict):
    """``--verify``'s comparison with the fault-free single-process run: the steps compared, the largest relative
    difference of a tensor, the tensors compared and the layouts' ``(first step, pipelines)`` history."""

    steps: int
    max_relative_diff: float
    tensors: int
    history: list[list[int]]


@attrs.frozen
class RunResult:
    """What a run left: its directory, event log, per-rank final reports and the failures seen.

    ``failed_ranks`` are the ranks published as failed (each in the layout of its time);
    ``failed_nodes`` the nodes the membership detector declared failed (standby ones included).
    ``reports`` are keyed by the final rank of each worker that finished. ``exit_codes`` are the agents'
    (negative: killed by the market). ``job_error`` is the error the job ended with, if it could not go on.
    """

    run_dir: Path
    events: Path
    reports: dict[int, WorkerReport]
    failed_ranks: tuple[int, ...]
    failed_nodes: tuple[str, ...]
    node_of_rank: dict[int, str]
    exit_codes: dict[str, int | None]
    timed_out: bool
    seconds: float
    job_error: str | None = None
    worker_errors: tuple[tuple[str, str], ...] = ()
    """``(node, last exception line)`` of every worker that failed with an exception, the earliest first."""
    stalled: str | None = None
    """Why the run stopped before its job ended, with no market node left to start (every node gone, or too few
    for one pipeline): None when the job ended, the run timed out or it was stopped."""

    @property
    def consecutive(self) -> str | None:
        """The consecutive-failure message of a worker that stopped on one, if any."""
        return next((r["consecutive"] for r in self.reports.values() if r["consecutive"]), None)

    @property
    def steps_done(self) -> int:
        return min((r["steps_done"] for r in self.reports.values()), default=0)


@attrs.frozen
class RunHandles:
    """What a ``during`` callback of :func:`run_cluster` can act on while the job trains."""

    etcd: EmbeddedEtcd | None
    """The run's embedded etcd (None: an external one)."""
    cluster: ProcessCluster
    membership: MembershipStore
    node_of_rank: dict[int, str]
    preempt: Callable[[str], None]
    events: Path
    finish: Callable[[], None]
    """Ask the job to end at its next step boundary (:func:`bamboo.launch.finish.request_finish`)."""
    step: Callable[[], int]
    """The last step in the job's event log so far (0 before the first)."""
