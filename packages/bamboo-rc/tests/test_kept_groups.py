"""A gloo group given up with a collective still pending is freed once that collective ends, on real processes.

gloo's destructor waits for every queued collective, so a group is kept alive
(:func:`bamboo.rc.comm.keep_until_settled`) until the collectives posted on it have finished; then
:func:`bamboo.rc.comm.release_settled` frees it, and its sockets and threads go.
"""

from __future__ import annotations

import datetime
import os
import time
import traceback

import pytest
import torch
from bamboo.rc import comm
from bamboo.rc.comm import CommTimeouts, GroupTable
from torch.distributed import TCPStore

pytestmark = pytest.mark.slow

GROUP_TIMEOUT_S = 1.0


def _threads() -> int:
    """This process's threads (the test runs in a child forked for it, which starts with one: no thread that
    other tests left in the xdist worker, Python's or a native library's, can end and change the count)."""
    return len(os.listdir("/proc/self/task"))


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_a_retired_group_with_a_pending_collective_is_freed_once_the_collective_times_out() -> None:
    """Run in a forked child, whose threads and descriptors are its own; its traceback comes back on failure."""
    reader, writer = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(reader)
            _retired_group_is_freed()
            code = 0
        except BaseException:
            os.write(writer, traceback.format_exc().encode())
        finally:
            os._exit(code)
    os.close(writer)
    with os.fdopen(reader, "rb") as failure:
        report = failure.read().decode()
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, report


def _retired_group_is_freed() -> None:
    timeouts = CommTimeouts(group=GROUP_TIMEOUT_S)
    reader, writer = os.pipe()
    release_reader, release_writer = os.pipe()
    pid = os.fork()
    if pid == 0:  # rank 1: joins the group, never joins the all-reduce, stays alive (a peer that gave the step up)
        code = 1
        try:
            os.close(writer)
            os.close(release_writer)
            port = int.from_bytes(os.read(reader, 8), "little")
            store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=30))
            table = GroupTable(store, "job", 1, timeouts, {})
            table.set_members(0, {"pair": [0, 1]})
            table.group("pair")
            os.read(release_reader, 1)  # until the test is done
            code = 0
        finally:
            os._exit(code)
    os.close(reader)
    os.close(release_reader)
    try:
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=datetime.timedelta(seconds=30))
        os.write(writer, store.port.to_bytes(8, "little"))
        kept_before = comm.kept_groups()
        without = (_threads(), _fds())
        table = GroupTable(store, "job", 0, timeouts, {})
        table.set_members(0, {"pair": [0, 1]})
        works = table.post_allreduce("pair", [torch.zeros(4)], "0AR")
        with_group = (_threads(), _fds())
        assert with_group[0] > without[0] and with_group[1] > without[1]

        table.set_members(1, {})  # rank 1 left: the group is retired with the all-reduce pending
        assert comm.kept_groups() == kept_before + 1
        assert comm.release_settled() == kept_before + 1  # still pending: freeing it now would block
        assert (_threads(), _fds()) == with_group

        deadline = time.monotonic() + 30 * GROUP_TIMEOUT_S
        while not works[0].is_completed():  # the all-reduce fails at the group's timeout
            assert time.monotonic() < deadline, "the pending all-reduce never timed out"
            time.sleep(0.05)
        with pytest.raises(RuntimeError):
            works[0].wait()
        del works
        assert comm.release_settled() == kept_before  # now freed: gloo joins its threads, closes its sockets
        after = (_threads(), _fds())
        assert after[0] < with_group[0] and after[1] < with_group[1]
    finally:
        os.write(release_writer, b"x")
        os.close(release_writer)
        os.close(writer)
        _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
