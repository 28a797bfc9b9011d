"""How the agents of a job agree on its spec: the first writes it (after reading the model's description: a
script's in a child process, so that an agent never imports torch, the built-in example's from its size), every
other one checks its flags against it."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from bamboo.launch import timeouts
from bamboo.launch.agent_options import AgentError, AgentOptions
from bamboo.launch.spec import JobSpec, ModelDescription, SpecFields

if TYPE_CHECKING:
    from bamboo.membership import KeyValueStore, MembershipStore

__all__ = ["describe_model", "ensure_spec", "new_spec", "refuse_used_checkpoint_dir"]

logger = logging.getLogger(__name__)


def describe_model(fields: SpecFields, log: Path) -> ModelDescription:
    """The model's description for the job's spec fields ``fields``: ``{"layers", "config", "micro_batches"}``.

    A script is run in ``describe`` mode in a child process (its output goes to ``log``), so that an agent never
    imports torch. The built-in example's follows from its size (:func:`bamboo.launch.example.describe_example`),
    here, without torch.
    """
    from bamboo.launch.script import ScriptError, describe_script

    pipelines = int(fields["pipelines"])
    script = tuple(fields.get("script", ()))
    if script:
        try:
            return describe_script(script, log, pipelines=pipelines,
                                   timeout_s=timeouts.SCRIPT_DESCRIBE_TIMEOUT_S)
        except ScriptError as error:
            raise AgentError(str(error)) from None
    from bamboo.launch.example import DEFAULT_LAYERS, describe_example

    return describe_example(int(fields.get("size", {}).get("layers", DEFAULT_LAYERS)), pipelines)


def new_spec(job: str, fields: SpecFields, description: ModelDescription) -> JobSpec:
    """The spec of a new job from its fields and its model's description (:class:`AgentError` when invalid)."""
    try:
        return JobSpec(job=job, layers=description["layers"], config=description["config"],
                       micro_batches=int(description["micro_batches"]), created_unix=time.time(), **fields)
    except (TypeError, ValueError) as error:
        raise AgentError(str(error)) from None


def ensure_spec(membership: MembershipStore, options: AgentOptions,
                say: Callable[[str], None]) -> tuple[JobSpec, bool]:
    """The job's spec from etcd, written by this agent when there is none yet; returns (spec, written here).

    Raises :class:`AgentError` when this agent's flags conflict with the stored spec.
    """
    kv, key = membership.kv, membership.keys.root + "spec"
    deadline = time.monotonic() + options.spec_timeout_s
    while True:
        found = kv.get(key)
        if found is not None:
            spec = JobSpec.from_json(found.value)
            conflicts = spec.conflicts(options.spec)
            if conflicts:
                raise AgentError(f"job {options.job}: " + "; ".join(conflicts))
            return spec, False
        if "stages" not in options.spec or "pipelines" not in options.spec:
            raise AgentError(f"job {options.job} has no spec in etcd yet: the first agent needs --stages and "
                             "--pipelines to create it")
        lease_ttl = max(1, int(options.spec.get("ttl", 2))) + 8
        lease = kv.grant_lease(lease_ttl)
        won, holder = kv.create(membership.keys.root + "spec-writer", options.node.encode(), lease=lease)
        if not won:
            kv.revoke_lease(lease)
            if time.monotonic() > deadline:
                raise AgentError(f"job {options.job}: no spec within {options.spec_timeout_s:g} s (agent "
                                 f"{holder.value.decode(errors='replace')} was writing it)")
            time.sleep(timeouts.SPEC_POLL_S)
            continue
        try:
            refuse_used_checkpoint_dir(options.spec.get("checkpoint_dir"), bool(options.spec.get("resume")))
            say(f"writing the spec of job {options.job}: reading the model")
            fields = SpecFields(**options.spec)
            log = Path(options.run_dir) / "logs" / f"describe-{options.node}.log"
            log.parent.mkdir(parents=True, exist_ok=True)
            with _kept_alive(kv, lease, lease_ttl):
                description = describe_model(fields, log)
            spec = new_spec(options.job, fields, description)
            won, stored = kv.create(key, spec.to_json().encode())
            if not won:
                return JobSpec.from_json(stored.value), False
            return spec, True
        finally:
            kv.revoke_lease(lease)


@contextlib.contextmanager
def _kept_alive(kv: KeyValueStore, lease: int, ttl_s: float) -> Iterator[None]:
    """Refresh ``lease`` every third of ``ttl_s`` while the body runs. The model's description can outlast the
    spec writer's lease (a large model, a loaded machine): lapsed, it let a second agent describe the model too
    (measured: a 19 s description on a loaded 2-core machine, then a second one beside it). A refresh that fails
    (etcd away) ends the refreshes; the spec itself stays first-writer-wins."""
    stop = threading.Event()

    def refresh() -> None:
        while not stop.wait(ttl_s / 3):
            try:
                kv.refresh_lease(lease)
            except Exception as error:  # etcd away: the lease may lapse, and another agent describe it as well
                logger.warning("could not refresh the spec writer's lease: %s", error)
                return

    thread = threading.Thread(target=refresh, name="spec-writer-lease", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()


def refuse_used_checkpoint_dir(directory: str | None, resume: bool) -> None:
    """A new job never overwrites the checkpoints of another run: a checkpoint directory that holds some is
    refused unless the job resumes from them (:class:`AgentError`, one line)."""
    if directory is None or resume:
        return
    from bamboo.rc.checkpoint_files import list_checkpoints

    found = list_checkpoints(directory)
    if found:
        raise AgentError(f"--checkpoint-dir {directory} holds the checkpoints of another run (steps "
                         f"{', '.join(str(step) for step, _ in found[:3])}{', ...' if len(found) > 3 else ''}): pass "
                         "--resume to continue from the newest, or give an empty directory")
