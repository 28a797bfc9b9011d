"""What the emulated cluster's launcher gives its agents: the market's plan of node additions and kills, each
agent's ``bamboo-launch agent`` command line, and the job's spec, written before any agent starts."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from bamboo.bench.emulated.market import ActionKind, MarketAction, plan_market
from bamboo.bench.emulated.run_options import RunError, RunOptions

if TYPE_CHECKING:
    from bamboo.launch.spec import SpecFields
    from bamboo.membership import KeyValueStore, MembershipStore

__all__ = ["agent_command", "initial_plan", "run_spec_fields", "write_spec"]


def initial_plan(options: RunOptions) -> tuple[MarketAction, ...]:
    """The market plan: the trace's, or (without ``--preemptions``) ``nodes`` adds at t=0 over the zones."""
    from bamboo.bench.preemptions import load_preemptions  # numpy and the loaders: the launcher's only

    if options.preemptions is None:
        zones = options.zones or ("zone-a", "zone-b", "zone-c")
        return tuple(
            MarketAction(0.0, ActionKind.ADD, f"n{i}", zones[i % len(zones)]) for i in range(options.nodes)
        )
    trace = load_preemptions(options.preemptions, nodes=options.nodes, zones=options.zones, hours=options.hours,
                             seed=options.trace_seed)
    return plan_market(trace.events(), time_scale=options.time_scale, allocation_delay_s=options.allocation_delay_s,
                       notice_s=options.notice_s)


def agent_command(options: RunOptions, job: str, endpoints: Sequence[str], run_dir: Path, min_nodes: int,
                  node: str, zone: str) -> list[str]:
    """The ``bamboo-launch agent`` command line of one emulated node (the same flags for every node): its job
    flags are :func:`run_spec_fields` written as flags, so they match the spec the launcher writes."""
    from bamboo.launch.agent import agent_argv
    from bamboo.launch.spec import FLAG_OF

    command = [*agent_argv(), "--job", job, "--node", node, "--zone", zone,
               "--host", "127.0.0.1", "--port", "0", "--run-dir", str(run_dir)]
    fields = run_spec_fields(options, min_nodes)
    for field, value in fields.items():
        if field == "size":
            command += ["--layers", str(fields["size"]["layers"])]
        elif field == "resume":
            command += ["--resume"]
        elif field != "script":  # the script goes last, after --
            command += [FLAG_OF[field], str(value)]
    for endpoint in endpoints:
        command += ["--etcd", endpoint]
    for flag, secret in (("--etcd-user", options.etcd_user), ("--etcd-password", options.etcd_password),
                         ("--etcd-ca", options.etcd_ca), ("--etcd-cert", options.etcd_cert),
                         ("--etcd-key", options.etcd_key)):
        if secret is not None:
            command += [flag, secret]
    if options.notice_s > 0:  # the market's SIGTERM comes this long before its kill
        command += ["--notice-window", str(options.notice_s)]
    if options.device is not None:
        command += ["--device", options.device]
    script = fields.get("script", ())
    if script:
        command += ["--", *script]
    return command


def run_spec_fields(options: RunOptions, min_nodes: int) -> SpecFields:
    """The job-spec fields of a run (field -> value, as an agent's flags parse them): what the launcher writes
    as the job's spec before it starts the agents, and what :func:`agent_command` passes each agent."""
    fields: SpecFields = {
        "stages": options.stages, "pipelines": options.pipelines, "steps": options.steps, "min_nodes": min_nodes,
        "redundancy": options.redundancy, "seed": options.seed, "ttl": options.ttl, "grace_s": float(options.grace_s),
        "reconfigure_timeout_s": float(options.reconfigure_timeout_s), "checkpoint_every": options.checkpoint_every,
        "memory_copy_every": options.memory_copy_every,
    }
    if options.preemption_rate is not None:
        fields["preemptions_per_node_hour"] = float(options.preemption_rate)
    if options.resume:
        fields["resume"] = True
    if options.confirm_timeout_s is not None:
        fields["confirm_timeout_s"] = float(options.confirm_timeout_s)
    if options.group_timeout_s is not None:
        fields["group_timeout_s"] = float(options.group_timeout_s)
    if options.checkpoint_dir:
        fields["checkpoint_dir"] = str(Path(options.checkpoint_dir).resolve())
    if options.script:
        fields["script"] = (str(Path(options.script[0]).resolve()), *options.script[1:])
    elif "layers" in options.size:
        fields["size"] = {"layers": int(options.size["layers"])}
    return fields


def write_spec(kv: KeyValueStore, membership: MembershipStore, job: str, options: RunOptions, min_nodes: int,
               run_dir: Path, say: Callable[[str], None]) -> None:
    """Write the job's spec (and its ``run_start`` record) before any agent starts, so that no agent has to
    read the model: the launcher describes it, as the first agent of a job started by hand would
    (:func:`bamboo.launch.agent_spec.describe_model`: the built-in example from its size, a script in a child
    process), so that the launcher itself never imports torch to start a job. The agents check their flags against
    it as against any stored spec."""
    from bamboo.launch.agent_options import AgentError
    from bamboo.launch.agent_spec import describe_model, new_spec
    from bamboo.launch.events import EtcdEventLog, RunStart

    fields = run_spec_fields(options, min_nodes)
    say("reading the model")
    try:
        spec = new_spec(job, fields, describe_model(fields, run_dir / "logs" / "describe.log"))
    except AgentError as error:
        raise RunError(str(error)) from None
    won, _ = kv.create(membership.keys.root + "spec", spec.to_json().encode())
    if not won:
        raise RunError(f"job {job} already exists in etcd; use a new --job")
    events = EtcdEventLog(kv, job, "launcher", spec.created_unix)
    events.write(RunStart(t=events.now(), job=job, unix_time=spec.created_unix,
                          target_nodes=spec.first_layout_nodes, stages=spec.stages, pipelines=spec.pipelines))
    events.close()
