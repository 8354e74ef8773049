"""Replica vbuckets in the engine: states, whole-snapshot apply, promotion, rollback."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from dcp.producer.engine import Bucket
from dcp.producer.engine.checkpoint_manager import CheckpointManager, CheckpointMemory
from dcp.producer.engine.errors import ReplicationError
from dcp.producer.engine.item import Item, ItemOp
from dcp.protocol.errors import NotMyVbucket, TemporaryFailure
from dcp.protocol.opcodes import VBucketState

R, A, P, D = VBucketState.REPLICA, VBucketState.ACTIVE, VBucketState.PENDING, VBucketState.DEAD


def mut(
    vb: int, seqno: int, key: bytes, value: bytes = b"v", *, rev: int = 1, cas: int = 0
) -> Item:
    return Item(vb, seqno, rev, cas or 1000 + seqno, 7, 0, 0, key, value, ItemOp.MUTATION, 0, b"")


def dele(vb: int, seqno: int, key: bytes, *, rev: int = 2) -> Item:
    return Item(vb, seqno, rev, 1000 + seqno, 0, 0, 0, key, b"", ItemOp.DELETION, 55, b"")


def snapshots(bucket: Bucket, vb: int) -> list[tuple[int, int, list[int]]]:
    """(start, end, seqnos) of every snapshot a fresh stream cursor reads from memory."""
    mgr = bucket.vbucket(vb).checkpoints
    cur = mgr.register_cursor("probe", 0).cursor
    out = [(s.start, s.end, [it.seqno for it in s.items]) for s in mgr.take(cur, 1 << 30)]
    mgr.remove_cursor(cur)
    return out


def stored(bucket: Bucket, vb: int) -> dict[bytes, tuple[int, int, int, bool]]:
    """key -> (seqno, rev, cas, deleted) of what the vbucket holds (its key index), for
    the keys these tests use."""
    v = bucket.vbucket(vb)
    out = {}
    for k in (b"a", b"b", b"c", b"d", b"x"):
        e = v.key_meta(k)
        if e is not None:
            out[k] = (e[0], e[1], e[2], bool(e[6]))
    assert v.num_keys == len(out)
    return out


def test_front_end_ops_by_state(bucket: Bucket) -> None:
    bucket.set(0, b"k", b"v")
    vb = bucket.vbucket(0)
    assert vb.set_state(P)
    with pytest.raises(TemporaryFailure):
        bucket.set(0, b"k", b"v2")
    with pytest.raises(TemporaryFailure):
        bucket.delete(0, b"k")
    for state in (R, D):
        vb.set_state(state)
        with pytest.raises(NotMyVbucket):
            bucket.set(0, b"k", b"v2")
        with pytest.raises(NotMyVbucket):
            bucket.get(0, b"k")
    assert bucket.expire(now=2e9) == 0


def test_apply_snapshot_keeps_source_metadata_and_boundaries(bucket: Bucket) -> None:
    vb = bucket.vbucket(1)
    vb.set_state(R)
    vb.apply_snapshot(1, 3, 1, [mut(1, 1, b"a", cas=77), mut(1, 3, b"b", rev=4)])
    vb.apply_snapshot(4, 9, 1, [dele(1, 5, b"a", rev=2), mut(1, 9, b"c")])
    assert vb.high_seqno == 9
    assert snapshots(bucket, 1) == [(1, 3, [1, 3]), (5, 9, [5, 9])]
    assert stored(bucket, 1) == {
        b"a": (5, 2, 1005, True),
        b"b": (3, 4, 1003, False),
        b"c": (9, 1, 1009, False),
    }
    bucket.flusher.flush_all()
    assert vb.persisted_seqno == 9 and vb.persisted_snap_end == 9
    got = bucket.storage.get(1, 3)
    assert got is not None and (got.cas, got.rev_seqno, got.flags, got.value) == (1003, 4, 7, b"v")
    tomb = bucket.storage.get(1, 5)
    assert tomb is not None and tomb.op == ItemOp.DELETION and tomb.delete_time == 55


def test_a_big_snapshot_stays_one_snapshot(open_bucket: Callable[..., Bucket]) -> None:
    bucket = open_bucket(checkpoint_max_items=10)
    vb = bucket.vbucket(0)
    vb.set_state(R)
    vb.apply_snapshot(1, 50, 2, [mut(0, i, b"k%d" % i) for i in range(1, 51)])
    vb.apply_snapshot(51, 52, 1, [mut(0, 52, b"x")])
    snaps = snapshots(bucket, 0)
    assert [(s, e) for s, e, _ in snaps] == [(1, 50), (52, 52)]
    batch = bucket.flusher.collect(5)  # a soft limit never splits a snapshot
    assert batch is not None and batch.vbuckets[0].snap_end == 50
    bucket.storage.write_batch(batch)
    bucket.flusher.complete(batch)


@pytest.mark.parametrize(
    ("items", "why"),
    [
        ([mut(0, 2, b"a"), mut(0, 2, b"b")], "does not advance"),
        ([mut(0, 3, b"a"), mut(0, 2, b"b")], "does not advance"),
        ([mut(1, 2, b"a")], "is for vb 1"),
        ([mut(0, 12, b"a")], "outside its snapshot"),
        ([mut(0, 1, b"a")], "outside its snapshot"),
    ],
)
def test_malformed_snapshots_change_nothing(bucket: Bucket, items: list[Item], why: str) -> None:
    vb = bucket.vbucket(0)
    vb.set_state(R)
    with pytest.raises(ReplicationError, match=why):
        vb.apply_snapshot(2, 10, 1, items)
    assert vb.high_seqno == 0 and stored(bucket, 0) == {} and snapshots(bucket, 0) == []


def test_seqnos_must_stay_above_the_high_seqno(bucket: Bucket) -> None:
    vb = bucket.vbucket(0)
    vb.set_state(R)
    vb.apply_snapshot(1, 5, 1, [mut(0, 5, b"a")])
    with pytest.raises(ReplicationError):
        vb.apply_snapshot(3, 6, 1, [mut(0, 4, b"b")])
    with pytest.raises(ReplicationError):
        vb.apply_snapshot(1, 4, 1, [])
    vb.set_state(A)
    with pytest.raises(NotMyVbucket):
        vb.apply_snapshot(6, 6, 1, [mut(0, 6, b"b")])


def test_promotion_adds_one_entry_at_the_last_snapshot_end(bucket: Bucket) -> None:
    vb = bucket.vbucket(0)
    vb.set_state(R)
    vb.adopt_failover_log([(0xAA, 0)])
    vb.apply_snapshot(1, 4, 1, [mut(0, 2, b"a"), mut(0, 4, b"b")])
    assert vb.set_state(A)
    assert [s for _, s in vb.failover_log.entries] == [4, 0]
    assert vb.failover_log.entries[1][0] == 0xAA
    assert not vb.set_state(A)  # already active: no second entry
    assert len(vb.failover_log) == 2
    res = bucket.set(0, b"c", b"v")
    assert res.seqno == 5 and res.cas > 1004


def test_takeover_promotion_keeps_the_history(bucket: Bucket) -> None:
    vb = bucket.vbucket(0)
    vb.set_state(R)
    vb.adopt_failover_log([(0xBB, 0)])
    vb.set_state(P)
    vb.set_state(A, takeover=True)
    assert vb.failover_log.entries == [(0xBB, 0)]


def test_state_and_failover_log_survive_a_crash(open_bucket: Callable[..., Bucket]) -> None:
    bucket = open_bucket()
    vb = bucket.vbucket(2)
    vb.set_state(R)
    vb.adopt_failover_log([(0xCC, 3), (0xAA, 0)])
    vb.apply_snapshot(1, 3, 1, [mut(2, 3, b"a")])
    bucket.flusher.flush_all()
    bucket.close(clean=False)  # kill -9: no clean-shutdown marker
    again = open_bucket()
    vb2 = again.vbucket(2)
    assert vb2.state is R and vb2.high_seqno == 3
    assert vb2.failover_log.entries == [(0xCC, 3), (0xAA, 0)]  # a replica gets no new entry
    assert vb2.replication_position() == (3, 3, 3, 0xCC)


def _replica_with(bucket: Bucket, vb: int, snaps: list[tuple[int, int, list[Item]]]) -> None:
    v = bucket.vbucket(vb)
    v.set_state(R)
    for start, end, items in snaps:
        v.apply_snapshot(start, end, 1, items)


def test_rollback_exact_when_the_tail_only_created_keys(bucket: Bucket) -> None:
    _replica_with(bucket, 0, [(1, 2, [mut(0, 1, b"a"), mut(0, 2, b"b")])])
    bucket.flusher.flush_all()
    _replica_with(bucket, 0, [(3, 4, [mut(0, 3, b"c"), mut(0, 4, b"d")])])
    bucket.flusher.flush_all()
    assert bucket.rollback(0, 2) == 2
    vb = bucket.vbucket(0)
    assert vb.high_seqno == vb.persisted_seqno == 2
    assert set(stored(bucket, 0)) == {b"a", b"b"}
    assert bucket.storage.get(0, 3) is None and bucket.storage.get(0, 4) is None
    assert snapshots(bucket, 0) == []


def test_rollback_drops_an_unpersisted_tail_and_restores_its_keys(bucket: Bucket) -> None:
    _replica_with(bucket, 0, [(1, 2, [mut(0, 1, b"a"), mut(0, 2, b"b")])])
    bucket.flusher.flush_all()
    _replica_with(bucket, 0, [(3, 3, [mut(0, 3, b"a", b"new", rev=2)])])  # memory only
    assert bucket.rollback(0, 2) == 2
    assert stored(bucket, 0)[b"a"] == (1, 1, 1001, False)
    assert bucket.storage.get(0, 1) is not None


def test_rollback_that_cannot_be_exact_resets_to_zero(bucket: Bucket) -> None:
    _replica_with(bucket, 0, [(1, 2, [mut(0, 1, b"a"), mut(0, 2, b"b")])])
    bucket.flusher.flush_all()
    # a's second version is flushed: without history its first one is gone from disk
    _replica_with(bucket, 0, [(3, 3, [mut(0, 3, b"a", b"new", rev=2)])])
    bucket.flusher.flush_all()
    assert bucket.rollback(0, 2) == 0
    vb = bucket.vbucket(0)
    assert vb.high_seqno == 0 and stored(bucket, 0) == {}
    assert bucket.storage.disk_high_seqno(0) == 0
    assert vb.replication_position() == (0, 0, 0, 0)


def test_rollback_with_history_restores_older_versions(open_bucket: Callable[..., Bucket]) -> None:
    bucket = open_bucket(history_seconds=3600)
    _replica_with(bucket, 0, [(1, 1, [mut(0, 1, b"a")])])
    bucket.flusher.flush_all()
    _replica_with(bucket, 0, [(2, 2, [mut(0, 2, b"a", b"new", rev=2)])])
    bucket.flusher.flush_all()
    assert bucket.rollback(0, 1) == 1
    assert stored(bucket, 0) == {b"a": (1, 1, 1001, False)}


def test_rollback_persists_and_prunes_the_failover_log(open_bucket: Callable[..., Bucket]) -> None:
    bucket = open_bucket()
    _replica_with(bucket, 3, [(1, 1, [mut(3, 1, b"a")])])
    bucket.vbucket(3).adopt_failover_log([(0xB2, 2), (0xB1, 0)])
    bucket.flusher.flush_all()
    _replica_with(bucket, 3, [(2, 2, [mut(3, 2, b"b")])])
    bucket.flusher.flush_all()
    assert bucket.rollback(3, 1) == 1
    assert bucket.vbucket(3).failover_log.entries == [(0xB1, 0)]
    bucket.close(clean=False)
    again = open_bucket()
    vb = again.vbucket(3)
    assert (vb.state, vb.high_seqno, vb.failover_log.entries) == (R, 1, [(0xB1, 0)])
    assert again.storage.get(3, 2) is None


def test_rollback_of_an_active_vbucket_is_refused(bucket: Bucket) -> None:
    bucket.set(0, b"a", b"v")
    with pytest.raises(NotMyVbucket):
        bucket.rollback(0, 0)


def test_dropping_the_newest_branch_keeps_the_data(open_bucket: Callable[..., Bucket]) -> None:
    # an active vbucket crashed: warm-up adds an entry at its persisted end; restarted as a
    # replica, its source does not know that entry, so it asks again with the older one
    bucket = open_bucket()
    bucket.set(0, b"a", b"v")
    bucket.flusher.flush_all()
    bucket.close(clean=False)
    again = open_bucket()
    vb = again.vbucket(0)
    assert [s for _, s in vb.failover_log.entries] == [1, 0]
    vb.set_state(R)
    older = vb.failover_log.entries[1][0]
    assert vb.drop_newest_failover_entry()
    assert vb.replication_position() == (1, 1, 1, older) and vb.high_seqno == 1
    assert not vb.drop_newest_failover_entry()  # the last entry stays


def _checkpoint_list(max_items: int) -> tuple[CheckpointManager, CheckpointMemory]:
    mem = CheckpointMemory(1 << 40)  # the persistence cursor keeps what is queued
    return CheckpointManager(0, mem, start_seqno=1, max_items=max_items, max_bytes=1 << 30), mem


@pytest.mark.parametrize(
    "items",
    [
        [mut(0, 2, b"a", b"x" * 10), mut(0, 3, b"b"), mut(0, 5, b"c" * 300, b"y" * 70_000)],
        [mut(0, 2, b"a"), mut(0, 3, b"a", rev=2), mut(0, 4, b"b")],  # a key twice
        [mut(0, 2, b"a"), dele(0, 3, b"b"), mut(0, 4, b"c")],  # not only mutations
    ],
)
def test_a_snapshot_is_queued_as_item_by_item_queueing_would(items: list[Item]) -> None:
    fast, fast_mem = _checkpoint_list(max_items=2)  # the limit waits for the snapshot
    slow, slow_mem = _checkpoint_list(max_items=1 << 30)
    fast.queue_snapshot(items)
    for it in items:
        slow.queue(it)
    slow.create_checkpoint()
    assert len(fast.checkpoints) == len(slow.checkpoints) == 2
    f, s = fast.checkpoints[0], slow.checkpoints[0]
    assert bytes(f.wire) == bytes(s.wire)
    assert (list(f.starts), list(f.seqnos), list(f.kinds)) == (
        list(s.starts),
        list(s.seqnos),
        list(s.kinds),
    )
    assert f.index == s.index and f.items == s.items
    assert (f.mem, f.last_seqno, f.queued, f.closed) == (s.mem, s.last_seqno, s.queued, True)
    assert fast_mem.used == slow_mem.used


def test_rollback_is_not_exact_when_a_version_in_between_never_reached_disk(
    open_bucket: Callable[..., Bucket],
) -> None:
    # a's revision 2 (seqno 2) was deduplicated away before any flush: the disk holds
    # revisions 1 and 3 only, so going back to seqno 2 cannot give a's value at 2
    bucket = open_bucket(history_seconds=3600)
    _replica_with(bucket, 0, [(1, 1, [mut(0, 1, b"a", b"one")])])
    bucket.flusher.flush_all()
    _replica_with(bucket, 0, [(2, 3, [mut(0, 3, b"a", b"three", rev=3)])])
    bucket.flusher.flush_all()
    assert bucket.rollback(0, 2) == 0
    assert stored(bucket, 0) == {}


def test_rollback_restores_the_direct_predecessor_with_history(
    open_bucket: Callable[..., Bucket],
) -> None:
    bucket = open_bucket(history_seconds=3600)
    _replica_with(bucket, 0, [(1, 2, [mut(0, 1, b"a", b"one"), mut(0, 2, b"b")])])
    bucket.flusher.flush_all()
    _replica_with(bucket, 0, [(3, 3, [mut(0, 3, b"a", b"two", rev=2)])])
    _replica_with(bucket, 0, [(4, 4, [mut(0, 4, b"c")])])
    bucket.flusher.flush_all()
    assert bucket.rollback(0, 2) == 2
    assert stored(bucket, 0) == {b"a": (1, 1, 1001, False), b"b": (2, 1, 1002, False)}


def test_a_snapshot_ending_past_its_last_item_moves_the_high_seqno(bucket: Bucket) -> None:
    # a disk snapshot whose last seqno was a purged tombstone ends with SEQNO_ADVANCED
    vb = bucket.vbucket(0)
    vb.set_state(R)
    vb.apply_snapshot(1, 5, 2, [mut(0, 2, b"a")])
    assert vb.high_seqno == 5
    vb.apply_snapshot(6, 8, 2, [])
    assert vb.high_seqno == 8 and vb.replication_position()[0] == 8
    vb.apply_snapshot(9, 9, 1, [mut(0, 9, b"b")])
    assert vb.high_seqno == 9


@pytest.mark.parametrize(
    "log",
    [[], [(0, 0)], [(1, 0), (2, 5)], [(1 << 64, 0)]],
)
def test_a_bad_failover_log_from_the_source_is_refused(bucket: Bucket, log: list) -> None:
    vb = bucket.vbucket(0)
    vb.set_state(R)
    before = list(vb.failover_log.entries)
    with pytest.raises(ReplicationError):
        vb.adopt_failover_log(log)
    assert vb.failover_log.entries == before
