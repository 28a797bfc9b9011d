"""The small measurements of ``scripts/gpu_check.py``: a message over gloo between two processes, the staging
copies of one on a GPU, and a ``transformers`` model's loss through ``bamboo.rc.from_transformers``.

Each returns plain numbers; ``gpu_check.py`` runs the ones that use a GPU in a child process.
"""

from __future__ import annotations

import statistics
import time

import torch
from bamboo.rc.comm import GroupTable
from bamboo.rc.device import resolve_device
from bamboo.rc.testing import ForkedRanks, RanksFailed
from bamboo.rc.timeouts import CommTimeouts
from bamboo.rc.transport import HostStaging
from torch.distributed import TCPStore

__all__ = ["gloo_seconds", "staging_seconds", "transformers_difference"]

REPEATS = 5
"""Timed messages per measurement (after one untimed); the median is reported."""


def _gloo_side(rank: int, store: TCPStore, mib: int) -> list[float]:
    groups = GroupTable(store, "probe", rank, CommTimeouts(), {})
    groups.set_members(0, {"p": (0, 1)})
    message = torch.ones(mib * 2**18)  # float32: mib MiB
    seconds = []
    for repeat in range(REPEATS + 1):
        started = time.perf_counter()
        post = groups.post_send if rank == 0 else groups.post_recv
        for work in post("p", message, 1 - rank, repeat, "probe"):
            work.wait()  # type: ignore[attr-defined]
        seconds.append(time.perf_counter() - started)
    return seconds[1:]


def gloo_seconds(mib: int) -> float:
    """Seconds to send one message of ``mib`` MiB between two local processes over gloo (the receiver's median)."""
    try:
        with ForkedRanks(2, lambda rank, store: _gloo_side(rank, store, mib)) as ranks:
            pass
    except RanksFailed as error:
        raise RuntimeError(f"the gloo probe failed: {error}") from None
    return statistics.median(ranks.results[1])


def staging_seconds(mib: int, device: str) -> float:
    """Seconds of the two staging copies of one message of ``mib`` MiB on ``device`` (a GPU): the sender's copy to
    pinned host memory and the receiver's copy back, through :class:`bamboo.rc.transport.HostStaging`."""
    place = resolve_device(device)
    staging = HostStaging(place)
    tensor = torch.ones(mib * 2**18, device=place)
    seconds = []
    for _ in range(REPEATS + 1):
        torch.cuda.synchronize(place)
        started = time.perf_counter()
        back = staging.inbound(staging.outbound(tensor))
        torch.cuda.synchronize(place)
        seconds.append(time.perf_counter() - started)
        assert back.device == place
    return statistics.median(seconds[1:])


def transformers_difference(device: str) -> float:
    """The relative difference between the loss of a small GPT-2 (``transformers``) on a batch and the loss of the
    same model through ``bamboo.rc.from_transformers`` (its layers run in order, then its loss function)."""
    import bamboo.rc
    import transformers

    place = resolve_device(device)
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256, n_positions=32)
    model = transformers.GPT2LMHeadModel(config).to(place).eval()
    layers, loss_fn = bamboo.rc.from_transformers(model)
    tokens = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1)).to(place)
    with torch.no_grad():
        theirs = float(model(input_ids=tokens, labels=tokens).loss)
        x = tokens
        for layer in layers:
            module = layer.build() if hasattr(layer, "build") else layer
            x = module.to(place).eval()(x)
        labels = torch.cat([tokens[:, 1:], torch.full_like(tokens[:, :1], -100)], dim=1)  # aligned: the next token
        ours = float(loss_fn(x, labels))
    return abs(ours - theirs) / abs(theirs)
