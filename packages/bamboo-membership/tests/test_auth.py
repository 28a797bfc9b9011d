"""etcd user/password auth passed through `EtcdOptions`: it works, a wrong password is a clear error, and the
client re-authenticates after etcd restarts (etcd forgets its simple tokens on restart), for requests and for
a watch that was open across the restart."""

from __future__ import annotations

import grpc
import pytest
from bamboo.membership.embedded import EmbeddedEtcd
from bamboo.membership.kv import EtcdKV, EtcdOptions, StoreError
from bamboo.membership.records import NodeRecord
from bamboo.membership.store import MembershipStore
from pyetcd import etcdrpc


def _enable_auth(server: EmbeddedEtcd, password: str) -> None:
    """Create root (with the root role) and turn auth on, over etcd's own gRPC API."""
    channel = grpc.insecure_channel(server.endpoint)
    auth = etcdrpc.AuthStub(channel)
    auth.UserAdd(etcdrpc.AuthUserAddRequest(name="root", password=password), timeout=5)
    auth.RoleAdd(etcdrpc.AuthRoleAddRequest(name="root"), timeout=5)
    auth.UserGrantRole(etcdrpc.AuthUserGrantRoleRequest(user="root", role="root"), timeout=5)
    auth.AuthEnable(etcdrpc.AuthEnableRequest(), timeout=5)
    channel.close()


def test_user_password_auth_is_passed_through_and_survives_a_restart(etcd_factory, wait_until) -> None:
    server = etcd_factory()
    _enable_auth(server, "s3cret")
    with pytest.raises(StoreError, match="authenticate"):
        EtcdKV(EtcdOptions(endpoints=(server.endpoint,), user="root", password="wrong"))
    anonymous = EtcdKV(EtcdOptions(endpoints=(server.endpoint,)))
    with pytest.raises(StoreError, match="put /bamboo/auth/probe"):
        anonymous.put("/bamboo/auth/probe", b"{}")
    anonymous.close()

    kv = EtcdKV(EtcdOptions(endpoints=(server.endpoint,), user="root", password="s3cret", timeout=2))
    store = MembershipStore(kv, "auth")
    assert store.decide("d", {"v": 1}).won
    decided: list[str] = []
    watch = kv.watch_prefix(store.keys.decisions, lambda event: decided.append(event.key))
    server.restart()
    wait_until(lambda: _decision(store) == {"v": 1}, timeout=30, message="an authenticated read after restart")
    assert kv.reauthentications >= 1  # the old token died with the old server
    assert store.decide("after-restart", {"v": 2}).won
    wait_until(lambda: store.keys.decision("after-restart") in decided, timeout=30,
               message="the watch to resume with a fresh token")
    watch.cancel()
    reg = store.register(NodeRecord(id="n"), ttl=2)
    assert set(store.list_nodes()) == {"n"}
    reg.leave()
    kv.close()


def _decision(store: MembershipStore) -> dict | None:
    try:
        found = store.get_decision("d")
    except StoreError:
        return None
    return None if found is None else found.value
