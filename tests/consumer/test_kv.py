"""KvClient: routing, pipelining, durable framing, results, errors."""

from __future__ import annotations

import pytest
import trio

from dcp.consumer import (
    BatchWriteError,
    KeyExists,
    KeyNotFound,
    KvClient,
    RetryTimeoutError,
    UsageError,
)
from dcp.protocol import codec
from dcp.protocol.opcodes import Opcode

NUM_VB = 16


def _kv(producer, **kw) -> KvClient:
    for vb in range(NUM_VB):
        producer.vb(vb)
    return KvClient("127.0.0.1", producer.port, num_vbuckets=NUM_VB, **kw)


class CountingStream(trio.abc.Stream):
    """Wraps a stream and counts ``send_all`` calls."""

    def __init__(self, inner: trio.abc.Stream) -> None:
        self.inner = inner
        self.sends = 0

    async def send_all(self, data) -> None:
        self.sends += 1
        await self.inner.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes=None):
        return await self.inner.receive_some(max_bytes)

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_set_get_add_replace_delete(producer):
    async with _kv(producer) as kv:
        r = await kv.set("doc-1", {"a": 1}, flags=7)
        vb = codec.vbucket_for_key(b"doc-1", NUM_VB)
        assert r.vbucket == vb and r.seqno == 1 and r.vb_uuid == producer.vbs[vb].log[0][0]
        assert r.cas
        g = await kv.get("doc-1")
        assert (g.value, g.flags, g.cas) == (b'{"a":1}', 7, r.cas)
        with pytest.raises(KeyExists):
            await kv.add("doc-1", b"x")
        with pytest.raises(KeyNotFound):
            await kv.replace("nope", b"x")
        assert (await kv.replace("doc-1", "v2")).seqno == 2
        assert (await kv.delete("doc-1")).seqno == 3
        with pytest.raises(KeyNotFound):
            await kv.get("doc-1")
    assert producer.hello_features[0][:3] == [0x07, 0x0B, 0x04]
    sets = [f for f in producer.frames if f.opcode == Opcode.SET]
    assert sets[0].datatype == 1 and sets[0].vbucket == vb


async def test_set_many_is_pipelined_in_one_write(producer):
    counted: list[CountingStream] = []

    async def connect() -> trio.abc.Stream:
        s = CountingStream(await trio.open_tcp_stream("127.0.0.1", producer.port))
        counted.append(s)
        return s

    async with _kv(producer, connector=connect) as kv:
        before = counted[0].sends
        items = {f"key-{i}": f"value-{i}" for i in range(500)}
        results = await kv.set_many(items)
        assert counted[0].sends - before == 1
        assert [r.key for r in results] == [k.encode() for k in items]
        assert all(r.seqno for r in results)
        got = await kv.get_many([*items, "missing"])
        assert len(got) == 500 and got[b"key-7"].value == b"value-7"
        await kv.delete_many(["key-1", "key-2"])
    for r in results:
        assert r.vbucket == codec.vbucket_for_key(r.key, NUM_VB)


async def test_durable_writes_use_alt_framing_with_persist_to_active(producer):
    async with _kv(producer) as kv:
        await kv.set("d", b"1", durable=True)
        await kv.delete("d", durable=True)
        await kv.set("n", b"1")
    writes = [f for f in producer.frames if f.opcode in (Opcode.SET, Opcode.DELETE)]
    # frame info id 1 / length 3: the level and a u16 timeout (tests/consumer/test_kv_durable.py)
    assert [(f.magic, bytes(f.framing_extras)[:2]) for f in writes] == [
        (0x08, b"\x13\x04"),
        (0x08, b"\x13\x04"),
        (0x80, b""),
    ]
    assert codec.parse_durability(writes[0]) == 4  # durable=True: PERSIST_TO_ACTIVE


async def test_tmpfail_is_retried_and_batch_errors_are_reported_per_item(producer):
    producer.kv_tmpfail = 3
    async with _kv(producer) as kv:
        r = await kv.set("a", b"1")
        assert r.seqno == 1
        await kv.set("b", b"1")
        with pytest.raises(BatchWriteError) as info:
            await kv._write_many(
                [kv._store_op(Opcode.ADD, k, b"2", 0, 0, 0, False) for k in ("a", "c", "b")]
            )
        res = info.value.results
        assert isinstance(res[0], KeyExists) and res[1].key == b"c"
        assert isinstance(res[2], KeyExists)


async def test_endless_tmpfail_gives_up_after_the_timeout(producer, autojump_clock):
    producer.kv_tmpfail = 10**9
    async with _kv(producer, timeout=2.0) as kv:
        with pytest.raises(RetryTimeoutError) as info:
            await kv.set("a", b"1")
    assert info.value.attempts > 3


async def test_bad_keys_and_values_are_usage_errors(producer):
    async with _kv(producer) as kv:
        with pytest.raises(UsageError):
            await kv.set("", b"x")
        with pytest.raises(UsageError):
            await kv.set("k" * 251, b"x")
        with pytest.raises(UsageError):
            await kv.set("k", 3.5)
    with pytest.raises(UsageError):
        KvClient(num_vbuckets=1000)


async def test_connect_is_retried_until_the_timeout(autojump_clock):
    attempts = 0

    async def refuse() -> trio.abc.Stream:
        nonlocal attempts
        attempts += 1
        raise OSError("refused")

    with pytest.raises(RetryTimeoutError) as info:
        async with KvClient(connector=refuse, timeout=3.0):
            pass
    assert info.value.operation == "connect" and attempts == info.value.attempts > 3


async def test_a_get_answered_success_without_flags_or_value_is_an_empty_document():
    """The session hands a SUCCESS answer with nothing but a CAS over as a tuple (the
    successful-write shape); a GET answered like that is an empty document, flags 0."""
    from trio.testing import memory_stream_pair

    from dcp.protocol import FrameReader

    client_end, server_end = memory_stream_pair()

    async def serve() -> None:
        reader = FrameReader()
        while True:
            data = await server_end.receive_some(65536)
            if not data:
                return
            reader.feed(data)
            for f in reader.read_frames():
                # no extras, no key, no value: only the opaque and a CAS
                await server_end.send_all(codec.response(f.opcode, opaque=f.opaque, cas=77))

    async def connect() -> trio.abc.Stream:
        return client_end

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        async with KvClient(connector=connect, num_vbuckets=NUM_VB) as kv:
            got = await kv.get("doc")
        nursery.cancel_scope.cancel()
    assert (got.key, got.value, got.flags, got.cas, got.datatype) == (b"doc", b"", 0, 77, 0)
