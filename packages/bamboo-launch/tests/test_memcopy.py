"""In-memory copies (bamboo.launch.memcopy): what a node keeps, the keepers it picks, the restore point it gives,
and the copy server over real sockets (the job token, the SHA-256)."""

from __future__ import annotations

import hashlib

import pytest
from bamboo.launch.memcopy import (
    Copy,
    CopyIndex,
    CopyServer,
    CopyStore,
    Holding,
    catch_up_step,
    fetch_copy,
    kept_elsewhere_step,
    lineage,
    memory_restore,
    plan_keepers,
    send_copy,
    verified,
)

BOUNDS = ((0, 2), (2, 4), (4, 6))
HISTORY = ((0, 2), (5, 1))  # 2 pipelines from step 0, 1 from step 5


def _copy(stage: int, step: int, data: bytes = b"state") -> Copy:
    return Copy(stage, step, BOUNDS[stage], data, hashlib.sha256(data).hexdigest(), lineage(HISTORY, step))


def test_a_store_keeps_the_newest_steps_of_each_stage_and_says_so() -> None:
    changes: list[int] = []
    store = CopyStore(keep=2, on_change=lambda: changes.append(1))
    for step in (3, 5, 4, 6):
        store.put(_copy(1, step))
    store.put(_copy(0, 6))
    copies, layers = store.index()
    assert copies == {1: {5: lineage(HISTORY, 5), 6: lineage(HISTORY, 6)}, 0: {6: lineage(HISTORY, 6)}}
    assert layers == {1: (2, 4), 0: (0, 2)}
    assert store.get(1, 4) is None and store.get(1, 6) is not None and len(changes) == 5


def test_a_stages_pinned_step_outlives_its_newest_steps_until_the_pin_moves() -> None:
    store = CopyStore(keep=2)
    store.put(_copy(0, 10))
    store.put(_copy(1, 10))
    store.pin(0, 10)
    for step in (20, 30, 40):
        store.put(_copy(0, step))
        store.put(_copy(1, step))
    assert sorted(store.index()[0][0]) == [10, 30, 40] and sorted(store.index()[0][1]) == [30, 40]
    store.pin(0, 30)  # the pin moves: 10 goes, 30 stays once it is no longer among the newest
    store.put(_copy(0, 50))
    assert sorted(store.index()[0][0]) == [30, 40, 50] and store.pinned() == {0: 30}
    store.pin(0, None)
    assert sorted(store.index()[0][0]) == [40, 50]


def test_the_pinned_step_is_the_newest_one_every_stage_has_on_a_keeper() -> None:
    """Hosts a, b, c train stages 0, 1, 2 and keep their newest steps; their keepers fall behind by different
    amounts. Only steps kept off each stage's own hosts count: those outlive the hosts."""
    holding = Holding(owners=(("a",), ("b",), ("c",)), placed=("a", "b", "c"))
    indexes = {
        "a": _index("a", "a", {0: (30, 40, 50)}), "b": _index("b", "b", {1: (30, 40, 50)}),
        "c": _index("c", "c", {2: (30, 40, 50)}),
        "k1": _index("k1", "b", {0: (20, 30, 40), 2: (10, 20)}), "k2": _index("k2", "c", {1: (20, 30, 50)}),
    }
    assert kept_elsewhere_step(indexes, holding) == 20
    indexes["k3"] = _index("k3", "a", {2: (30, 40)})
    assert kept_elsewhere_step(indexes, holding) == 30  # 40: not on stage 1's keeper; 50: on none of stage 0's
    del indexes["k1"]
    assert kept_elsewhere_step(indexes, holding) is None  # stage 0 on its host only


def _replay(sends: tuple[set[int], ...], mode: str, steps: int = 12) -> dict[str, CopyIndex]:
    """Hosts h0..h2 train stages 0..2 and keep a copy at every step; host i sends a copy to its keeper ki at each
    step in ``sends[i]`` (a background thread that falls behind sends only then), as `CopyService` does in
    ``mode``: "newest" (its newest copy, nothing pinned), "pins" (also the pin, set first), or "pins and catch-up"
    (also the step the others' keepers share, :func:`catch_up_step`, in place of its newest). Returns every node's
    index at the end."""
    holding = Holding(owners=(("h0",), ("h1",), ("h2",)), placed=("h0", "h1", "h2"))
    stores = {name: CopyStore() for name in ("h0", "h1", "h2", "k0", "k1", "k2")}

    def indexes() -> dict[str, CopyIndex]:
        return {name: CopyIndex(name, name, name, *store.index()) for name, store in stores.items()}

    for step in range(1, steps + 1):
        for stage in range(3):
            host, keeper = stores[f"h{stage}"], stores[f"k{stage}"]
            host.put(_copy(stage, step))
            if step not in sends[stage]:
                continue
            sent = step
            if mode != "newest":
                pin = kept_elsewhere_step(indexes(), holding)
                host.pin(stage, pin)
                keeper.pin(stage, pin)
            if mode == "pins and catch-up":
                sent = catch_up_step(indexes(), holding, stage, host.steps(stage)) or step
            keeper.put(_copy(stage, sent))
    return indexes()


@pytest.mark.parametrize("mode", ["newest", "pins", "pins and catch-up"])
def test_pins_keep_a_step_every_stage_has_when_the_keepers_fall_behind_unevenly(mode: str) -> None:
    """Keepers that fall behind by different amounts hold no step in common, and the hosts move on: losing every
    host, or one host whose keeper lags far, left no step to restore from memory. The pinned step is one; a host
    that catches up to the step the others' keepers share makes a newer one."""
    history = ((0, 2), (5, 1))
    keepers = {"k0", "k1", "k2"}
    uneven = _replay((set(range(1, 13)), {1, 5, 9}, {1, 2, 4, 7, 10}), mode)
    every_host_lost = memory_restore(uneven, BOUNDS, keepers, history)
    far_behind = _replay(({1, 5}, set(range(1, 13)), set(range(1, 13))), mode)
    one_host_lost = memory_restore(far_behind, BOUNDS, keepers | {"h1", "h2"}, history)
    if mode == "newest":
        assert every_host_lost is None and one_host_lost is None
        return
    assert every_host_lost is not None and one_host_lost is not None
    # h0 sent step 5 (pins) or, catching up, step 4, the newest the other keepers had then: either is kept
    assert one_host_lost[0] == (5 if mode == "pins" else 4) and one_host_lost[1][0] == ("k0",)
    assert every_host_lost[1] == {0: ("k0",), 1: ("k1",), 2: ("k2",)}
    # pins alone keep step 1, the last one all three sent; catching up, the laggards send steps the others' keepers
    # already have, and step 7 is common by the end
    assert every_host_lost[0] == (1 if mode == "pins" else 7)


def test_a_host_behind_catches_up_to_the_step_the_other_keepers_share_while_it_keeps_it() -> None:
    holding = Holding(owners=(("a",), ("b",), ("c",)), placed=("a", "b", "c"))
    indexes = {"k0": _index("k0", "x", {0: (7, 8, 9)}), "k1": _index("k1", "y", {1: (8, 9)}),
               "k2": _index("k2", "z", {2: (4,)})}
    assert catch_up_step(indexes, holding, 2, kept=(8, 9, 10)) == 9  # shared by stages 0 and 1, kept by c
    assert catch_up_step(indexes, holding, 2, kept=(10, 11, 12)) is None  # c no longer has 8 or 9: its newest
    indexes["k2"] = _index("k2", "z", {2: (9,)})
    assert catch_up_step(indexes, holding, 2, kept=(9, 10)) is None  # its keeper has 9 already


def test_an_index_round_trips_and_refuses_an_unknown_version() -> None:
    index = CopyIndex("n1", "a", "127.0.0.1:5", {0: {4: "x", 5: "y"}, 2: {5: "y"}}, {0: (0, 2), 2: (4, 6)})
    assert CopyIndex.from_json(index.to_json()) == index
    with pytest.raises(ValueError, match="unknown version 2"):
        CopyIndex.from_json(b'{"v": 2}')


def _index(node: str, zone: str, copies: dict[int, tuple[int, ...]] | None = None,
           history: tuple[tuple[int, int], ...] = HISTORY) -> CopyIndex:
    copies = copies or {}
    lineages = {stage: {step: lineage(history, step) for step in steps} for stage, steps in copies.items()}
    return CopyIndex(node, zone, f"{node}:1", lineages, {stage: BOUNDS[stage] for stage in copies})


def _indexes(zones: str) -> dict[str, CopyIndex]:
    """``"node:zone node:zone ..."`` as copy indexes."""
    return {node: _index(node, zone) for node, zone in (pair.split(":") for pair in zones.split())}


def test_keepers_are_in_zones_without_a_copy_first_one_per_zone_then_on_standby_then_the_least_loaded() -> None:
    # stage 0 is kept by its owners in zones a and b, stage 1 by theirs in c and b; s* are on standby
    indexes = _indexes("w:a h1:b s1:a s2:b p1:c p2:b s3:c")
    holding = Holding(owners=(("h1", "w"), ("p1", "p2")),
                      placed=("w", "h1", "p1", "p2"))
    assert plan_keepers(indexes, holding) == [["s3", "s1"], ["s1", "s2"]]  # s1: the only node in zone a for stage 1
    assert plan_keepers(indexes, holding, count=4) == [["s3", "s1", "s2"], ["s1", "s2", "s3"]]  # held: never
    # the 8-node run measured: every standby node keeps one stage (before: node5 both, node7 none)
    eight = _indexes("node0:a node1:b node2:c node3:a node4:b node5:c node6:a node7:b")
    holding = Holding(owners=(("node0", "node3"), ("node1", "node2")),
                      placed=("node0", "node1", "node2", "node3"))
    assert plan_keepers(eight, holding) == [["node4", "node5"], ["node6", "node7"]]
    # two owners in one zone, four standby nodes in another: each stage's copies go to two of their own
    spread = _indexes("h0:a h1:a s1:b s2:b s3:b s4:b")
    assert plan_keepers(spread, Holding(owners=(("h0",), ("h1",)), placed=("h0", "h1"))) == [
        ["s1", "s2"], ["s3", "s4"]]
    # a standby node before a placed one in the same zone; its own zone when it must
    three = _indexes("a0:a a1:b a2:c s:b")
    assert plan_keepers(three, Holding(owners=(("a0",), ("a1",), ("a2",)),
                                       placed=("a0", "a1", "a2")))[0] == ["s", "a1"]
    lonely = _indexes("w:a s1:a")
    assert plan_keepers(lonely, Holding(owners=(("w",),), placed=("w",))) == [["s1"]]


def test_the_restore_point_is_the_newest_step_every_stage_has_on_a_live_node() -> None:
    indexes = {
        "a": _index("a", "a", {0: (7, 8), 1: (7, 8)}),
        "b": _index("b", "b", {2: (7,)}),
        "c": _index("c", "c", {2: (8,)}),  # dead: not in alive
    }
    assert memory_restore(indexes, BOUNDS, {"a", "b"}, HISTORY) == (7, {0: ("a",), 1: ("a",), 2: ("b",)})
    assert memory_restore(indexes, BOUNDS, {"a", "b", "c"}, HISTORY) == (8, {0: ("a",), 1: ("a",), 2: ("c",)})
    assert memory_restore(indexes, BOUNDS, {"a"}, HISTORY) is None
    other_split = ((0, 3), (3, 4), (4, 6))  # copies of another split of the layers are no use
    assert memory_restore(indexes, other_split, {"a", "b"}, HISTORY) is None


def test_copies_of_an_abandoned_timeline_are_not_restored() -> None:
    """The job restored step 6 and trains steps 7, 8 again with 2 pipelines where it had run 1: a copy of step 8
    kept from before the restore is of another lineage, and the newest step restorable is the new timeline's 7."""
    now = ((0, 2), (5, 1), (6, 2))
    indexes = {"a": _index("a", "a", {0: (7,), 1: (7,), 2: (7,)}, history=now),
               "old": _index("old", "b", {0: (8,), 1: (8,), 2: (8,)}, history=HISTORY)}
    assert lineage(now, 6) == lineage(HISTORY, 6) and lineage(now, 8) != lineage(HISTORY, 8)
    assert memory_restore(indexes, BOUNDS, {"a", "old"}, now) == (7, {0: ("a",), 1: ("a",), 2: ("a",)})
    assert memory_restore(indexes, BOUNDS, {"a", "old"}, HISTORY)[0] == 8  # type: ignore[index]


def test_a_copy_travels_to_a_keeper_and_back_with_the_job_token() -> None:
    store = CopyStore()
    server = CopyServer(store, "127.0.0.1", token="secret")
    try:
        copy = _copy(2, 9, b"x" * 3_000_000)
        send_copy(server.address, copy, token="secret", pin=5)
        assert store.get(2, 9) == copy and store.pinned() == {2: 5}  # the host's pin of its stage
        assert fetch_copy(server.address, 2, 9, token="secret") == copy
        with pytest.raises(RuntimeError, match="bad token"):
            fetch_copy(server.address, 2, 9, token="wrong")
        with pytest.raises(RuntimeError, match="no copy of stage 2 at step 8"):
            fetch_copy(server.address, 2, 8, token="secret")
        # A keeper stores what it is sent unhashed; the bytes are checked where they are used.
        forged = Copy(1, 9, BOUNDS[1], b"data", hashlib.sha256(b"other").hexdigest(), lineage(HISTORY, 9))
        send_copy(server.address, forged, token="secret")
        with pytest.raises(RuntimeError, match="node-x: the copy of stage 1 at step 9 does not match its SHA-256"):
            verified(store.get(1, 9), "node-x")  # type: ignore[arg-type]
        assert verified(copy, "node-x") is copy
        with pytest.raises(RuntimeError, match="the copy of stage 1 at step 9 does not match its SHA-256"):
            fetch_copy(server.address, 1, 9, token="secret")
        assert store.get(1, 9) is None and 1 not in store.index()[0]  # found damaged: no longer offered
    finally:
        server.close()
