"""Streams on one connection: noops, dead connections, 1024 vbuckets, to-latest, raw mode."""

from __future__ import annotations

import trio

from dcp.consumer import (
    Mutation,
    RollbackEvent,
    SnapshotMarker,
    StartFrom,
    StreamEnd,
)

from .conftest import drain, make_client


async def test_every_noop_is_answered(producer, autojump_clock):
    producer.vb(0).add_mutations(2)
    async with make_client(producer, vbuckets=[0], noop_interval=1.0) as c:
        await c.getone()
        await trio.sleep(10.5)
        assert c.statistics()["noops"] == producer.noops_sent >= 9
    assert producer.noop_replies == producer.noops_sent
    assert producer.accepted == 1, "a connection with noops is not dead"
    replies = [f for f in producer.frames if f.magic == 0x81 and f.opcode == 0x5C]
    assert all(f.status == 0 for f in replies)
    assert len({f.opaque for f in replies}) == len(replies)


async def test_silent_connection_is_closed_as_dead_and_reopened(producer, autojump_clock):
    h = producer.vb(0)
    h.add_mutations(9, per_snapshot=3)
    producer.fault(0, 5, "silence")  # mid-snapshot [4,6], and no more noops either
    async with make_client(producer, vbuckets=[0], noop_interval=2.0, to_latest=True) as c:
        t0 = trio.current_time()
        items = await drain(c)
        elapsed = trio.current_time() - t0
    assert producer.accepted == 2
    assert 4.0 <= elapsed < 10.0, "detected after 2 x noop interval of silence"
    spans = [(b.start, b.end) for b in items]
    assert spans[-2:] == [(4, 6), (7, 9)] and spans.count((4, 6)) == 1


async def test_quiet_server_is_probed_with_a_noop_before_being_declared_dead(
    producer, autojump_clock
):
    producer.send_noops = False  # e.g. its noop timer has not started yet
    producer.vb(0).add_mutations(3, per_snapshot=3)
    async with make_client(producer, vbuckets=[0], noop_interval=1.0) as c:
        await c.getone()
        await trio.sleep(20)
        assert c.statistics()["probes"] >= 10
    assert producer.client_noops >= 10
    assert producer.accepted == 1, "an answered probe proves the connection is alive"


async def test_refused_noop_control_disables_dead_connection_detection(producer, autojump_clock):
    producer.refuse_controls.add("enable_noop")
    producer.vb(0).add_mutations(3, per_snapshot=3)
    async with make_client(producer, vbuckets=[0], noop_interval=1.0) as c:
        await c.getone()
        await trio.sleep(30)
    assert producer.accepted == 1


async def test_1024_vbuckets_stream_over_one_connection(producer):
    for vb in range(1024):
        producer.vb(vb).add_mutations(vb % 5 + 1, per_snapshot=3)
    async with make_client(producer, to_latest=True) as c:  # vbuckets=None: all of them
        with trio.fail_after(20):
            items = await drain(c)
        assert c.vbuckets == list(range(1024))
    assert producer.accepted == 1
    assert len(producer.stream_requests) == 1024
    assert len({r.opaque for r in producer.stream_requests}) == 1024
    per_vb: dict[int, list[int]] = {}
    for b in items:
        per_vb.setdefault(b.vbucket, []).extend(e.seqno for e in b)
    assert all(per_vb[vb] == list(range(1, vb % 5 + 2)) for vb in range(1024))


async def test_to_latest_stops_at_the_high_seqnos_seen_at_start(producer):
    producer.vb(0).add_mutations(6, per_snapshot=3)
    producer.vb(1)  # high seqno 0: already done, no stream request
    producer.vb(2).add_mutations(2, per_snapshot=2)
    async with make_client(producer, to_latest=True) as c:
        first = await c.getone()
        producer.vb(0).add_mutations(3, per_snapshot=3)  # after the start: not included
        producer.wake_all()
        rest = await drain(c)
        assert await c.getone() is None
    ends = {(b.vbucket, b.end) for b in [first, *rest]}
    assert ends == {(0, 3), (0, 6), (2, 2)}
    assert {r.vbucket: r.end for r in producer.stream_requests} == {0: 6, 2: 2}


async def test_start_now_streams_only_new_changes(producer):
    h = producer.vb(0)
    h.add_mutations(5, per_snapshot=5)
    async with make_client(producer, vbuckets=[0], start=StartFrom.NOW) as c:
        await c.started.wait()
        h.add_snapshot(["new"])
        producer.wake_all()
        b = await c.getone()
        assert [(e.seqno, e.key) for e in b] == [(6, b"new")]
    (req,) = producer.stream_requests
    assert (req.start, req.snap_start, req.snap_end, req.vb_uuid) == (5, 5, 5, h.log[0][0])


async def test_raw_mode_delivers_events_as_they_arrive(producer):
    h = producer.vb(0)
    h.add_mutations(4, per_snapshot=2)
    producer.script(0, ("rollback", 0))
    async with make_client(producer, vbuckets=[0], raw=True, to_latest=True) as c:
        events = await drain(c)
        kinds = [type(e) for e in events]
        assert kinds == [
            RollbackEvent,
            SnapshotMarker,
            Mutation,
            Mutation,
            SnapshotMarker,
            Mutation,
            Mutation,
            StreamEnd,
        ]
        assert await c.commit()  # commits the last complete snapshot delivered
        assert c.committed()[0].seqno == 4


async def test_raw_mode_hands_out_partial_snapshots(producer):
    h = producer.vb(0)
    h.add_snapshot(["a", "b", "c", "d"])
    producer.fault(0, 3, "silence")
    async with make_client(producer, vbuckets=[0], raw=True) as c:
        got = [await c.getone() for _ in range(3)]
        assert [type(e) for e in got] == [SnapshotMarker, Mutation, Mutation]
        assert not await c.commit(), "no snapshot is complete yet"


async def test_getmany_returns_every_ready_batch(producer):
    producer.vb(0).add_mutations(20, per_snapshot=2)
    async with make_client(producer, vbuckets=[0], to_latest=True) as c:
        got: list = []
        while len(got) < 10:
            got += await c.getmany(timeout=5)
        assert await c.getmany(timeout=0.1) == []
    assert [b.end for b in got] == list(range(2, 21, 2))
