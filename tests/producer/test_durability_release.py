"""What a closed stream leaves behind in the durability monitor, over the wire: a
stable-only stream's ``wait_stable`` callback (it kept the stream, its queued snapshot
and its connection alive), and a replica's acks, which must go with the stream that
made them and no other (active_stream.py ``release``, durability.py, sync_waiters.py)."""

from __future__ import annotations

from pathlib import Path

import trio

from dcp.protocol import DurabilityLevel, Opcode, Status, codec

from .conftest import client_of, running_server
from .test_stable_only import open_dcp, quiet
from .test_sync_writes import NVB, durable_set, read_mutation, replica_of, seqno_of, two_copies
from .wire import WireClient, keys_for_vb


async def _until(check, timeout: float = 5.0) -> None:  # type: ignore[no-untyped-def]
    with trio.fail_after(timeout):
        while not check():
            await trio.sleep(0.02)


async def test_closed_stable_only_streams_leave_no_waiter_behind(tmp_path: Path) -> None:
    """Persistence paused on a single node: the stable seqno stays 0 and every
    stable-only stream holds its first snapshot, waiting. 30 of them opened and closed,
    half by DCP_CLOSE_STREAM, half by closing the connection: nothing stays registered
    (it stayed 30, and each held its stream and connection)."""
    async with running_server(tmp_path / "d") as server, client_of(server) as kv:
        server.pause_persistence()
        (k,) = keys_for_vb(0, 1, NVB)
        await kv.set(k, b"v")
        clients: list[WireClient] = []
        try:
            for i in range(30):
                c = await WireClient.connect(server.port, NVB)
                clients.append(c)
                await open_dcp(c, f"so-{i}", stable_only=True)
                assert (await c.stream_req(0)).status == Status.SUCCESS
            await _until(lambda: server.durability.waiting() == 30)
            assert await quiet(clients[0], 0.1) == []  # held: not even the marker
            for c in clients[:15]:
                op = next(c.opaques)
                r = await c.call(codec.request(Opcode.DCP_CLOSE_STREAM, vbucket=0, opaque=op), op)
                assert r.status == Status.SUCCESS
            assert server.durability.waiting() == 15
            for c in clients[15:]:
                await c.aclose()
            await _until(lambda: server.durability.waiting() == 0)
            assert all(not s.gate or not s.gate.waiting for s in server.streams_of(0))
        finally:
            for c in clients:
                await c.aclose()
            server.resume_persistence()


async def test_an_old_connection_closing_late_keeps_the_new_streams_ack(tmp_path: Path) -> None:
    """B's replication reconnected: its new stream acked seqno 1 before the server saw
    the old connection close. B will not send the same ack again, so forgetting B's acks
    by name then left the vbucket's majority at 0 (MAJORITY writes ambiguous, stable-only
    readers stalled) until the next write."""
    vb = 1
    async with two_copies(tmp_path) as (server, w):
        old, old_opaque = await replica_of(server, vb)
        new: WireClient | None = None
        try:
            (k,) = keys_for_vb(vb, 1, NVB)
            op, frame = durable_set(w, k, DurabilityLevel.MAJORITY, 10_000)
            await w.send(frame)
            await read_mutation(old, 1)
            await old.send(codec.seqno_acknowledged(vb, old_opaque, 1, 1))
            r = await w.next_frame()
            assert (r.opaque, r.status, seqno_of(r)) == (op, Status.SUCCESS, 1)
            # the same node on a new connection (under another DCP name: the same one
            # would close the old connection at once)
            new = await WireClient.connect(server.port, NVB)
            assert (await new.dcp_open("replication:B:again")).status == Status.SUCCESS
            assert (await new.control("consumer_name", "B")).status == Status.SUCCESS
            new_opaque = next(new.opaques)
            assert (await new.stream_req(vb, opaque=new_opaque)).status == Status.SUCCESS
            await read_mutation(new, 1)
            await new.send(codec.seqno_acknowledged(vb, new_opaque, 1, 1))
            noop = next(new.opaques)
            await new.call(codec.request(Opcode.NOOP, opaque=noop), noop)  # ack handled
            before = len(server.connections)
            await old.aclose()
            await _until(lambda: len(server.connections) == before - 1)
            st = await w.stats(f"vbucket-seqno {vb}")
            assert (st[f"vb_{vb}:majority_seqno"], st[f"vb_{vb}:stable_seqno"]) == ("1", "1")
            # and the stream that made the ack closing does drop it
            await new.aclose()
            await _until(lambda: len(server.connections) == before - 2)
            st = await w.stats(f"vbucket-seqno {vb}")
            assert st[f"vb_{vb}:majority_seqno"] == "0"
        finally:
            await old.aclose()
            if new is not None:
                await new.aclose()


async def test_writers_are_indexed_by_the_vbucket_they_wait_on(tmp_path: Path) -> None:
    """Two writers wait on different vbuckets; an ack of one wakes its writer only, and
    nothing stays indexed once every answer is out."""
    async with two_copies(tmp_path) as (server, w0), client_of(server) as w2:
        replica, opaque = await replica_of(server, 2)
        try:
            (k0,) = keys_for_vb(0, 1, NVB)
            (k2,) = keys_for_vb(2, 1, NVB)
            op0, f0 = durable_set(w0, k0, DurabilityLevel.MAJORITY, 800)
            op2, f2 = durable_set(w2, k2, DurabilityLevel.MAJORITY, 10_000)
            await w0.send(f0)
            await w2.send(f2)
            await _until(lambda: server.sync_waiters.of(0) and server.sync_waiters.of(2))
            (c0,) = server.sync_waiters.of(0)
            (c2,) = server.sync_waiters.of(2)
            assert c0 is not c2 and len(server.sync_waiters) == 2
            await read_mutation(replica, 1)
            await replica.send(codec.seqno_acknowledged(2, opaque, 1, 1))
            r = await w2.next_frame()
            assert (r.opaque, r.status) == (op2, Status.SUCCESS)
            assert server.sync_waiters.of(2) == set() and server.sync_waiters.of(0) == {c0}
            r = await w0.next_frame()  # nobody acks vb 0: ambiguous at its deadline
            assert (r.opaque, r.status) == (op0, Status.SYNC_WRITE_AMBIGUOUS)
            assert len(server.sync_waiters) == 0
        finally:
            await replica.aclose()
