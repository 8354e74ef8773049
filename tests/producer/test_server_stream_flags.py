"""Stream-request flags over the wire: ToLatest, FromLatest, DiskOnly, StrictVbUuid."""

from __future__ import annotations

from dcp.protocol import Opcode, Status, StreamRequestFlag, codec

from .wire import items_of, keys_for_vb


def is_end(f) -> bool:  # type: ignore[no-untyped-def]
    return f.opcode == Opcode.DCP_STREAM_END


async def test_to_latest_ends_at_the_high_seqno_of_request_time(server, client) -> None:
    keys = keys_for_vb(1, 6, 4)
    await client.set_many([(k, b"x") for k in keys[:4]])
    await client.dcp_open("t-tolatest")
    r = await client.stream_req(1, flags=StreamRequestFlag.TO_LATEST)
    assert r.status == Status.SUCCESS
    await client.set_many([(k, b"y") for k in keys[4:]])  # after the request: not included
    frames = await client.read_stream_until(is_end)
    assert [s for _, s, _, _ in items_of(frames)] == [1, 2, 3, 4]


async def test_from_latest_sends_only_changes_made_after_the_request(server, client) -> None:
    keys = keys_for_vb(2, 6, 4)
    await client.set_many([(k, b"old") for k in keys[:3]])
    await client.dcp_open("t-fromlatest")
    r = await client.stream_req(2, flags=StreamRequestFlag.FROM_LATEST)
    assert r.status == Status.SUCCESS
    await client.set_many([(k, b"new") for k in keys[3:]])
    frames = await client.read_stream_until(
        lambda f: bool(items_of([f])) and items_of([f])[0][1] == 6
    )
    assert [(s, v) for _, s, _, v in items_of(frames)] == [(4, b"new"), (5, b"new"), (6, b"new")]


async def test_disk_only_ends_at_the_persisted_seqno(server, client) -> None:
    keys = keys_for_vb(3, 5, 4)
    await client.set_many([(k, b"x") for k in keys[:3]])
    await server.flush_all()
    server.pause_persistence()
    await client.set_many([(k, b"x") for k in keys[3:]])
    await client.dcp_open("t-diskonly")
    assert (await client.stream_req(3, flags=StreamRequestFlag.DISK_ONLY)).status == 0
    frames = await client.read_stream_until(is_end)
    assert [s for _, s, _, _ in items_of(frames)] == [1, 2, 3]
    server.resume_persistence()


async def test_strict_vb_uuid_checks_the_uuid_even_from_zero(server, client) -> None:
    await client.dcp_open("t-strict")
    r = await client.stream_req(0, uuid=12345, flags=StreamRequestFlag.STRICT_VB_UUID)
    assert r.status == Status.ROLLBACK and codec.U64.unpack(r.value)[0] == 0
    assert (await client.stream_req(0, uuid=12345)).status == Status.SUCCESS


async def test_get_failover_log_and_all_vb_seqnos_agree_with_stream_responses(
    server, client
) -> None:
    await client.dcp_open("t-flog")
    r = await client.stream_req(1)
    op = next(client.opaques)
    g = await client.call(codec.request(Opcode.DCP_GET_FAILOVER_LOG, vbucket=1, opaque=op), op)
    assert g.status == 0 and codec.parse_failover_log(g.value) == codec.parse_failover_log(r.value)
    op = next(client.opaques)
    g = await client.call(codec.request(Opcode.DCP_GET_FAILOVER_LOG, vbucket=9, opaque=op), op)
    assert g.status == Status.NOT_MY_VBUCKET
