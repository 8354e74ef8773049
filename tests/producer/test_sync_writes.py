"""Durable writes at every level against a running server, in bytes (kv_handlers.py,
sync_writes.py, durability.py): a majority answer waits for a replica's
DCP_SEQNO_ACKNOWLEDGED on its stream; the persist levels for this node's disk."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import trio

from dcp.producer.server import DcpServer
from dcp.protocol import DurabilityLevel, Frame, HelloFeature, Opcode, Status, VBucketState, codec

from .conftest import client_of, running_server
from .wire import WireClient, keys_for_vb

NVB = 4


def durable_set(
    client: WireClient, key: bytes, level: int, timeout_ms: int | None = None, value: bytes = b"v"
) -> tuple[int, bytes]:
    op = next(client.opaques)
    return op, codec.request(
        Opcode.SET,
        vbucket=client.vb(key),
        opaque=op,
        extras=codec.store_extras(0, 0),
        key=key,
        value=value,
        framing_extras=codec.durability_frame_info(level, timeout_ms),
    )


async def replica_of(server: DcpServer, vb: int, name: str = "B") -> tuple[WireClient, int]:
    """A DCP connection that says it is node ``name`` and streams ``vb`` from 0: what a
    replica's replication connection does. Returns it and its stream's opaque."""
    c = await WireClient.connect(server.port, NVB)
    assert (await c.dcp_open(f"replication:{name}")).status == Status.SUCCESS
    assert (await c.control("consumer_name", name)).status == Status.SUCCESS
    opaque = next(c.opaques)
    assert (await c.stream_req(vb, opaque=opaque)).status == Status.SUCCESS
    return c, opaque


async def read_mutation(replica: WireClient, seqno: int) -> None:
    """Read the replica's stream until the mutation with ``seqno`` has arrived."""

    def done(f: Frame) -> bool:
        return f.opcode == Opcode.DCP_MUTATION and codec.parse_mutation(f)[0] >= seqno

    await replica.read_stream_until(done, ack=True)


def seqno_of(r: Frame) -> int:
    return codec.U64.unpack_from(r.extras, 8)[0]


@contextlib.asynccontextmanager
async def two_copies(tmp_path: Path, **cfg: object) -> AsyncIterator[tuple[DcpServer, WireClient]]:
    """A server whose map gives every vbucket the chain (this node, B), and a writer."""
    async with running_server(tmp_path / "d", **cfg) as server, client_of(server) as w:
        server.durability.set_topology([("self", "B")] * NVB)
        await w.hello([HelloFeature.XERROR, HelloFeature.MUTATION_SEQNO])
        yield server, w


async def test_a_majority_write_waits_for_the_replicas_ack(tmp_path: Path) -> None:
    async with two_copies(tmp_path) as (server, w):
        vb = 1
        replica, opaque = await replica_of(server, vb)
        try:
            (k,) = keys_for_vb(vb, 1, NVB)
            op, frame = durable_set(w, k, DurabilityLevel.MAJORITY, 10_000)
            await w.send(frame)
            await read_mutation(replica, 1)  # the write is applied and streamed at once
            assert not await w.frames_for(0.4), "answered before any replica held it"
            await replica.send(codec.seqno_acknowledged(vb, opaque, 1, 0))
            r = await w.next_frame(5)
            assert (r.opaque, r.status) == (op, Status.SUCCESS)
            assert seqno_of(r) == 1
            assert server.durability.majority_seqno(vb) == 1
            assert server.metrics.sync_writes[DurabilityLevel.MAJORITY, "ok"] == 1
            # nothing was answered to the ack itself
            assert not [f for f in await replica.frames_for(0.2) if f.is_response]
        finally:
            await replica.aclose()


async def test_without_an_ack_a_majority_write_is_ambiguous_at_its_deadline(
    tmp_path: Path,
) -> None:
    async with two_copies(tmp_path) as (server, w):
        (k,) = keys_for_vb(2, 1, NVB)
        op, frame = durable_set(w, k, DurabilityLevel.MAJORITY, 500)
        t0 = trio.current_time()
        r = await w.call(frame, op, timeout=5)
        assert r.status == Status.SYNC_WRITE_AMBIGUOUS, r
        assert trio.current_time() - t0 >= 0.45
        assert bytes((await w.get(k)).value) == b"v"  # applied: ambiguous, not undone
        assert server.metrics.sync_writes[DurabilityLevel.MAJORITY, "ambiguous"] == 1


async def test_an_ack_above_what_was_sent_does_not_release_a_write(tmp_path: Path) -> None:
    """The replica's window is full (flow control), so the durable write is not sent to
    it; its ack of that seqno anyway is clamped to what it was sent."""
    async with two_copies(tmp_path) as (server, w):
        vb = 3
        replica, opaque = await replica_of(server, vb)
        try:
            assert (await replica.control("connection_buffer_size", "100")).status == 0
            k0, k1 = keys_for_vb(vb, 2, NVB)
            await w.set(k0, b"x" * 500)  # fills the window: seqno 1 sent, not acked
            await replica.read_stream_until(lambda f: f.opcode == Opcode.DCP_MUTATION, ack=False)
            op, frame = durable_set(w, k1, DurabilityLevel.MAJORITY, 10_000)
            await w.send(frame)
            assert not await replica.frames_for(0.2)  # seqno 2 is held back
            await replica.send(codec.seqno_acknowledged(vb, opaque, 2, 2))
            assert not await w.frames_for(0.4), "a seqno never sent released the write"
            assert server.durability.majority_seqno(vb) == 1  # clamped to what was sent
            await replica.send(codec.buffer_ack(10_000))
            await read_mutation(replica, 2)
            await replica.send(codec.seqno_acknowledged(vb, opaque, 2, 2))
            r = await w.next_frame(5)
            assert (r.opaque, r.status) == (op, Status.SUCCESS)
        finally:
            await replica.aclose()


async def test_acks_under_another_name_or_opaque_release_nothing(tmp_path: Path) -> None:
    async with two_copies(tmp_path) as (server, w):
        vb = 0
        stranger, s_opaque = await replica_of(server, vb, name="X")  # not in the chain
        replica, opaque = await replica_of(server, vb)
        try:
            (k,) = keys_for_vb(vb, 1, NVB)
            op, frame = durable_set(w, k, DurabilityLevel.MAJORITY, 10_000)
            await w.send(frame)
            await read_mutation(stranger, 1)
            await read_mutation(replica, 1)
            await stranger.send(codec.seqno_acknowledged(vb, s_opaque, 1, 1))
            await replica.send(codec.seqno_acknowledged(vb, opaque + 1, 1, 1))  # wrong opaque
            assert not await w.frames_for(0.4)
            assert not await replica.frames_for(0.1)  # an ignored ack is not answered either
            await replica.send(codec.seqno_acknowledged(vb, opaque, 1, 1))
            r = await w.next_frame(5)
            assert (r.opaque, r.status) == (op, Status.SUCCESS)
        finally:
            await stranger.aclose()
            await replica.aclose()


async def test_a_replicas_acks_are_forgotten_when_its_stream_or_connection_goes(
    tmp_path: Path,
) -> None:
    async with two_copies(tmp_path) as (server, w):
        vb = 1
        replica, opaque = await replica_of(server, vb)
        (k,) = keys_for_vb(vb, 1, NVB)
        await w.set(k, b"a")
        await read_mutation(replica, 1)
        await replica.send(codec.seqno_acknowledged(vb, opaque, 1, 1))
        with trio.fail_after(5):
            while server.durability.majority_seqno(vb) != 1:
                await trio.sleep(0.01)
        op = next(replica.opaques)
        r = await replica.call(codec.request(Opcode.DCP_CLOSE_STREAM, vbucket=vb, opaque=op), op)
        assert r.status == Status.SUCCESS
        assert server.durability.majority_seqno(vb) == 0
        # again with a stream, and then the connection closes
        opaque = next(replica.opaques)
        assert (await replica.stream_req(vb, opaque=opaque)).status == Status.SUCCESS
        await read_mutation(replica, 1)
        await replica.send(codec.seqno_acknowledged(vb, opaque, 1, 1))
        with trio.fail_after(5):
            while server.durability.majority_seqno(vb) != 1:
                await trio.sleep(0.01)
        await replica.aclose()
        with trio.fail_after(5):
            while server.durability.majority_seqno(vb) != 0:
                await trio.sleep(0.01)


async def test_persist_to_majority_needs_both_disks(tmp_path: Path) -> None:
    async with two_copies(tmp_path) as (server, w):
        vb = 2
        replica, opaque = await replica_of(server, vb)
        try:
            (k,) = keys_for_vb(vb, 1, NVB)
            op, frame = durable_set(w, k, DurabilityLevel.PERSIST_TO_MAJORITY, 10_000)
            await w.send(frame)
            await read_mutation(replica, 1)
            await replica.send(codec.seqno_acknowledged(vb, opaque, 1))  # held, not persisted
            assert not await w.frames_for(0.4)
            await replica.send(codec.seqno_acknowledged(vb, opaque, 1, 1))
            r = await w.next_frame(5)
            assert (r.opaque, r.status) == (op, Status.SUCCESS)
            assert server.bucket.vbucket(vb).persisted_seqno >= 1
        finally:
            await replica.aclose()


async def test_majority_levels_are_impossible_with_too_few_copies(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as w:
        server.durability.set_topology([("self", None)] * NVB)
        k1, k2 = keys_for_vb(0, 2, NVB)
        for level in (
            DurabilityLevel.MAJORITY,
            DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE,
            DurabilityLevel.PERSIST_TO_MAJORITY,
        ):
            op, frame = durable_set(w, k1, level)
            r = await w.call(frame, op)
            assert r.status == Status.DURABILITY_IMPOSSIBLE, (level, r)
        assert (await w.get(k1)).status == Status.KEY_ENOENT  # nothing written
        op, frame = durable_set(w, k2, DurabilityLevel.PERSIST_TO_ACTIVE)
        assert (await w.call(frame, op)).status == Status.SUCCESS  # one copy is enough
        assert server.metrics.sync_writes[DurabilityLevel.MAJORITY, "impossible"] == 1


async def test_a_write_waiting_when_its_vbucket_turns_replica_is_ambiguous_at_once(
    tmp_path: Path,
) -> None:
    async with two_copies(tmp_path) as (server, w):
        vb = 3
        k1, k2 = keys_for_vb(vb, 2, NVB)
        op1, f1 = durable_set(w, k1, DurabilityLevel.MAJORITY, 30_000)
        op2, f2 = durable_set(w, k2, DurabilityLevel.MAJORITY, 30_000)
        await w.send(f1 + f2)
        assert not await w.frames_for(0.3)
        t0 = trio.current_time()
        server.vbucket_states.set(vb, VBucketState.REPLICA, {})
        r1 = await w.next_frame(5)
        r2 = await w.next_frame(5)
        assert trio.current_time() - t0 < 5  # not the 30 s deadline
        assert [(r.opaque, r.status) for r in (r1, r2)] == [
            (op1, Status.SYNC_WRITE_AMBIGUOUS),
            (op2, Status.SYNC_WRITE_AMBIGUOUS),
        ]
        assert b"stopped being active" in bytes(r1.value)
        # made active again: a new term, the old acks are gone, new writes wait again
        server.vbucket_states.set(vb, VBucketState.ACTIVE, {})
        assert server.durability.term(vb) >= 1
        op, frame = durable_set(w, k1, DurabilityLevel.MAJORITY, 300)
        assert (await w.call(frame, op)).status == Status.SYNC_WRITE_AMBIGUOUS


async def test_on_a_single_node_majority_is_at_once_and_persist_levels_wait_for_disk(
    tmp_path: Path,
) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as w:
        await w.hello([HelloFeature.XERROR])
        server.pause_persistence()
        k1, k2, k3 = keys_for_vb(1, 3, NVB)
        op, frame = durable_set(w, k1, DurabilityLevel.MAJORITY, 10_000)
        assert (await w.call(frame, op, timeout=2)).status == Status.SUCCESS
        op2, f2 = durable_set(w, k2, DurabilityLevel.MAJORITY_AND_PERSIST_TO_ACTIVE, 10_000)
        op4, f4 = durable_set(w, k3, DurabilityLevel.PERSIST_TO_ACTIVE, 10_000)
        await w.send(f2 + f4)
        assert not await w.frames_for(0.4), "a persist level answered before the disk"
        server.resume_persistence()
        r2, r4 = await w.next_frame(5), await w.next_frame(5)
        assert [(r.opaque, r.status) for r in (r2, r4)] == [
            (op2, Status.SUCCESS),
            (op4, Status.SUCCESS),
        ]
        assert server.bucket.vbucket(1).persisted_seqno >= 3


async def test_an_undefined_level_is_refused_and_nothing_is_written(tmp_path: Path) -> None:
    async with running_server(tmp_path / "d") as server, client_of(server) as w:
        (k,) = keys_for_vb(0, 1, NVB)
        for level in (5, 0xFF):
            op, frame = durable_set(w, k, level)
            r = await w.call(frame, op)
            assert r.status == Status.DURABILITY_INVALID_LEVEL, (level, r)
        assert (await w.get(k)).status == Status.KEY_ENOENT
        assert server.bucket.vbucket(0).high_seqno == 0
        # a malformed durability frame info (2 bytes) is EINVAL, nothing written either
        op = next(w.opaques)
        frame = codec.request(
            Opcode.SET,
            vbucket=0,
            opaque=op,
            extras=codec.store_extras(0, 0),
            key=k,
            value=b"v",
            framing_extras=bytes([0x12, 1, 0]),  # id 1, length 2
        )
        assert (await w.call(frame, op)).status == Status.EINVAL
        assert (await w.get(k)).status == Status.KEY_ENOENT
