"""A message of more chunks than it has gloo tags arrives whole, on a real gloo pair in this process.

Chunk i of a message goes under the message's tag number ``i mod MAX_CHUNKS`` (``bamboo.rc.comm``): chunks
past the last tag reuse the tags in turn, which is sound only because gloo pairs the sends and receives of one
tag between two ranks first in, first out. The constants are made small here, so that a few hundred bytes
make a message of ten times more chunks than tags.
"""

from __future__ import annotations

import datetime
import threading
from collections.abc import Iterator

import pytest
import torch
from bamboo.rc import comm
from bamboo.rc.comm import CommTimeouts, GroupTable
from torch.distributed import TCPStore

GROUP = "p2p-0-1"


@pytest.fixture
def pair(monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[GroupTable, GroupTable]]:
    """Ranks 0 and 1 of a real gloo group, one table each (the group's build is a rendezvous of both)."""
    monkeypatch.setattr(comm, "CHUNK_BYTES", 64)
    monkeypatch.setattr(comm, "MAX_CHUNKS", 4)
    timeout = datetime.timedelta(seconds=30)
    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timeout)
    client = TCPStore("127.0.0.1", server.port, is_master=False, timeout=timeout)
    tables = (GroupTable(server, "job", 0, CommTimeouts(group=10.0), {}),
              GroupTable(client, "job", 1, CommTimeouts(group=10.0), {}))
    for table in tables:
        table.set_members(0, {GROUP: [0, 1]})
    builder = threading.Thread(target=tables[1].group, args=(GROUP,))
    builder.start()
    tables[0].group(GROUP)
    builder.join()
    yield tables
    for table in tables:
        table.groups.clear()


def test_a_message_of_ten_times_more_chunks_than_tags_arrives_whole(pair: tuple[GroupTable, GroupTable]) -> None:
    sender, receiver = pair
    big = torch.arange(16 * 40, dtype=torch.float32)  # 40 chunks of 64 bytes, 4 tags
    small = -torch.arange(1, 16 * 7 + 1, dtype=torch.float32)  # 7 chunks
    got_big, got_small = torch.empty_like(big), torch.empty_like(small)
    # The receiver posts in the other order than the sender sends: only the chunks of one message share tags.
    works = receiver.post_recv(GROUP, got_small, 0, 6, "1RA1")
    works += receiver.post_recv(GROUP, got_big, 0, 5, "1RA0")
    works += sender.post_send(GROUP, big, 1, 5, "0SA0")
    works += sender.post_send(GROUP, small, 1, 6, "0SA1")
    comm.wait_works(works)
    assert torch.equal(got_big, big) and torch.equal(got_small, small)
    # The same tags again, as the next step's messages of the same instructions, the other way round.
    again = receiver.post_send(GROUP, big * 2, 0, 5, "1SG0")
    comm.wait_works([*again, *sender.post_recv(GROUP, got_big, 1, 5, "0RG0")])
    assert torch.equal(got_big, big * 2)
