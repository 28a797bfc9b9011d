"""bamboo.bench.measured.rendezvous: which torchrun agents a stored rendezvous state holds, and when each node's
agent was first seen in it (a fake store, an injected clock)."""

from __future__ import annotations

import base64
import pickle

from bamboo.bench.measured.rendezvous import RendezvousWatch, agent_pids, state_key
from torch.distributed.elastic.rendezvous.dynamic_rendezvous import _NodeDesc, _RendezvousState


def _stored(participants: list[int], waiting: list[int] = ()) -> bytes:
    state = _RendezvousState()
    state.participants = {_NodeDesc("127.0.0.1", pid, 0): rank for rank, pid in enumerate(participants)}
    state.wait_list = {_NodeDesc("127.0.0.1", pid, 0) for pid in waiting}
    return base64.b64encode(pickle.dumps(state))


def test_agent_pids_reads_participants_and_the_wait_list() -> None:
    assert agent_pids(_stored([11, 12], [13])) == {11, 12, 13}


def test_agent_pids_of_a_placeholder_or_garbage_is_empty() -> None:
    assert agent_pids(b"Y2R0") == set()  # base64 of bytes that are no pickle
    assert agent_pids(b"not base64!") == set()


class _Store:
    def __init__(self) -> None:
        self.values: dict[str, bytes] = {}

    def check(self, keys: list[str]) -> bool:
        return all(key in self.values for key in keys)

    def get(self, key: str) -> bytes:
        return self.values[key]


def test_the_watch_notes_each_node_once_at_its_first_sighting() -> None:
    store, now = _Store(), [100.0]
    rendezvous = ["job"]
    pids = {"node0": 11, "node1": 12, "node2": 13}
    watch = RendezvousWatch(store, lambda: rendezvous[0], lambda: pids, clock=lambda: now[0])
    watch.poll()  # no state yet
    assert watch.registered() == {}
    store.values[state_key("job")] = _stored([11])
    watch.poll()
    now[0] = 105.0
    store.values[state_key("job")] = _stored([11], [12])
    watch.poll()
    assert watch.registered() == {"node0": 100.0, "node1": 105.0}
    rendezvous[0] = "job-1"  # a job restart: the new rendezvous is read, earlier sightings kept
    now[0] = 110.0
    store.values[state_key("job-1")] = _stored([11, 12, 13])
    watch.poll()
    assert watch.registered() == {"node0": 100.0, "node1": 105.0, "node2": 110.0}


def test_a_live_agent_missing_from_the_rendezvous_for_long_is_reported_dropped_and_no_other() -> None:
    store, now = _Store(), [100.0]
    live = {"node0": 11, "node1": 12, "node2": 13}
    watch = RendezvousWatch(store, lambda: "job", lambda: dict(live), clock=lambda: now[0], dropped_after_s=3.0)
    store.values[state_key("job")] = _stored([11, 12, 13])
    watch.poll()
    store.values[state_key("job")] = _stored([13])  # node0 and node1 gone from it: a restart's exit, or dropped
    now[0] = 101.0
    watch.poll()
    now[0] = 102.0
    store.values[state_key("job")] = _stored([13], [12])  # node1 back within the limit: a restart, not a drop
    watch.poll()
    store.values[state_key("job")] = _stored([], [12])
    live["node2"] = 23  # node2's agent was killed (its absence is no drop); 23 is its machine's next agent
    now[0] = 104.5
    watch.poll()
    assert watch.dropped() == {"node0": 101.0}
    now[0] = 110.0
    watch.poll()
    assert watch.dropped() == {"node0": 101.0}  # node2's new agent was never in it: still starting, not dropped
