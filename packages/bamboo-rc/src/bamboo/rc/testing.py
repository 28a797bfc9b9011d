"""Run a function on several forked ranks against one TCPStore: the harness of bamboo-rc's multi-process tests
and of the GPU check's probes (the store calls wait ``VERIFY_STORE_S``, as ``bamboo-rc verify``'s do).

The children are forked before the store exists (a fork while the store's thread holds a lock can deadlock the
child) and read its port from a pipe; each runs ``member(rank, store)`` and saves what it returns. The process
that forks them hosts the store, so it can play the failure authority (publish a victim's death) while they run.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import tempfile
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from bamboo.rc.timeouts import VERIFY_STORE_S

__all__ = ["ForkedRanks", "RanksFailed"]

class RanksFailed(RuntimeError):
    """A forked rank raised: the message holds the traceback of each that did."""


class ForkedRanks:
    """``count`` forked processes, each running ``member(rank, store)`` against a TCPStore this process hosts.

    Use it as a context manager: inside, the children run (``pids`` maps each pid to its rank, ``store`` is the
    host's end, for a test that plays the failure authority); leaving it waits for every child, fails the test
    with the tracebacks of those that raised, and fills ``results`` (rank -> what ``member`` returned, saved
    with ``torch.save``) for every child that returned.
    """

    def __init__(self, count: int, member: Callable[[int, Any], Any]) -> None:
        self.count, self.member = count, member
        self.pids: dict[int, int] = {}
        self.results: dict[int, Any] = {}
        self.store: Any = None
        self._folder: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> ForkedRanks:
        import torch
        from bamboo.rc.worker import heap_frozen_for_forks
        from torch.distributed import TCPStore

        self._folder = tempfile.TemporaryDirectory(prefix="bamboo-forked-ranks-")
        out = Path(self._folder.name)
        reader, writer = os.pipe()
        with heap_frozen_for_forks():
            for rank in range(self.count):
                pid = os.fork()
                if pid == 0:  # pragma: no cover - the child
                    code = 1
                    try:
                        os.close(writer)
                        port = int.from_bytes(os.read(reader, 8), "little")
                        store = TCPStore("127.0.0.1", port, is_master=False,
                                         timeout=datetime.timedelta(seconds=VERIFY_STORE_S))
                        torch.save(self.member(rank, store), out / f"{rank}.pt")
                        code = 0
                    except BaseException:
                        (out / f"{rank}.error").write_text(traceback.format_exc())
                    finally:
                        os._exit(code)
                self.pids[pid] = rank
        os.close(reader)
        self.store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                              timeout=datetime.timedelta(seconds=VERIFY_STORE_S))
        os.write(writer, self.store.port.to_bytes(8, "little") * self.count)
        os.close(writer)
        return self

    def __exit__(self, *exc: object) -> None:
        import torch

        assert self._folder is not None
        out = Path(self._folder.name)
        try:
            for pid in self.pids:
                with contextlib.suppress(ChildProcessError):  # the test reaped it (a victim it waited for)
                    os.waitpid(pid, 0)
            self.store = None
            if exc[0] is None:
                errors = [path.read_text() for path in sorted(out.glob("*.error"))]
                if errors:
                    raise RanksFailed("\n".join(errors))
                self.results = {int(path.stem): torch.load(path, weights_only=False)
                                for path in sorted(out.glob("*.pt"))}
        finally:
            self._folder.cleanup()
