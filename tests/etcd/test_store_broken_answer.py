"""EtcdStore when etcd dies in the middle of an answer: StoreUnavailable, like any other
way of not getting one (found by ``python -m tools.chaos failover``: an etcd killed while
it streamed a prefix read made the orchestrator fail with ``ChunkedEncodingError`` and
resign, logged as a bug).

Rules of this module: a stand-in etcd on loopback (a trio listener) reads one request
and sends the bytes given, then closes; nothing else runs.
"""

from __future__ import annotations

import pytest
import trio

from dcp.producer.cluster.store import EtcdStore, StoreUnavailable

CUT_CHUNKED = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    b"64\r\n" + b'{"header":{"revision":"7"},"kvs":['  # 100 bytes announced, 34 sent
)
CUT_LENGTH = (
    b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: 100\r\n\r\n"
    b'{"header":{"revision":"7"},"kvs":['
)


async def _answer_once(listener: trio.SocketListener, reply: bytes) -> None:
    stream = await listener.accept()
    async with stream:
        got = b""
        while b"\r\n\r\n" not in got:
            data = await stream.receive_some(65536)
            if not data:
                return
            got += data
        await stream.send_all(reply)


@pytest.mark.parametrize("reply", [CUT_CHUNKED, CUT_LENGTH], ids=["chunked", "content-length"])
async def test_an_answer_cut_off_is_store_unavailable(reply: bytes) -> None:
    (listener,) = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    store = EtcdStore(f"http://127.0.0.1:{port}", timeout=2.0)
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_answer_once, listener, reply)
            with trio.fail_after(10):
                with pytest.raises(StoreUnavailable, match="get prefix /dcp/c/"):
                    await store.get_prefix("/dcp/c/")
    finally:
        await listener.aclose()
        await store.aclose()
