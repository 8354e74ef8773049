"""Restarts: clean shutdown keeps history; an unclean one forces rollbacks of unpersisted
changes; graceful shutdown ends streams with Disconnected."""

from __future__ import annotations

from dcp.protocol import Opcode, Status, StreamEndStatus, codec

from .conftest import client_of, running_server
from .wire import items_of, keys_for_vb


async def test_rollback_after_unclean_restart_of_unpersisted_writes(tmp_path) -> None:
    data = tmp_path / "d"
    keys = keys_for_vb(2, 15, 4)
    async with running_server(data) as server:
        async with client_of(server) as c:
            await c.set_many([(k, b"persisted") for k in keys[:10]])
            await server.flush_all()
            server.pause_persistence()
            await c.set_many([(k, b"lost") for k in keys[10:]])
            await c.dcp_open("t-crash")
            r = await c.stream_req(2)
            uuid1 = codec.parse_failover_log(r.value)[0][0]
            frames = await c.read_stream_until(
                lambda f: bool(items_of([f])) and items_of([f])[0][1] == 15
            )
            assert [s for _, s, _, _ in items_of(frames)][-1] == 15
        server.request_shutdown(clean=False)  # a crash: no final flush, no clean marker
    async with running_server(data) as server:
        vb = server.bucket.vbucket(2)
        assert vb.high_seqno == 10
        log = list(vb.failover_log.entries)
        assert len(log) == 2 and log[0][1] == 10 and log[1][0] == uuid1
        async with client_of(server) as c:
            await c.dcp_open("t-crash-2")
            r = await c.stream_req(2, start=15, uuid=uuid1, snap_start=11, snap_end=15)
            assert r.status == Status.ROLLBACK
            assert codec.U64.unpack(r.value)[0] == 10
            r = await c.stream_req(2, start=10, uuid=uuid1, snap_start=10, snap_end=10)
            assert r.status == Status.SUCCESS
            assert codec.parse_failover_log(r.value) == log


async def test_clean_restart_keeps_data_and_failover_log(tmp_path) -> None:
    data = tmp_path / "d"
    keys = keys_for_vb(1, 5, 4)
    async with running_server(data) as server:
        async with client_of(server) as c:
            await c.set_many([(k, b"v") for k in keys])
        log_before = list(server.bucket.vbucket(1).failover_log.entries)
    async with running_server(data) as server:
        assert list(server.bucket.vbucket(1).failover_log.entries) == log_before
        assert server.bucket.vbucket(1).high_seqno == 5
        async with client_of(server) as c:
            for k in keys:
                r = await c.get(k)
                assert r.status == Status.SUCCESS and bytes(r.value) == b"v"
            await c.dcp_open("t-clean")
            r = await c.stream_req(1, start=5, uuid=log_before[0][0])
            assert r.status == Status.SUCCESS


async def test_graceful_shutdown_ends_streams_with_disconnected(tmp_path) -> None:
    async with running_server(tmp_path / "d") as server:
        async with client_of(server) as c:
            await c.dcp_open("t-shutdown")
            await c.stream_req(0)
            await c.stream_req(3)
            server.request_shutdown()
            frames = await c.frames_for(3.0)
            assert c.eof, "server did not close the connection after ending its streams"
    ends = [f for f in frames if f.opcode == Opcode.DCP_STREAM_END]
    assert sorted(f.vbucket for f in ends) == [0, 3]
    assert all(codec.parse_stream_end(f) == StreamEndStatus.DISCONNECTED for f in ends)
