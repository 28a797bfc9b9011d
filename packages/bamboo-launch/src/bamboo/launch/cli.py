"""The ``bamboo-launch`` command line.

Subcommands (each one works end to end):

- ``bamboo-launch agent --job J --etcd HOST:PORT ... [-- SCRIPT ARGS]``: one machine's agent (see
  ``bamboo.launch.agent``): what every machine of a cluster runs, and what ``run`` starts per node;
- ``bamboo-launch run [...] [-- SCRIPT ARGS]``: train the built-in example, or a user script that
  calls ``bamboo.launch.train_worker`` (see ``bamboo.launch.script``), on an emulated spot cluster
  (embedded or external etcd, one agent per node, the spot market, failover and reconfiguration;
  see ``bamboo.launch.run``);
- ``bamboo-launch k8s render``: write the Kubernetes manifests of a job on EKS or GKE spot pools
  (validated against the Kubernetes schemas before they are written);
- ``bamboo-launch k8s validate FILE...``: validate YAML manifests against the Kubernetes schemas;
- ``bamboo-launch report (EVENTS.jsonl | --etcd URL --job J)``: the final report of a run from its event
  log, a local file or the job's log in etcd (``--json``, ``--plot OUT.png``);
- ``bamboo-launch market``: the emulated spot market, replaying a preemption trace against one
  process per node (see ``bamboo.launch.market``);
- ``bamboo-launch watch (EVENTS.jsonl | --etcd URL --job J)``: the live progress view of a run, following
  its event log;
- ``bamboo-launch measure {bamboo,checkpoint,on-demand}``: one system of a comparison on the emulated market
  (bamboo, the checkpoint/restart baseline, or on-demand nodes), its report and its measured profile (see
  ``bamboo.launch.measure``; ``bamboo-bench compare`` runs it once per system).

Bad input prints one line, ``bamboo-launch: error: ...``, and exits with status 2.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any, NoReturn

import attrs
from bamboo.launch.spec import MEMORY_COPY_EVERY
from bamboo.launch.timeouts import RUN_TIMEOUT_S

__all__ = ["agent_spec_fields", "build_parser", "main"]


VERIFY_TOLERANCE = 1e-6
"""``--verify`` fails above this relative difference from the fault-free single-process run."""


class CliError(Exception):
    """A user error: printed as one line, exit status 2."""


def _fail(message: str) -> NoReturn:
    raise CliError(message)


def _zones(text: str) -> tuple[str, ...]:
    zones = tuple(zone.strip() for zone in text.split(","))
    if not text or any(not zone for zone in zones):
        raise argparse.ArgumentTypeError(f"zones must be comma-separated names like a,b,c, got {text!r}")
    return zones


def _endpoints(text: str) -> tuple[str, ...]:
    endpoints = []
    for part in text.split(","):
        endpoint = part.strip()
        if endpoint.startswith("https://"):
            raise argparse.ArgumentTypeError(
                f"give etcd endpoints as host:port and TLS with --etcd-tls-secret, got {endpoint!r}"
            )
        endpoint = endpoint.removeprefix("http://").rstrip("/")
        if not endpoint:
            raise argparse.ArgumentTypeError(f"etcd endpoints must be host:port[,host:port...], got {text!r}")
        endpoints.append(endpoint)
    return tuple(endpoints)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _non_negative_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0, got {text!r}")
    return value


def _add_k8s(subparsers: argparse._SubParsersAction) -> None:
    from bamboo.launch.k8s import AGENT_ARGS_DOC, CLOUDS, ZONE_SPREADS, K8sConfig

    defaults = K8sConfig()
    k8s = subparsers.add_parser("k8s", help="Kubernetes manifests for EKS or GKE spot node pools")
    k8s_commands = k8s.add_subparsers(dest="k8s_command", required=True, metavar="{render,validate}")
    render = k8s_commands.add_parser(
        "render",
        help="write the manifests of a job (agents, etcd, RBAC, the job token, network policies)",
        usage="bamboo-launch k8s render [options] [-- SCRIPT ARGS...]",
        description=(
            "Write the Kubernetes objects of a Bamboo job: one agent per node spread across zones, an etcd "
            "StatefulSet (or --etcd URL of an external one), the minimum RBAC, spot-pool scheduling, the job "
            "token's Secret (or --agent-token-secret / --agent-tls-secret) and NetworkPolicies that admit only "
            "the job's agents. The manifests are validated against the Kubernetes schemas before they are "
            "written. Anything after -- is the training script the agents run, a path inside the image "
            "(default: the built-in example)."
        ),
        epilog=AGENT_ARGS_DOC,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    render.add_argument(
        "--job", default=defaults.job, help="job name: object names and etcd prefix (default: %(default)s)"
    )
    render.add_argument(
        "--namespace", default=defaults.namespace, help="namespace of the objects (default: %(default)s)"
    )
    render.add_argument(
        "--image",
        default=defaults.image,
        help="container image with bamboo-launch installed (default: %(default)s)",
    )
    render.add_argument(
        "--nodes", type=int, default=defaults.nodes, help="agents to run, one per node (default: %(default)s)"
    )
    render.add_argument(
        "--stages", type=int, default=defaults.stages, help="pipeline depth P (default: %(default)s)"
    )
    render.add_argument(
        "--pipelines",
        type=int,
        default=defaults.pipelines,
        help="data-parallel pipelines D (default: %(default)s)",
    )
    render.add_argument(
        "--steps", type=int, default=defaults.steps, help="training steps of the job (default: %(default)s)"
    )
    render.add_argument(
        "--cloud",
        choices=CLOUDS,
        default=defaults.cloud,
        help="spot pool to target: eks (capacityType=SPOT), gke (gke-spot=true), none (default: %(default)s)",
    )
    render.add_argument(
        "--zones",
        type=_zones,
        default=(),
        help="restrict agents to these zones, e.g. us-east-1a,us-east-1b (default: any)",
    )
    render.add_argument(
        "--zone-spread",
        choices=ZONE_SPREADS,
        default=defaults.zone_spread,
        help="best-effort: spread over zones but run anyway when a zone has no capacity; strict: never skew by more "
        "than one (default: %(default)s)",
    )
    render.add_argument(
        "--etcd",
        dest="etcd_endpoints",
        type=_endpoints,
        default=(),
        help="use this external etcd, host:port[,host:port...], instead of deploying one",
    )
    render.add_argument(
        "--etcd-tls-secret",
        default=None,
        help="external etcd only: a Secret with ca.crt, tls.crt and tls.key for TLS to etcd (default: no TLS)",
    )
    render.add_argument(
        "--etcd-auth-secret",
        default=None,
        help="external etcd only: a Secret with username and password keys for etcd auth (default: none)",
    )
    render.add_argument(
        "--etcd-replicas",
        type=int,
        default=defaults.etcd_replicas,
        help="etcd members to deploy: 1, 3 or 5 (default: %(default)s)",
    )
    render.add_argument("--etcd-image", default=defaults.etcd_image, help="etcd image (default: %(default)s)")
    render.add_argument(
        "--etcd-storage",
        default=defaults.etcd_storage,
        help="etcd volume size per member (default: %(default)s)",
    )
    render.add_argument("--cpu", default=defaults.cpu, help="CPU request per agent (default: %(default)s)")
    render.add_argument(
        "--memory", default=defaults.memory, help="memory request and limit per agent (default: %(default)s)"
    )
    render.add_argument(
        "--gpus-per-node",
        type=int,
        default=defaults.gpus_per_node,
        help="nvidia.com/gpu per agent, 0 for CPU (default: %(default)s)",
    )
    render.add_argument(
        "--grpc-port", type=int, default=defaults.grpc_port, help="agent gRPC port (default: %(default)s)"
    )
    render.add_argument(
        "--grace-period",
        dest="grace_period_s",
        type=int,
        default=defaults.grace_period_s,
        help="seconds from SIGTERM (a preemption notice) to the kill; GKE spot gives non-system pods 15 s, "
        "EKS a 2-minute notice through its node drain (default: %(default)s)",
    )
    render.add_argument(
        "--checkpoint-dir",
        default=defaults.checkpoint_dir,
        help="where --checkpoint-claim is mounted and the agents write checkpoints; without a claim the job "
        "writes none, since a pod's own disk cannot serve a restore (default: %(default)s)",
    )
    render.add_argument(
        "--checkpoint-claim",
        default=None,
        help="a ReadWriteMany PersistentVolumeClaim to mount at --checkpoint-dir for checkpoints (default: none, "
        "no checkpoints)",
    )
    auth = render.add_mutually_exclusive_group()
    auth.add_argument(
        "--agent-token-secret",
        default=None,
        metavar="NAME",
        help="an existing Secret whose key 'token' is the job token that calls to an agent must carry "
        "(default: render JOB-agent-token with a fresh random token; the output then contains a secret)",
    )
    auth.add_argument(
        "--agent-tls-secret",
        default=None,
        metavar="NAME",
        help="a Secret with ca.crt, tls.crt and tls.key: the agents authenticate each other with mutual TLS "
        "instead of a job token (default: a job token)",
    )
    render.add_argument(
        "--kubernetes-version",
        default="1.30",
        help="schema version to validate against (default: %(default)s)",
    )
    render.add_argument("--no-validate", action="store_true", help="skip the schema validation")
    render.add_argument(
        "-o",
        "--out",
        default="-",
        help="output: a YAML file, a directory (one file per object) or - for stdout (default: -)",
    )
    render.set_defaults(handler=_k8s_render, script=[])

    validate = k8s_commands.add_parser(
        "validate",
        help="validate YAML manifests against the Kubernetes schemas",
        description="Validate every object in the given YAML files against the Kubernetes JSON schemas (strict).",
    )
    validate.add_argument("files", nargs="+", help="YAML files, several documents each allowed")
    validate.add_argument(
        "--kubernetes-version", default="1.30", help="schema version (default: %(default)s)"
    )
    validate.set_defaults(handler=_k8s_validate)


_FLAG_OF_FIELD = {"etcd_endpoints": "--etcd", "grace_period_s": "--grace-period"}


def _flag_names(message: str) -> str:
    """Say ``--etcd-replicas`` where the config's validation says ``etcd_replicas``."""
    import re

    from bamboo.launch.k8s import K8sConfig

    for field in sorted((f.name for f in attrs.fields(K8sConfig)), key=len, reverse=True):
        flag = _FLAG_OF_FIELD.get(field, "--" + field.replace("_", "-"))
        message = re.sub(rf"(?<![\w-])'?{field}'?(?![\w-])", flag, message)
    return message


def _k8s_render(args: argparse.Namespace) -> int:
    from bamboo.launch.k8s import K8sConfig, dump_yaml, render_manifests, validate_manifests

    try:
        config = K8sConfig(
            job=args.job,
            namespace=args.namespace,
            image=args.image,
            nodes=args.nodes,
            stages=args.stages,
            pipelines=args.pipelines,
            steps=args.steps,
            cloud=args.cloud,
            zones=args.zones,
            zone_spread=args.zone_spread,
            etcd_endpoints=args.etcd_endpoints,
            etcd_tls_secret=args.etcd_tls_secret,
            etcd_auth_secret=args.etcd_auth_secret,
            etcd_replicas=args.etcd_replicas,
            etcd_image=args.etcd_image,
            etcd_storage=args.etcd_storage,
            cpu=args.cpu,
            memory=args.memory,
            gpus_per_node=args.gpus_per_node,
            grpc_port=args.grpc_port,
            grace_period_s=args.grace_period_s,
            checkpoint_dir=args.checkpoint_dir,
            checkpoint_claim=args.checkpoint_claim,
            agent_token_secret=args.agent_token_secret,
            agent_tls_secret=args.agent_tls_secret,
            script=tuple(args.script),
        )
    except (ValueError, TypeError) as error:
        _fail(_flag_names(str(error)))
    manifests = render_manifests(config)
    if not args.no_validate:
        validate_manifests(manifests, args.kubernetes_version)

    def text(objects: list[dict[str, Any]]) -> str:
        secrets = [m["metadata"]["name"] for m in objects if m["kind"] == "Secret"]
        warning = "".join(
            f"# Secret {name} holds the job token that every call to an agent must carry: keep this file "
            "private (or render with --agent-token-secret NAME of a Secret you manage).\n"
            for name in secrets
        )
        return warning + dump_yaml(objects)

    def write(path: Path, objects: list[dict[str, Any]]) -> None:
        private = any(m["kind"] == "Secret" for m in objects)
        if private:  # created private, before the secret is written
            path.touch(mode=0o600, exist_ok=True)
            path.chmod(0o600)
        path.write_text(text(objects), encoding="utf-8")

    if args.out == "-":
        sys.stdout.write(text(manifests))
        return 0
    out = Path(args.out)
    if out.is_dir() or args.out.endswith("/"):
        out.mkdir(parents=True, exist_ok=True)
        for index, manifest in enumerate(manifests):
            name = f"{index:02d}-{manifest['kind'].lower()}-{manifest['metadata']['name']}.yaml"
            write(out / name, [manifest])
    else:
        write(out, manifests)
    secret_note = "".join(
        f"; Secret {m['metadata']['name']} holds the job token: keep the output private"
        for m in manifests
        if m["kind"] == "Secret"
    )
    print(f"wrote {len(manifests)} objects to {out}{secret_note}", file=sys.stderr)
    return 0


def _k8s_validate(args: argparse.Namespace) -> int:
    import yaml
    from bamboo.launch.k8s import validate_manifests

    total = 0
    for name in args.files:
        try:
            text = Path(name).read_text(encoding="utf-8")
        except OSError as error:
            _fail(f"cannot read {name}: {error.strerror or error}")
        try:
            documents = [doc for doc in yaml.safe_load_all(text) if doc is not None]
        except yaml.YAMLError as error:
            _fail(f"{name}: not valid YAML: {str(error).splitlines()[0]}")
        try:
            validate_manifests(documents, args.kubernetes_version)
        except ValueError as error:
            _fail(f"{name}: {error}")
        total += len(documents)
    print(f"{total} objects in {len(args.files)} file(s) are valid Kubernetes {args.kubernetes_version}")
    return 0


def _add_report(subparsers: argparse._SubParsersAction) -> None:
    from bamboo.launch.report import DEFAULT_ON_DEMAND_PRICE, DEFAULT_SPOT_PRICE

    report = subparsers.add_parser(
        "report",
        help="the final report of a run from its JSON-lines event log",
        description=(
            "Compute throughput, node-hours, cost at spot prices against the same work at on-demand prices, "
            "and value (throughput per $/h) from a run's event log. Without --on-demand-throughput the "
            "on-demand cost is the same node-hours at the on-demand price."
        ),
    )
    report.add_argument(
        "events",
        nargs="*",
        help="the run's event log (JSON lines, see bamboo.launch.events); several logs of one run "
        "(say the launcher's and the market's, written with a shared start) are merged by time",
    )
    _add_etcd_source(report)
    report.add_argument("--json", action="store_true", help="print the report as one JSON object")
    report.add_argument(
        "--plot", metavar="OUT.png", help="also write the four-panel figure (nodes, throughput, cost, value)"
    )
    report.add_argument("--bins", type=int, default=60, help="time bins in the figure (default: %(default)s)")
    report.add_argument(
        "--spot-price",
        type=_positive_float,
        default=DEFAULT_SPOT_PRICE,
        help="$/h per spot GPU node (default: %(default)s)",
    )
    report.add_argument(
        "--on-demand-price",
        type=_positive_float,
        default=DEFAULT_ON_DEMAND_PRICE,
        help="$/h per on-demand GPU node (default: %(default)s)",
    )
    report.add_argument(
        "--on-demand-throughput",
        type=_positive_float,
        default=None,
        help="samples/s of a measured fault-free on-demand run (with --on-demand-nodes) to price the same work",
    )
    report.add_argument("--on-demand-nodes", type=int, default=None, help="nodes of that on-demand run")
    report.set_defaults(handler=_report)


def _report(args: argparse.Namespace) -> int:
    from bamboo.launch.report import Prices, compute_report, format_report, plot_report

    if args.bins < 1:
        _fail(f"--bins must be >= 1, got {args.bins}")
    try:
        prices = Prices(
            spot=args.spot_price,
            on_demand=args.on_demand_price,
            on_demand_throughput=args.on_demand_throughput,
            on_demand_nodes=args.on_demand_nodes,
        )
    except ValueError as error:
        _fail(
            str(error)
            .replace("on_demand_throughput", "--on-demand-throughput")
            .replace("on_demand_nodes", "--on-demand-nodes")
        )
    events = _source_events(args)
    report = compute_report(events, prices)
    if args.json:
        print(json.dumps(report.to_dict()))
    else:
        print(format_report(report))
    if args.plot:
        out = plot_report(events, args.plot, prices, args.bins)
        print(f"wrote {out}", file=sys.stderr)
    return 0


def _add_etcd_source(parser: argparse.ArgumentParser,
                     etcd_help: str = "read the job's event log from etcd (host:port[,host:port]) instead of a file",
                     job_help: str = "with --etcd: the job's name") -> None:
    parser.add_argument("--etcd", type=_endpoints, default=None, metavar="URL", help=etcd_help)
    parser.add_argument("--job", default=None, help=job_help)
    parser.add_argument("--etcd-user", default=None, help="etcd user name (with --etcd-password)")
    parser.add_argument("--etcd-password", default=None, help="etcd password")
    parser.add_argument("--etcd-ca", default=None, help="PEM CA of the etcd server (enables TLS)")
    parser.add_argument("--etcd-cert", default=None, help="PEM client certificate (with --etcd-key)")
    parser.add_argument("--etcd-key", default=None, help="PEM client key")


def _etcd_kv(args: argparse.Namespace) -> Any:
    from bamboo.membership import EtcdKV, EtcdOptions, StoreError

    try:
        return EtcdKV(EtcdOptions(endpoints=args.etcd, user=args.etcd_user, password=args.etcd_password,
                                  ca_cert=args.etcd_ca, cert_cert=args.etcd_cert, cert_key=args.etcd_key))
    except StoreError as error:
        _fail(str(error))


def _check_source(args: argparse.Namespace, files: Sequence[str]) -> None:
    if args.etcd is None and args.job is not None:
        _fail("--job needs --etcd (or give the event log file instead)")
    if args.etcd is not None:
        if args.job is None:
            _fail("--etcd needs --job (the job whose event log to read)")
        if files:
            _fail(f"give an event log file or --etcd with --job, not both (got {' '.join(files)})")
    elif not files:
        _fail("give the run's event log (EVENTS.jsonl), or --etcd URL --job J")


def _source_events(args: argparse.Namespace) -> list[Any]:
    """The events of a report: from the files given, or from the job's log in etcd."""
    from bamboo.launch.events import read_etcd_events, read_events
    from bamboo.membership import StoreError

    _check_source(args, args.events)
    if args.etcd is not None:
        kv = _etcd_kv(args)
        try:
            events = read_etcd_events(kv, args.job)
        except StoreError as error:
            _fail(str(error))
        finally:
            kv.close()
        if not events:
            _fail(f"job {args.job} has no event records in etcd at {','.join(args.etcd)}")
        return events
    events = []
    for name in args.events:
        try:
            events.extend(read_events(name))
        except OSError as error:
            _fail(f"cannot read {name}: {error.strerror or error}")
    return events


def _add_market(subparsers: argparse._SubParsersAction) -> None:
    market = subparsers.add_parser(
        "market",
        help="replay a preemption trace against one process per node (the emulated spot market)",
        usage="bamboo-launch market --preemptions FILE|synthetic:RATE [options] -- COMMAND [ARGS...]",
        description=(
            "The emulated spot market. Every trace add starts COMMAND as a new node (its own process group, "
            "with BAMBOO_NODE_ID and BAMBOO_ZONE set); every trace remove SIGKILLs that node's whole process "
            "group; with --notice, SIGTERM reaches the node's leader process that many seconds before. "
            "Trace time is divided by --time-scale. When the trace ends, the nodes still running are killed."
        ),
    )
    market.add_argument(
        "--preemptions",
        required=True,
        metavar="FILE|synthetic:RATE",
        help="a trace file in any bamboo-bench format (the paper's EC2 CSV, GCP log, SkyPilot JSON, generic CSV), "
        "or synthetic:RATE for the paper's model with a per-hour preemption probability RATE (e.g. synthetic:0.1)",
    )
    market.add_argument(
        "--time-scale",
        type=_positive_float,
        default=60.0,
        help="trace seconds per wall second (default: %(default)s)",
    )
    market.add_argument(
        "--zones",
        type=_zones,
        default=None,
        help="zone names: spread a zone-less trace (the EC2 CSV) round-robin over them, or name a synthetic "
        "trace's zones (default: the trace's own; synthetic: 3 zones)",
    )
    market.add_argument(
        "--nodes", type=int, default=8, help="synthetic only: the desired cluster size (default: %(default)s)"
    )
    market.add_argument(
        "--hours",
        type=_positive_float,
        default=1.0,
        help="synthetic only: trace length in hours (default: %(default)s)",
    )
    market.add_argument(
        "--seed", type=int, default=0, help="synthetic only: random seed (default: %(default)s)"
    )
    market.add_argument(
        "--start", type=_non_negative_float, default=None, help="replay the trace from this trace second"
    )
    market.add_argument(
        "--end", type=_positive_float, default=None, help="replay the trace up to this trace second"
    )
    market.add_argument(
        "--allocation-delay",
        type=_non_negative_float,
        default=0.0,
        help="wall seconds from a trace add to the node's start, not compressed (default: %(default)s)",
    )
    market.add_argument(
        "--notice",
        type=_non_negative_float,
        default=0.0,
        help="wall seconds of preemption notice (SIGTERM) before each kill; 0 for none (default: %(default)s)",
    )
    market.add_argument(
        "--events",
        metavar="OUT.jsonl",
        default=None,
        help="append join and preemption records to this event log",
    )
    market.add_argument(
        "--log-dir", default=None, help="write each node's output to DIR/<node>.log (default: discard)"
    )
    market.add_argument(
        "--dry-run", action="store_true", help="print the plan (one action a line) and start nothing"
    )
    market.set_defaults(handler=_market, script=[])


def _load_market_trace(args: argparse.Namespace) -> Any:
    """The trace named by --preemptions, sliced by --start/--end (bamboo-bench's loaders and generator)."""
    spec_text = args.preemptions
    if spec_text.startswith("synthetic:"):
        from bamboo.bench.synthetic import SyntheticSpec, generate_trace

        rate_text = spec_text.split(":", 1)[1]
        try:
            rate = float(rate_text)
        except ValueError:
            _fail(f"--preemptions synthetic:RATE needs a number RATE in [0, 1], got {rate_text!r}")
        if args.nodes < 1:
            _fail(f"--nodes must be >= 1, got {args.nodes}")
        zones = len(args.zones) if args.zones else 3
        try:
            spec = SyntheticSpec(preemption_probability=rate, desired_nodes=args.nodes, zones=zones)
        except ValueError as error:
            _fail(f"--preemptions {spec_text}: {error}")
        trace = generate_trace(spec, args.hours, args.seed)
    else:
        from bamboo.bench.loaders import load_trace

        trace = load_trace(spec_text)  # a malformed file raises TraceFormatError naming file and line
    if args.start is not None or args.end is not None:
        start = args.start or 0.0
        end = args.end if args.end is not None else max(trace.duration_s, start) + 1.0
        if not end > start:
            _fail(f"--end {end:g} must be after --start {start:g}")
        trace = trace.slice(start, end)
    return trace


def _market_zone_map(args: argparse.Namespace, trace: Any) -> dict[str, str] | None:
    from bamboo.launch.market import assign_zones

    if not args.zones:
        return None
    if args.preemptions.startswith("synthetic:"):
        names = dict(zip(trace.zone_names, args.zones, strict=False))
        return {event.node: names[event.zone] for event in trace.events()}
    used = sorted({event.zone for event in trace.events()})
    if len(used) > 1:
        _fail(f"the trace already has zones {used}; --zones is for traces without zones")
    return assign_zones(trace.events(), args.zones)


def _market(args: argparse.Namespace) -> int:
    from bamboo.launch.market import plan_market

    trace = _load_market_trace(args)
    plan = plan_market(
        trace.events(),
        time_scale=args.time_scale,
        allocation_delay_s=args.allocation_delay,
        notice_s=args.notice,
        zone_of=_market_zone_map(args, trace),
    )
    if args.dry_run:
        for action in plan:
            print(action)
        kills = sum(action.kind.value == "kill" for action in plan)
        adds = len(plan) - kills - sum(action.kind.value == "notify" for action in plan)
        end = plan[-1].at_s if plan else 0.0
        print(f"# {trace.name}: {adds} nodes started, {kills} killed, over {end:.1f} s", file=sys.stderr)
        return 0
    if not args.script:
        _fail("market needs the node's command after --, e.g. -- bamboo-launch agent ...")
    import shutil

    if shutil.which(args.script[0]) is None:
        _fail(f"the node command {args.script[0]!r} is not an executable file or on PATH")
    return _replay(args, plan)


def _replay(args: argparse.Namespace, plan: Sequence[Any]) -> int:
    import signal
    import threading

    from bamboo.launch.events import EventLog, Join, Preemption
    from bamboo.launch.market import ActionKind, ExecutedAction, ProcessCluster, SpotMarket
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    command = list(args.script)
    log = EventLog(args.events) if args.events else None
    noticed_at: dict[str, float] = {}
    counts = {"started": 0, "killed": 0, "noticed": 0}

    def record(executed: ExecutedAction) -> None:
        action = executed.action
        if action.kind is ActionKind.ADD:
            counts["started"] += 1
            if log is not None:
                log.write(Join(t=log.now(), node=executed.live_node, zone=action.zone))
        elif action.kind is ActionKind.NOTIFY:
            counts["noticed"] += 1
            noticed_at[executed.live_node] = executed.executed_at_s
        else:
            counts["killed"] += 1
            notice = executed.executed_at_s - noticed_at.pop(executed.live_node, executed.executed_at_s)
            if log is not None:
                log.write(Preemption(t=log.now(), node=executed.live_node, zone=action.zone, notice_s=notice))

    total = plan[-1].at_s if plan else 0.0
    interrupted = threading.Event()
    previous = {
        sig: signal.signal(sig, lambda *_: interrupted.set()) for sig in (signal.SIGINT, signal.SIGTERM)
    }
    try:
        with ProcessCluster(lambda node, zone: command, log_dir=args.log_dir) as cluster:
            market = SpotMarket(plan, cluster, on_action=record)
            market.start()
            try:
                with Progress(
                    TextColumn("[bold]spot market"),
                    BarColumn(),
                    TextColumn("{task.completed:.0f}/{task.total:.0f} s"),
                    TextColumn("{task.fields[status]}"),
                    TimeElapsedColumn(),
                    console=Console(stderr=True),
                ) as progress:
                    task = progress.add_task("replay", total=max(total, 0.001), status="")
                    while not market.join(timeout=0.2) and not interrupted.is_set():
                        status = f"alive {len(cluster.alive())}, started {counts['started']}, killed {counts['killed']}"
                        progress.update(task, completed=min(market.elapsed(), total), status=status)
                    progress.update(task, completed=min(market.elapsed(), total))
            finally:
                # Stop the market before the cluster closes, so no node starts after the clean-up.
                market.stop(timeout=10)
            failures = len(market.failures)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        if log is not None:
            log.close()
    print(
        f"replayed {len(plan)} actions: {counts['started']} nodes started, {counts['killed']} killed, "
        f"{counts['noticed']} noticed, {failures} failed actions"
    )
    if interrupted.is_set():
        print("bamboo-launch: interrupted; every node was killed", file=sys.stderr)
        return 130
    return 1 if failures else 0


AGENT_USAGE_LINE = (
    "bamboo-launch agent --job J --etcd HOST:PORT[,...] --stages P --pipelines D [--zone Z | --k8s-node NAME] "
    "[--steps S] [--host ADDR] [--port N] [--checkpoint-dir DIR] [--ttl S] [--grace S] [etcd TLS and auth flags] "
    "[options] [-- SCRIPT ARGS]"
)

# The agent's flags that set fields of the job's spec (argparse dest -> spec field).
_SPEC_FLAGS = {
    "stages": "stages", "pipelines": "pipelines", "steps": "steps", "min_nodes": "min_nodes",
    "redundancy": "redundancy", "seed": "seed", "checkpoint_dir": "checkpoint_dir",
    "checkpoint_every": "checkpoint_every", "memory_copy_every": "memory_copy_every", "resume": "resume",
    "ttl": "ttl", "grace": "grace_s",
    "confirm_timeout": "confirm_timeout_s", "group_timeout": "group_timeout_s",
    "reconfigure_timeout": "reconfigure_timeout_s",
}


def _add_agent(subparsers: argparse._SubParsersAction) -> None:
    from bamboo.launch import timeouts
    from bamboo.membership import timeouts as membership_timeouts
    from bamboo.rc import timeouts as rc_timeouts

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
    job = agent.add_argument_group("the job (spec)")
    job.add_argument("--job", required=True, help="the job's name: its keys live under /bamboo/JOB/ in etcd")
    job.add_argument("--stages", type=int, default=None,
                     help="(spec) pipeline depth P; needed by the agent that creates the job")
    job.add_argument("--pipelines", type=int, default=None,
                     help="(spec) data-parallel pipelines D wanted; needed by the agent that creates the job")
    job.add_argument("--steps", type=int, default=None, help="(spec) training steps (default: 20)")
    job.add_argument("--min-nodes", type=int, default=None,
                     help="(spec) registered nodes the first layout waits for (default: P x D)")
    job.add_argument("--redundancy", default=None, choices=["none", "lflb", "eflb", "efeb"],
                     help="(spec) redundant computation mode (default: eflb)")
    job.add_argument("--layers", type=int, default=None,
                     help="(spec) decoder blocks of the built-in example GPT (default: 4; not with a script)")
    job.add_argument("--seed", type=int, default=None, help="(spec) the model's seed (default: 0)")
    job.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                     help="(spec) where asynchronous checkpoints go: storage every machine sees (default: none)")
    job.add_argument("--checkpoint-every", type=int, default=None,
                     help="(spec) steps between checkpoints (default: 10)")
    job.add_argument("--memory-copy-every", type=int, default=None, metavar="N",
                     help="(spec) steps between in-memory copies of every stage, kept by its holders and by "
                     f"keepers in other zones, restored before any checkpoint (0: none; default: {MEMORY_COPY_EVERY})")
    job.add_argument("--resume", action="store_true", default=None,
                     help="(spec) start from the newest good checkpoint in --checkpoint-dir (a job never "
                     "overwrites another run's checkpoints: a directory that holds some needs --resume)")
    job.add_argument("--ttl", type=int, default=None,
                     help=f"(spec) lease TTL, seconds: a node silent this long is dead (default: "
                     f"{membership_timeouts.LEASE_TTL_S:g})")
    job.add_argument("--grace", type=_positive_float, default=None,
                     help=f"(spec) seconds a suspect must stay unresponsive to its probes before it is declared "
                     f"dead; a stopped or partitioned node is only slow until then (default: "
                     f"{membership_timeouts.GRACE_PERIOD_S:g})")
    job.add_argument("--confirm-timeout", type=_positive_float, default=None,
                     help=f"(spec) seconds a worker that saw a peer fail waits for the failure to be confirmed "
                     f"before it gives up (default: {rc_timeouts.CONFIRM_S:g})")
    job.add_argument("--group-timeout", type=_positive_float, default=None,
                     help=f"(spec) gloo timeout of every group: bounds an operation on a live but stuck peer "
                     f"(default: {rc_timeouts.GROUP_S:g})")
    job.add_argument("--reconfigure-timeout", type=_positive_float, default=None,
                     help=f"(spec) seconds a reconfiguration may take to start every node before it is abandoned "
                     f"and decided again (default: {timeouts.RECONFIGURE_TIMEOUT_S:g})")
    where = agent.add_argument_group("this machine")
    where.add_argument("--node", default=None,
                       help="this agent's unique id (default: $BAMBOO_NODE_ID, else the host name)")
    zone = where.add_mutually_exclusive_group()
    zone.add_argument("--zone", default=None, help="this machine's zone (default: $BAMBOO_ZONE)")
    zone.add_argument("--k8s-node", default=None, metavar="NAME",
                      help="the Kubernetes node: the zone is its topology.kubernetes.io/zone label")
    where.add_argument("--host", default="127.0.0.1",
                       help="the address the gRPC service binds to and peers reach (default: %(default)s)")
    where.add_argument("--port", type=int, default=0, help="the gRPC port (default: 0, a free one)")
    where.add_argument("--run-dir", default=None,
                       help="where this machine's files go: worker contexts, out/rank<R>.pt (default: "
                       "$TMPDIR/bamboo-JOB)")
    where.add_argument("--events", default=None, metavar="OUT.jsonl",
                       help="also append this agent's event records to a local JSON-lines file")
    where.add_argument("--notice-window", type=_positive_float, default=30.0,
                       help="seconds from SIGTERM (a preemption notice) to the machine's end (default: "
                       "%(default)s)")
    where.add_argument("--preemption-notices", default="none", choices=["none", "aws", "gce"],
                       help="also poll the cloud's metadata server for preemption notices: AWS spot "
                       "instance-action (IMDSv2) or GCE instance/preempted (default: none)")
    where.add_argument("--metadata-url", default=None,
                       help="base URL of the metadata server (default: the cloud's own)")
    where.add_argument("--spec-timeout", type=_positive_float, default=None,
                       help=f"seconds to wait for another agent to write the job's spec (default: "
                       f"{timeouts.SPEC_WAIT_S:g})")
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
    etcd.add_argument("--etcd", type=_endpoints, action="append", required=True, metavar="HOST:PORT[,...]",
                      help="etcd client endpoints (repeat the flag or separate with commas)")
    etcd.add_argument("--etcd-user", default=None, help="etcd user name (with --etcd-password)")
    etcd.add_argument("--etcd-password", default=None, help="etcd password")
    etcd.add_argument("--etcd-ca", default=None, help="PEM CA of the etcd server (enables TLS)")
    etcd.add_argument("--etcd-cert", default=None, help="PEM client certificate for etcd (with --etcd-key)")
    etcd.add_argument("--etcd-key", default=None, help="PEM client key for etcd")
    agent.set_defaults(handler=_agent, script=[])


def agent_spec_fields(args: argparse.Namespace) -> dict[str, Any]:
    """The job-spec fields that ``bamboo-launch agent``'s parsed flags ``args`` give (field -> value)."""
    spec = {field: getattr(args, dest) for dest, field in _SPEC_FLAGS.items() if getattr(args, dest) is not None}
    if args.checkpoint_dir is not None:
        spec["checkpoint_dir"] = str(Path(args.checkpoint_dir).resolve())
    if args.script:
        spec["script"] = tuple(args.script)
    if args.layers is not None:
        spec["size"] = {"layers": args.layers}
    return spec


def _agent(args: argparse.Namespace) -> int:
    import os
    import socket

    from bamboo.launch.agent import AgentError, AgentOptions, default_run_dir, run_agent
    from bamboo.launch.spec import EtcdAccess

    for name in ("stages", "pipelines", "steps", "min_nodes", "checkpoint_every", "ttl", "layers"):
        value = getattr(args, name)
        if value is not None and value < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if args.seed is not None and args.seed < 0:
        _fail(f"--seed must be >= 0, got {args.seed}")
    if args.script and args.layers is not None:
        _fail("--layers sizes the built-in example; a script describes its own layers")
    if args.script and not Path(args.script[0]).is_file():
        _fail(f"script {args.script[0]!r} not found" if not Path(args.script[0]).exists()
              else f"script {args.script[0]!r} is not a file")
    spec = agent_spec_fields(args)
    endpoints = tuple(endpoint for group in args.etcd for endpoint in group)
    try:
        options = AgentOptions(
            job=args.job,
            etcd=EtcdAccess(endpoints, user=args.etcd_user, password=args.etcd_password, ca=args.etcd_ca,
                            cert=args.etcd_cert, key=args.etcd_key),
            node=args.node or os.environ.get("BAMBOO_NODE_ID") or socket.gethostname(),
            zone=args.zone if args.zone is not None else os.environ.get("BAMBOO_ZONE", ""),
            k8s_node=args.k8s_node, host=args.host, port=args.port,
            run_dir=str(Path(args.run_dir or default_run_dir(args.job)).resolve()), events=args.events,
            spec=spec, token_file=args.token_file, tls_cert=args.tls_cert, tls_key=args.tls_key,
            tls_ca=args.tls_ca, tls_server_name=args.tls_server_name, insecure=args.insecure,
            notice_window_s=args.notice_window, preemption_notices=args.preemption_notices,
            metadata_url=args.metadata_url,
            **({"spec_timeout_s": args.spec_timeout} if args.spec_timeout is not None else {}),
        )
    except AgentError as error:
        _fail(str(error))
    return run_agent(options)


def _add_run(subparsers: argparse._SubParsersAction) -> None:
    run = subparsers.add_parser(
        "run",
        help="train on an emulated spot cluster: embedded etcd, one agent per node, the spot market, failover",
        usage=(
            "bamboo-launch run --nodes N --stages P --pipelines D [--zones a,b,c] [--etcd URL] "
            "[--preemptions FILE|synthetic:RATE] [--time-scale X] [--checkpoint-dir DIR] [--steps S] [options] "
            "[-- SCRIPT ARGS...]"
        ),
        description=(
            "Start etcd (embedded unless --etcd), one node process per initial node of the trace (an agent that "
            "registers under a lease, serves the gRPC agent service and spawns its worker), place P x D of them "
            "with bamboo-reconfig (the rest on standby), train with redundant computation, and replay the "
            "preemption trace: a removal SIGKILLs the node's whole process group and the runtime fails over; an "
            "addition starts a new node after the allocation delay. Trace time runs from the first training "
            "step. Writes a JSON-lines event log and prints the report. The model is the built-in example (the "
            "tiny GPT of bamboo-rc) or, after --, your script: each worker runs `python SCRIPT ARGS`, which "
            "gives its layers (DeepSpeed LayerSpecs), loss and data (microbatch(step, index)) to "
            "bamboo.launch.train_worker(...); RANK, WORLD_SIZE, LOCAL_RANK and BAMBOO_* are set. The launcher "
            "runs the script once first to read its model, and once more for --verify."
        ),
    )
    run.add_argument("--nodes", type=int, default=8, help="initial cluster size; synthetic traces keep about "
                     "this many nodes (default: %(default)s)")
    run.add_argument("--stages", type=int, default=4, help="pipeline depth P (default: %(default)s)")
    run.add_argument("--pipelines", type=int, default=2, help="data-parallel pipelines D (default: %(default)s)")
    run.add_argument("--zones", type=_zones, default=None, help="zone names, comma separated (default: the "
                     "trace's own; without a trace or for a synthetic one: 3 zones)")
    run.add_argument("--steps", type=int, default=20, help="training steps S (default: %(default)s)")
    run.add_argument("--preemptions", default=None, metavar="FILE|synthetic:RATE",
                     help="preemption trace: a file in any bamboo-bench format (the paper's EC2 CSV, ...) or "
                     "synthetic:RATE, the paper's model at per-hour preemption probability RATE (default: none)")
    run.add_argument("--time-scale", type=_positive_float, default=60.0,
                     help="trace seconds per wall second (default: %(default)s)")
    run.add_argument("--hours", type=_positive_float, default=1.0,
                     help="synthetic only: trace length in hours (default: %(default)s)")
    run.add_argument("--seed", type=int, default=0, help="synthetic only: the trace's random seed (default: "
                     "%(default)s)")
    run.add_argument("--allocation-delay", type=_non_negative_float, default=0.0,
                     help="wall seconds from a trace add to the node's start (default: %(default)s)")
    run.add_argument("--notice", type=_non_negative_float, default=0.0,
                     help="wall seconds of preemption notice (SIGTERM) before each kill (default: %(default)s)")
    run.add_argument("--checkpoint-dir", default=None, metavar="DIR",
                     help="write asynchronous checkpoints here (one shard per stage; default: RUN_DIR/checkpoints)")
    run.add_argument("--checkpoint-every", type=int, default=10,
                     help="steps between checkpoints (default: %(default)s)")
    run.add_argument("--memory-copy-every", type=int, default=MEMORY_COPY_EVERY, metavar="N",
                     help="steps between in-memory copies of every stage, kept by its holders and by keepers in "
                     "other zones; a stage whose every live copy is lost is restored from them before any "
                     "checkpoint (0: none; default: %(default)s)")
    run.add_argument("--resume", action="store_true",
                     help="start from the newest good checkpoint in --checkpoint-dir, e.g. with a larger --steps "
                     "(a run never overwrites another run's checkpoints: a directory that holds some needs it)")
    run.add_argument("--etcd", type=_endpoints, default=None, metavar="URL",
                     help="external etcd endpoints host:port[,host:port] (default: start an embedded etcd)")
    run.add_argument("--etcd-user", default=None, help="external etcd: user name (with --etcd-password)")
    run.add_argument("--etcd-password", default=None, help="external etcd: password")
    run.add_argument("--etcd-ca", default=None, help="external etcd: PEM CA of the server (enables TLS)")
    run.add_argument("--etcd-cert", default=None, help="external etcd: PEM client certificate (with --etcd-key)")
    run.add_argument("--etcd-key", default=None, help="external etcd: PEM client key")
    run.add_argument("--job", default=None, help="job name: etcd keys live under /bamboo/<job>/ (default: a "
                     "fresh random name)")
    run.add_argument("--run-dir", default=None, help="where the run's files go: RUN.json, out/, logs/<node>.log, "
                     "events.jsonl (default: a new temporary directory, kept)")
    run.add_argument("--events", default=None, metavar="OUT.jsonl",
                     help="the JSON-lines event log (default: RUN_DIR/events.jsonl)")
    run.add_argument("--plot", default=None, metavar="OUT.png", help="also write the four-panel figure here")
    run.add_argument("--json", action="store_true", help="print the report as one JSON object")
    run.add_argument("--verify", action="store_true",
                     help="after the run, compare the final parameters with a fault-free single-process run of the "
                     "same steps (exit status 1 above 1e-6 relative)")
    run.add_argument("--layers", type=int, default=4, help="decoder blocks of the built-in example GPT (not used "
                     "with a script; default: %(default)s)")
    run.add_argument("--redundancy", default="eflb", choices=["none", "lflb", "eflb", "efeb"],
                     help="redundant computation mode (default: %(default)s)")
    run.add_argument("--ttl", type=int, default=2, help="node lease TTL, seconds (default: %(default)s)")
    run.add_argument("--grace", type=_positive_float, default=2.0,
                     help="seconds a suspect must stay unresponsive before it is declared failed (default: "
                     "%(default)s)")
    run.add_argument("--reconfigure-timeout", type=_positive_float, default=120.0,
                     help="seconds a reconfiguration may take to start every node of the new layout before it is "
                     "abandoned and decided again (a node that dies meanwhile is noticed sooner: at once when a "
                     "transfer fails on its closed connection, otherwise when its lease expires, --ttl; default: "
                     "%(default)s)")
    run.add_argument("--timeout", type=_positive_float, default=RUN_TIMEOUT_S,
                     help="seconds the whole run may take before every node is killed (default: %(default)s)")
    run.add_argument("--no-live", action="store_true",
                     help="no live view; print a progress line (step, loss, samples/s, nodes) every "
                     "--progress-every steps instead")
    run.add_argument("--progress-every", type=int, default=10, metavar="N",
                     help="with --no-live: steps between progress lines (default: %(default)s)")
    run.set_defaults(handler=_run, script=[])


def _run(args: argparse.Namespace) -> int:
    from bamboo.launch.run import RunError, RunOptions, compare_with_reference, run_cluster
    from rich.console import Console

    for name in ("nodes", "stages", "pipelines", "steps", "layers", "checkpoint_every", "ttl"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.script and args.layers + 2 < args.stages:
        _fail(f"--stages {args.stages} is more than the example's {args.layers + 2} layers (raise --layers)")
    try:
        options = RunOptions(
            nodes=args.nodes, stages=args.stages, pipelines=args.pipelines, steps=args.steps, zones=args.zones,
            etcd=args.etcd, etcd_user=args.etcd_user, etcd_password=args.etcd_password, etcd_ca=args.etcd_ca,
            etcd_cert=args.etcd_cert, etcd_key=args.etcd_key, preemptions=args.preemptions,
            time_scale=args.time_scale, hours=args.hours, trace_seed=args.seed,
            allocation_delay_s=args.allocation_delay, notice_s=args.notice, checkpoint_dir=args.checkpoint_dir,
            checkpoint_every=args.checkpoint_every, memory_copy_every=args.memory_copy_every, resume=args.resume,
            run_dir=args.run_dir, events=args.events,
            job=args.job,
            redundancy=args.redundancy, size={} if args.script else {"layers": args.layers}, ttl=args.ttl,
            grace_s=args.grace,
            reconfigure_timeout_s=args.reconfigure_timeout, timeout_s=args.timeout, live=not args.no_live,
            progress_every=args.progress_every,
            script=tuple(args.script),
        )
    except ValueError as error:
        _fail(str(error))
    console = Console(stderr=True)
    try:
        result = run_cluster(options, progress=lambda line: console.print(f"[dim]bamboo-launch:[/dim] {line}"))
        return _finish_run(args, options, result, compare_with_reference if args.verify else None)
    except RunError as error:
        _fail(f"{error} (node logs: {options.run_dir or 'the run directory'}/logs)")


def _finish_run(args: argparse.Namespace, options: Any, result: Any, verify: Any) -> int:
    from bamboo.launch.events import read_events
    from bamboo.launch.report import compute_report, format_report, plot_report

    events = read_events(result.events)
    report = compute_report(events)
    status = 0
    extra: dict[str, Any] = {"run_dir": str(result.run_dir), "events": str(result.events),
                             "failed_ranks": list(result.failed_ranks), "timed_out": result.timed_out}
    if result.consecutive:
        extra["consecutive_failure"] = result.consecutive
    logs = result.run_dir / "logs"
    if result.job_error:
        extra["job_error"] = result.job_error
        if result.worker_errors:  # the cause is most often the first worker's exception, not the lost copies
            node, line = result.worker_errors[0]
            extra["job_error"] += f" (the first worker error: node {node}: {line})"
        status = 1
    if result.worker_errors:
        extra["worker_errors"] = [f"{node}: {line} (log {logs / (node.split('.')[0] + '.log')})"
                                  for node, line in result.worker_errors]
    errors = {node: code for node, code in result.exit_codes.items() if code is not None and code > 0}
    if errors:  # a worker's error, a lost lease, a script that never called train_worker (killed nodes are < 0)
        extra["node_errors"] = {node: f"status {code}, log {logs / (node + '.log')}"
                                for node, code in sorted(errors.items())}
    if verify is not None:
        comparison = verify(result, options)
        diff = comparison["max_relative_diff"]
        extra["verify"] = "PASSED" if diff <= VERIFY_TOLERANCE else f"FAILED ({diff:.3g} > {VERIFY_TOLERANCE:g})"
        extra["max_relative_diff"] = diff
        extra["compared_steps"] = comparison["steps"]
        if diff > VERIFY_TOLERANCE:
            status = 1
    if result.timed_out:
        status = 1
    if args.plot:
        plot_report(events, args.plot)
    if args.json:
        print(json.dumps({**report.to_dict(), **extra}))
    else:
        print(format_report(report))
        for key, value in extra.items():
            rows = value if key == "worker_errors" else [value]  # one line per worker error
            print(f"  {key.replace('_', ' '):<16} {rows[0]}")
            for row in rows[1:]:
                print(f"  {'':<16} {row}")
        if args.plot:
            print(f"  plot             {args.plot}")
    return status


def _add_watch(subparsers: argparse._SubParsersAction) -> None:
    watch = subparsers.add_parser(
        "watch",
        help="live progress view of a run from its event log",
        description=(
            "Follow an event log as it grows (a local JSON-lines file, or the job's log in etcd with --etcd URL "
            "--job J, from any machine) and show step, loss, samples/s, nodes active, on standby and "
            "joining, the counts of preemptions, failovers, reconfigurations and checkpoints, and the last "
            "events. Stops at the run_end record, or on Ctrl-C."
        ),
    )
    watch.add_argument("events", nargs="?", default=None,
                       help="the run's event log (JSON lines; it may not exist yet)")
    _add_etcd_source(watch)
    watch.add_argument("--once", action="store_true", help="show the current state once and exit")
    watch.add_argument("--json", action="store_true", help="with --once: print the state as one JSON object")
    watch.add_argument(
        "--interval",
        type=_positive_float,
        default=0.5,
        help="seconds between reads of the log (default: %(default)s)",
    )
    watch.add_argument(
        "--window", type=int, default=10, help="steps averaged for samples/s (default: %(default)s)"
    )
    watch.set_defaults(handler=_watch)


def _watch(args: argparse.Namespace) -> int:
    import signal
    import threading

    from bamboo.launch.live import EventFollower, LiveState, render_live
    from rich.console import Console
    from rich.live import Live

    if args.window < 1:
        _fail(f"--window must be >= 1, got {args.window}")
    if args.json and not args.once:
        _fail("--json needs --once (the live view is for a terminal)")
    _check_source(args, [args.events] if args.events else [])
    if args.etcd is not None:
        from bamboo.launch.events import EtcdEventFollower

        follower: Any = EtcdEventFollower(_etcd_kv(args), args.job)
    else:
        follower = EventFollower(args.events)
    state = LiveState(window=args.window)
    if args.once:
        if args.etcd is None and not follower.path.exists():
            _fail(f"cannot read {args.events}: No such file or directory")
        state.apply_all(follower.poll())
        if args.json:
            print(json.dumps(state.summary()))
        else:
            Console().print(render_live(state))
        return 0
    interrupted = threading.Event()
    previous = signal.signal(signal.SIGINT, lambda *_: interrupted.set())
    try:
        with Live(render_live(state), refresh_per_second=4, console=Console()) as live:
            while not interrupted.is_set():
                state.apply_all(follower.poll())
                live.update(render_live(state))
                if state.finished:
                    return 0
                interrupted.wait(args.interval)
    finally:
        signal.signal(signal.SIGINT, previous)
    return 130


def _add_finish(subparsers: argparse._SubParsersAction) -> None:
    finish = subparsers.add_parser(
        "finish",
        help="end a running job early, at a step boundary, with a final checkpoint",
        usage="bamboo-launch finish --etcd URL --job J [--by NAME]",
        description=(
            "Ask a running job to end before its last step. The job's lowest live rank sees the request "
            "after its next step and every node stops two steps later, at a step all of them finish; they "
            "write their final checkpoint (with --checkpoint-dir) and the job ends as it does at its last "
            "step, each agent exiting 0. A request while the job reconfigures takes effect once the new "
            "layout trains. Asking twice keeps the first request. Exit status: 0 asked (or the job had "
            "ended already), 2 bad input or no such job."
        ),
    )
    _add_etcd_source(finish, etcd_help="the job's etcd (host:port[,host:port]); required",
                     job_help="the job's name; required")
    finish.add_argument("--by", default=None,
                        help="who asks, written in the job's records (default: the user name)")
    finish.set_defaults(handler=_finish)


def _finish(args: argparse.Namespace) -> int:
    import getpass

    from bamboo.launch.finish import request_finish
    from bamboo.launch.records import JobEnd, RecordError, read_record
    from bamboo.membership import MembershipStore, StoreError

    if args.etcd is None or args.job is None:
        _fail("give the job's --etcd URL and --job name")
    kv = _etcd_kv(args)
    try:
        membership = MembershipStore(kv, args.job)
        if kv.get(membership.keys.root + "spec") is None:
            _fail(f"etcd at {','.join(args.etcd)} has no job {args.job!r}")
        ended = read_record(JobEnd, membership.get_decision("end"))
        if ended is not None:
            print(f"job {args.job} has ended already, after {ended.steps} steps")
            return 0
        try:
            asker = args.by or getpass.getuser()
        except (KeyError, OSError):  # no user name in the environment or the password database
            asker = "bamboo-launch finish"
        request, asked = request_finish(membership, asker)
    except (StoreError, RecordError) as error:
        _fail(str(error))
    finally:
        kv.close()
    if asked:
        print(f"asked job {args.job} to finish at its next step boundary (it stops two steps after its "
              "lowest live rank sees the request)")
    else:
        print(f"job {args.job} was asked to finish already, by {request.by}")
    return 0


def _add_export(subparsers: argparse._SubParsersAction) -> None:
    export = subparsers.add_parser(
        "export",
        help="write the trained model as one state dict, loadable into your layers in order",
        usage="bamboo-launch export (RUN_DIR | --checkpoint-dir DIR [--step N]) -o MODEL.pt",
        description=(
            "Gather a finished run's final model (from RUN_DIR/out/rank*.pt), or a checkpoint's (the newest good "
            "one in --checkpoint-dir, or --step N), into one state dict with the keys of "
            "torch.nn.Sequential(*layers).state_dict(): load it with "
            "torch.nn.Sequential(*[spec.build() for spec in layers]).load_state_dict(torch.load(MODEL.pt))."
        ),
    )
    export.add_argument("run_dir", nargs="?", default=None, help="a run directory (bamboo-launch run --run-dir)")
    export.add_argument("--checkpoint-dir", default=None, metavar="DIR", help="export a checkpoint instead")
    export.add_argument("--step", type=int, default=None, help="with --checkpoint-dir: this step's checkpoint "
                        "(default: the newest good one)")
    export.add_argument("-o", "--output", required=True, metavar="MODEL.pt", help="where the state dict goes")
    export.set_defaults(handler=_export)


def _export(args: argparse.Namespace) -> int:
    from bamboo.launch.export import ExportError, export_checkpoint, export_run, save_state_dict

    if (args.run_dir is None) == (args.checkpoint_dir is None):
        _fail("give a run directory or --checkpoint-dir DIR (one of them)")
    if args.step is not None and args.checkpoint_dir is None:
        _fail("--step goes with --checkpoint-dir")
    try:
        if args.run_dir is not None:
            state, source = export_run(args.run_dir), f"the final model of {args.run_dir}"
        else:
            step, state = export_checkpoint(args.checkpoint_dir, args.step)
            source = f"the checkpoint of step {step} in {args.checkpoint_dir}"
    except ExportError as error:
        _fail(str(error))
    path = save_state_dict(state, args.output)
    layers = len({key.split(".", 1)[0] for key in state})
    print(f"wrote {path}: {source}, {layers} layers, {len(state)} tensors")
    return 0


def _add_measure(subparsers: argparse._SubParsersAction) -> None:
    from bamboo.launch.measure import SYSTEMS
    from bamboo.launch.report import DEFAULT_ON_DEMAND_PRICE, DEFAULT_SPOT_PRICE

    measure = subparsers.add_parser(
        "measure",
        help="run one system of a comparison (bamboo, checkpoint, on-demand) and write its measured profile",
        usage=("bamboo-launch measure {bamboo,checkpoint,on-demand} --nodes N --stages P --pipelines D "
               "[--preemptions FILE|synthetic:RATE] [--time-scale X] (--steps S | --duration SECONDS) "
               "[--run-dir DIR] [--json] [options] [-- SCRIPT ARGS...]"),
        description=(
            "Train the built-in example (or, for bamboo and on-demand, your script) with one system on the "
            "emulated spot market, print its report and write its measured profile (RUN_DIR/profile.json, "
            "bamboo-bench's format: step time per pipeline count, start-up, failover pause, reconfiguration, "
            "restart and checkpoint costs; bamboo-bench simulate --model takes it). bamboo: bamboo-launch run with "
            "eager redundant computation on the trace's nodes. checkpoint: torchrun elastic agents and DeepSpeed's "
            "PipelineEngine on the same model, global batch and data order, DeepSpeed checkpoints every K steps "
            "(K by Young's rule), every membership change restarting the workers from the last checkpoint, and "
            "fewer pipelines while nodes are short. on-demand: bamboo-launch run without redundancy and without "
            "preemptions on P x D nodes, priced at --on-demand-price. The run ends after --steps, or --duration "
            "wall seconds after its first step (every node is then stopped; trace time runs from the first step)."
        ),
    )
    measure.add_argument("system", choices=SYSTEMS, help="the system to run")
    measure.add_argument("--nodes", type=int, required=True, help="initial spot cluster size; synthetic traces keep "
                         "about this many nodes (on-demand runs P x D)")
    measure.add_argument("--stages", type=int, required=True, help="pipeline depth P")
    measure.add_argument("--pipelines", type=int, required=True, help="data-parallel pipelines D")
    length = measure.add_mutually_exclusive_group(required=True)
    length.add_argument("--steps", type=int, default=None, help="train this many steps")
    length.add_argument("--duration", type=_positive_float, default=None, metavar="SECONDS",
                        help="train this many wall seconds after the first step, then stop every node")
    measure.add_argument("--preemptions", default=None, metavar="FILE|synthetic:RATE",
                         help="preemption trace (as bamboo-launch run; not used by on-demand; default: none)")
    measure.add_argument("--time-scale", type=_positive_float, default=60.0,
                         help="trace seconds per wall second (default: %(default)s)")
    measure.add_argument("--hours", type=_positive_float, default=1.0,
                         help="synthetic only: trace length in hours (default: %(default)s)")
    measure.add_argument("--seed", type=int, default=0, help="synthetic only: the trace's seed (default: %(default)s)")
    measure.add_argument("--zones", type=_zones, default=None, help="zone names, comma separated (default: the "
                         "trace's own; synthetic: 3 zones)")
    measure.add_argument("--layers", type=int, default=4, help="decoder blocks of the built-in example GPT "
                         "(default: %(default)s)")
    measure.add_argument("--checkpoint-every", type=int, default=10, help="bamboo: steps between its asynchronous "
                         "checkpoints (the baseline chooses K itself; default: %(default)s)")
    measure.add_argument("--ttl", type=int, default=10, help="bamboo: node lease TTL, seconds (default: %(default)s)")
    measure.add_argument("--grace", type=_positive_float, default=10.0,
                         help="bamboo: seconds an unresponsive node has before it is declared failed (a killed "
                         "node's closed connections are seen at once; default: %(default)s)")
    measure.add_argument("--timeout", type=_positive_float, default=1800.0,
                         help="seconds the whole run may take (default: %(default)s)")
    measure.add_argument("--run-dir", required=True, help="where the run's files go (logs, events.jsonl, "
                         "profile.json)")
    measure.add_argument("--spot-price", type=_positive_float, default=DEFAULT_SPOT_PRICE,
                         help="$/h per spot node (default: %(default)s)")
    measure.add_argument("--on-demand-price", type=_positive_float, default=DEFAULT_ON_DEMAND_PRICE,
                         help="$/h per on-demand node (default: %(default)s)")
    measure.add_argument("--json", action="store_true", help="print the result as one JSON object: system, "
                         "report, measurements, profile (its path), timeline, and the baseline's K and restarts")
    measure.set_defaults(handler=_measure, script=[])


def _measure(args: argparse.Namespace) -> int:
    from bamboo.launch.measure import MeasureError, MeasureOptions, run_measured

    for name in ("nodes", "stages", "pipelines", "layers", "checkpoint_every", "ttl"):
        if getattr(args, name) < 1:
            _fail(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.steps is not None and args.steps < 1:
        _fail(f"--steps must be >= 1, got {args.steps}")
    if not args.script and args.layers + 2 < args.stages:
        _fail(f"--stages {args.stages} is more than the example's {args.layers + 2} layers (raise --layers)")
    try:
        options = MeasureOptions(
            system=args.system, nodes=args.nodes, stages=args.stages, pipelines=args.pipelines, run_dir=args.run_dir,
            steps=args.steps, duration_s=args.duration, preemptions=args.preemptions, time_scale=args.time_scale,
            hours=args.hours, trace_seed=args.seed, zones=args.zones, layers=args.layers, script=tuple(args.script),
            checkpoint_every=args.checkpoint_every, ttl=args.ttl, grace_s=args.grace, timeout_s=args.timeout,
            spot_price=args.spot_price, on_demand_price=args.on_demand_price)
    except ValueError as error:
        _fail(str(error))

    def say(line: str) -> None:
        print(f"bamboo-launch measure {args.system}: {line}", file=sys.stderr, flush=True)

    try:
        result = run_measured(options, progress=say)
    except MeasureError as error:
        _fail(str(error))
    if args.json:
        print(json.dumps(result))
        return 0
    from bamboo.launch.report import Report, format_report

    print(format_report(Report(**result["report"])))
    measured = result["measurements"]
    print(f"  profile          {result['profile']}")
    print("  step time        " + ", ".join(f"{1000 * s:.1f} ms with {d} pipeline(s)"
                                             for d, s in measured["step_time_s"].items()))
    if result.get("checkpoint_interval"):
        print(f"  checkpoints      {result['checkpoint_interval']['describe']}")
    for restart in result.get("restarts", []):
        print(f"  restart          after the {restart['cause']} of {restart['node']}: {restart['to_first_step_s']:.2f} s "
              f"to the first step, {restart['redone_steps']} steps trained again")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser (also used to render ``--help`` in the README)."""
    parser = argparse.ArgumentParser(
        prog="bamboo-launch",
        description="Bamboo's launcher: the agent every machine of a job runs, training runs on an emulated spot "
        "cluster, Kubernetes manifests, the emulated spot market, run reports and the live view.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True,
                                       metavar="{agent,run,export,k8s,market,report,watch,finish,measure}")
    _add_agent(subparsers)
    _add_run(subparsers)
    _add_export(subparsers)
    _add_k8s(subparsers)
    _add_market(subparsers)
    _add_report(subparsers)
    _add_watch(subparsers)
    _add_finish(subparsers)
    _add_measure(subparsers)
    return parser


def _split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bamboo-launch``; returns the exit status."""
    parser = build_parser()
    arguments, script = _split_script(list(sys.argv[1:] if argv is None else argv))
    args, unknown = parser.parse_known_args(arguments)
    if unknown:
        hint = ""
        if hasattr(args, "script") and any(word.endswith(".py") for word in unknown):
            hint = (f"; a training script goes after --, as in: bamboo-launch {args.command} [options] -- "
                    f"{' '.join(unknown)}")
        parser.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if script:
        if not hasattr(args, "script"):
            parser.error(f"'{args.command}' takes no script after --, got {' '.join(script)!r}")
        args.script = list(args.script or []) + script
    try:
        return int(args.handler(args))
    except CliError as error:
        print(f"bamboo-launch: error: {error}", file=sys.stderr)
        return 2
    except ValueError as error:  # schema and format errors from the library carry their own context
        print(f"bamboo-launch: error: {error}", file=sys.stderr)
        return 2
    except OSError as error:  # an output path that cannot be written, a full disk
        where = f"{error.filename}: " if error.filename else ""
        print(f"bamboo-launch: error: {where}{error.strerror or error}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
