"""The ``bamboo-launch`` command line: one module per subcommand.

- ``bamboo-launch agent --job J --etcd HOST:PORT ... [-- SCRIPT ARGS]``: one machine's agent, what every
  machine of a cluster runs and what ``run`` starts per node (:mod:`bamboo.launch.cli.agent`);
- ``bamboo-launch run [...] [-- SCRIPT ARGS]``: train the built-in example, or a user script that calls
  ``bamboo.launch.train_worker``, on an emulated spot cluster (bamboo-bench's
  :mod:`bamboo.bench.emulated.cli.run`, found through the entry points below);
- ``bamboo-launch export (RUN_DIR | --checkpoint-dir DIR) -o MODEL.pt``: the trained model as one state dict
  (:mod:`bamboo.launch.cli.export`);
- ``bamboo-launch k8s render`` / ``k8s validate FILE...``: Kubernetes manifests for EKS or GKE spot pools,
  validated against the Kubernetes schemas (:mod:`bamboo.launch.cli.k8s`);
- ``bamboo-launch market``: the emulated spot market against one process per node (bamboo-bench's
  :mod:`bamboo.bench.emulated.cli.market`, found the same way);
- ``bamboo-launch report (EVENTS.jsonl | --etcd URL --job J)``: a run's final report (bamboo-bench's
  :mod:`bamboo.bench.value.cli`, found the same way);
- ``bamboo-launch watch (EVENTS.jsonl | --etcd URL --job J)``: the live view of a run (:mod:`bamboo.launch.cli.watch`);
- ``bamboo-launch finish --etcd URL --job J``: end a job early at a step boundary (:mod:`bamboo.launch.cli.finish`).

``run`` and ``market`` belong to the emulated cluster, and ``report`` to a run's value, layers of bamboo-bench
above this package, which this package never imports: a package declares such subcommands in the
``bamboo.launch.commands`` entry-point group (``NAME = "module"``, a module with ``add_parser(subparsers)``), read
here with :mod:`importlib.metadata` (not for a command of this package's own, which parses alone: every machine's
agent starts without them). When none declares one of them (bamboo-bench is not installed), the command prints one
line that says so and exits with status 2.

Every flag's default comes from the options class it fills (``AgentOptions``, ``JobSpec``, ``K8sConfig``; ``run``'s
come from bamboo-bench's ``RunOptions``) or from a ``timeouts`` module. Bad input, and an etcd that does not answer, print one line,
``bamboo-launch: error: ...``, and exit with status 2; never a traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from importlib.metadata import entry_points
from types import ModuleType

from bamboo.bench.argtypes import USAGE, OneLineParser
from bamboo.launch.cli import agent, export, finish, k8s, watch
from bamboo.launch.cli.agent import agent_spec_fields
from bamboo.launch.cli.common import CliError, error_line
from bamboo.membership import StoreError

__all__ = ["agent_spec_fields", "build_parser", "main"]

TRACEBACK_ENV = "BAMBOO_TRACEBACK"
"""Set (to anything) to see the traceback of an internal error instead of its one line."""

LOCAL_COMMANDS = {module.__name__.rsplit(".", 1)[-1]: module for module in (agent, export, k8s, watch, finish)}
"""This package's subcommands' modules, by name."""

ENTRY_POINT_GROUP = "bamboo.launch.commands"
"""The entry-point group in which other packages declare subcommands of ``bamboo-launch`` (name = module)."""

PLUGGED_COMMANDS = {"run": ("its emulated spot cluster", "emulated"), "market": ("its emulated spot cluster", "emulated"),
                    "report": ("its report of a run's value", "value")}
"""The subcommands that bamboo-bench declares in :data:`ENTRY_POINT_GROUP`: for each, the layer of bamboo-bench it
belongs to and the extra that installs that layer."""

ORDER = ("agent", "run", "export", "k8s", "market", "report", "watch", "finish")
"""The order in which ``--help`` lists the subcommands (any other declared one comes after them)."""

PLUGGED_MISSING = ("bamboo-launch {command} needs bamboo-bench ({layer}), which is not installed here: "
                   "pip install 'bamboo-bench[{extra}]' (or -e packages/bamboo-bench)")


def declared_commands() -> dict[str, ModuleType]:
    """The subcommands' modules that installed packages declare in :data:`ENTRY_POINT_GROUP`, by name (one
    whose module cannot be imported is left out: its command then says what is missing)."""
    found: dict[str, ModuleType] = {}
    for point in entry_points(group=ENTRY_POINT_GROUP):
        try:
            module = point.load()
        except ImportError:
            continue
        if isinstance(module, ModuleType) and hasattr(module, "add_parser"):
            found.setdefault(point.name, module)
    return found


def _missing(args: argparse.Namespace) -> int:
    layer, extra = PLUGGED_COMMANDS[args.command]
    raise CliError(PLUGGED_MISSING.format(command=args.command, layer=layer, extra=extra))


def _add_missing(subparsers: argparse._SubParsersAction, name: str) -> None:
    """A command that only says what to install (:func:`_parse` accepts every word after it, so that this one
    line is what shows)."""
    stub = subparsers.add_parser(name, help="(needs bamboo-bench)", add_help=False)
    stub.set_defaults(handler=_missing, script=[])


def build_parser(command: str | None = None) -> argparse.ArgumentParser:
    """The full argument parser (also used to render ``--help`` in the README), or, given one of this package's
    own subcommands, the parser of that one alone: what ``bamboo-launch agent`` parses on every machine, without
    reading the entry points or importing the declared commands' modules (bamboo-bench's emulated cluster and
    report, and the rich they draw with)."""
    parser = OneLineParser(
        prog="bamboo-launch",
        description="Bamboo's launcher: the agent every machine of a job runs, training runs on an emulated spot "
        "cluster, Kubernetes manifests, the emulated spot market, run reports and the live view.",
    )
    if command in LOCAL_COMMANDS:
        subparsers = parser.add_subparsers(dest="command", required=True, metavar="{" + command + ",...}")
        LOCAL_COMMANDS[command].add_parser(subparsers)
        return parser
    declared = declared_commands()
    names = [name for name in ORDER if name in LOCAL_COMMANDS or name in declared or name in PLUGGED_COMMANDS]
    names += sorted(name for name in declared if name not in names)
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="{" + ",".join(names) + "}")
    for name in names:
        module = LOCAL_COMMANDS.get(name) or declared.get(name)
        if module is None:
            _add_missing(subparsers, name)
        else:
            module.add_parser(subparsers)
    return parser


def _split_script(argv: list[str]) -> tuple[list[str], list[str]]:
    if "--" in argv:
        index = argv.index("--")
        return argv[:index], argv[index + 1 :]
    return argv, []


def _parse(words: list[str]) -> argparse.Namespace:
    parser = build_parser(words[0] if words else None)
    arguments, script = _split_script(words)
    args, unknown = parser.parse_known_args(arguments)
    if getattr(args, "handler", None) is _missing:
        return args
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
    return args


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of ``bamboo-launch``; returns the exit status (``--help`` exits 0 through ``SystemExit``)."""
    try:
        args = _parse(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as done:  # a parse error (its one line is printed) returns its status; --help exits 0
        if not done.code:
            raise
        return int(done.code)
    try:
        return int(args.handler(args))
    except (CliError, ValueError, StoreError) as error:  # the library's errors carry their own context
        print(f"bamboo-launch: error: {error_line(error)}", file=sys.stderr)
        return USAGE
    except OSError as error:  # an output path that cannot be written, a full disk
        where = f"{error.filename}: " if error.filename else ""
        print(f"bamboo-launch: error: {where}{error.strerror or error}", file=sys.stderr)
        return USAGE
    except KeyboardInterrupt:
        print("bamboo-launch: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # a bug: one line, and the traceback on request
        if os.environ.get(TRACEBACK_ENV):
            raise
        print(f"bamboo-launch: internal error: {type(error).__name__}: {error} (a bug: please report it; "
              f"{TRACEBACK_ENV}=1 shows the traceback)", file=sys.stderr)
        return 1
