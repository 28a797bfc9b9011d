"""The transport's failure path, on real processes: a dead peer during a collective never holds a survivor past
the confirm timeout.

Three forked members build a gloo group and all-reduce tensors staged as a worker stages them
(:class:`bamboo.rc.transport.HostStaging`; on the CPU the staging is the identity). Member 2 fails after the
group is built, before it joins the all-reduce:

- **stopped** (SIGSTOP): its sockets stay open, so gloo alone would wait the whole group timeout (60 s here).
  This process, the failure authority, sees the stop and publishes the failure; the survivors, polling for
  failure events as every blocking wait does, leave the collective at once;
- **killed** (SIGKILL): gloo fails the collective within milliseconds; the survivors report the suspects and
  wait for the authority's confirmation;
- **killed, never confirmed**: the survivors give up after the confirm timeout and raise the peer failure.

After a confirmed failure the survivors retire the group (kept until its pending collective settles), build
the next epoch's group without the victim and all-reduce on it.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from typing import Any

import pytest
import torch
from bamboo.rc import comm
from bamboo.rc.comm import GroupTable
from bamboo.rc.coordinator import FailoverCoordinator
from bamboo.rc.failures import FailureNoticed, PeerFailure, StoreFailureNotices
from bamboo.rc.layout import Layout
from bamboo.rc.timeouts import CommTimeouts
from bamboo.rc.transport import HostStaging
from bamboo.schedule import one_f_one_b
from torch.distributed import TCPStore

pytestmark = pytest.mark.slow

GROUP_S = 120.0
"""gloo's own timeout: what a survivor would wait for a stopped peer without the failure notices."""
CONFIRM_S = 20.0
"""Long enough for a loaded machine to confirm a failure well within it."""
SHORT_CONFIRM_S = 2.0
"""The confirm timeout of the run in which nobody confirms."""
VICTIM = 2
JOB = "transport"


def _member(rank: int, store: TCPStore, mode: str) -> dict[str, Any]:
    timeouts = CommTimeouts(group=GROUP_S, build=30.0, confirm=SHORT_CONFIRM_S if mode == "unconfirmed" else CONFIRM_S,
                            poll=0.02)
    coordinator = FailoverCoordinator(store, JOB, Layout(1, 3), rank, 0, one_f_one_b(1, 1, rc="none"),
                                      StoreFailureNotices(store, JOB), timeouts)
    groups = GroupTable(store, JOB, rank, timeouts, {})
    groups.set_members(0, {"dp": (0, 1, 2)})
    groups.group("dp")
    store.set(f"built-{rank}", "1")
    if rank == VICTIM:  # once every member's mesh is whole: a death while a peer still connects is another test
        store.wait([f"built-{other}" for other in range(3)])
        store.set("victim-fails", "1")
        os.kill(os.getpid(), signal.SIGSTOP if mode == "stopped" else signal.SIGKILL)
    store.wait(["victim-fails"])
    staging = HostStaging(torch.device("cpu"))
    tensor = staging.outbound(torch.full((1 << 16,), float(rank + 1)))
    started = time.monotonic()
    works = groups.post_allreduce("dp", [tensor], "AR")
    event = None
    try:
        groups.wait_collective("dp", works, "AR", coordinator.raise_if_noticed)
        outcome = "completed"
    except FailureNoticed as noticed:
        outcome, event = "noticed", noticed.event
    except PeerFailure as failure:
        try:
            event = coordinator.confirm(failure)
            outcome = "confirmed"
        except PeerFailure:
            outcome = "unconfirmed"
    waited = time.monotonic() - started
    result: dict[str, Any] = {"outcome": outcome, "waited": waited}
    if event is not None:
        coordinator.epoch = event.epoch  # as the failover's agreement does: the next event is the next epoch's
        groups.set_members(event.epoch, {"dp": tuple(r for r in range(3) if r not in event.victims)})
        result["kept"] = comm.kept_groups()
        again = staging.outbound(torch.full((1 << 16,), float(rank + 1)))
        groups.allreduce("dp", [again], "AR again", coordinator.raise_if_noticed)
        result["sum"] = float(again[0])
        result["version"] = groups.versions["dp"]
    return result


def _run(mode: str, forked_ranks: Callable[..., Any]) -> dict[int, dict[str, Any]]:
    """Fork the three members; this process hosts the store and is the failure authority (unless ``mode`` is
    ``unconfirmed``). Returns the survivors' results."""
    with forked_ranks(3, lambda rank, store: _member(rank, store, mode)) as ranks:
        victim = next(pid for pid, rank in ranks.pids.items() if rank == VICTIM)
        _, status = os.waitpid(victim, os.WUNTRACED)  # stopped or killed: either way the authority sees it
        if mode != "unconfirmed":
            StoreFailureNotices(ranks.store, JOB).publish_next([VICTIM])
        for pid, rank in ranks.pids.items():
            if rank != VICTIM:
                os.waitpid(pid, 0)
        if os.WIFSTOPPED(status):
            os.kill(victim, signal.SIGKILL)
            os.waitpid(victim, 0)
    assert sorted(ranks.results) == [r for r in range(3) if r != VICTIM]
    return ranks.results


@pytest.mark.parametrize(("mode", "outcomes"), [
    ("stopped", {"noticed"}),  # gloo cannot tell: only the confirmation releases the survivors
    ("killed", {"confirmed", "noticed"}),  # gloo's error, then the confirmation; or the confirmation came first
])
def test_a_dead_peer_during_a_collective_releases_the_survivors_who_rebuild_without_it(
    mode: str, outcomes: set[str], forked_ranks: Callable[..., Any],
) -> None:
    survivors = _run(mode, forked_ranks)
    for rank, result in survivors.items():
        assert result["outcome"] in outcomes, (rank, result)
        assert result["waited"] < CONFIRM_S, (rank, result)  # released by the confirmation, not by a timeout
        assert result["version"] == 1  # the next epoch's group, without the victim
        assert result["sum"] == 1.0 + 2.0  # ranks 0 and 1 contribute rank + 1
    if mode == "stopped":  # its collective is still pending on the old group: kept until it settles
        assert all(result["kept"] >= 1 for result in survivors.values())


def test_a_failure_nobody_confirms_holds_a_survivor_for_the_confirm_timeout_and_no_longer(
    forked_ranks: Callable[..., Any],
) -> None:
    survivors = _run("unconfirmed", forked_ranks)
    for rank, result in survivors.items():
        assert result["outcome"] == "unconfirmed", (rank, result)
        assert SHORT_CONFIRM_S <= result["waited"] < GROUP_S / 2, (rank, result)  # the confirm timeout, not gloo's
