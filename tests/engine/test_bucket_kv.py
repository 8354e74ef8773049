"""KV operations of the bucket: seqnos, CAS, add/replace/delete, expiry, validation."""

from __future__ import annotations

import pytest

from dcp.producer.engine import Bucket, ItemOp
from dcp.protocol.errors import (
    InvalidArguments,
    KeyExists,
    KeyNotFound,
    NotMyVbucket,
    TooBig,
)
from dcp.protocol.opcodes import Status, VBucketState


def test_each_write_gets_the_next_seqno_a_new_cas_and_the_vb_uuid(bucket: Bucket) -> None:
    r1 = bucket.set(0, b"a", b"1")
    r2 = bucket.set(0, b"b", b"2")
    r3 = bucket.set(1, b"a", b"3")
    assert (r1.seqno, r2.seqno, r3.seqno) == (1, 2, 1)
    assert r2.cas > r1.cas
    assert r1.vb_uuid == bucket.vbucket(0).uuid != bucket.vbucket(1).uuid


def test_cas_is_unique_even_when_the_clock_stands_still(bucket: Bucket) -> None:
    cas = {bucket.set(0, b"k%d" % i, b"").cas for i in range(100)}
    assert len(cas) == 100


def test_get_returns_value_flags_cas_datatype(bucket: Bucket) -> None:
    r = bucket.set(2, b"doc", b'{"x":1}', flags=7, datatype=1)
    g = bucket.get(2, b"doc")
    assert (g.value, g.flags, g.cas, g.datatype, g.expiry) == (b'{"x":1}', 7, r.cas, 1, 0)


def test_add_fails_if_a_live_key_exists_but_succeeds_over_a_tombstone(bucket: Bucket) -> None:
    bucket.add(0, b"k", b"1")
    with pytest.raises(KeyExists) as ei:
        bucket.add(0, b"k", b"2")
    assert ei.value.status == Status.KEY_EEXISTS
    bucket.delete(0, b"k")
    assert bucket.add(0, b"k", b"3").seqno == 3


def test_replace_requires_a_live_key(bucket: Bucket) -> None:
    with pytest.raises(KeyNotFound):
        bucket.replace(0, b"k", b"1")
    bucket.set(0, b"k", b"1")
    bucket.replace(0, b"k", b"2")
    assert bucket.get(0, b"k").value == b"2"


def test_delete_makes_a_tombstone_and_get_misses(bucket: Bucket) -> None:
    bucket.set(0, b"k", b"1")
    r = bucket.delete(0, b"k")
    assert r.seqno == 2
    with pytest.raises(KeyNotFound):
        bucket.get(0, b"k")
    with pytest.raises(KeyNotFound):
        bucket.delete(0, b"k")
    assert bucket.vbucket(0).key_meta(b"k")[6] == 1  # tombstone kept in the index


def test_cas_checked_writes(bucket: Bucket) -> None:
    r = bucket.set(0, b"k", b"1")
    with pytest.raises(KeyExists):
        bucket.set(0, b"k", b"2", cas=r.cas + 1)
    r2 = bucket.set(0, b"k", b"2", cas=r.cas)
    with pytest.raises(KeyExists):
        bucket.replace(0, b"k", b"3", cas=r.cas)
    with pytest.raises(KeyExists):
        bucket.delete(0, b"k", cas=r.cas)
    bucket.delete(0, b"k", cas=r2.cas)
    with pytest.raises(KeyNotFound):
        bucket.set(0, b"k", b"4", cas=r2.cas)  # CAS on a missing key
    with pytest.raises(KeyNotFound):
        bucket.set(0, b"never", b"4", cas=123)
    with pytest.raises(InvalidArguments):
        bucket.add(0, b"new", b"x", cas=5)


def test_rev_seqno_counts_versions_across_tombstones(bucket: Bucket) -> None:
    bucket.set(0, b"k", b"1")
    bucket.set(0, b"k", b"2")
    bucket.delete(0, b"k")
    bucket.set(0, b"k", b"3")
    assert bucket.vbucket(0).key_meta(b"k")[1] == 4


def test_bad_sizes_are_refused_not_crashed(open_bucket) -> None:
    b = open_bucket(max_value_size=10)
    with pytest.raises(InvalidArguments):
        b.set(0, b"", b"x")
    with pytest.raises(InvalidArguments):
        b.set(0, b"k" * 251, b"x")
    b.set(0, b"k" * 250, b"x")
    with pytest.raises(TooBig) as ei:
        b.set(0, b"k", b"x" * 11)
    assert ei.value.status == Status.E2BIG
    with pytest.raises(InvalidArguments):
        b.set(0, b"k", b"x", flags=1 << 32)
    with pytest.raises(InvalidArguments):
        b.set(0, b"k", b"x", expiry=-1)
    with pytest.raises(InvalidArguments):
        b.set(0, "str-key", b"x")  # type: ignore[arg-type]
    b.set(0, bytearray(b"k2"), memoryview(b"v"))  # type: ignore[arg-type]
    assert b.get(0, b"k2").value == b"v"
    assert b.vbucket(0).high_seqno == 2


def test_out_of_range_or_inactive_vbucket_is_not_my_vbucket(bucket: Bucket) -> None:
    with pytest.raises(NotMyVbucket):
        bucket.set(4, b"k", b"v")
    with pytest.raises(NotMyVbucket):
        bucket.vbucket(-1)
    bucket.vbucket(1).set_state(VBucketState.REPLICA)
    for op in (
        lambda: bucket.set(1, b"k", b"v"),
        lambda: bucket.get(1, b"k"),
        lambda: bucket.delete(1, b"k"),
    ):
        with pytest.raises(NotMyVbucket) as ei:
            op()
        assert ei.value.status == Status.NOT_MY_VBUCKET


def test_relative_expiry_hides_item_and_expiry_pass_makes_an_expiration(
    bucket: Bucket, clock
) -> None:
    bucket.set(0, b"t", b"v", expiry=10)
    bucket.set(0, b"keep", b"v")
    assert bucket.get(0, b"t").expiry == int(clock.now) + 10
    clock.advance(10)
    with pytest.raises(KeyNotFound):
        bucket.get(0, b"t")  # never returned once expired, even before the pass
    assert bucket.vbucket(0).high_seqno == 2
    assert bucket.expire() == 1
    assert bucket.expire() == 0
    mgr = bucket.vbucket(0).checkpoints
    snaps = mgr.take(mgr.register_cursor("s", 2).cursor, 10)
    (it,) = snaps[0].items
    assert (it.seqno, it.op, it.key, it.delete_time) == (3, ItemOp.EXPIRATION, b"t", int(clock.now))
    bucket.add(0, b"t", b"again")  # an expired key is absent for add


def test_absolute_expiry_and_superseded_expiry_is_ignored(bucket: Bucket, clock) -> None:
    at = int(clock.now) + 100 * 24 * 3600
    bucket.set(0, b"a", b"v", expiry=at)
    assert bucket.get(0, b"a").expiry == at
    bucket.set(0, b"b", b"v", expiry=5)
    bucket.set(0, b"b", b"v2")  # no expiry any more
    clock.advance(3600)
    assert bucket.expire() == 0
    assert bucket.get(0, b"b").value == b"v2"


def test_expiry_pass_skips_replicas(bucket: Bucket, clock) -> None:
    bucket.set(3, b"t", b"v", expiry=1)
    bucket.vbucket(3).set_state(VBucketState.REPLICA)
    clock.advance(5)
    assert bucket.expire() == 0


def test_becoming_active_adds_a_failover_entry_unless_takeover(bucket: Bucket) -> None:
    vb = bucket.vbucket(0)
    bucket.set(0, b"a", b"1")
    vb.set_state(VBucketState.REPLICA)
    vb.set_state(VBucketState.ACTIVE)
    assert len(vb.failover_log) == 2 and vb.failover_log.entries[0][1] == 1
    vb.set_state(VBucketState.PENDING)
    vb.set_state(VBucketState.ACTIVE, takeover=True)
    assert len(vb.failover_log) == 2


def test_listener_is_called_with_the_vbucket_on_every_queued_item(bucket: Bucket) -> None:
    seen: list[int] = []
    bucket.add_listener(seen.append)
    bucket.set(1, b"a", b"1")
    bucket.delete(1, b"a")
    bucket.set(2, b"a", b"1")
    assert seen == [1, 1, 2]


def test_stats_seqno_keys(bucket: Bucket) -> None:
    bucket.set(0, b"a", b"1")
    st = bucket.vbucket(0).stats_seqno()
    assert st["high_seqno"] == 1 and st["last_persisted_seqno"] == 0
    assert st["vb_uuid"] == bucket.vbucket(0).uuid
    assert {
        "abs_high_seqno",
        "purge_seqno",
        "last_persisted_snap_start",
        "last_persisted_snap_end",
    } <= set(st)


def test_get_reads_values_from_disk_once_memory_is_freed(bucket: Bucket) -> None:
    bucket.set(0, b"a", b"disk value", flags=3)
    bucket.vbucket(0).checkpoints.create_checkpoint()
    bucket.flusher.flush_all()
    assert bucket.vbucket(0).checkpoints.find_item(b"a") is None
    g = bucket.get(0, b"a")
    assert (g.value, g.flags) == (b"disk value", 3)
