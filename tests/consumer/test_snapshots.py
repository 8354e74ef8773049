"""Snapshot atomicity: the application sees whole snapshots only, in seqno order."""

from __future__ import annotations

import trio

from dcp.consumer import (
    Deletion,
    Expiration,
    MemoryOffsetStore,
    Mutation,
    Offset,
    SnapshotBatch,
)

from .conftest import drain, make_client
from .fake_producer import DISK, MEMORY, Item


async def test_batches_are_whole_snapshots_in_seqno_order(producer):
    h = producer.vb(0)
    h.add_snapshot(["a", "b", "c"], flags=DISK)
    # dedup: seqno 4 (an older "a") was removed from the snapshot [4, 6]
    h.add_snapshot([Item(5, b"b", b"b2"), Item(6, b"a", b"a2")], start=4, end=6, flags=MEMORY)
    async with make_client(producer, vbuckets=[0], to_latest=True) as client:
        batches = await drain(client)
    assert [(b.vbucket, b.start, b.end) for b in batches] == [(0, 1, 3), (0, 4, 6)]
    assert batches[0].is_disk and not batches[0].is_memory
    assert batches[1].is_memory
    assert [e.seqno for e in batches[1].events] == [5, 6]
    assert [e.key for e in batches[0]] == [b"a", b"b", b"c"]
    assert all(isinstance(e, Mutation) for b in batches for e in b)
    assert batches[1].events[1].value == b"a2"
    assert batches[0].vb_uuid == h.log[0][0]


async def test_nothing_of_a_snapshot_is_delivered_before_its_end_arrives(producer):
    h = producer.vb(0)
    h.add_snapshot(["a", "b"])  # [1, 2]
    h.add_snapshot(["c", "d", "e", "f"])  # [3, 6]
    producer.fault(0, 5, "silence")  # marker [3,6], items 3 and 4 sent, then nothing
    async with make_client(producer, vbuckets=[0]) as client:
        first = await client.getone()
        assert (first.start, first.end) == (1, 2)
        with trio.move_on_after(0.5) as cs:
            await client.getone()
        assert cs.cancelled_caught, "a partial snapshot must not be delivered"
        assert client.statistics()["items"] == 4


async def test_partial_snapshot_at_disconnect_is_discarded_and_requested_again(producer):
    h = producer.vb(3)
    h.add_snapshot(["a", "b", "c"])  # [1, 3]
    h.add_snapshot(["d", "e", "f", "g", "h"])  # [4, 8]
    producer.fault(3, 6, "disconnect")
    uuid = h.log[0][0]
    store = MemoryOffsetStore({3: Offset(3, uuid, 3, failover_log=((uuid, 0),))})
    async with make_client(producer, vbuckets=[3], to_latest=True, offset_store=store) as c:
        batches = await drain(c)
    # the partial [4, 8] (items 4, 5) was dropped; the retry delivered it whole, once
    assert [(b.start, b.end, len(b)) for b in batches] == [(4, 8, 5)]
    reqs = producer.requests_for(3)
    assert len(reqs) == 2 and producer.accepted == 2
    for r in reqs:
        assert (r.start, r.snap_start, r.snap_end, r.vb_uuid, r.end) == (3, 3, 3, uuid, 8)


async def test_reconnect_resumes_from_the_last_committed_batch(producer):
    h = producer.vb(0)
    for _ in range(4):
        h.add_snapshot(["k1", "k2"])
    async with make_client(producer, vbuckets=[0]) as client:
        b1 = await client.getone()
        b2 = await client.getone()
        assert await b1.commit()
        await producer.drop_connections()
        # b2 was delivered but not committed: it comes again, then the rest. Batches
        # queued before the client noticed the drop may come first (at-least-once).
        seen: list = []
        while (3, 4) not in [(b.start, b.end) for b in seen] or seen[-1].end != 8:
            seen.append(await client.getone())
        spans = [(b.start, b.end) for b in seen]
        i = spans.index((3, 4))
        assert spans[i:] == [(3, 4), (5, 6), (7, 8)]
        assert set(spans[:i]) <= {(5, 6), (7, 8)}
        assert not await b2.commit(), "a batch of an abandoned stream is not committed"
        assert await seen[-1].commit()
        assert client.committed()[0].seqno == 8
    last = producer.requests_for(0)[-1]
    assert (last.start, last.snap_start, last.snap_end) == (2, 2, 2)


async def test_stream_end_ok_completes_a_snapshot_whose_last_items_were_deduplicated(producer):
    h = producer.vb(0)
    h.add_snapshot([Item(1, b"a"), Item(2, b"b")], start=1, end=4)  # 3, 4 deduplicated away
    async with make_client(producer, vbuckets=[0], to_latest=True) as client:
        batches = await drain(client)
    assert [(b.start, b.end, len(b)) for b in batches] == [(1, 4, 2)]


async def test_next_marker_completes_the_previous_snapshot(producer):
    h = producer.vb(0)
    h.add_snapshot([Item(1, b"a")], start=1, end=2)  # seqno 2 deduplicated away
    h.add_snapshot(["b"], start=3)
    async with make_client(producer, vbuckets=[0]) as client:
        b = await client.getone()
        assert (b.start, b.end, len(b)) == (1, 2, 1)
        b = await client.getone()
        assert (b.start, b.end, len(b)) == (3, 3, 1)


async def test_deletions_and_expirations_are_decoded(producer):
    h = producer.vb(0)
    h.add_snapshot([Item(1, b"a", b"x"), Item(2, b"b", kind="d"), Item(3, b"c", kind="x")])
    async with make_client(producer, vbuckets=[0], to_latest=True) as client:
        (b,) = await drain(client)
    assert [type(e) for e in b] == [Mutation, Deletion, Deletion]
    assert b.events[1].delete_time is None  # V1 deletion without IncludeDeleteTimes
    async with make_client(
        producer, vbuckets=[0], to_latest=True, include_expirations=True
    ) as client:
        (b,) = await drain(client)
    assert [type(e) for e in b] == [Mutation, Deletion, Expiration]
    assert b.events[1].delete_time == 1700000000
    assert producer.open_flags[-1] & 0x20
    assert ("enable_expiry_opcode", "true") in producer.controls


async def test_handshake_sends_hello_open_and_controls(producer):
    producer.vb(0).add_snapshot(["a"])
    async with make_client(
        producer, vbuckets=[0], to_latest=True, noop_interval=30, buffer_size=123456
    ) as client:
        await drain(client)
    assert set(producer.hello_features[0]) >= {0x07, 0x0B, 0x04}
    assert producer.open_flags[0] & 0x01
    ctl = dict(producer.controls)
    assert ctl["enable_noop"] == "true" and ctl["set_noop_interval"] == "30"
    assert ctl["connection_buffer_size"] == "123456"
    assert ctl["supports_cursor_dropping"] == "true"
    assert ctl["send_stream_end_on_client_close_stream"] == "true"


async def test_empty_batch_is_a_commit_point(producer):
    h = producer.vb(0)
    h.add_snapshot([], start=1, end=1)
    h.high = 1
    async with make_client(producer, vbuckets=[0], to_latest=True) as client:
        (b,) = await drain(client)
        assert isinstance(b, SnapshotBatch) and len(b) == 0 and b.end == 1
        assert await client.commit()
        assert client.committed()[0].seqno == 1


async def test_a_snapshot_running_past_the_end_is_cut_at_the_end(producer):
    producer.clamp_to_end = False
    h = producer.vb(0)
    h.add_snapshot(["a", "b"])
    async with make_client(producer, vbuckets=[0], to_latest=True) as c:
        await c.started.wait()
        h.snapshots[0].items.append(Item(3, b"c"))  # the open snapshot grew to [1, 3]
        h.snapshots[0].end = h.high = 3
        (b,) = await drain(c)
    assert (b.start, b.end, [e.seqno for e in b]) == (1, 2, [1, 2])
