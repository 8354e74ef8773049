"""DCP streaming end to end: a real server on an ephemeral port, a raw-wire client."""

from __future__ import annotations

import trio

from dcp.protocol import (
    Opcode,
    SnapshotMarkerFlag,
    Status,
    StreamEndStatus,
    StreamRequestFlag,
    codec,
)

from .conftest import client_of, running_server
from .wire import WireClient, items_of, keys_for_vb, markers_of


def is_end(f) -> bool:  # type: ignore[no-untyped-def]
    return f.opcode == Opcode.DCP_STREAM_END


async def test_stream_from_zero_delivers_every_write_in_seqno_order(server, client) -> None:
    keys = keys_for_vb(1, 20, 4)
    for i, k in enumerate(keys):
        await client.set(k, b"v%d" % i)
    await client.dcp_open("t-zero")
    r = await client.stream_req(1, end=20)
    assert r.status == Status.SUCCESS
    log = codec.parse_failover_log(r.value)
    assert len(log) == 1 and log[0][1] == 0 and log[0][0] != 0
    frames = await client.read_stream_until(is_end)
    items = items_of(frames)
    assert [s for _, s, _, _ in items] == list(range(1, 21))
    assert [k for _, _, k, _ in items] == keys
    assert codec.parse_stream_end(frames[-1]) == StreamEndStatus.OK
    m = markers_of(frames)
    assert m[0][0] == 1 and m[-1][1] == 20
    assert all(flags & SnapshotMarkerFlag.MEMORY for _, _, flags in m)


async def test_seed_dedup_example_over_the_wire_is_one_snapshot_2_to_3(server, client) -> None:
    a, b = keys_for_vb(0, 2, 4)
    await client.set(a, b"A1")
    await client.set(b, b"B")
    await client.set(a, b"A2")
    await client.dcp_open("t-dedup")
    assert (await client.stream_req(0, end=3)).status == Status.SUCCESS
    frames = await client.read_stream_until(is_end)
    assert [(s, e) for s, e, _ in markers_of(frames)] == [(2, 3)]
    assert items_of(frames) == [
        (Opcode.DCP_MUTATION, 2, b, b"B"),
        (Opcode.DCP_MUTATION, 3, a, b"A2"),
    ]


async def test_every_message_of_a_stream_echoes_its_opaque(server, client) -> None:
    for k in keys_for_vb(2, 5, 4):
        await client.set(k, b"x")
    await client.dcp_open("t-opaque")
    await client.stream_req(2, end=5, opaque=0xCAFE)
    frames = await client.read_stream_until(is_end)
    assert frames and all(f.opaque == 0xCAFE and f.vbucket == 2 for f in frames)


async def test_stream_from_a_mid_point_sends_only_later_seqnos(server, client) -> None:
    keys = keys_for_vb(3, 10, 4)
    for k in keys:
        await client.set(k, b"x")
    await client.dcp_open("t-mid")
    r = await client.stream_req(3, end=2**64 - 1)
    uuid = codec.parse_failover_log(r.value)[0][0]
    await client.read_stream_until(lambda f: items_of([f])[-1:] and items_of([f])[0][1] == 10)
    c2 = await WireClient.connect(server.port, 4)
    try:
        await c2.dcp_open("t-mid-2")
        r = await c2.stream_req(3, start=6, uuid=uuid, end=10)
        assert r.status == Status.SUCCESS
        frames = await c2.read_stream_until(is_end)
        assert [s for _, s, _, _ in items_of(frames)] == [7, 8, 9, 10]
    finally:
        await c2.aclose()


async def test_live_stream_is_refused_with_key_exists_and_bad_requests_get_errors(
    server, client
) -> None:
    await client.dcp_open("t-errors")
    assert (await client.stream_req(0)).status == Status.SUCCESS
    assert (await client.stream_req(0)).status == Status.KEY_EEXISTS
    assert (await client.stream_req(99)).status == Status.NOT_MY_VBUCKET
    # start beyond the high seqno
    assert (await client.stream_req(1, start=5, uuid=0)).status in (Status.ERANGE, Status.ROLLBACK)
    # snap_start > start
    assert (await client.stream_req(2, start=0, snap_start=3, snap_end=4)).status == Status.ERANGE


async def test_unknown_vbucket_uuid_is_told_to_roll_back_to_zero(server, client) -> None:
    for k in keys_for_vb(0, 3, 4):
        await client.set(k, b"x")
    await client.dcp_open("t-uuid")
    r = await client.stream_req(0, start=2, uuid=0x1234, snap_start=2, snap_end=2)
    assert r.status == Status.ROLLBACK
    assert codec.U64.unpack(r.value)[0] == 0


async def test_backfill_then_memory_hand_over_has_no_gap_or_duplicate(tmp_path) -> None:
    async with running_server(
        tmp_path / "d", checkpoint_max_items=10, checkpoint_retain_seconds=0
    ) as server:
        async with client_of(server) as c:
            keys = keys_for_vb(1, 60, 4)
            await c.set_many([(k, b"old") for k in keys[:51]])
            await server.flush_all()
            # Closed, persisted checkpoints are freed: memory no longer starts at seqno 1.
            with trio.fail_after(5):
                while server.bucket.vbucket(1).checkpoints.stats().get("num_checkpoints", 99) > 2:
                    await c.set(keys[50], b"tick")
                    await server.flush_all()
            high_before = server.bucket.vbucket(1).high_seqno
            await c.dcp_open("t-backfill")
            r = await c.stream_req(1)
            assert r.status == Status.SUCCESS
            frames = await c.read_stream_until(
                lambda f: bool(items_of([f])) and items_of([f])[0][1] == high_before
            )
            for k in keys[51:]:
                await c.set(k, b"new")
            high = server.bucket.vbucket(1).high_seqno
            frames += await c.read_stream_until(
                lambda f: bool(items_of([f])) and items_of([f])[0][1] == high
            )
            markers = markers_of(frames)
            assert markers[0][2] & SnapshotMarkerFlag.DISK
            assert any(m[2] & SnapshotMarkerFlag.MEMORY for m in markers[1:])
            seqnos = [s for _, s, _, _ in items_of(frames)]
            assert seqnos == sorted(set(seqnos)), "duplicate or out-of-order seqno"
            got = {k: v for _, _, k, v in items_of(frames)}
            assert set(got) == set(keys)
            assert all(got[k] == b"new" for k in keys[51:])


async def test_close_stream_with_stream_end_enabled_sends_closed(server, client) -> None:
    await client.dcp_open("t-close")
    assert (await client.control("send_stream_end_on_client_close_stream", "true")).status == 0
    await client.stream_req(0)
    op = next(client.opaques)
    r = await client.call(codec.request(Opcode.DCP_CLOSE_STREAM, vbucket=0, opaque=op), op)
    assert r.status == Status.SUCCESS
    frames = await client.read_stream_until(is_end)
    assert codec.parse_stream_end(frames[-1]) == StreamEndStatus.CLOSED
    op = next(client.opaques)
    r = await client.call(codec.request(Opcode.DCP_CLOSE_STREAM, vbucket=0, opaque=op), op)
    assert r.status == Status.KEY_ENOENT


async def test_all_1024_vbuckets_stream_on_one_connection(tmp_path) -> None:
    async with running_server(tmp_path / "d", num_vbuckets=1024) as server:
        async with client_of(server) as c:
            keys = [f"key-{i}".encode() for i in range(3000)]
            await c.set_many([(k, k) for k in keys])
            highs = {vb: server.bucket.vbucket(vb).high_seqno for vb in range(1024)}
            await c.dcp_open("t-1024")
            await c.control("connection_buffer_size", str(1 << 20))
            buf = bytearray()
            for vb in range(1024):
                buf += codec.stream_request(vb, 10_000 + vb, end=highs[vb])
            await c.send(bytes(buf))
            ended: set[int] = set()
            got: dict[bytes, bytes] = {}
            with trio.fail_after(30):
                while len(ended) < 1024:
                    f = await c.next_frame()
                    if f.is_response:
                        assert f.status == Status.SUCCESS, f
                        continue
                    await c.ack_all([f])
                    if f.opcode == Opcode.DCP_STREAM_END:
                        assert f.opaque == 10_000 + f.vbucket
                        ended.add(f.vbucket)
                    elif f.opcode == Opcode.DCP_MUTATION:
                        got[bytes(f.key)] = bytes(f.value)
            assert got == {k: k for k in keys}


async def test_key_only_streams_strip_values_and_0x40_keeps_the_datatype(server, client) -> None:
    (k,) = keys_for_vb(0, 1, 4)
    op = next(client.opaques)
    await client.call(
        codec.request(
            Opcode.SET,
            vbucket=0,
            opaque=op,
            datatype=1,
            extras=codec.store_extras(7, 0),
            key=k,
            value=b'{"a":1}',
        ),
        op,
    )
    for flag, want_dt in ((0x08, 0), (0x40, 1)):
        async with client_of(server) as c:
            await c.dcp_open(f"t-novalue-{flag}", flags=0x01 | flag)
            await c.stream_req(0, end=1)
            frames = await c.read_stream_until(is_end)
            (m,) = [f for f in frames if f.opcode == Opcode.DCP_MUTATION]
            assert bytes(m.key) == k and m.value == b"" and m.datatype == want_dt
            assert codec.parse_mutation(m)[2] == 7


async def test_a_cut_inside_a_snapshot_keeps_the_real_snapshot_end_in_the_marker(
    server, client
) -> None:
    """Asking for end=2 of a deduplicated snapshot 2..3 must not pretend 2 is a snapshot end."""
    a, b = keys_for_vb(0, 2, 4)
    await client.set(a, b"A1")
    await client.set(b, b"B")
    await client.set(a, b"A2")
    await client.dcp_open("t-cut")
    await client.stream_req(0, end=2)
    frames = await client.read_stream_until(is_end)
    assert [(s, e) for s, e, _ in markers_of(frames)] == [(2, 3)]
    assert [s for _, s, _, _ in items_of(frames)] == [2]


async def test_a_bounded_stream_served_from_disk_sends_every_chunk_before_ending(tmp_path) -> None:
    """Regression (found by the Spark connector): a finite stream whose disk snapshot
    reaches its end seqno used to end after the first backfill chunk."""
    async with running_server(tmp_path / "d", num_vbuckets=1) as server:
        async with client_of(server) as c:
            await c.set_many([(b"key-%05d" % i, b"v") for i in range(10_000)])
    async with running_server(tmp_path / "d", num_vbuckets=1) as server:  # disk only now
        async with client_of(server) as c:
            await c.dcp_open("t-bounded-disk")
            await c.control("connection_buffer_size", str(1 << 20))
            assert (await c.stream_req(0, end=9_000)).status == Status.SUCCESS
            frames = await c.read_stream_until(is_end, ack=True, timeout=30)
            assert codec.parse_stream_end(frames[-1]) == StreamEndStatus.OK
            assert [s for _, s, _, _ in items_of(frames)] == list(range(1, 9_001))


async def test_a_bounded_stream_whose_range_has_no_items_left_still_ends(tmp_path) -> None:
    async with running_server(tmp_path / "d", num_vbuckets=1, tombstone_purge_age=0.0) as srv:
        async with client_of(srv) as c:
            await c.set_many([(b"a", b"1"), (b"b", b"2")])
            await c.delete(b"b")  # seqno 3: a tombstone, then purged
            await srv.flush_all()
            assert await srv.persistence.compact_now() == 1
    async with running_server(tmp_path / "d", num_vbuckets=1) as server:
        async with client_of(server) as c:
            await c.dcp_open("t-empty-tail")
            uuid = server.bucket.vbucket(0).uuid
            r = await c.stream_req(0, start=2, uuid=uuid, end=3)
            assert r.status == Status.ROLLBACK  # below the purge seqno
            r = await c.stream_req(
                0, start=2, uuid=uuid, end=3, flags=StreamRequestFlag.IGNORE_PURGED_TOMBSTONES
            )
            assert r.status == Status.SUCCESS
            frames = await c.read_stream_until(is_end, timeout=10)
            assert codec.parse_stream_end(frames[-1]) == StreamEndStatus.OK


async def test_disk_snapshots_repeat_keys_only_for_change_streams(tmp_path) -> None:
    """With a history window the disk keeps superseded versions. A plain client's disk
    snapshot still has each key once (its newest version, flags DISK only, as without
    history); a change-stream client gets every version, HISTORY|MAY_CONTAIN_DUPLICATES."""
    async with running_server(tmp_path / "d", num_vbuckets=1, history_seconds=3600) as server:
        async with client_of(server) as c:
            await c.set(b"user:1", b"v1")
            await c.set(b"user:2", b"w1")
            await c.set(b"user:1", b"v2")
    async with running_server(tmp_path / "d", num_vbuckets=1, history_seconds=3600) as server:
        for change_streams in (False, True):
            async with client_of(server) as c:
                await c.dcp_open(f"t-hist-{change_streams}")
                if change_streams:
                    assert (await c.control("change_streams", "true")).status == 0
                await c.stream_req(0, end=3)
                frames = await c.read_stream_until(is_end)
                ((start, end, flags),) = markers_of(frames)
                got = [(s, v) for _, s, _, v in items_of(frames)]
                if change_streams:
                    assert flags == (
                        SnapshotMarkerFlag.DISK
                        | SnapshotMarkerFlag.HISTORY
                        | SnapshotMarkerFlag.MAY_CONTAIN_DUPLICATES
                    )
                    assert (start, end) == (1, 3)
                    assert got == [(1, b"v1"), (2, b"w1"), (3, b"v2")]
                else:
                    assert flags == SnapshotMarkerFlag.DISK
                    assert (start, end) == (2, 3)
                    assert got == [(2, b"w1"), (3, b"v2")]


async def test_backfill_of_many_tombstones_releases_its_slot(tmp_path) -> None:
    """Deletion frames are smaller than the size a backfill charges for them: the
    buffered-bytes count must still return to zero, or the stream keeps its
    connection's only backfill slot (and every other vbucket of it waits forever)."""
    async with running_server(
        tmp_path / "d",
        checkpoint_max_items=50,
        checkpoint_retain_seconds=0,
        backfill_buffer_bytes=4096,
        max_concurrent_backfills=1,
    ) as server:
        async with client_of(server) as c:
            keys0 = keys_for_vb(0, 600, 4)
            keys1 = keys_for_vb(1, 5, 4)
            await c.set_many([(k, b"x") for k in keys0 + keys1])
            for k in keys0[:500]:
                assert (await c.delete(k)).status == Status.SUCCESS
            await server.flush_all()
            for vb in (0, 1):  # persisted checkpoints are freed: both streams backfill
                server.bucket.vbucket(vb).checkpoints.create_checkpoint()
            await server.flush_all()
            high1 = server.bucket.vbucket(1).high_seqno
            await c.dcp_open("t-tombstones")
            assert (await c.stream_req(0)).status == Status.SUCCESS  # open-ended
            assert (await c.stream_req(1, end=high1)).status == Status.SUCCESS
            frames = await c.read_stream_until(lambda f: is_end(f) and f.vbucket == 1, timeout=10.0)
            assert all(flags & SnapshotMarkerFlag.DISK for _, _, flags in markers_of(frames))
            got1 = [k for _, _, k, _ in items_of([f for f in frames if f.vbucket == 1])]
            assert got1 == keys1
            dels = [f for f in frames if f.opcode == Opcode.DCP_DELETION and f.vbucket == 0]
            assert len(dels) == 500


async def test_persisted_checkpoints_are_retained_then_freed(tmp_path) -> None:
    """Within checkpoint_retain_seconds a persisted range is streamed from memory at its
    checkpoint boundaries; after it the housekeeping frees it and the disk serves it."""
    async with running_server(tmp_path / "d", checkpoint_retain_seconds=0.3) as server:
        async with client_of(server) as c:
            keys = keys_for_vb(2, 20, 4)
            await c.set_many([(k, b"one") for k in keys])
            server.bucket.vbucket(2).checkpoints.create_checkpoint()  # a boundary at 20
            await c.set_many([(k, b"two") for k in keys[::2]])
            await server.flush_all()
            mgr = server.bucket.vbucket(2).checkpoints
            assert mgr.memory_start_seqno == 1  # retained though persisted
            await c.dcp_open("t-retained")
            assert (await c.stream_req(2, end=20)).status == Status.SUCCESS
            frames = await c.read_stream_until(is_end)
            assert [(s, e) for s, e, _ in markers_of(frames)] == [(1, 20)]
            assert markers_of(frames)[0][2] & SnapshotMarkerFlag.MEMORY
            assert {v for _, _, _, v in items_of(frames)} == {b"one"}
            with trio.fail_after(5):  # freed once its time is up (checked about every 1 s)
                while mgr.memory_start_seqno == 1:
                    await trio.sleep(0.05)
            assert (await c.stream_req(2, end=20, opaque=77)).status == Status.SUCCESS
            frames = await c.read_stream_until(is_end)
            # from disk: one snapshot up to the newest persisted seqno, and it says so
            ((_start, end, flags),) = markers_of(frames)
            assert flags & SnapshotMarkerFlag.DISK and end == 30
