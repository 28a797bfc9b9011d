"""gRPC's wait slice, lengthened by `bamboo.membership.streams`: an idle watch stream's reader sleeps until a message
comes, and a signal still reaches a main thread blocked in a gRPC call at once."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable

import grpc._common
import pytest
from bamboo.membership import timeouts
from bamboo.membership.kv import EtcdKV


def test_an_idle_watch_stream_s_reader_sleeps_until_a_message_comes(kv: EtcdKV, job: str,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """gRPC's own slice (0.1 s) woke the stream's reading thread ten times a second while nothing came."""
    assert grpc._common.MAXIMUM_WAIT_TIMEOUT == timeouts.GRPC_WAIT_SLICE_S
    got = threading.Event()
    watch = kv.watch_prefix(f"/bamboo/{job}/idle/", lambda _event: got.set())
    try:
        wakes: list[float] = []
        wait_once = grpc._common._wait_once

        def counted(wait_fn: Callable[..., object], timeout: float, spin_cb: Callable[[], None] | None) -> None:
            if threading.current_thread().name == "bamboo-watch-stream":
                wakes.append(timeout)
            wait_once(wait_fn, timeout, spin_cb)

        monkeypatch.setattr(grpc._common, "_wait_once", counted)
        kv.put(f"/bamboo/{job}/idle/a", b"1")  # the reader's next wait starts under the counting function
        assert got.wait(10)
        time.sleep(0.5)  # the message and its notifications of the call's state (6 wakes once in make test)
        settled = len(wakes)
        time.sleep(1.0)
        # Every wait of the reader takes the long slice, and an idle second wakes it (nearly) never: a wait ends
        # when gRPC notifies the call's condition. With gRPC's 0.1 s slice the slices alone woke it about ten
        # times in this second.
        assert set(wakes) <= {timeouts.GRPC_WAIT_SLICE_S}, wakes
        idle = wakes[settled:]
        assert len(idle) <= 2, f"the idle reader woke {len(idle)} times in a second (slices {idle[:8]})"
        got.clear()
        kv.put(f"/bamboo/{job}/idle/b", b"2")
        assert got.wait(10)  # a message still wakes it at once
    finally:
        watch.cancel()


def test_a_signal_reaches_a_main_thread_blocked_in_a_grpc_stream(kv: EtcdKV, job: str) -> None:
    """The slice was short so that a signal reaches a main thread blocked in gRPC; on Linux the signal interrupts
    the wait itself. SIGINT, 0.5 s into a wait for a watch message that never comes, raises KeyboardInterrupt
    long before the 60 s slice ends. (The child restores Python's SIGINT handler: it inherits an ignored SIGINT
    from an xdist worker, and Python then installs none.)"""
    endpoint = kv.options.endpoints[0]
    code = textwrap.dedent(f"""
        import os, queue, signal, threading, time
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from bamboo.membership.kv import EtcdKV, EtcdOptions
        from bamboo.membership.streams import request_iterator
        from pyetcd import etcdrpc
        kv = EtcdKV(EtcdOptions([{endpoint!r}]))
        requests = queue.Queue()
        requests.put(etcdrpc.WatchRequest(create_request=etcdrpc.WatchCreateRequest(
            key=b"/bamboo/{job}/never/", range_end=b"/bamboo/{job}/never0")))
        call = etcdrpc.WatchStub(kv.client.channel).Watch(request_iterator(requests))
        next(call)  # the creation's answer
        threading.Timer(0.5, os.kill, (os.getpid(), signal.SIGINT)).start()
        start = time.monotonic()
        try:
            next(call)
        except KeyboardInterrupt:
            print(f"interrupted after {{time.monotonic() - start:.1f}} s", flush=True)
            os._exit(0)
        os._exit(1)
    """)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0 and "interrupted after" in done.stdout, done.stdout + done.stderr[-2000:]
