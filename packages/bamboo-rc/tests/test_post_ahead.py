"""Receives posted ahead: which receive the interpreter posts before a send or a computation, and when it does not.

The exactness of training with them is covered by the verify matrix (`test_verify.py`), and with failures while
messages are in flight by the failover tests (`test_failover.py`); the cuts they leave by
`packages/bamboo-schedule/tests/test_failover_ahead.py`."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from bamboo.rc.interpreter import StageInterpreter
from bamboo.rc.state import ReusedBuffers
from bamboo.schedule import Instruction, generate


class FakeGroups:
    def __init__(self) -> None:
        self.groups = {"p2p-0-1": object()}
        self.posted: list[tuple[str, tuple[int, ...], int, str]] = []

    def post_recv(self, group: str, out: torch.Tensor, peer: int, tag: int, instruction: str) -> list[object]:
        self.posted.append((group, tuple(out.shape), peer, instruction))
        return [object()]


class FakeInterpreter:
    """The state `post_ahead` reads, on rank `rank` of one pipeline (node = rank)."""

    post_ahead = StageInterpreter.post_ahead
    _group_for = StageInterpreter._group_for
    _receive_spec = StageInterpreter._receive_spec
    _handle = StageInterpreter._handle

    def __init__(self, rank: int, receives_ahead: bool = True) -> None:
        self.rank = rank
        self.receives_ahead = receives_ahead
        self.groups = FakeGroups()
        self.staging = SimpleNamespace(inbound_buffer=lambda shape, dtype: torch.empty(shape, dtype=dtype))
        self._waiter = None
        self._pending: dict[str, tuple[int, object, torch.Tensor | None]] = {}
        self._segmented: dict[str, object] = {}
        self._act_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}
        self._output_meta: dict[int, tuple[tuple[int, ...], torch.dtype]] = {}

    def _peer_rank(self, node: int) -> int:
        return node

    def _needs_barrier(self, group: str) -> bool:
        return False


def stream(node: int) -> list[Instruction]:
    return list(generate("1f1b", 2, 4, rc="none").streams[node])


def test_the_next_activation_is_posted_before_a_computation_once_its_shape_is_known() -> None:
    interpreter, instructions = FakeInterpreter(rank=1), stream(1)
    texts = [str(i) for i in instructions]
    backward = texts.index("1B0")
    interpreter.post_ahead(instructions, backward)
    assert interpreter.groups.posted == []  # the activation's shape comes with its first message: not known yet
    interpreter._act_meta[0] = ((2, 8, 4), torch.float32)
    interpreter.post_ahead(instructions, backward)
    interpreter.post_ahead(instructions, backward + 1)  # 1SG0>0: the same receive is next, posted once
    assert interpreter.groups.posted == [("p2p-0-1", (2, 8, 4), 0, "1RA1<0")]
    peer, _, buffer = interpreter._pending["1RA1<0"]
    assert peer == 0 and buffer is not None and buffer.shape == (2, 8, 4)


def test_a_gradient_is_posted_ahead_after_the_stage_s_first_forward() -> None:
    interpreter, instructions = FakeInterpreter(rank=0), stream(0)
    texts = [str(i) for i in instructions]
    interpreter.post_ahead(instructions, texts.index("0SA0>1"))
    assert interpreter.groups.posted == []  # no forward of stage 0 ran yet: its output's shape is not known
    interpreter._output_meta[0] = ((2, 8, 4), torch.float32)
    interpreter.post_ahead(instructions, texts.index("0SA1>1"))
    assert [posted[3] for posted in interpreter.groups.posted] == ["0RG1<1"]


def test_nothing_is_posted_ahead_in_efeb_or_at_a_receive_or_on_an_unbuilt_group() -> None:
    efeb = FakeInterpreter(rank=1, receives_ahead=False)
    efeb._act_meta[0] = ((2, 8, 4), torch.float32)
    instructions = stream(1)
    efeb.post_ahead(instructions, 1)
    at_receive = FakeInterpreter(rank=1)
    at_receive._act_meta[0] = ((2, 8, 4), torch.float32)
    at_receive.post_ahead(instructions, 0)  # 1RA0<0 itself: posted where it runs
    unbuilt = FakeInterpreter(rank=1)
    unbuilt._act_meta[0] = ((2, 8, 4), torch.float32)
    unbuilt.groups.groups.clear()
    unbuilt.post_ahead(instructions, 1)
    assert efeb.groups.posted == at_receive.groups.posted == unbuilt.groups.posted == []


class FakeSyncInterpreter(FakeInterpreter):
    """`FakeInterpreter` with what `post_sync_ahead` reads: the replica's pending update and the sync buffers."""

    post_sync_ahead = StageInterpreter.post_sync_ahead

    def __init__(self, rank: int) -> None:
        super().__init__(rank)
        self._replica_updates: dict[int, object] = {}
        self._received_syncs: dict[int, torch.Tensor] = {}
        self._sync_buffers = ReusedBuffers()

    def _sync_size(self, s: int) -> int:
        return 10 + s


def test_a_replica_sync_is_posted_ahead_after_the_last_gradient_once_the_replica_took_its_last_update() -> None:
    instructions = list(generate("1f1b", 2, 4, rc="lflb").streams[0])
    texts = [str(i) for i in instructions]
    last_backward = texts.index("0B3")  # after 0RG3<1, the node's last activation or gradient receive
    assert texts[last_backward:] == ["0B3", "0AR", "0SY>1", "0OPT", "1RY<1"]
    waiting = FakeSyncInterpreter(rank=0)
    waiting._output_meta[0] = ((2, 8, 4), torch.float32)
    waiting._replica_updates[1] = object()  # the last update still reads the buffer the sync would land in
    waiting.post_ahead(instructions, last_backward)
    assert waiting.groups.posted == []
    interpreter = FakeSyncInterpreter(rank=0)
    interpreter._output_meta[0] = ((2, 8, 4), torch.float32)
    interpreter.post_ahead(instructions, texts.index("0B2"))  # 0RG3<1 is the next receive: RY is not reached
    assert [posted[3] for posted in interpreter.groups.posted] == ["0RG3<1"]
    interpreter.post_ahead(instructions, last_backward)
    interpreter.post_ahead(instructions, last_backward + 1)  # posted once
    assert [posted[3] for posted in interpreter.groups.posted] == ["0RG3<1", "1RY<1"]
    assert interpreter.groups.posted[1][:3] == ("p2p-0-1", (11,), 1)  # the whole sync, from stage 1's owner
    peer, payload, segment = interpreter._segmented["1RY<1"]  # resumed by `_receive_segments` at RY
    assert (peer, payload.shape, segment) == (1, (11,), 0)
    assert interpreter._pending["1RY<1"][2].data_ptr() == payload.data_ptr()
