"""Bad input: errors or a closed connection for the sender, nothing for anyone else."""

from __future__ import annotations

import trio

from dcp.protocol import Opcode, Status, codec

from .conftest import client_of, running_server
from .wire import items_of, keys_for_vb


async def test_unknown_opcode_is_answered_unknown_command(client) -> None:
    r = await client.call(codec.request(0xEE, opaque=5), 5)
    assert r.status == Status.UNKNOWN_COMMAND
    r = await client.call(codec.request(Opcode.NOOP, opaque=6), 6)  # still usable
    assert r.status == Status.SUCCESS


async def test_wrong_extras_length_is_einval_and_the_connection_survives(client) -> None:
    r = await client.call(codec.request(Opcode.SET, opaque=9, extras=b"\x00" * 3, key=b"k"), 9)
    assert r.status == Status.EINVAL
    await client.dcp_open("t-bad")
    r = await client.call(codec.request(Opcode.DCP_STREAM_REQ, opaque=10, extras=b"\0" * 20), 10)
    assert r.status == Status.EINVAL
    r = await client.call(codec.request(Opcode.DCP_BUFFER_ACK, opaque=11, extras=b"\0"), 11)
    assert r.status == Status.EINVAL
    r = await client.call(codec.request(Opcode.NOOP, opaque=12), 12)
    assert r.status == Status.SUCCESS


async def test_dcp_requests_before_dcp_open_are_refused(client) -> None:
    r = await client.stream_req(0)
    assert r.status == Status.EINVAL
    r = await client.control("enable_noop", "true")
    assert r.status == Status.EINVAL
    r = await client.dcp_open("t-consumer", flags=0)
    assert r.status == Status.NOT_SUPPORTED


async def test_unknown_control_key_is_einval(client) -> None:
    await client.dcp_open("t-ctl")
    assert (await client.control("no_such_key", "1")).status == Status.EINVAL
    assert (await client.control("enable_noop", "maybe")).status == Status.EINVAL
    assert (await client.control("connection_buffer_size", "-5")).status == Status.EINVAL
    assert (await client.control("change_streams", "false")).status == Status.EINVAL
    assert (await client.control("change_streams", "true")).status == Status.SUCCESS  # default
    assert (await client.control("enable_noop", "true")).status == Status.SUCCESS


async def test_change_streams_are_not_supported_without_a_history(tmp_path) -> None:
    async with running_server(tmp_path / "d", history_seconds=0, history_bytes=0) as server:
        async with client_of(server) as c:
            await c.dcp_open("t-no-history")
            assert (await c.control("change_streams", "true")).status == Status.NOT_SUPPORTED
            assert (await c.control("enable_noop", "true")).status == Status.SUCCESS


async def test_oversize_and_garbage_frames_close_only_that_connection(server) -> None:
    async with client_of(server) as healthy, client_of(server) as writer:
        keys = keys_for_vb(1, 50, 4)
        await healthy.dcp_open("healthy")
        await healthy.stream_req(1)
        for bad in (
            codec.HEADER.pack(0x80, 0x01, 1, 8, 0, 0, 0x7FFF_FFFF, 1, 0),  # 2 GiB body
            b"\x99" * 24,  # bad magic
            codec.HEADER.pack(0x80, 0x57, 100, 31, 0, 0, 10, 1, 0) + b"\0" * 10,  # lengths lie
        ):
            async with client_of(server) as evil:
                await evil.send(bad)
                frames = await evil.frames_for(2.0)
                assert evil.eof, "server kept a connection whose byte stream is broken"
                assert all(f.status == Status.EINVAL for f in frames)
        await writer.set_many([(k, b"ok") for k in keys])
        frames = await healthy.read_stream_until(
            lambda f: bool(items_of([f])) and items_of([f])[0][1] == 50
        )
        assert [s for _, s, _, _ in items_of(frames)] == list(range(1, 51))


async def test_a_second_connection_with_the_same_name_replaces_the_first(server) -> None:
    async with client_of(server) as first, client_of(server) as second:
        await first.dcp_open("same-name")
        await first.stream_req(0)
        await second.dcp_open("same-name")
        await first.wait_closed(5)
        assert (await second.stream_req(0)).status == Status.SUCCESS


async def test_a_client_that_never_reads_cannot_grow_server_memory(server) -> None:
    """Requests keep coming but responses are never read: the server stops reading."""
    async with client_of(server) as c:
        big_get = codec.request(Opcode.STAT, opaque=1, key=b"vbucket-seqno")
        sent = 0
        with trio.move_on_after(3):
            while True:
                await c.send(big_get * 50)
                sent += 50
        conn = next(x for x in server.connections if x.frames_in)
        queued = conn.statistics()["queued_response_bytes"]
        assert sent > 1000
        assert queued <= server.config.connection_output_cap + 512 * 1024
