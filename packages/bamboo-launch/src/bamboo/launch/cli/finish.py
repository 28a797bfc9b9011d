"""``bamboo-launch finish --etcd URL --job J``: end a running job early, at a step boundary, with a final
checkpoint (:mod:`bamboo.launch.finish`)."""

from __future__ import annotations

import argparse
import getpass

from bamboo.launch.cli.common import add_etcd_source, etcd_kv, fail
from bamboo.launch.finish import request_finish
from bamboo.launch.records import JobEnd, RecordError, read_record
from bamboo.membership import MembershipStore, StoreError

__all__ = ["add_parser", "run"]


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    """Register ``finish``."""
    finish = subparsers.add_parser(
        "finish",
        help="end a running job early, at a step boundary, with a final checkpoint",
        usage="bamboo-launch finish --etcd URL --job J [--by NAME]",
        description=(
            "Ask a running job to end before its last step. The job's lowest live rank sees the request "
            "after its next step and every node stops four steps later, at a step all of them finish; they "
            "write their final checkpoint (with --checkpoint-dir) and the job ends as it does at its last "
            "step, each agent exiting 0. A request while the job reconfigures takes effect once the new "
            "layout trains. Asking twice keeps the first request. Exit status: 0 asked (or the job had "
            "ended already), 2 bad input or no such job."
        ),
    )
    add_etcd_source(finish, etcd_help="the job's etcd (host:port[,host:port]); required",
                     job_help="the job's name; required")
    finish.add_argument("--by", default=None,
                        help="who asks, written in the job's records (default: the user name)")
    finish.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    """``finish``: ask the job to end at its next step boundary (once)."""
    if args.etcd is None or args.job is None:
        fail("give the job's --etcd URL and --job name")
    kv = etcd_kv(args)
    try:
        membership = MembershipStore(kv, args.job)
        if kv.get(membership.keys.root + "spec") is None:
            fail(f"etcd at {','.join(args.etcd)} has no job {args.job!r}")
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
        fail(str(error))
    finally:
        kv.close()
    if asked:
        print(f"asked job {args.job} to finish at its next step boundary (it stops four steps after its "
              "lowest live rank sees the request)")
    else:
        print(f"job {args.job} was asked to finish already, by {request.by}")
    return 0
