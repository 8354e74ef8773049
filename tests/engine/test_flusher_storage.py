"""Flusher + LMDB: batches, persisted seqnos, superseded versions, failures, backfill."""

from __future__ import annotations

import itertools
import threading

import lmdb
import pytest

from dcp.producer.engine import (
    BackfillScan,
    Bucket,
    FlushBatch,
    ItemOp,
    StorageError,
    StorageFullError,
)
from dcp.producer.engine.records import VB_KEY, VBStateRecord


def stored(bucket: Bucket, vb: int) -> list[tuple[int, bytes, int]]:
    """(seqno, key, op) of every record stored for ``vb``."""
    with bucket.storage.open_backfill(vb, 0) as scan:
        return [(it.seqno, it.key, it.op) for it in scan.read(1 << 30)]


def disk_state(bucket: Bucket, vb: int) -> VBStateRecord:
    with bucket.storage.env.begin() as txn:
        return VBStateRecord.decode(txn.get(VB_KEY.pack(vb), db=bucket.storage.state_db))


def test_collect_groups_items_by_vbucket_and_does_not_move_the_cursor(bucket: Bucket) -> None:
    bucket.set(2, b"a", b"1")
    bucket.set(0, b"a", b"1")
    bucket.set(2, b"b", b"1")
    f = bucket.flusher
    batch = f.collect()
    assert isinstance(batch, FlushBatch) and batch.num_items == 3
    assert [(v.vbid, [i.seqno for i in v.items]) for v in batch.vbuckets] == [(0, [1]), (2, [1, 2])]
    with pytest.raises(RuntimeError):
        f.collect()
    assert bucket.vbucket(2).persisted_seqno == 0
    bucket.storage.write_batch(batch)
    assert f.complete(batch) == {0: 1, 2: 2}
    assert bucket.vbucket(2).persisted_seqno == 2
    assert f.collect() is None
    assert f.pending_items() == 0


def test_vbucket_state_is_written_in_the_same_transaction(bucket: Bucket) -> None:
    bucket.set(1, b"a", b"1")
    bucket.set(1, b"b", b"1")
    bucket.flusher.flush_all()
    rec = disk_state(bucket, 1)
    assert (rec.high_seqno, rec.snap_start, rec.snap_end) == (2, 1, 2)
    assert rec.failover == bucket.vbucket(1).failover_log.entries
    st = bucket.vbucket(1).stats_seqno()
    assert (st["last_persisted_snap_start"], st["last_persisted_snap_end"]) == (1, 2)


def test_only_the_newest_version_of_a_key_stays_on_disk(bucket: Bucket) -> None:
    bucket.set(0, b"a", b"1")
    bucket.set(0, b"b", b"1")
    bucket.flusher.flush_all()
    bucket.vbucket(0).checkpoints.create_checkpoint()
    bucket.set(0, b"a", b"2")
    bucket.vbucket(0).checkpoints.create_checkpoint()
    bucket.set(0, b"a", b"3")  # two versions of a in one batch, different checkpoints
    bucket.delete(0, b"b")
    bucket.flusher.flush_all()
    assert stored(bucket, 0) == [(4, b"a", ItemOp.MUTATION), (5, b"b", ItemOp.DELETION)]


def test_state_change_alone_is_flushed(bucket: Bucket) -> None:
    from dcp.protocol.opcodes import VBucketState

    bucket.vbucket(3).set_state(VBucketState.REPLICA)
    assert bucket.flusher.flush_all() == 0
    assert disk_state(bucket, 3).state == VBucketState.REPLICA
    assert not bucket.flusher.has_pending()


def test_collect_respects_max_items_but_keeps_snapshots_whole(bucket: Bucket) -> None:
    for i in range(10):
        bucket.set(0, b"k%d" % i, b"v")
        bucket.set(1, b"k%d" % i, b"v")
    f = bucket.flusher
    batch = f.collect(max_items=4)
    assert [(v.vbid, len(v.items)) for v in batch.vbuckets] == [(0, 10)]
    bucket.storage.write_batch(batch)
    f.complete(batch)
    batch = f.collect(max_items=4)
    assert [(v.vbid, len(v.items)) for v in batch.vbuckets] == [(1, 10)]


def test_persistence_listener_tells_durable_writers(bucket: Bucket) -> None:
    seen: list[tuple[int, int]] = []
    bucket.flusher.add_persistence_listener(lambda vb, s: seen.append((vb, s)))
    r = bucket.set(3, b"a", b"1")
    assert not bucket.is_persisted(3, r.seqno)
    bucket.flusher.flush_all()
    assert bucket.is_persisted(3, r.seqno)
    assert seen == [(3, 1)]


def test_failed_write_keeps_items_queued_and_retry_succeeds(bucket: Bucket) -> None:
    bucket.set(0, b"a", b"1")
    bucket.flusher.flush_all()
    bucket.set(0, b"b", b"2")
    f = bucket.flusher
    batch = f.collect()

    def boom(_batch):
        raise lmdb.MapFullError("simulated")

    bucket.storage.before_commit = boom
    with pytest.raises(StorageFullError) as ei:
        bucket.storage.write_batch(batch)
    assert ei.value.status == 0x86  # ETMPFAIL
    f.failed(batch, ei.value)
    assert stored(bucket, 0) == [(1, b"a", ItemOp.MUTATION)]  # aborted cleanly
    assert bucket.vbucket(0).persisted_seqno == 1
    bucket.storage.before_commit = None
    assert f.flush_all() == 1
    assert stored(bucket, 0) == [(1, b"a", ItemOp.MUTATION), (2, b"b", ItemOp.MUTATION)]


def test_real_map_full_then_grow_map_and_retry(open_bucket) -> None:
    b = open_bucket(map_size=1 << 20, num_vbuckets=2)
    for i in range(400):
        b.set(0, b"k%04d" % i, b"x" * 4000)
    f = b.flusher
    batch = f.collect()
    with pytest.raises(StorageFullError):
        b.storage.write_batch(batch)
    f.failed(batch, StorageFullError("x"))
    assert b.vbucket(0).persisted_seqno == 0
    b.storage.grow_map(64 << 20)
    assert b.storage.map_size >= 64 << 20
    assert f.flush_all() == 400
    assert len(stored(b, 0)) == 400


def test_grow_map_waits_for_open_scans(bucket: Bucket) -> None:
    bucket.set(0, b"a", b"1")
    bucket.flusher.flush_all()
    scan = bucket.storage.open_backfill(0, 0)
    with pytest.raises(StorageError):
        bucket.storage.grow_map(bucket.storage.map_size * 2, timeout=0.01)
    assert [it.key for it in scan.read(10)] == [b"a"]  # the scan is still valid
    t = threading.Timer(0.05, scan.close)
    t.start()
    bucket.storage.grow_map(bucket.storage.map_size * 2, timeout=5)
    t.join()


def test_other_lmdb_errors_become_storage_error(bucket: Bucket) -> None:
    bucket.set(0, b"a", b"1")
    batch = bucket.flusher.collect()

    def boom(_batch):
        raise lmdb.DiskError("simulated EIO")

    bucket.storage.before_commit = boom
    with pytest.raises(StorageError) as ei:
        bucket.storage.write_batch(batch)
    assert not isinstance(ei.value, StorageFullError)


def test_backfill_is_one_consistent_snapshot_read_in_chunks(bucket: Bucket) -> None:
    for i in range(10):
        bucket.set(0, b"k%d" % i, b"v%d" % i)
    bucket.delete(0, b"k3")
    bucket.flusher.flush_all()
    scan = bucket.storage.open_backfill(0, 4)
    assert isinstance(scan, BackfillScan)
    assert (scan.start_seqno, scan.end_seqno, scan.history) == (4, 11, False)
    # writes flushed after the scan opened are invisible to it
    bucket.set(0, b"k5", b"new")
    bucket.set(0, b"zz", b"new")
    bucket.flusher.flush_all()
    chunks = []
    while items := scan.read(3):
        chunks.append([it.seqno for it in items])
    scan.close()
    assert chunks == [[5, 6, 7], [8, 9, 10], [11]]
    with bucket.storage.open_backfill(0, 4) as scan2:
        assert [it.seqno for it in scan2.read(100)] == [5, 7, 8, 9, 10, 11, 12, 13]
        assert scan2.end_seqno == 13


def test_backfilled_mutation_reuses_the_stored_wire_body(bucket: Bucket) -> None:
    from dcp.protocol.codec import mutation_body

    r = bucket.set(0, b"key", b"value", flags=9, expiry=0, datatype=1)
    bucket.flusher.flush_all()
    (it,) = stored_items(bucket, 0)
    assert it.body == mutation_body(1, 1, 9, 0, b"key", b"value")
    assert (it.cas, it.datatype, it.value, it.vbucket) == (r.cas, 1, b"value", 0)
    bucket.delete(0, b"key")
    bucket.flusher.flush_all()
    (tomb,) = stored_items(bucket, 0)
    assert (tomb.op, tomb.body, tomb.delete_time) == (ItemOp.DELETION, b"", tomb.delete_time)


def stored_items(bucket: Bucket, vb: int):
    with bucket.storage.open_backfill(vb, 0) as scan:
        return scan.read(1000)


def test_backfill_of_empty_or_caught_up_vbucket_is_empty(bucket: Bucket) -> None:
    with bucket.storage.open_backfill(1, 0) as scan:
        assert scan.end_seqno == 0 and scan.read(10) == []
    bucket.set(1, b"a", b"1")
    bucket.flusher.flush_all()
    with bucket.storage.open_backfill(1, 1) as scan:
        assert scan.read(10) == []
    assert bucket.storage.open_scans == 0


def test_backfill_scan_can_move_between_threads(bucket: Bucket) -> None:
    for i in range(100):
        bucket.set(0, b"k%d" % i, b"v")
    bucket.flusher.flush_all()
    scan = bucket.storage.open_backfill(0, 0)
    got: list[int] = []

    def read() -> None:
        got.extend(it.seqno for it in scan.read(40))

    for _ in range(3):
        t = threading.Thread(target=read)
        t.start()
        t.join()
    scan.close()
    assert got == list(range(1, 101))


def test_flush_concurrent_with_reads_from_another_thread(bucket: Bucket) -> None:
    for i in range(2000):
        bucket.set(i % 4, b"k%d" % i, b"v" * 50)
    batch = bucket.flusher.collect(10_000)
    errors: list[BaseException] = []

    def write() -> None:
        try:
            bucket.storage.write_batch(batch)
        except BaseException as exc:  # pragma: no cover
            errors.append(exc)

    t = threading.Thread(target=write)
    t.start()
    for _ in range(50):
        bucket.get(1, b"k1")
    t.join()
    assert not errors
    bucket.flusher.complete(batch)
    assert bucket.get(1, b"k1").value == b"v" * 50


def _frames_of(chunk) -> list[bytes]:
    """Split a BackfillChunk's runs into frames (items of other kinds as themselves)."""
    out: list = []
    for seg in chunk.segments:
        if isinstance(seg, list):
            out.extend(seg)
            continue
        assert seg.ckpt is None  # ready frames, no checkpoint behind them
        bounds = [*seg.starts, seg.end]
        out.extend(bytes(seg.wire[a:b]) for a, b in itertools.pairwise(bounds))
    return out


def test_read_frames_gives_the_exact_wire_frames_of_stored_mutations(bucket: Bucket) -> None:
    """Byte for byte what the codec would encode for this stream (vbucket, opaque), with
    deletions left as items (their frames depend on stream options), cut at ``upto``."""
    from dcp.protocol.codec import mutation

    res = {}
    for i in range(6):
        res[i] = bucket.set(3, b"k%d" % i, b"value-%d" % i, flags=i, datatype=1)
    bucket.delete(3, b"k2")  # seqno 7
    bucket.set(3, b"k9", b"last", expiry=0)  # seqno 8
    bucket.flusher.flush_all()
    with bucket.storage.open_backfill(3, 0) as scan:
        chunk = scan.read_frames(100, upto=7, opaque=0xABCD)
        assert scan.done  # stopped at upto
    got = _frames_of(chunk)
    want_seqnos = [1, 2, 4, 5, 6, 7]
    assert (chunk.count, chunk.first, chunk.last, chunk.beyond) == (6, 1, 7, 0)
    for seqno, frame in zip(want_seqnos[:-1], got[:-1], strict=True):
        i = seqno - 1
        assert frame == mutation(
            3,
            0xABCD,
            seqno,
            1,
            b"k%d" % i,
            b"value-%d" % i,
            cas=res[i].cas,
            datatype=1,
            flags=i,
            expiry=0,
        )
    tomb = got[-1]
    assert (tomb.op, tomb.key, tomb.seqno) == (ItemOp.DELETION, b"k2", 7)
    assert chunk.nbytes >= sum(len(f) for f in got[:-1])


def test_read_frames_in_chunks_and_beyond_marks_a_cut_inside_the_disk(bucket: Bucket) -> None:
    for i in range(10):
        bucket.set(0, b"k%d" % i, b"v")
    bucket.set(0, b"k4", b"again")  # seqno 11: seqno 5 is gone from disk
    bucket.flusher.flush_all()
    with bucket.storage.open_backfill(0, 0) as scan:
        sizes = []
        while not scan.done:
            sizes.append(scan.read_frames(4, upto=1 << 62, opaque=1).count)
        assert sizes == [4, 4, 2]
    with bucket.storage.open_backfill(0, 4) as scan:
        chunk = scan.read_frames(100, upto=5, opaque=1)
        # nothing at or below 5 is left, but the scan says where the disk continues
        assert (chunk.count, chunk.beyond, scan.done) == (0, 6, True)
