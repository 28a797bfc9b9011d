"""``bamboo-launch agent --job J --etcd HOST:PORT ... [-- SCRIPT ARGS]``: one machine's agent (:mod:`bamboo.launch.agent`).

Before it writes anything to etcd, the command checks what it can check on its own machine: the flags, the
script, the token and TLS files, and that an address beyond loopback has a job token or mutual TLS. Then it
waits for etcd (saying so at once when etcd does not answer, and giving up with one line after
``--etcd-timeout``), refuses a node id that a live agent of the job already registered (two agents on one
host without ``--node`` both take the host name), and runs the agent.

The job-spec flags default to ``None`` (only the flags given are checked against a stored spec); their help
shows :class:`bamboo.launch.spec.JobSpec`'s defaults, which the first agent writes.
"""

from __future__ import annotations

import argparse
import os
import socket
import time
from pathlib import Path
from typing import cast

from bamboo.bench.argtypes import default_of, non_negative_float, positive_float
from bamboo.launch import timeouts
from bamboo.launch.agent import AgentError, AgentOptions, default_run_dir, run_agent, say_line
from bamboo.launch.cli.common import DEVICE_HELP, device, endpoints, fail, steps_or_auto_flag
from bamboo.launch.example import DEFAULT_LAYERS
from bamboo.launch.spec import (
    AUTO_EVERY,
    FLAG_OF,
    REDUNDANCY,
    EtcdAccess,
    JobSpec,
    SpecError,
    SpecFields,
)
from bamboo.membership import EtcdKV, MembershipStore, StoreError, StoreUnavailableError
from bamboo.membership.agent import is_loopback
from bamboo.membership.cloud import PREEMPTION_NOTICE_KINDS
from bamboo.membership.timeouts import LEASE_TTL_S
from bamboo.rc.timeouts import DEFAULT_PREEMPTIONS_PER_NODE_HOUR

__all__ = ["AGENT_USAGE_LINE", "SPEC_FLAGS", "add_parser", "agent_spec_fields", "run"]

AGENT_USAGE_LINE = (
    "bamboo-launch agent --job J --etcd HOST:PORT[,...] --stages P --pipelines D [--zone Z | --k8s-node NAME] "
    "[--steps S] [--host ADDR] [--port N] [--checkpoint-dir DIR] [--ttl S] [--grace S] [etcd TLS and auth flags] "
    "[options] [-- SCRIPT ARGS]"
)

SPEC_FLAGS = {flag[2:].replace("-", "_"): field for field, flag in FLAG_OF.items()
              if field not in ("size", "script")}
"""The agent's flags that set fields of the job's spec (argparse dest -> spec field), from the spec's own table
(``--layers`` sets ``size``; a script after ``--`` sets ``script``)."""


def _spec_default(field: str) -> object:
    """The default of the job spec's ``field``, as a flag's help shows it (the spec owns every default)."""
    return default_of(JobSpec, field)


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``agent``."""
    agent = subparsers.add_parser(
        "agent",
        help="one machine's agent: registration, failure detection, the job-wide duties, the worker",
        usage=AGENT_USAGE_LINE,
        description=(
            "Run one machine of a Bamboo job. Every machine of a cluster runs exactly one agent, and there is "
            "no other process: the agents agree on the job's spec in etcd (the first one writes it; a flag that "
            "conflicts with it is an error), register under leases, detect failures (gRPC probes, leases), elect "
            "one of them to publish confirmed failures and write the first layout, and each spawns its worker, "
            "which waits warm for a role and trains through failovers and reconfigurations. Flags marked (spec) "
            "are the job's: they are needed, or checked, as described. The agent exits 0 when the job ends, 1 "
            "when the job cannot go on (the error is printed), 2 on bad input, 3 when a preemption notice's "
            "deadline passed. Without a script after --, it trains the built-in example (a tiny GPT)."
        ),
    )
    _add_job_flags(agent.add_argument_group("the job (spec)"))
    _add_machine_flags(agent)
    _add_auth_and_etcd_flags(agent)
    agent.set_defaults(handler=run, script=[])


def _add_job_flags(job: argparse._ArgumentGroup) -> None:
    job.add_argument("--job", required=True, help="the job's name: its keys live under /bamboo/JOB/ in etcd")
    job.add_argument("--stages", type=int, default=None,
                     help="(spec) pipeline depth P; needed by the agent that creates the job")
    job.add_argument("--pipelines", type=int, default=None,
                     help="(spec) data-parallel pipelines D wanted; needed by the agent that creates the job")
    job.add_argument("--steps", type=int, default=None,
                     help=f"(spec) training steps (default: {_spec_default('steps')})")
    job.add_argument("--min-nodes", type=int, default=None,
                     help="(spec) registered nodes the first layout waits for (default: P x D)")
    job.add_argument("--redundancy", default=None, choices=REDUNDANCY,
                     help="(spec) redundant computation mode; auto: chosen for each layout from the job's measured "
                     f"step and preemption rate (default: {_spec_default('redundancy')})")
    job.add_argument("--preemption-rate", type=non_negative_float, default=None, metavar="PER_NODE_HOUR",
                     help="(spec) with --redundancy auto: the preemptions per node-hour assumed before the job has "
                     f"history of its own (weighed as one node-hour against it; default: "
                     f"{DEFAULT_PREEMPTIONS_PER_NODE_HOUR:g})")
    job.add_argument("--layers", type=int, default=None,
                     help=f"(spec) decoder blocks of the built-in example GPT (default: {DEFAULT_LAYERS}; not with a "
                     "script)")
    job.add_argument("--seed", type=int, default=None,
                     help=f"(spec) the model's seed (default: {_spec_default('seed')})")
    job.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                     help="(spec) where asynchronous checkpoints go: storage every machine sees (default: none)")
    job.add_argument("--checkpoint-every", type=steps_or_auto_flag, default=None, metavar="N|auto",
                     help="(spec) steps between checkpoints, or auto: chosen for each layout by Young's rule from "
                     "the preemption rate and the measured cost of a copy (default: "
                     f"{_spec_default('checkpoint_every')})")
    job.add_argument("--memory-copy-every", type=steps_or_auto_flag, default=None, metavar="N|auto",
                     help="(spec) steps between in-memory copies of every stage, kept by its holders and by "
                     "keepers in other zones, restored before any checkpoint (0: none; auto: as --checkpoint-every "
                     f"auto; default: {_spec_default('memory_copy_every')})")
    job.add_argument("--resume", action="store_true", default=None,
                     help="(spec) start from the newest good checkpoint in --checkpoint-dir (a job never "
                     "overwrites another run's checkpoints: a directory that holds some needs --resume)")
    job.add_argument("--ttl", type=int, default=None,
                     help=f"(spec) lease TTL, seconds: a node silent this long is dead (default: "
                     f"{_spec_default('ttl'):g})")
    job.add_argument("--grace", type=positive_float, default=None,
                     help=f"(spec) seconds a suspect must stay unresponsive to its probes before it is declared "
                     f"dead; a stopped or partitioned node is only slow until then (default: "
                     f"{_spec_default('grace_s'):g})")
    job.add_argument("--confirm-timeout", type=positive_float, default=None,
                     help=f"(spec) seconds a worker that saw a peer fail waits for the failure to be confirmed "
                     f"before it gives up (default: {_spec_default('confirm_timeout_s'):g})")
    job.add_argument("--group-timeout", type=positive_float, default=None,
                     help=f"(spec) gloo timeout of every group: bounds an operation on a live but stuck peer "
                     f"(default: {_spec_default('group_timeout_s'):g})")
    job.add_argument("--reconfigure-timeout", type=positive_float, default=None,
                     help=f"(spec) seconds a reconfiguration may take to start every node before it is abandoned "
                     f"and decided again (default: {_spec_default('reconfigure_timeout_s'):g})")


def _add_machine_flags(agent: argparse.ArgumentParser) -> None:
    where = agent.add_argument_group("this machine")
    where.add_argument("--node", default=None,
                       help="this agent's unique id (default: $BAMBOO_NODE_ID, else the host name)")
    zone = where.add_mutually_exclusive_group()
    zone.add_argument("--zone", default=None, help="this machine's zone (default: $BAMBOO_ZONE)")
    zone.add_argument("--k8s-node", default=None, metavar="NAME",
                      help="the Kubernetes node: the zone is its topology.kubernetes.io/zone label")
    where.add_argument("--host", default=default_of(AgentOptions, "host"),
                       help="the address the gRPC service binds to and peers reach (default: %(default)s)")
    where.add_argument("--port", type=int, default=default_of(AgentOptions, "port"),
                       help="the gRPC port (default: %(default)s, a free one)")
    where.add_argument("--run-dir", default=None,
                       help="where this machine's files go: worker contexts, out/rank<R>.pt (default: "
                       "$TMPDIR/bamboo-JOB)")
    where.add_argument("--events", default=None, metavar="OUT.jsonl",
                       help="also append this agent's event records to a local JSON-lines file")
    where.add_argument("--notice-window", type=positive_float, default=default_of(AgentOptions, "notice_window_s"),
                       help="seconds from SIGTERM (a preemption notice) to the machine's end (default: "
                       "%(default)s)")
    where.add_argument("--preemption-notices", default=default_of(AgentOptions, "preemption_notices"),
                       choices=PREEMPTION_NOTICE_KINDS,
                       help="also poll the cloud's metadata server for preemption notices: AWS spot "
                       "instance-action (IMDSv2) or GCE instance/preempted (default: none)")
    where.add_argument("--metadata-url", default=None,
                       help="base URL of the metadata server (default: the cloud's own)")
    where.add_argument("--device", type=device, default=None, help=DEVICE_HELP)
    where.add_argument("--spec-timeout", type=positive_float, default=None,
                       help="seconds to wait for another agent to write the job's spec (default: "
                       f"{default_of(AgentOptions, 'spec_timeout_s'):g})")
    where.add_argument("--etcd-timeout", type=positive_float, default=timeouts.ETCD_OUTAGE_S, metavar="S",
                       help="seconds to wait for etcd to answer when the agent starts; it says at once that it "
                       "waits, and gives up after this with one line (default: %(default)s)")


def _add_auth_and_etcd_flags(agent: argparse.ArgumentParser) -> None:
    auth = agent.add_argument_group("who may call this agent (required beyond loopback)")
    auth.add_argument("--token-file", default=None,
                      help="a file with the job's shared token: calls without it are refused")
    auth.add_argument("--tls-cert", default=None, help="PEM certificate of this agent (mutual TLS, with --tls-key)")
    auth.add_argument("--tls-key", default=None, help="PEM private key of this agent")
    auth.add_argument("--tls-ca", default=None,
                      help="PEM CA that the job's agents' certificates are signed by (mutual TLS)")
    auth.add_argument("--tls-server-name", default=None,
                      help="the name peers check in the agents' certificates, when one certificate serves every "
                      "agent (pod IPs change; default: the address dialled)")
    auth.add_argument("--insecure", action="store_true",
                      help="listen beyond loopback with neither a token nor mutual TLS (anyone who reaches the "
                      "port could drain the job)")
    etcd = agent.add_argument_group("etcd")
    etcd.add_argument("--etcd", type=endpoints, action="append", required=True, metavar="HOST:PORT[,...]",
                      help="etcd client endpoints (repeat the flag or separate with commas)")
    etcd.add_argument("--etcd-user", default=None, help="etcd user name (with --etcd-password)")
    etcd.add_argument("--etcd-password", default=None, help="etcd password")
    etcd.add_argument("--etcd-ca", default=None, help="PEM CA of the etcd server (enables TLS)")
    etcd.add_argument("--etcd-cert", default=None, help="PEM client certificate for etcd (with --etcd-key)")
    etcd.add_argument("--etcd-key", default=None, help="PEM client key for etcd")


def agent_spec_fields(args: argparse.Namespace) -> SpecFields:
    """The job-spec fields that ``bamboo-launch agent``'s parsed flags ``args`` give (field -> value)."""
    spec = cast("SpecFields", {field: getattr(args, dest) for dest, field in SPEC_FLAGS.items()
                                if getattr(args, dest) is not None})
    if args.checkpoint_dir is not None:
        spec["checkpoint_dir"] = str(Path(args.checkpoint_dir).resolve())
    if args.script:
        spec["script"] = tuple(args.script)
    if args.layers is not None:
        spec["size"] = {"layers": args.layers}
    return spec


def _check_flags(args: argparse.Namespace) -> None:
    """The checks that need nothing but this machine (one line each)."""
    for name in ("stages", "pipelines", "steps", "min_nodes", "checkpoint_every", "ttl", "layers"):
        value = getattr(args, name)
        if value is not None and value != AUTO_EVERY and value < 1:
            fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.memory_copy_every not in (None, AUTO_EVERY) and args.memory_copy_every < 0:
        fail(f"--memory-copy-every must be >= 0, got {args.memory_copy_every}")
    if args.seed is not None and args.seed < 0:
        fail(f"--seed must be >= 0, got {args.seed}")
    if args.script and args.layers is not None:
        fail("--layers sizes the built-in example; a script describes its own layers")
    if args.script and not Path(args.script[0]).is_file():
        fail(f"script {args.script[0]!r} not found" if not Path(args.script[0]).exists()
             else f"script {args.script[0]!r} is not a file")
    for flag, path in (("--token-file", args.token_file), ("--tls-cert", args.tls_cert), ("--tls-key", args.tls_key),
                       ("--tls-ca", args.tls_ca)):
        if path is not None and not Path(path).is_file():
            fail(f"{flag} {path}: no such file")
    if args.token_file is not None and not Path(args.token_file).read_text().strip():
        fail(f"--token-file {args.token_file} is empty: it holds the job's token")
    mutual_tls = args.tls_cert is not None and args.tls_ca is not None
    if not is_loopback(args.host) and not args.insecure and args.token_file is None and not mutual_tls:
        fail(f"--host {args.host} is beyond loopback: give the job's token (--token-file) or mutual TLS (--tls-cert, "
             "--tls-key and --tls-ca), or pass --insecure to let any process that reaches the port call the agent")


def _options(args: argparse.Namespace) -> AgentOptions:
    etcd = tuple(endpoint for group in args.etcd for endpoint in group)
    try:
        return AgentOptions(
            job=args.job,
            etcd=EtcdAccess(etcd, user=args.etcd_user, password=args.etcd_password, ca=args.etcd_ca,
                            cert=args.etcd_cert, key=args.etcd_key),
            node=args.node or os.environ.get("BAMBOO_NODE_ID") or socket.gethostname(),
            zone=args.zone if args.zone is not None else os.environ.get("BAMBOO_ZONE", ""),
            k8s_node=args.k8s_node, host=args.host, port=args.port,
            run_dir=str(Path(args.run_dir or default_run_dir(args.job)).resolve()), events=args.events,
            spec=agent_spec_fields(args), token_file=args.token_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_ca=args.tls_ca, tls_server_name=args.tls_server_name, insecure=args.insecure,
            notice_window_s=args.notice_window, preemption_notices=args.preemption_notices,
            metadata_url=args.metadata_url, device=args.device,
            **({"spec_timeout_s": args.spec_timeout} if args.spec_timeout is not None else {}),
        )
    except AgentError as error:
        fail(str(error))


def wait_for_etcd(membership: MembershipStore, where: str, timeout_s: float) -> None:
    """Return once etcd answers; say at once when it does not, and fail with one line after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    said = False
    while True:
        try:
            membership.kv.get(membership.keys.root + "spec")
            return
        except StoreUnavailableError as error:
            if time.monotonic() >= deadline:
                fail(f"{error} (tried for {timeout_s:g} s, --etcd-timeout)")
            if not said:
                say_line(f"etcd at {where} does not answer; trying again for up to {timeout_s:g} s (--etcd-timeout)")
                said = True
            time.sleep(timeouts.ETCD_RETRY_S)


def refuse_a_live_twin(membership: MembershipStore, node: str, given_ttl: int | None) -> None:
    """Fail when a live agent of the job already registered as ``node``. A record left by a dead agent (one that
    crashed and is started again) expires within its lease's TTL: wait that long before refusing."""
    key = membership.keys.node(node)
    if membership.kv.get(key) is None:
        return
    stored = membership.kv.get(membership.keys.root + "spec")
    try:
        ttl = JobSpec.from_json(stored.value).ttl if stored is not None else given_ttl or LEASE_TTL_S
    except SpecError:
        ttl = given_ttl or LEASE_TTL_S
    say_line(f"node {node} is registered already; waiting up to {ttl} s for that registration to expire")
    deadline = time.monotonic() + ttl + 1.0
    while membership.kv.get(key) is not None:
        if time.monotonic() >= deadline:
            fail(f"node id {node!r} is taken: another live agent of job {membership.keys.job} registered it (two "
                 "agents on one host both default to the host name); give each agent its own --node")
        time.sleep(timeouts.SPEC_POLL_S)


def run(args: argparse.Namespace) -> int:
    """``agent``: the local checks, etcd, the node id, then the agent until the job ends."""
    _check_flags(args)
    options = _options(args)
    kv = EtcdKV(options.etcd.options())
    try:
        membership = MembershipStore(kv, options.job)
        wait_for_etcd(membership, ",".join(options.etcd.endpoints), args.etcd_timeout)
        refuse_a_live_twin(membership, options.node, args.ttl)
    except StoreError as error:
        fail(f"etcd at {','.join(options.etcd.endpoints)}: {error}")
    finally:
        kv.close()
    return run_agent(options)
