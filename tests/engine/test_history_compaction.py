"""History window and tombstone purge (compaction)."""

from __future__ import annotations

import pytest

from dcp.producer.engine import Bucket, DecisionKind, decide_stream_request
from dcp.protocol.errors import KeyNotFound
from dcp.protocol.opcodes import SEQNO_MAX, VBucketState


def versions(bucket: Bucket, vb: int, start: int = 0):
    with bucket.storage.open_backfill(vb, start) as scan:
        return [(it.seqno, it.key) for it in scan.read(1 << 30)], scan.history


def compact(bucket: Bucket, now: float | None = None):
    plan = bucket.compactor.plan(now)
    result = bucket.storage.compact(plan)
    bucket.compactor.complete(result)
    return result


def write_versions(b: Bucket) -> None:
    for i in range(3):
        b.set(0, b"a", b"%d" % i)
        b.vbucket(0).checkpoints.create_checkpoint()
        b.flusher.flush_all()


def test_history_window_keeps_superseded_versions_for_backfill(open_bucket) -> None:
    b = open_bucket(history_seconds=60.0)
    write_versions(b)
    got, history = versions(b, 0)
    assert got == [(1, b"a"), (2, b"a"), (3, b"a")] and history
    assert b.get(0, b"a").value == b"2"


def test_without_history_only_newest_version_and_no_history_flag(open_bucket) -> None:
    b = open_bucket()
    write_versions(b)
    assert versions(b, 0) == ([(3, b"a")], False)


def test_history_is_pruned_by_age_and_history_start_rises(open_bucket, clock) -> None:
    b = open_bucket(history_seconds=60.0)
    write_versions(b)  # all at the same clock time
    clock.advance(30)
    b.set(0, b"a", b"late")
    b.flusher.flush_all()
    assert compact(b).versions_pruned == 0
    clock.advance(40)  # the first three versions are now 70 s old
    res = compact(b)
    assert res.versions_pruned == 3
    got, _history = versions(b, 0)
    assert got == [(4, b"a")]
    assert b.vbucket(0).history_start == 4
    assert versions(b, 0, start=3)[1] is True
    assert versions(b, 0, start=0)[1] is False  # history before 4 is incomplete


def test_history_is_pruned_by_bytes_oldest_first(open_bucket) -> None:
    b = open_bucket(history_bytes=4 * 120)  # per vbucket: 120 bytes (4 vbuckets)
    for _i in range(5):
        b.set(0, b"a", b"x" * 40)
        b.vbucket(0).checkpoints.create_checkpoint()
        b.flusher.flush_all()
    assert len(versions(b, 0)[0]) == 5
    res = compact(b)
    got = [s for s, _ in versions(b, 0)[0]]
    assert got[-1] == 5 and res.versions_pruned == 5 - len(got)
    assert got == list(range(6 - len(got), 6))  # the newest ones are kept
    assert len(got) in (2, 3)


def test_old_tombstones_are_purged_raising_purge_seqno(open_bucket, clock) -> None:
    b = open_bucket(tombstone_purge_age=100.0)
    b.set(0, b"a", b"1")
    b.set(0, b"b", b"1")
    b.delete(0, b"a")  # seqno 3
    b.flusher.flush_all()
    assert compact(b).tombstones_purged == 0  # too young
    clock.advance(50)
    b.delete(0, b"b")  # seqno 4, younger
    b.flusher.flush_all()
    clock.advance(60)
    res = compact(b)
    assert res.tombstones_purged == 1
    vb = b.vbucket(0)
    assert vb.purge_seqno == 3
    assert vb.key_meta(b"a") is None and vb.key_meta(b"b") is not None
    assert versions(b, 0)[0] == [(4, b"b")]
    # a client resuming below the purge seqno must roll back to 0
    d = decide_stream_request(
        failover_log=vb.failover_log.entries,
        high_seqno=vb.high_seqno,
        purge_seqno=vb.purge_seqno,
        persisted_seqno=vb.persisted_seqno,
        vb_state=VBucketState.ACTIVE,
        start=2,
        end=SEQNO_MAX,
        vb_uuid=vb.uuid,
        snap_start=2,
        snap_end=2,
        flags=0,
    )
    assert (d.kind, d.rollback_seqno) == (DecisionKind.ROLLBACK, 0)
    # the purge seqno is persisted and survives a restart
    b.close()
    b2 = open_bucket(tombstone_purge_age=100.0)
    assert b2.vbucket(0).purge_seqno == 3
    with pytest.raises(KeyNotFound):
        b2.get(0, b"a")
    b2.add(0, b"a", b"back")


def test_purge_seqno_is_not_lowered_by_a_flush_collected_before_compaction(
    open_bucket, clock
) -> None:
    b = open_bucket(tombstone_purge_age=10.0)
    b.set(0, b"a", b"1")
    b.delete(0, b"a")
    b.flusher.flush_all()
    clock.advance(20)
    b.set(0, b"z", b"1")
    batch = b.flusher.collect()  # carries purge seqno 0
    res = b.storage.compact(b.compactor.plan())
    b.storage.write_batch(batch)
    b.flusher.complete(batch)
    b.compactor.complete(res)
    b.close()
    assert open_bucket(tombstone_purge_age=10.0).vbucket(0).purge_seqno == 2


def test_purging_a_tombstone_under_history_takes_its_old_versions_too(open_bucket, clock) -> None:
    b = open_bucket(history_seconds=1e6, tombstone_purge_age=10.0)
    b.set(0, b"a", b"1")
    b.vbucket(0).checkpoints.create_checkpoint()
    b.delete(0, b"a")
    b.flusher.flush_all()
    assert len(versions(b, 0)[0]) == 2
    clock.advance(20)
    compact(b)
    assert versions(b, 0)[0] == []
    b.close()
    b2 = open_bucket(history_seconds=1e6, tombstone_purge_age=10.0)
    with pytest.raises(KeyNotFound):
        b2.get(0, b"a")  # not resurrected
