"""TTL expiry and tombstone purge through the running server."""

from __future__ import annotations

import trio

from dcp.protocol import DcpOpenFlag, Opcode, Status, codec

from .conftest import client_of, running_server
from .wire import items_of, keys_for_vb


def is_end(f) -> bool:  # type: ignore[no-untyped-def]
    return f.opcode == Opcode.DCP_STREAM_END


async def test_expired_items_become_expirations_with_new_seqnos(tmp_path) -> None:
    async with running_server(tmp_path / "d", expiry_interval=0.1) as server:
        async with client_of(server) as c:
            k1, k2 = keys_for_vb(1, 2, 4)
            await c.set(k1, b"short-lived", expiry=1)
            await c.set(k2, b"forever")
            with trio.fail_after(10):
                while server.bucket.vbucket(1).high_seqno < 3:
                    await trio.sleep(0.1)
            assert (await c.get(k1)).status == Status.KEY_ENOENT
            assert bytes((await c.get(k2)).value) == b"forever"
        for flags, want in (
            (DcpOpenFlag.PRODUCER, Opcode.DCP_DELETION),
            (DcpOpenFlag.PRODUCER | DcpOpenFlag.INCLUDE_DELETE_TIMES, Opcode.DCP_EXPIRATION),
        ):
            async with client_of(server) as c:
                await c.dcp_open(f"t-exp-{flags}", flags)
                assert (await c.control("enable_expiry_opcode", "true")).status == 0
                await c.stream_req(1, end=3)
                frames = await c.read_stream_until(is_end)
                assert items_of(frames)[-1][:3] == (want, 3, k1)


async def test_purged_tombstones_force_a_rollback_to_zero_below_the_purge_seqno(tmp_path) -> None:
    async with running_server(tmp_path / "d", tombstone_purge_age=0.0) as server:
        async with client_of(server) as c:
            keys = keys_for_vb(2, 4, 4)
            await c.set_many([(k, b"v") for k in keys])
            assert (await c.delete(keys[0])).status == Status.SUCCESS  # tombstone at seqno 5
            await c.set(keys[1], b"v2")
            await server.flush_all()
            await trio.sleep(0.01)
            purged = await server.persistence.compact_now()
            vb = server.bucket.vbucket(2)
            assert purged == 1 and vb.purge_seqno == 5
            uuid = vb.uuid
            await c.dcp_open("t-purge")
            r = await c.stream_req(2, start=3, uuid=uuid)
            assert r.status == Status.ROLLBACK and codec.U64.unpack(r.value)[0] == 0
            r = await c.stream_req(2, start=5, uuid=uuid)
            assert r.status == Status.SUCCESS


async def test_a_disk_snapshot_ending_in_a_purged_tombstone_ends_with_seqno_advanced(
    tmp_path,
) -> None:
    async with running_server(
        tmp_path / "d", tombstone_purge_age=0.0, checkpoint_retain_seconds=0
    ) as server:
        async with client_of(server) as c:
            keys = keys_for_vb(2, 3, 4)
            await c.set_many([(k, b"v") for k in keys])
            assert (await c.delete(keys[0])).status == Status.SUCCESS  # seqno 4: the last
            await server.flush_all()
            server.bucket.vbucket(2).checkpoints.create_checkpoint()
            await server.flush_all()
            await trio.sleep(0.01)
            assert await server.persistence.compact_now() == 1
            for on in (True, False):
                async with client_of(server) as d:
                    await d.dcp_open(f"t-adv-{on}")
                    if on:
                        assert (await d.control("send_seqno_advanced", "true")).status == 0
                    assert (await d.stream_req(2)).status == Status.SUCCESS  # open-ended
                    frames = await d.frames_for(0.5)
                    ops = [f.opcode for f in frames if f.opcode != Opcode.DCP_NOOP]
                    (marker,) = [
                        codec.parse_snapshot_marker(f)
                        for f in frames
                        if f.opcode == Opcode.DCP_SNAPSHOT_MARKER
                    ]
                    # seqno 1 was superseded by the tombstone at 4, which was purged
                    assert marker[:2] == (2, 4)
                    assert [s for _, s, _, _ in items_of(frames)] == [2, 3]
                    if on:
                        assert ops[-1] == Opcode.DCP_SEQNO_ADVANCED
                        assert codec.parse_seqno_advanced(frames[-1]) == 4
                    else:
                        assert Opcode.DCP_SEQNO_ADVANCED not in ops
