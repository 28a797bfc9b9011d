"""What the subcommands of ``bamboo-launch`` share: the one-line error, the etcd flags, reading an event log.

Every user error is a :class:`CliError` (or a ``ValueError`` or a ``StoreError`` from the library, whose
message carries its own context): :func:`bamboo.launch.cli.main` prints it as one line,
``bamboo-launch: error: ...``, and exits with status :data:`USAGE`.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import NoReturn

from bamboo.bench.argtypes import USAGE
from bamboo.launch.events import Event
from bamboo.launch.spec import steps_or_auto
from bamboo.membership import EtcdKV

__all__ = [
    "USAGE",
    "CliError",
    "add_etcd_source",
    "check_source",
    "endpoints",
    "error_line",
    "etcd_kv",
    "fail",
    "source_events",
    "steps_or_auto_flag",
]

class CliError(Exception):
    """A user error: printed as one line, exit status :data:`USAGE`."""


def fail(message: str) -> NoReturn:
    """Stop the command with the one-line error ``message``."""
    raise CliError(message)


def error_line(error: BaseException) -> str:
    """The one line that says what ``error`` is: its message (attrs' validators put the message first among
    their arguments), its first line; the exception's name when it has no message."""
    message = error.args[0] if error.args and isinstance(error.args[0], str) else str(error)
    return message.strip().splitlines()[0] if message.strip() else type(error).__name__


DEVICE_HELP = ("where the worker computes: cpu, cuda (GPU LOCAL_RANK mod the GPUs; every emulated node of `run` shares "
               "GPU 0), cuda:N or auto (default: $BAMBOO_DEVICE, else auto: a GPU when CUDA is present, else cpu)")


def device(text: str) -> str:
    """A worker's device as bamboo-rc's ``initialize(device=)`` takes it (checked there against the GPUs present)."""
    if text not in ("cpu", "cuda", "auto") and not (text.startswith("cuda:") and text[5:].isdigit()):
        raise argparse.ArgumentTypeError(f"expected cpu, cuda, cuda:N or auto, got {text!r}")
    return text


def steps_or_auto_flag(text: str) -> int | str:
    """``--checkpoint-every`` / ``--memory-copy-every``: ``auto`` or a whole number of steps (the commands check its
    least value)."""
    try:
        return steps_or_auto(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of steps or 'auto', got {text!r}") from None


def endpoints(text: str) -> tuple[str, ...]:
    """``host:port[,host:port...]`` (an ``http://`` prefix is dropped; TLS has its own flags)."""
    found = []
    for part in text.split(","):
        endpoint = part.strip()
        if endpoint.startswith("https://"):
            raise argparse.ArgumentTypeError(
                f"give etcd endpoints as host:port and TLS with --etcd-tls-secret, got {endpoint!r}"
            )
        endpoint = endpoint.removeprefix("http://").rstrip("/")
        if not endpoint:
            raise argparse.ArgumentTypeError(f"etcd endpoints must be host:port[,host:port...], got {text!r}")
        found.append(endpoint)
    return tuple(found)


def add_etcd_source(parser: argparse.ArgumentParser,
                    etcd_help: str = "read the job's event log from etcd (host:port[,host:port]) instead of a file",
                    job_help: str = "with --etcd: the job's name") -> None:
    """``--etcd URL --job J`` and etcd's auth and TLS flags, for a command that reads a job from etcd."""
    parser.add_argument("--etcd", type=endpoints, default=None, metavar="URL", help=etcd_help)
    parser.add_argument("--job", default=None, help=job_help)
    parser.add_argument("--etcd-user", default=None, help="etcd user name (with --etcd-password)")
    parser.add_argument("--etcd-password", default=None, help="etcd password")
    parser.add_argument("--etcd-ca", default=None, help="PEM CA of the etcd server (enables TLS)")
    parser.add_argument("--etcd-cert", default=None, help="PEM client certificate (with --etcd-key)")
    parser.add_argument("--etcd-key", default=None, help="PEM client key")


def etcd_kv(args: argparse.Namespace) -> EtcdKV:
    """A client of the etcd that ``args`` name (:func:`add_etcd_source`'s flags)."""
    from bamboo.membership import EtcdOptions, StoreError

    try:
        return EtcdKV(EtcdOptions(endpoints=args.etcd, user=args.etcd_user, password=args.etcd_password,
                                  ca_cert=args.etcd_ca, cert_cert=args.etcd_cert, cert_key=args.etcd_key))
    except StoreError as error:
        fail(str(error))


def check_source(args: argparse.Namespace, files: Sequence[str]) -> None:
    """An event log is one source: files, or ``--etcd`` with ``--job``."""
    if args.etcd is None and args.job is not None:
        fail("--job needs --etcd (or give the event log file instead)")
    if args.etcd is not None:
        if args.job is None:
            fail("--etcd needs --job (the job whose event log to read)")
        if files:
            fail(f"give an event log file or --etcd with --job, not both (got {' '.join(files)})")
    elif not files:
        fail("give the run's event log (EVENTS.jsonl), or --etcd URL --job J")


def source_events(args: argparse.Namespace) -> list[Event]:
    """The events of a report: from the files given (``args.events``), or from the job's log in etcd."""
    from bamboo.launch.events import read_etcd_events, read_events
    from bamboo.membership import StoreError

    check_source(args, args.events)
    if args.etcd is not None:
        kv = etcd_kv(args)
        try:
            events = read_etcd_events(kv, args.job)
        except StoreError as error:
            fail(str(error))
        finally:
            kv.close()
        if not events:
            fail(f"job {args.job} has no event records in etcd at {','.join(args.etcd)}")
        return events
    events = []
    for name in args.events:
        try:
            events.extend(read_events(name))
        except OSError as error:
            fail(f"cannot read {name}: {error.strerror or error}")
    return events
