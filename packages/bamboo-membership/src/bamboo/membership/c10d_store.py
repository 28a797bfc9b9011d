"""An etcd-backed `torch.distributed.Store`, so process groups form and re-form with no TCPStore host.

Importing this module imports torch (the `torch` extra of bamboo-membership); nothing else in the package
does, and `bamboo.membership.EtcdStore` only loads this module when first used.

`EtcdStore(kv, prefix)` keeps every c10d key under `prefix` in etcd. Values are the opaque bytes that
c10d and gloo write (addresses, counters as decimal text); they are c10d's payloads, not Bamboo records.
A new group gets a new prefix (a prefix is never reused), e.g. `c10d_prefix(job, "epoch-3/dp-1")`,
and then, with no `init_process_group`:

    store = EtcdStore(kv, c10d_prefix("job", "epoch-3/pp-0"))
    opts = ProcessGroupGloo._Options(); opts._timeout = timeout
    opts._devices = [ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    group = ProcessGroupGloo(store, rank, world_size, opts)

Timeouts: `get` and `wait` block until their keys exist, for at most the store's `timeout` (constructor
argument, default `C10D_STORE_TIMEOUT_S` = 300 s, changeable with `set_timeout`), polling etcd every
`poll_min` seconds at first and backing off to `poll_max` (`C10D_POLL_MIN_S` = 1 ms, `C10D_POLL_MAX_S` =
20 ms; all in `bamboo.membership.timeouts`). Each etcd request is bounded by the client's own timeout.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from datetime import timedelta

import torch.distributed as dist
from bamboo.membership import timeouts
from bamboo.membership.kv import KeyValueStore
from bamboo.membership.store import JobKeys

__all__ = ["EtcdStore", "c10d_prefix"]

_TimeoutError: type[Exception] = getattr(dist, "DistStoreError", RuntimeError)


def c10d_prefix(job: str, group: str) -> str:
    """The etcd prefix for one process group of `job`: `/bamboo/<job>/c10d/<group>/`."""
    if not group or group != group.strip():
        raise ValueError(f"c10d group name must be non-empty without surrounding spaces, got {group!r}")
    return f"{JobKeys(job).root}c10d/{group.rstrip('/')}/"


def _text(value: str | bytes) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


class EtcdStore(dist.Store):
    """`torch.distributed.Store` over a `KeyValueStore` (etcd): set/get/add/compare_set/wait/check/num_keys/delete_key."""

    def __init__(
        self,
        kv: KeyValueStore,
        prefix: str,
        timeout: timedelta = timedelta(seconds=timeouts.C10D_STORE_TIMEOUT_S),
        *,
        poll_min: float = timeouts.C10D_POLL_MIN_S,
        poll_max: float = timeouts.C10D_POLL_MAX_S,
    ) -> None:
        super().__init__()
        if not prefix.endswith("/"):
            raise ValueError(f"EtcdStore prefix must end with '/', got {prefix!r}")
        self.kv = kv
        self.prefix = prefix
        self.poll_min = poll_min
        self.poll_max = poll_max
        self.set_timeout(timeout)

    def _key(self, key: str) -> str:
        return f"{self.prefix}{key}"

    def _wait_for(self, keys: Sequence[str], timeout: timedelta | None) -> dict[str, bytes]:
        limit = (timeout if timeout is not None else self.timeout).total_seconds()
        deadline = time.monotonic() + limit
        found: dict[str, bytes] = {}
        pause = self.poll_min
        while True:
            for key in keys:
                if key not in found:
                    item = self.kv.get(self._key(key))
                    if item is not None:
                        found[key] = item.value
            if len(found) == len(keys):
                return found
            if limit > 0 and time.monotonic() >= deadline:
                missing = [k for k in keys if k not in found]
                raise _TimeoutError(f"EtcdStore {self.prefix}: keys {missing} not set within {limit:.1f} s")
            time.sleep(pause)
            pause = min(pause * 2, self.poll_max)

    def set(self, key: str, value: str | bytes) -> None:
        self.kv.put(self._key(key), _text(value))

    def get(self, key: str) -> bytes:
        return self._wait_for([key], None)[key]

    def add(self, key: str, amount: int) -> int:
        full = self._key(key)
        while True:
            item = self.kv.get(full)
            current = 0 if item is None else int(item.value.decode() or 0)
            new = current + int(amount)
            if self.kv.compare_and_swap(full, str(new).encode(), 0 if item is None else item.mod_revision):
                return new

    def compare_set(self, key: str, expected_value: str | bytes, desired_value: str | bytes) -> bytes:
        """Set `desired_value` if the key holds `expected_value` (or is absent and `expected_value` is empty).

        Returns the value the key holds afterwards; for an absent key with a non-empty expectation,
        returns `expected_value` unchanged, as c10d's TCPStore does.
        """
        full, expected, desired = self._key(key), _text(expected_value), _text(desired_value)
        while True:
            item = self.kv.get(full)
            if item is None:
                if expected:
                    return expected
                if self.kv.compare_and_swap(full, desired, 0):
                    return desired
                continue
            if item.value != expected:
                return item.value
            if self.kv.compare_and_swap(full, desired, item.mod_revision):
                return desired

    def wait(self, keys: Sequence[str], timeout: timedelta | None = None) -> None:
        self._wait_for(list(keys), timeout)

    def check(self, keys: Sequence[str]) -> bool:
        return all(self.kv.get(self._key(key)) is not None for key in keys)

    def num_keys(self) -> int:
        return len(self.kv.get_prefix(self.prefix))

    def delete_key(self, key: str) -> bool:
        return self.kv.delete(self._key(key))
