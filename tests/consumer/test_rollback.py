"""Rollback: surfaced as an event before the stream resumes, state reset per §5.5."""

from __future__ import annotations

import pytest

from dcp.consumer import (
    MemoryOffsetStore,
    Offset,
    RollbackError,
    RollbackEvent,
    RollbackPolicy,
    SnapshotBatch,
)

from .conftest import drain, make_client

A, B = 0xAAAA, 0xBBBB


def _committed_at(vb: int, seqno: int, log: tuple) -> MemoryOffsetStore:
    return MemoryOffsetStore({vb: Offset(vb, log[0][0], seqno, failover_log=log)})


async def test_rollback_is_delivered_before_the_stream_resumes_and_can_happen_twice(producer):
    h = producer.vb(0, uuid=A)
    h.add_mutations(10, per_snapshot=5)  # history A: [1,5] [6,10]
    h.failover(B, at=6)  # the server lost 7..10; new branch B from 6
    h.add_snapshot(["x", "y"])  # 7, 8 on branch B
    producer.script(0, ("rollback", 8), ("rollback", 5))  # two scripted answers first
    store = _committed_at(0, 10, ((A, 0),))
    async with make_client(producer, vbuckets=[0], to_latest=True, offset_store=store) as c:
        items = await drain(c)
        r1, r2 = items[0], items[1]
        assert isinstance(r1, RollbackEvent) and isinstance(r2, RollbackEvent)
        assert (r1.vbucket, r1.vb_uuid, r1.seqno, r1.rollback_seqno) == (0, A, 10, 8)
        assert (r2.vbucket, r2.vb_uuid, r2.seqno, r2.rollback_seqno) == (0, A, 8, 5)
        batches = items[2:]
        assert all(isinstance(b, SnapshotBatch) for b in batches)
        seqnos = [e.seqno for b in batches for e in b]
        assert seqnos == [6, 7, 8]
        assert [e.key for b in batches for e in b][1:] == [b"x", b"y"]
        # nothing was committed yet: the store still says 10 on branch A
        assert store.offsets[0].seqno == 10
        assert not await r1.commit(), "an older rollback is superseded by the newer one"
        assert await r2.commit()
        assert store.offsets[0].seqno == 5 and store.offsets[0].vb_uuid == A
        assert await c.commit()
        assert store.offsets[0].seqno == 8
        assert store.offsets[0].failover_log == ((B, 6), (A, 0))
    reqs = [(r.start, r.snap_start, r.snap_end, r.vb_uuid) for r in producer.requests_for(0)]
    assert reqs == [(10, 10, 10, A), (8, 8, 8, A), (5, 5, 5, A)]


async def test_failover_on_the_server_makes_the_client_roll_back(producer):
    h = producer.vb(1, uuid=A)
    h.add_mutations(10, per_snapshot=5)
    async with make_client(producer, vbuckets=[1]) as c:
        b1, b2 = await c.getone(), await c.getone()
        assert (b1.end, b2.end) == (5, 10)
        await c.commit()
        # the node holding 7..10 dies; a replica that had only 6 takes over
        h.failover(B, at=6)
        h.add_snapshot(["n7", "n8", "n9"])
        await producer.drop_connections()
        ev = await c.getone()
        assert isinstance(ev, RollbackEvent)
        assert (ev.vb_uuid, ev.seqno, ev.rollback_seqno) == (A, 10, 6)
        assert ev.failover_log == ((A, 0),)
        b = await c.getone()
        assert [(e.seqno, e.key) for e in b] == [(7, b"n7"), (8, b"n8"), (9, b"n9")]
        await c.commit()
        assert c.committed()[1].seqno == 9
        assert c.committed()[1].vb_uuid == B
    last = producer.requests_for(1)[-1]
    assert (last.start, last.snap_start, last.snap_end, last.vb_uuid) == (6, 6, 6, A)


async def test_fail_policy_raises_a_typed_error_naming_the_divergence(producer):
    h = producer.vb(2, uuid=A)
    h.add_mutations(4, per_snapshot=4)
    h.failover(B, at=2)
    store = _committed_at(2, 4, ((A, 0),))
    async with make_client(
        producer, vbuckets=[2], offset_store=store, rollback_policy=RollbackPolicy.FAIL
    ) as c:
        with pytest.raises(RollbackError) as info:
            await c.getone()
    err = info.value
    assert (err.vbucket, err.vb_uuid, err.seqno, err.rollback_seqno) == (2, A, 4, 2)
    assert "vbucket 2" in str(err) and "rollback" in str(err)
    assert store.offsets[2].seqno == 4, "nothing is reset under the fail policy"


async def test_uncommitted_rollback_is_reported_again_after_a_restart(producer):
    h = producer.vb(0, uuid=A)
    h.add_mutations(6, per_snapshot=3)
    h.failover(B, at=3)
    store = _committed_at(0, 6, ((A, 0),))
    for _ in range(2):  # the application crashes before committing the rollback
        async with make_client(producer, vbuckets=[0], offset_store=store) as c:
            ev = await c.getone()
            assert isinstance(ev, RollbackEvent) and ev.rollback_seqno == 3
    async with make_client(producer, vbuckets=[0], offset_store=store, to_latest=True) as c:
        items = await drain(c)
        assert isinstance(items[0], RollbackEvent)
        await items[0].commit()
    assert store.offsets[0].seqno == 3


async def test_offset_without_failover_log_rolls_back_to_zero_when_unknown(producer):
    h = producer.vb(0, uuid=A)
    h.add_mutations(4, per_snapshot=2)
    offsets = {0: Offset(0, vb_uuid=0x1234, seqno=4)}  # uuid the server never had
    async with make_client(producer, vbuckets=[0], offsets=offsets, to_latest=True) as c:
        items = await drain(c)
    assert isinstance(items[0], RollbackEvent) and items[0].rollback_seqno == 0
    assert items[0].failover_log == ()
    assert [e.seqno for b in items[1:] for e in b] == [1, 2, 3, 4]
    reqs = producer.requests_for(0)
    assert (reqs[1].start, reqs[1].vb_uuid) == (0, 0)
