"""Reconnects and retries: transient trouble is retried, never turned into a gap."""

from __future__ import annotations

import pytest
import trio

from dcp.consumer import DcpClient, RetryTimeoutError, StreamError
from dcp.protocol.opcodes import Status, StreamEndStatus

from .conftest import drain, make_client


def _seqnos(items) -> list[int]:
    return [e.seqno for b in items for e in b]


async def test_server_dropping_the_connection_mid_stream_is_survived(producer):
    h = producer.vb(0)
    h.add_mutations(30, per_snapshot=3)
    producer.fault(0, 14, "disconnect")
    producer.fault(0, 26, "disconnect")
    async with make_client(producer, vbuckets=[0], to_latest=True) as c:
        items = await drain(c)
    assert producer.accepted == 3
    seqnos = _seqnos(items)
    assert sorted(set(seqnos)) == list(range(1, 31)), "no gap"
    # nothing was committed, so every reconnect replays from 0: duplicates, never holes
    ends = [b.end for b in items]
    assert ends[-1] == 30


async def test_committed_batches_are_not_replayed_after_a_reconnect(producer):
    h = producer.vb(0)
    h.add_mutations(12, per_snapshot=3)
    producer.fault(0, 8, "disconnect")
    got = []
    async with make_client(producer, vbuckets=[0], to_latest=True) as c:
        async for b in c:
            got.append((b.start, b.end))
            await b.commit()
    # [1,3] and [4,6] were committed before the drop; [7,9] was partial and discarded
    assert got == [(1, 3), (4, 6), (7, 9), (10, 12)]
    assert [r.start for r in producer.requests_for(0)] == [0, 6]


async def test_stream_end_with_a_non_ok_reason_reopens_from_committed_state(producer):
    h = producer.vb(5)
    h.add_mutations(9, per_snapshot=3)
    producer.fault(5, 5, "stream_end", reason=StreamEndStatus.STATE_CHANGED)
    async with make_client(producer, vbuckets=[5], to_latest=True) as c:
        got = []
        async for b in c:
            got.append((b.start, b.end, len(b)))
            if b.end == 3:
                await b.commit()
    assert got == [(1, 3, 3), (4, 6, 3), (7, 9, 3)]
    assert producer.accepted == 1, "the same connection was reused"
    assert [(r.start, r.snap_start, r.snap_end) for r in producer.requests_for(5)] == [
        (0, 0, 0),
        (3, 3, 3),
    ]


async def test_not_my_vbucket_and_tmpfail_are_retried_with_backoff(producer):
    producer.vb(1).add_mutations(3, per_snapshot=3)
    producer.script(
        1,
        ("status", Status.NOT_MY_VBUCKET),
        ("status", Status.ETMPFAIL),
        ("status", Status.NOT_MY_VBUCKET),
    )
    async with make_client(producer, vbuckets=[1], to_latest=True) as c:
        items = await drain(c)
        assert c.statistics()["stream_retries"] == 3
    assert _seqnos(items) == [1, 2, 3]
    assert len(producer.requests_for(1)) == 4


async def test_retries_give_up_after_the_retry_timeout(producer, autojump_clock):
    producer.vb(1).add_mutations(3)
    producer.script(1, *[("status", Status.NOT_MY_VBUCKET)] * 10_000)
    async with make_client(producer, vbuckets=[1], retry_timeout=5.0) as c:
        with pytest.raises(RetryTimeoutError) as info:
            await c.getone()
    assert info.value.vbucket == 1 and info.value.operation == "stream request"
    assert info.value.elapsed >= 5.0 and info.value.attempts > 3


async def test_a_refused_stream_request_is_a_stream_error(producer):
    producer.vb(1).add_mutations(3)
    producer.script(1, ("status", Status.EACCESS))
    async with make_client(producer, vbuckets=[1]) as c:
        with pytest.raises(StreamError) as info:
            await c.getone()
    assert info.value.vbucket == 1 and info.value.status == Status.EACCESS


async def test_unreachable_server_raises_after_the_retry_timeout(autojump_clock):
    async def refuse() -> trio.abc.Stream:
        raise OSError("connection refused")

    async with DcpClient(connector=refuse, retry_timeout=3.0, vbuckets=[0]) as c:
        with pytest.raises(RetryTimeoutError) as info:
            await c.getone()
    assert info.value.operation == "connect" and info.value.attempts >= 3
    assert isinstance(info.value.__cause__, OSError)


async def test_connection_comes_back_after_the_server_was_down(producer, autojump_clock):
    producer.vb(0).add_mutations(6, per_snapshot=3)
    down = True

    async def flaky() -> trio.abc.Stream:
        if down:
            raise OSError("connection refused")
        return await trio.open_tcp_stream("127.0.0.1", producer.port)

    async with DcpClient(
        connector=flaky, vbuckets=[0], to_latest=True, noop_interval=None, retry_timeout=30.0
    ) as c:
        await trio.sleep(2.0)
        down = False
        items = await drain(c)
        assert c.statistics()["reconnects"] >= 3
    assert _seqnos(items) == list(range(1, 7))


async def test_garbage_from_the_server_drops_the_connection_and_reconnects(producer):
    producer.vb(0).add_mutations(3, per_snapshot=3)
    first = True

    async def connect() -> trio.abc.Stream:
        nonlocal first
        stream = await trio.open_tcp_stream("127.0.0.1", producer.port)
        if first:
            first = False
            return GarbageAfterHandshake(stream)
        return stream

    async with DcpClient(connector=connect, vbuckets=[0], to_latest=True, noop_interval=None) as c:
        items = await drain(c)
        assert c.statistics()["connects"] == 2
    assert _seqnos(items) == [1, 2, 3]


class GarbageAfterHandshake(trio.abc.Stream):
    """Delivers the server's first answers, then a frame with a bad magic."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.reads = 0

    async def receive_some(self, max_bytes=None):
        self.reads += 1
        data = await self.inner.receive_some(max_bytes)
        if self.reads > 1 and data:
            return b"\x42" + bytes(40)
        return data

    async def send_all(self, data) -> None:
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.inner.aclose()
