"""Flow control, cursor dropping under a memory quota, noops and idle disconnects."""

from __future__ import annotations

import trio

from dcp.protocol import Opcode, Status, codec

from .conftest import client_of, running_server
from .wire import items_of, keys_for_vb


async def test_flow_control_stalls_without_acks_and_resumes_with_them(server, client) -> None:
    keys = keys_for_vb(0, 200, 4)
    await client.set_many([(k, b"x" * 100) for k in keys])
    await client.dcp_open("t-flow")
    assert (await client.control("connection_buffer_size", "2000")).status == Status.SUCCESS
    await client.stream_req(0)
    first = await client.frames_for(0.5)
    sent = sum(f.size for f in first if not f.is_response)
    assert 0 < sent < 2000 + 200, sent  # one message may overshoot the window
    assert not await client.frames_for(0.3), "server kept sending past the window"
    got = items_of(first)
    with trio.fail_after(10):
        while len(got) < 200:
            await client.ack_all([f for f in first if not f.is_response])
            first = await client.frames_for(0.2)
            got += items_of(first)
    assert [s for _, s, _, _ in got] == list(range(1, 201))


async def test_stalled_client_loses_its_cursor_then_catches_up_with_nothing_missing(
    tmp_path,
) -> None:
    async with running_server(
        tmp_path / "d", checkpoint_max_items=50, checkpoint_memory_quota=256 * 1024
    ) as server:
        async with client_of(server) as c, client_of(server) as writer:
            await c.dcp_open("t-slow")
            await c.control("connection_buffer_size", "4096")
            await c.stream_req(1)
            keys = keys_for_vb(1, 400, 4)
            for i in range(0, 4000, 400):  # 4000 writes of 1 KiB: ~4 MiB through a 256 KiB quota
                await writer.set_many(
                    [(k, b"%06d" % (i + j) + b"v" * 1018) for j, k in enumerate(keys)]
                )
                await server.flush_all()
            await trio.sleep(0.3)
            (stream,) = server.streams()
            assert stream.cursor is None or stream.cursor.dropped, "cursor never dropped"
            assert server.bucket.cursors_dropped >= 1
            assert server.bucket.checkpoint_memory() < 4 * 256 * 1024
            latest: dict[bytes, bytes] = {}
            high = server.bucket.vbucket(1).high_seqno
            seen = 0
            with trio.fail_after(30):
                while seen < high:
                    f = await c.next_frame()
                    if f.is_response:
                        continue
                    await c.ack_all([f])
                    for _, s, k, v in items_of([f]):
                        latest[k] = v
                        seen = s
            assert latest == {k: b"%06d" % (3600 + j) + b"v" * 1018 for j, k in enumerate(keys)}
            assert stream.backfills >= 1 and stream.cursor_drops >= 1


async def test_noops_are_sent_and_a_silent_client_is_disconnected(tmp_path) -> None:
    async with running_server(tmp_path / "d", idle_timeout=1.5) as server:
        async with client_of(server) as quiet, client_of(server) as polite:
            for c, name in ((quiet, "quiet"), (polite, "polite")):
                await c.dcp_open(name)
                assert (await c.control("enable_noop", "true")).status == 0
                assert (await c.control("set_noop_interval", "0.2")).status == 0
                await c.stream_req(0)
            noops = 0
            with trio.fail_after(10):
                async with trio.open_nursery() as n:

                    async def answer() -> None:
                        nonlocal noops
                        while True:
                            f = await polite.next_frame(10)
                            if f.opcode == Opcode.DCP_NOOP and not f.is_response:
                                noops += 1
                                await polite.send(codec.response(Opcode.DCP_NOOP, opaque=f.opaque))

                    n.start_soon(answer)
                    await quiet.wait_closed(timeout=6)
                    n.cancel_scope.cancel()
            assert quiet.eof
            assert noops >= 3
            assert any(c.dcp_name == "polite" for c in server.connections)
