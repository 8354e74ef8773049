"""TAKEOVER streams on the source, driven by a raw client playing the consumer.

The sequence (protocol_spec/README.md, "Takeover"): items until caught up; the source
turns pending (writes ETMPFAIL, its other streams end StateChanged);
DCP_SET_VBUCKET_STATE(pending) -> SUCCESS; the source is dead (writes NOT_MY_VBUCKET);
DCP_SET_VBUCKET_STATE(active) -> SUCCESS; STREAM_END OK. Lost before the consumer took
the pending state, the source is active again (same failover log); lost after, it stays
dead.
"""

from __future__ import annotations

import trio

from dcp.producer.server import DcpServer
from dcp.protocol import Frame, Opcode, Status, StreamEndStatus, StreamRequestFlag, codec
from dcp.protocol.opcodes import VBucketState

from .conftest import client_of, running_server
from .wire import WireClient, items_of, keys_for_vb

VB = 1
_SET_STATE = Opcode.DCP_SET_VBUCKET_STATE


def _is_state(f: Frame) -> bool:
    return f.opcode == _SET_STATE and not f.is_response


async def _vb_state(client: WireClient, vb: int = VB) -> int:
    op = next(client.opaques)
    r = await client.call(codec.request(Opcode.GET_VBUCKET, vbucket=vb, opaque=op), op)
    assert r.status == Status.SUCCESS
    return codec.U32.unpack(r.value)[0]


async def _until_state(client: WireClient, state: int, timeout: float = 5.0) -> None:
    with trio.fail_after(timeout):
        while await _vb_state(client) != state:
            await trio.sleep(0.02)


async def _start_takeover(server: DcpServer, dcp: WireClient, name: str) -> Frame:
    await dcp.dcp_open(f"replication:takeover:{name}")
    r = await dcp.stream_req(VB, flags=StreamRequestFlag.TAKEOVER)
    assert r.status == Status.SUCCESS
    return r


async def test_takeover_hands_over_every_acknowledged_write(server, client) -> None:
    keys = keys_for_vb(VB, 400, 4)
    await client.set_many([(k, b"before") for k in keys[:200]])
    acked: list[bytes] = []
    refused: list[int] = []

    async def writer() -> None:
        # writes while the takeover streams: every SUCCESS must reach the consumer
        async with client_of(server) as w:
            for k in keys[200:]:
                r = await w.store(Opcode.SET, k, b"during")
                if r.status != Status.SUCCESS:
                    refused.append(r.status)
                    return
                acked.append(k)
                await trio.sleep(0.001)

    async with client_of(server) as other, client_of(server) as dcp:
        await other.dcp_open("t-other")
        assert (await other.stream_req(VB)).status == Status.SUCCESS
        async with trio.open_nursery() as nursery:
            nursery.start_soon(writer)
            await trio.sleep(0.05)
            await _start_takeover(server, dcp, "a->b")
            frames = await dcp.read_stream_until(_is_state, ack=True)
        pending = frames[-1]
        assert pending.vbucket == VB and pending.extras == bytes((VBucketState.PENDING,))
        assert len(pending.value) == 0 and len(pending.key) == 0
        # the source is pending: writes wait for the hand-over (ETMPFAIL) ...
        assert await _vb_state(client) == VBucketState.PENDING
        (late,) = keys_for_vb(VB, 1, 4, prefix="late")
        assert (await client.store(Opcode.SET, late, b"x")).status == Status.ETMPFAIL
        assert (await client.get(keys[0])).status == Status.ETMPFAIL
        assert not refused or refused == [Status.ETMPFAIL]
        # ... and the vbucket's other streams ended StateChanged
        ended = await other.read_stream_until(lambda f: f.opcode == Opcode.DCP_STREAM_END)
        assert codec.parse_stream_end(ended[-1]) == StreamEndStatus.STATE_CHANGED
        # every acknowledged write was sent before the pending state, in seqno order
        items = items_of(frames)
        seqnos = [s for _, s, _, _ in items]
        assert seqnos == list(range(1, len(seqnos) + 1))
        assert seqnos[-1] == server.bucket.vbucket(VB).high_seqno
        assert {k for _, _, k, _ in items} == set(keys[:200]) | set(acked)
        assert len(acked) > 0
        log_before = list(server.bucket.vbucket(VB).failover_log.entries)
        # the consumer took the pending state: the source is dead, then sends active
        await dcp.send(codec.response(_SET_STATE, opaque=pending.opaque))
        frames = await dcp.read_stream_until(_is_state, ack=True)
        assert [f.opcode for f in frames] == [_SET_STATE]
        assert frames[0].extras == bytes((VBucketState.ACTIVE,))
        assert await _vb_state(client) == VBucketState.DEAD
        assert (await client.store(Opcode.SET, late, b"x")).status == Status.NOT_MY_VBUCKET
        await dcp.send(codec.response(_SET_STATE, opaque=frames[0].opaque))
        end = await dcp.read_stream_until(lambda f: f.opcode == Opcode.DCP_STREAM_END)
        assert [f.opcode for f in end] == [Opcode.DCP_STREAM_END]
        assert codec.parse_stream_end(end[0]) == StreamEndStatus.OK
        assert await _vb_state(client) == VBucketState.DEAD
        assert list(server.bucket.vbucket(VB).failover_log.entries) == log_before
        # a new takeover (or stream) of the dead vbucket is refused
        assert (await dcp.stream_req(VB)).status == Status.NOT_MY_VBUCKET


async def test_connection_lost_before_the_pending_ack_makes_the_source_active_again(
    server, client
) -> None:
    keys = keys_for_vb(VB, 5, 4)
    await client.set_many([(k, b"v") for k in keys[:4]])
    log_before = list(server.bucket.vbucket(VB).failover_log.entries)
    async with client_of(server) as dcp:
        await _start_takeover(server, dcp, "lost")
        await dcp.read_stream_until(_is_state, ack=True)
        assert await _vb_state(client) == VBucketState.PENDING
    # the consumer went away without taking the pending state: nothing was handed over
    await _until_state(client, VBucketState.ACTIVE)
    assert list(server.bucket.vbucket(VB).failover_log.entries) == log_before
    await client.set(keys[4], b"after")


async def test_a_refused_pending_state_closes_the_connection_and_undoes_it(server, client) -> None:
    await client.set_many([(k, b"v") for k in keys_for_vb(VB, 3, 4)])
    async with client_of(server) as dcp:
        await _start_takeover(server, dcp, "refused")
        (pending,) = (await dcp.read_stream_until(_is_state, ack=True))[-1:]
        await dcp.send(codec.response(_SET_STATE, Status.EINVAL, opaque=pending.opaque))
        await dcp.wait_closed()
    await _until_state(client, VBucketState.ACTIVE)


async def test_connection_lost_after_the_pending_ack_leaves_the_source_dead(server, client) -> None:
    await client.set_many([(k, b"v") for k in keys_for_vb(VB, 3, 4)])
    async with client_of(server) as dcp:
        await _start_takeover(server, dcp, "half")
        (pending,) = (await dcp.read_stream_until(_is_state, ack=True))[-1:]
        await dcp.send(codec.response(_SET_STATE, opaque=pending.opaque))
        (active,) = (await dcp.read_stream_until(_is_state, ack=True))[-1:]
        assert active.extras == bytes((VBucketState.ACTIVE,))
    # the consumer may hold the active state now: two active copies must not exist
    await trio.sleep(0.2)
    assert await _vb_state(client) == VBucketState.DEAD


async def test_takeover_of_an_empty_vbucket_and_a_stray_ack(server, client) -> None:
    async with client_of(server) as dcp:
        await _start_takeover(server, dcp, "empty")
        # an ack no takeover waits for is ignored (logged), the stream goes on
        await dcp.send(codec.response(_SET_STATE, opaque=999))
        (pending,) = await dcp.read_stream_until(_is_state, ack=True)
        await dcp.send(codec.response(_SET_STATE, opaque=pending.opaque))
        (active,) = await dcp.read_stream_until(_is_state, ack=True)
        await dcp.send(codec.response(_SET_STATE, opaque=active.opaque))
        end = await dcp.read_stream_until(lambda f: f.opcode == Opcode.DCP_STREAM_END)
        assert codec.parse_stream_end(end[-1]) == StreamEndStatus.OK
    assert await _vb_state(client) == VBucketState.DEAD


async def test_a_later_reconcile_of_the_assignment_keeps_the_source_dead(server, client) -> None:
    # vb 1 is in the node's assignment as active (an explicit SET_VBUCKET_STATE active, as a
    # promotion leaves it); after the hand-over, a state change of another vbucket makes
    # the node reconcile its whole assignment: it must not make vb 1 active again.
    op = next(client.opaques)
    r = await client.call(codec.set_vbucket_state(VB, VBucketState.ACTIVE, op), op)
    assert r.status == Status.SUCCESS
    await client.set_many([(k, b"v") for k in keys_for_vb(VB, 3, 4)])
    async with client_of(server) as dcp:
        await _start_takeover(server, dcp, "kept")
        (pending,) = (await dcp.read_stream_until(_is_state, ack=True))[-1:]
        await dcp.send(codec.response(_SET_STATE, opaque=pending.opaque))
        (active,) = (await dcp.read_stream_until(_is_state, ack=True))[-1:]
        await dcp.send(codec.response(_SET_STATE, opaque=active.opaque))
        await dcp.read_stream_until(lambda f: f.opcode == Opcode.DCP_STREAM_END)
    op = next(client.opaques)
    r = await client.call(codec.set_vbucket_state(2, VBucketState.REPLICA, op), op)
    assert r.status == Status.SUCCESS
    assert await _vb_state(client) == VBucketState.DEAD


async def test_two_nodes_move_a_vbucket_by_set_vbucket_state_takeover(tmp_path) -> None:
    # The whole move between two in-process servers: B is told to take vb 1 from A;
    # B's replication opens the TAKEOVER stream and answers A's state messages.
    async with (
        running_server(tmp_path / "a") as a,
        running_server(tmp_path / "b") as b,
        client_of(a) as ca,
        client_of(b) as cb,
    ):
        keys = keys_for_vb(VB, 50, 4)
        await ca.set_many([(k, f"v{i}".encode()) for i, k in enumerate(keys)])
        opts = {"source": f"127.0.0.1:{a.port}", "takeover": True}
        op = next(cb.opaques)
        r = await cb.call(codec.set_vbucket_state(VB, VBucketState.REPLICA, op, opts), op)
        assert r.status == Status.SUCCESS
        await _until_state(cb, VBucketState.ACTIVE, timeout=15)
        assert await _vb_state(ca) == VBucketState.DEAD
        va, vb_ = a.bucket.vbucket(VB), b.bucket.vbucket(VB)
        assert vb_.high_seqno == va.high_seqno == 50
        assert list(vb_.failover_log.entries) == list(va.failover_log.entries)
        assert (await ca.store(Opcode.SET, keys[0], b"x")).status == Status.NOT_MY_VBUCKET
        got = await cb.get(keys[7])
        assert got.status == Status.SUCCESS and bytes(got.value) == b"v7"
        await cb.set(keys[0], b"new")


async def test_active_is_sent_only_once_the_source_is_dead_on_disk(server, client) -> None:
    # a crash after the consumer turned active must not bring the source back active
    await client.set_many([(k, b"v") for k in keys_for_vb(VB, 3, 4)])
    await server.flush_all()
    async with client_of(server) as dcp:
        await _start_takeover(server, dcp, "persist")
        (pending,) = (await dcp.read_stream_until(_is_state, ack=True))[-1:]
        server.pause_persistence()
        await dcp.send(codec.response(_SET_STATE, opaque=pending.opaque))
        await _until_state(client, VBucketState.DEAD)
        held = await dcp.frames_for(0.4)  # the DEAD state is not on disk: nothing yet
        assert not [f for f in held if _is_state(f)], held
        states = server.bucket.storage.load_states()
        assert states[VB].state != VBucketState.DEAD  # what a crash would find
        server.resume_persistence()
        (active,) = (await dcp.read_stream_until(_is_state, ack=True))[-1:]
        assert active.extras == bytes((VBucketState.ACTIVE,))
        assert server.bucket.storage.load_states()[VB].state == VBucketState.DEAD
