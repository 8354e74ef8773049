"""KvClient durable writes: the durability timeout on the wire, and the ambiguous answer.

A durable write carries the time the client will still wait (less a margin) as the
timeout of its durability frame info, so the server's SYNC_WRITE_AMBIGUOUS reaches the
client before the client gives up (``dcp/consumer/kv_requests.py``).
"""

from __future__ import annotations

import itertools
import struct

import pytest
import trio
from trio.testing import memory_stream_pair

from dcp.consumer import BatchWriteError, KvClient, RetryTimeoutError, SyncWriteAmbiguous
from dcp.consumer.kv_requests import durability_timeout_ms
from dcp.producer.server import DcpServer, ServerConfig
from dcp.protocol import FrameReader, codec
from dcp.protocol.opcodes import DurabilityLevel, FrameInfoId, Opcode, Status

NUM_VB = 16


def _timeout_of(frame) -> int:
    """The u16 timeout of a request's durability frame info (parsed, not sliced)."""
    ((fid, data),) = codec.parse_frame_infos(frame.framing_extras)
    assert fid == FrameInfoId.DURABILITY and len(data) == 3
    return struct.unpack(">H", data[1:])[0]


def test_the_timeout_sent_is_the_time_left_less_a_margin_within_u16() -> None:
    assert durability_timeout_ms(10.0) == 9750  # 0.25 s margin
    assert durability_timeout_ms(1.0) == 900  # a tenth of a short time
    assert durability_timeout_ms(0.0) == 1  # never 0: that would be the server's 30 s
    assert durability_timeout_ms(-1.0) == 1
    assert durability_timeout_ms(3600.0) == 0xFFFE  # never 0xFFFF: reserved


async def test_durable_requests_carry_the_client_timeout_in_their_frame_info(producer):
    for vb in range(NUM_VB):
        producer.vb(vb)
    async with KvClient("127.0.0.1", producer.port, num_vbuckets=NUM_VB, timeout=2.0) as kv:
        op = kv._store_op(Opcode.SET, "d", b"1", 0, 0, 0, DurabilityLevel.PERSIST_TO_ACTIVE)
        # alt magic, 4 bytes of framing extras: id 1 / length 3, level 4, 1800 ms (2 s - 10 %)
        assert op.frame[0] == 0x08 and op.frame[2] == 4
        assert op.frame[24:28] == b"\x13\x04\x07\x08"
        await kv.set("d", b"1", durable=True)
        await kv.delete("d", durable=True)
        await kv.set_many({"a": b"1", "b": b"2"}, durable=True)
    writes = [f for f in producer.frames if f.opcode in (Opcode.SET, Opcode.DELETE)]
    assert len(writes) == 4
    for f in writes:
        assert f.magic == 0x08 and codec.parse_durability(f) == 4  # durable=True
        # sent at once: the whole 2 s are left, less the margin (and a little time spent)
        assert 1700 <= _timeout_of(f) <= 1800, _timeout_of(f)


async def test_a_retried_durable_write_sends_only_the_time_left(producer, autojump_clock):
    for vb in range(NUM_VB):
        producer.vb(vb)
    producer.kv_tmpfail = 4  # ETMPFAIL four times, then the write succeeds
    async with KvClient("127.0.0.1", producer.port, num_vbuckets=NUM_VB, timeout=5.0) as kv:
        await kv.set("d", b"1", durable=True)
    sent = [_timeout_of(f) for f in producer.frames if f.opcode == Opcode.SET]
    assert len(sent) == 5
    assert sent[0] == 4750
    assert all(a > b for a, b in itertools.pairwise(sent)), sent


@pytest.mark.parametrize("many", [False, True])
async def test_a_durable_write_that_cannot_be_persisted_in_time_is_ambiguous(
    tmp_path, many
) -> None:
    """Against the real server with persistence paused: the answer comes from the server
    at the client's deadline (not the server's 30 s default) as ``SyncWriteAmbiguous``."""
    cfg = ServerConfig(
        host="127.0.0.1",
        port=0,
        data_dir=str(tmp_path / "d"),
        num_vbuckets=NUM_VB,
        log_level="WARNING",
    )
    async with (
        DcpServer(cfg) as server,
        KvClient("127.0.0.1", server.port, num_vbuckets=NUM_VB, timeout=1.0) as kv,
    ):
        server.pause_persistence()
        t0 = trio.current_time()
        if many:
            with pytest.raises(BatchWriteError) as batch:
                await kv.set_many({"x": b"1", "y": b"2"}, durable=True)
            errors = batch.value.results
            assert all(isinstance(e, SyncWriteAmbiguous) for e in errors), errors
            err = errors[0]
        else:
            with pytest.raises(SyncWriteAmbiguous) as info:
                await kv.set("invoice", b"paid", durable=True)
            err = info.value
        waited = trio.current_time() - t0
        assert 0.8 <= waited <= 2.0, waited
        assert err.status == Status.SYNC_WRITE_AMBIGUOUS
        assert "may or may not have been persisted" in str(err)
        assert not err.retriable
        # the write was applied; once persistence resumes a durable write succeeds
        key = "x" if many else "invoice"
        assert (await kv.get(key)).value == (b"1" if many else b"paid")
        server.resume_persistence()
        assert (await kv.set(key, b"again", durable=True)).seqno


async def test_without_extended_errors_a_durable_etmpfail_is_ambiguous_not_retried(
    autojump_clock,
) -> None:
    """A server that did not grant XERROR answers the deadline with ETMPFAIL: the write
    may have been applied, so it is neither retried nor reported as a timeout."""
    client_end, server_end = memory_stream_pair()
    seen: list[int] = []

    async def serve() -> None:
        reader = FrameReader()
        while True:
            data = await server_end.receive_some(65536)
            if not data:
                return
            reader.feed(data)
            for f in reader.read_frames():
                seen.append(f.opcode)
                status = Status.SUCCESS if f.opcode == Opcode.HELLO else Status.ETMPFAIL
                await server_end.send_all(codec.response(f.opcode, opaque=f.opaque, status=status))

    async def connect() -> trio.abc.Stream:
        return client_end

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        async with KvClient(connector=connect, num_vbuckets=NUM_VB, timeout=2.0) as kv:
            with pytest.raises(SyncWriteAmbiguous) as info:
                await kv.add("d", b"1", durable=True)
            assert seen == [Opcode.HELLO, Opcode.ADD]  # sent once
            # a write that is not durable is still retried on ETMPFAIL
            with pytest.raises(RetryTimeoutError):
                await kv.add("p", b"1")
        nursery.cancel_scope.cancel()
    assert info.value.status == Status.ETMPFAIL
    assert seen.count(Opcode.ADD) > 3
