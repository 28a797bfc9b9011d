"""The etcd-backed c10d store: Store semantics, and real 2-rank ProcessGroupGloo groups in separate
processes, formed, then re-formed under a new prefix after one rank is killed and replaced."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from datetime import timedelta

import pytest

torch = pytest.importorskip("torch")

from bamboo.membership.c10d_store import EtcdStore, c10d_prefix  # noqa: E402
from bamboo.membership.embedded import EmbeddedEtcd  # noqa: E402
from bamboo.membership.kv import EtcdKV  # noqa: E402

# One rank: joins each named group in turn, all-reduces (rank + 1) and prints the sum as JSON.
RANK = textwrap.dedent(
    """
    import json, os, sys
    from datetime import timedelta
    import torch
    from torch.distributed import ProcessGroupGloo
    from bamboo.membership.c10d_store import EtcdStore, c10d_prefix
    from bamboo.membership.kv import EtcdKV, EtcdOptions

    endpoint, rank, groups = sys.argv[1], int(sys.argv[2]), sys.argv[3].split(",")
    kv = EtcdKV(EtcdOptions(endpoints=(endpoint,)))
    keep = []
    for name in groups:
        store = EtcdStore(kv, c10d_prefix("c10d-test", name), timedelta(seconds=150))
        opts = ProcessGroupGloo._Options()
        opts._timeout = timedelta(seconds=150)  # a newcomer may import torch slowly on a loaded machine
        opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
        group = ProcessGroupGloo(store, rank, 2, opts)
        keep.append(group)
        x = torch.tensor([float(rank + 1)])
        group.allreduce([x]).wait()
        print(json.dumps({"group": name, "rank": rank, "sum": x.item()}), flush=True)
    if len(sys.argv) > 4:
        sys.stdin.readline()  # stay alive until the test kills us
    # End like a worker does: flush, then os._exit. A normal interpreter exit destroys live gloo
    # and etcd client threads and can abort with "terminate called without an active exception".
    sys.stdout.flush()
    os._exit(0)
    """
)


def _rank(etcd: EmbeddedEtcd, rank: int, groups: str, *hold: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", RANK, etcd.endpoint, str(rank), groups, *hold],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_store_semantics(kv: EtcdKV, job: str) -> None:
    store = EtcdStore(kv, c10d_prefix(job, "sem"), timedelta(seconds=2))
    store.set("k", "v")
    assert store.get("k") == b"v"
    assert [store.add("n", 2), store.add("n", 5), store.add("n", -1)] == [2, 7, 6]
    assert store.get("n") == b"6"
    assert store.compare_set("cs", "", "first") == b"first"  # absent + empty expectation: created
    assert store.compare_set("cs", "wrong", "x") == b"first"  # mismatch: current value
    assert store.compare_set("cs", "first", "second") == b"second"
    assert store.compare_set("absent", "exp", "x") == b"exp"
    assert store.check(["k", "n"]) and not store.check(["k", "nope"])
    assert store.num_keys() == 3
    assert store.delete_key("k") and not store.delete_key("k")
    store.wait(["n", "cs"])
    with pytest.raises(torch.distributed.DistStoreError, match=r"\['late'\]"):
        store.wait(["late"], timedelta(seconds=0.05))
    store.set_timeout(timedelta(seconds=0.05))
    with pytest.raises(torch.distributed.DistStoreError, match="missing"):
        store.get("missing")
    with pytest.raises(ValueError, match="'no-slash'"):
        EtcdStore(kv, "no-slash")


def test_two_rank_gloo_group_forms_and_reforms_under_a_new_prefix_after_a_kill(etcd: EmbeddedEtcd) -> None:
    survivor = _rank(etcd, 0, "epoch-1,epoch-2")
    victim = _rank(etcd, 1, "epoch-1", "hold")
    try:
        first = json.loads(victim.stdout.readline())
        assert first == {"group": "epoch-1", "rank": 1, "sum": 3.0}
        assert json.loads(survivor.stdout.readline()) == {"group": "epoch-1", "rank": 0, "sum": 3.0}
        victim.kill()  # rank 1 dies; the survivor is already waiting to form epoch-2
        victim.wait(timeout=10)
        newcomer = _rank(etcd, 1, "epoch-2")
        out, err = newcomer.communicate(timeout=180)
        assert newcomer.returncode == 0, err
        assert json.loads(out) == {"group": "epoch-2", "rank": 1, "sum": 3.0}
        out, err = survivor.communicate(timeout=60)
        assert survivor.returncode == 0, err
        assert json.loads(out) == {"group": "epoch-2", "rank": 0, "sum": 3.0}
    finally:
        for proc in (survivor, victim):
            if proc.poll() is None:
                proc.kill()
                proc.wait()


def test_importing_the_package_does_not_import_torch() -> None:
    code = "import sys, bamboo.membership, bamboo.membership.agent; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "False"
