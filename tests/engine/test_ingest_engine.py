"""The batched ingest path of the engine: ``VBucket.store_set`` + ``Bucket.queued_many``
behave like ``store``, and ``LmdbStorage.write_batch`` keeps exactly the newest version."""

from __future__ import annotations

import pytest

from dcp.producer.engine import Bucket, ItemOp
from dcp.producer.engine.records import encode_item, item_key
from dcp.protocol.opcodes import VBucketState


def stored(bucket: Bucket, vb: int) -> list[tuple[int, bytes, bytes]]:
    with bucket.storage.open_backfill(vb, 0) as scan:
        return [(it.seqno, it.key, it.value) for it in scan.read(1 << 30)]


def test_store_set_matches_store(bucket: Bucket, clock) -> None:
    now = clock()
    writes = [(b"k%d" % i, b"v%d" % i, i, 60 if i % 2 else 0) for i in range(5)]
    writes.append((b"k1", b"again", 0, 0))
    plain = [bucket.set(1, k, v, flags=f, expiry=e) for k, v, f, e in writes]
    vb = bucket.vbucket(2)
    fast = [vb.store_set(k, v, f, e, 0, now) for k, v, f, e in writes]
    bucket.queued_many({2})
    assert [r[2] for r in fast] == [r.seqno for r in plain] == [1, 2, 3, 4, 5, 6]
    assert all(r[1] == vb.uuid for r in fast)
    cases = [r[0] for r in fast]
    assert cases == sorted(cases) and len(set(cases)) == len(cases)  # HLC, per vbucket
    assert cases[0] == int(now * 1e9)
    for k, _v, _f, _e in writes:
        e1 = bucket.vbucket(1).key_meta(k)
        e2 = vb.key_meta(k)
        assert e1[:2] + e1[3:] == e2[:2] + e2[3:]  # all but the CAS
    assert vb.key_meta(b"k3")[4] == int(now) + 60  # relative expiry made absolute
    assert vb.get(b"k1").value == b"again"
    mgr = vb.checkpoints
    assert [it.seqno for s in mgr.peek(mgr.persistence_cursor, 100)[0] for it in s.items] == [
        1,
        3,
        4,
        5,
        6,
    ]  # k1's first version deduplicated
    bucket.flusher.flush_all()
    assert stored(bucket, 2) == stored(bucket, 1)


def test_store_set_leaves_errors_to_store(bucket: Bucket, clock) -> None:
    vb = bucket.vbucket(0)
    assert vb.store_set(b"k", b"x" * (bucket.config.max_value_size + 1), 0, 0, 0, clock()) is None
    vb.set_state(VBucketState.REPLICA)
    assert vb.store_set(b"k", b"v", 0, 0, 0, clock()) is None
    assert vb.high_seqno == 0 and vb.key_meta(b"k") is None


def test_queued_many_notifies_like_each_write(bucket: Bucket, clock) -> None:
    seen: list[int] = []
    bucket.add_listener(seen.append)
    for vbid in (3, 1):
        bucket.vbucket(vbid).store_set(b"k", b"v", 0, 0, 0, clock())
    bucket.queued_many({3, 1})
    assert sorted(seen) == [1, 3]
    assert bucket.flusher.pending_items() == 2
    bucket.queued_many(set())
    assert len(seen) == 2


def test_write_batch_records_are_the_format_of_records_py(bucket: Bucket) -> None:
    bucket.set(0, b"a", b"1", flags=5, expiry=100)
    bucket.set(0, b"b", b"2")
    bucket.delete(0, b"b")
    batch = bucket.flusher.collect()
    items = batch.vbuckets[0].items
    bucket.storage.write_batch(batch)
    bucket.flusher.complete(batch)
    with bucket.storage.env.begin() as txn:
        for it in items:
            if it.key == b"a" or it.op != ItemOp.MUTATION:
                assert txn.get(item_key(0, it.seqno), db=bucket.storage.item_db(0)) == encode_item(
                    it
                )


@pytest.mark.parametrize("history", [False, True])
def test_overwrites_keep_only_the_newest_version_unless_history(open_bucket, history: bool) -> None:
    bucket = open_bucket(history_seconds=3600.0 if history else 0.0)
    for rnd in range(3):
        for i in range(20):
            bucket.set(0, b"k%d" % (i % 7), b"r%d-%d" % (rnd, i))
            if i % 5 == 4:
                bucket.vbucket(0).checkpoints.create_checkpoint()  # versions in one batch
        bucket.flusher.flush_all()
    got = stored(bucket, 0)
    last = {}
    for seqno, key, value in got:
        last[key] = (seqno, value)
    vb = bucket.vbucket(0)
    for key, (seqno, value) in last.items():
        assert vb.key_meta(key)[0] == seqno
        assert value == vb.get(key).value
    assert bucket.storage.disk_keys(0) == {k: s for k, (s, _v) in last.items()}
    if history:
        assert len(got) > len(last)
    else:
        assert len(got) == len(last) == 7
