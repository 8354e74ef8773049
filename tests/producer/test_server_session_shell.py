"""The connection as an I/O shell over ``dcp.protocol.ServerSession``, seen on the wire:
noop answers matched by opaque, a client's refusal of a DCP message, the session's window
and noop state in STAT dcp."""

from __future__ import annotations

import trio

from dcp.protocol import Opcode, Status, codec

from .conftest import client_of, running_server
from .wire import WireClient, keys_for_vb


async def _next_noop(c: WireClient, timeout: float) -> int:
    """The opaque of the next DCP_NOOP request the server sends (other frames dropped)."""
    with trio.fail_after(timeout):
        while True:
            f = await c.next_frame(timeout)
            if f.opcode == Opcode.DCP_NOOP and not f.is_response:
                return f.opaque


async def test_a_stale_noop_answer_does_not_count_and_the_matching_one_does(tmp_path) -> None:
    async with running_server(tmp_path / "d", idle_timeout=30) as server:
        async with client_of(server) as c:
            await c.dcp_open("t-noop-opaque")
            assert (await c.control("enable_noop", "true")).status == Status.SUCCESS
            assert (await c.control("set_noop_interval", "0.2")).status == Status.SUCCESS
            await c.stream_req(0)
            first = await _next_noop(c, 5)
            await c.send(codec.response(Opcode.DCP_NOOP, opaque=first + 1000))  # stale
            more = [
                f
                for f in await c.frames_for(1.0)
                if f.opcode == Opcode.DCP_NOOP and not f.is_response
            ]
            assert more == [], "a noop answer with another opaque was taken as the answer"
            st = await c.stats("dcp")
            assert st["eq_dcpq:t-noop-opaque:noop_pending"] == "True"
            await c.send(codec.response(Opcode.DCP_NOOP, opaque=first))
            assert await _next_noop(c, 5) == (first + 1) & 0xFFFFFFFF


async def test_a_client_refusing_a_mutation_is_disconnected(server, client) -> None:
    (key,) = keys_for_vb(0, 1, 4)
    await client.set(key, b"value")
    await client.dcp_open("t-refuses")
    await client.stream_req(0)
    with trio.fail_after(5):
        while True:
            f = await client.next_frame()
            if f.opcode == Opcode.DCP_MUTATION and not f.is_response:
                break
    await client.send(codec.response(Opcode.DCP_MUTATION, Status.ENOMEM, opaque=f.opaque))
    await client.wait_closed()
    assert client.eof


async def test_no_request_after_a_refusal_is_applied(server, client) -> None:
    """A refusal and a SET in the same write: the connection closes at the refusal, so
    the SET behind it is never applied (not even by the SET fast path)."""
    key, late = keys_for_vb(0, 2, 4)
    await client.set(key, b"value")
    await client.dcp_open("t-refuses-then-sets")
    await client.stream_req(0)
    with trio.fail_after(5):
        while True:
            f = await client.next_frame()
            if f.opcode == Opcode.DCP_MUTATION and not f.is_response:
                break
    refusal = codec.response(Opcode.DCP_MUTATION, Status.ENOMEM, opaque=f.opaque)
    set_req = codec.request(
        Opcode.SET, vbucket=0, opaque=77, key=late, value=b"late", extras=codec.store_extras(0, 0)
    )
    await client.send(refusal + set_req)
    await client.wait_closed()
    async with client_of(server) as other:
        assert (await other.get(late)).status == Status.KEY_ENOENT


async def test_the_window_and_the_noop_settings_show_in_stat_dcp(server, client) -> None:
    await client.dcp_open("t-stat")
    assert (await client.control("connection_buffer_size", "12345")).status == Status.SUCCESS
    assert (await client.control("set_noop_interval", "7.5")).status == Status.SUCCESS
    bad = await client.control("set_noop_interval", "0")
    assert bad.status == Status.EINVAL and b"interval must be 0.1..10800" in bytes(bad.value)
    st = await client.stats("dcp")
    assert (
        st["eq_dcpq:t-stat:window"],
        st["eq_dcpq:t-stat:noop_interval"],
        st["eq_dcpq:t-stat:noop_enabled"],
    ) == ("12345", "7.5", "False")
